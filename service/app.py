"""`service.app:build_app`: the Serve application builder.

    serve run deployments/local.yaml
    serve run service.app:build_app world_size=2 init=random checkpoint=/abs/w.safetensors
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from ray.serve import Application

from service.config import AppConfig
from service.ingress.deployment import Ingress
from service.server import GangServer


class InvalidAppArgs(ValueError):
    """build_app arguments failed validation; the message lists every problem."""


def parse_args(args: dict[str, Any]) -> AppConfig:
    try:
        return AppConfig.model_validate(dict(args))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'args'}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidAppArgs(
            f"invalid gangserve arguments: {problems}. Valid keys: {', '.join(sorted(AppConfig.model_fields))}"
        ) from None


def gang_bundle(cfg: AppConfig) -> dict[str, float]:
    """Resources of one rank: one placement-group bundle."""
    bundle = {"CPU": cfg.cpus_per_rank}
    if cfg.use_gpu:
        bundle["GPU"] = 1
    return bundle


def build_app(args: dict[str, Any]) -> Application:
    cfg = parse_args(args)
    bundle = gang_bundle(cfg)
    server = GangServer.options(
        # One bundle per rank, reserved all-or-nothing; the replica is rank 0 in bundle 0.
        placement_group_bundles=[dict(bundle) for _ in range(cfg.world_size)],
        placement_group_strategy=cfg.placement_strategy,
        ray_actor_options={"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0)},
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
    ).bind(cfg.model_dump())
    # The ingress only parses HTTP; it reserves no logical CPU so the gang gets them all.
    return Ingress.options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=max(256, cfg.max_ongoing_requests)
    ).bind(server, cfg.model_dump())
