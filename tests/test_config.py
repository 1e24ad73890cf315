"""Builder arguments: one pydantic model, unknown keys and impossible shapes rejected."""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from service.app import InvalidAppArgs, compose_app, parse_args
from tests.conftest import ROOT

pytestmark = pytest.mark.unit


def test_unknown_key_is_rejected_with_its_name() -> None:
    with pytest.raises(InvalidAppArgs, match="world_sise.*Extra inputs are not permitted"):
        parse_args({"world_sise": 2})


def test_cli_style_string_args_are_coerced() -> None:
    cfg = parse_args({"world_size": "4", "use_gpu": "false", "init": "random", "seed": "3"})
    assert (cfg.gang.world_size, cfg.gang.use_gpu, cfg.model.init, cfg.model.seed) == (4, False, "random", 3)


def test_flat_builder_args_land_in_their_sections_and_a_section_may_come_whole() -> None:
    """Every config writes the builder arguments flat; the tree has one section per concern.
    Each flat name belongs to one section, a section may be given whole beside other flat
    arguments, and the same argument twice (flat and in its section) is refused."""
    cfg = parse_args({"model": "transformer", "num_layers": 3, "world_size": 4, "max_batch_size": 5,
                      "data_channel": False, "max_sessions": 7, "max_active_jobs": 2, "max_seq_len": 99})
    assert (cfg.model.kind, cfg.model.num_layers, cfg.gang.world_size) == ("transformer", 3, 4)
    assert (cfg.batching.max_batch_size, cfg.transport.data_channel, cfg.sessions.max_sessions) == (5, False, 7)
    assert (cfg.training.max_active_jobs, cfg.serving.max_seq_len) == (2, 99)
    assert parse_args({"gang": {"world_size": 1}, "model": "transformer"}).gang.world_size == 1
    with pytest.raises(InvalidAppArgs, match="world_size given both flat and in the gang section"):
        parse_args({"gang": {"world_size": 1}, "world_size": 2})
    # Every section's every argument has exactly one flat name.
    from service.config.builder_args import BUILDER_ARGS, AppConfig

    sections = {name for name, field in AppConfig.model_fields.items() if name != "tunables"}
    assert {section for section, _ in BUILDER_ARGS.values()} == sections
    assert sum(len(type(getattr(cfg, s)).model_fields) for s in sections) == len(BUILDER_ARGS)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ({"world_size": 3}, "num_heads (8) must be divisible by world_size (3)"),
        ({"embed_dim": 500}, "embed_dim (500) must be divisible by num_heads (8)"),
        ({"checkpoint": "relative/w.safetensors"}, "absolute path"),
        ({"backend": "nccl"}, "backend=nccl needs use_gpu=true"),
        ({"init": "zeros"}, "init"),
        ({"world_size": 0}, "world_size"),
        ({"compute_dtype": "float16"}, "compute_dtype=float16 needs use_gpu=true"),
        ({"compute_dtype": "int8"}, "compute_dtype"),
        ({"max_padding_fraction": 1.0}, "max_padding_fraction"),
    ],
)
def test_impossible_configs_name_the_numbers(args: dict, needle: str) -> None:
    with pytest.raises(InvalidAppArgs) as info:
        parse_args(args)
    assert needle in str(info.value)


@pytest.mark.parametrize("name", ["local.yaml", "gpu.yaml"])
def test_shipped_serve_configs_validate_and_build(name: str) -> None:
    doc = yaml.safe_load((ROOT / "deployments" / name).read_text())
    ServeDeploySchema.model_validate(doc)  # what `serve run` / `serve deploy` check
    for app in doc["applications"]:
        assert app["import_path"] == "service.app:build_app"
        built = compose_app(parse_args(app["args"]))  # no cluster needed to build
        assert built is not None


def test_local_yaml_is_cpu_gloo_world_size_2() -> None:
    doc = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())
    args = doc["applications"][0]["args"]
    assert doc["http_options"] == {"host": "127.0.0.1", "port": 8000}
    cfg = parse_args(args)
    assert (cfg.gang.world_size, cfg.gang.use_gpu, cfg.gang.backend, cfg.model.init) == (2, False, "gloo", "seed")


def test_kuberay_manifest_embeds_a_valid_serve_config() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deployments" / "kuberay.yaml").read_text()))
    (manifest,) = [d for d in docs if d and d["kind"] == "RayService"]
    doc = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(doc)
    cfg = parse_args(doc["applications"][0]["args"])
    assert cfg.gang.use_gpu and cfg.gang.placement_strategy == "STRICT_SPREAD"
    workers = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    gpus = workers["replicas"] * int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= cfg.gang.world_size, "the manifest's GPU workers cannot hold the gang"


def _bound_arguments(app: Any, deployment: str) -> dict[str, Any]:
    """The arguments `deployment` is bound with somewhere in the composed `app`, by the names
    of its constructor's parameters (not by position)."""
    from ray.serve import Application

    seen, todo = [], [app]
    while todo:
        bound = todo.pop()._bound_deployment
        seen.append(bound.name)
        if bound.name == deployment:
            signature = inspect.signature(bound.func_or_class.__init__)
            return dict(signature.bind(None, *bound.init_args, **bound.init_kwargs).arguments)
        todo += [a for a in [*bound.init_args, *bound.init_kwargs.values()] if isinstance(a, Application)]
    raise AssertionError(f"no deployment {deployment} in the app; found {seen}")


def test_training_limits_are_builder_args_passed_to_the_job_manager() -> None:
    """Every training limit, given as a (CLI-style, string) builder argument at a value other
    than its default, reaches the JobManager deployment's `limits`; the app's serving
    max_seq_len, model and tunables reach it too."""
    from service.config.builder_args import TrainingLimits

    assert parse_args({}).training == TrainingLimits()
    for field in TrainingLimits.model_fields.values():
        assert field.description, "every limit says what it bounds"
    with pytest.raises(InvalidAppArgs, match="max_active_jobs"):
        parse_args({"max_active_jobs": 0})
    # Each limit at default + 1: a limit that did not reach the deployment would keep its default.
    given = {name: field.default + 1 for name, field in TrainingLimits.model_fields.items()}
    cfg = parse_args({**{name: str(value) for name, value in given.items()}, "max_seq_len": 128,
                      "tunables": {"training": {"max_log_lines_per_job": 7}}})
    assert cfg.training.model_dump() == given
    bound = _bound_arguments(compose_app(cfg), "JobManager")
    assert bound["limits"].model_dump() == given
    assert bound["max_seq_len"] == 128
    assert bound["model"] == cfg.model
    assert bound["tunables"].training.max_log_lines_per_job == 7


def test_the_builder_argument_reference_is_generated_and_current() -> None:
    """docs/builder-arguments.md is `python -m service.config.builder_args` (make docs): every builder
    argument of AppConfig, with its default and description, and nothing else."""
    from service.config.builder_args import BUILDER_ARGS, builder_args_markdown

    path = ROOT / "docs" / "builder-arguments.md"
    assert path.read_text() == builder_args_markdown(), "docs/builder-arguments.md is stale: run `make docs`"
    text = path.read_text()
    for name in [*BUILDER_ARGS, "tunables"]:
        assert f"| `{name}` |" in text, name


# ---------------------------------------------------------------- tunables (service.config.tunables)

def test_the_tunables_reference_is_generated_and_current() -> None:
    """docs/tunables.md is `python -m service.config.tunables` (make docs): every tunable, with its
    value and what it bounds."""
    import dataclasses

    from service.config.tunables import Tunables, tunables_markdown

    path = ROOT / "docs" / "tunables.md"
    assert path.read_text() == tunables_markdown(), "docs/tunables.md is stale: run `make docs`"
    defaults = Tunables()
    for section in dataclasses.fields(defaults):
        for field in dataclasses.fields(getattr(defaults, section.name)):
            assert len(field.metadata["doc"]) > 20, f"{section.name}.{field.name} says what it bounds"
            assert f"| `{section.name}.{field.name}` |" in path.read_text()


def test_a_tunables_override_in_the_builder_args_reaches_the_running_value() -> None:
    """A partial `tunables:` section (as a YAML config's args carry it) overrides what it
    names and keeps every other default, and survives the pickling (and the dump/validate round trip) that
    hands the config to each deployment."""
    import pickle

    import yaml

    from service.app import parse_args
    from service.config.builder_args import AppConfig

    args = yaml.safe_load("tunables:\n  gang: {probe_interval_s: 0.5}\n  state: {s3_request_timeout_s: 90}\n")
    import dataclasses

    from service.config.tunables import Tunables

    cfg = parse_args(args)
    defaults = Tunables()
    assert cfg.tunables.gang.probe_interval_s == 0.5 != defaults.gang.probe_interval_s
    assert cfg.tunables.state.s3_request_timeout_s == 90.0 != defaults.state.s3_request_timeout_s
    # Everything else untouched: the defaults, whatever they are.
    assert cfg.tunables == dataclasses.replace(
        defaults, gang=dataclasses.replace(defaults.gang, probe_interval_s=0.5),
        state=dataclasses.replace(defaults.state, s3_request_timeout_s=90.0))
    replica = pickle.loads(pickle.dumps(cfg))  # how Ray hands the object to each deployment
    assert replica.tunables == cfg.tunables and replica == cfg
    assert AppConfig.model_validate(cfg.model_dump()) == cfg  # the tree's dump validates back to itself


def test_a_tunables_override_reaches_the_owner_that_uses_it(tmp_path: Path) -> None:
    """The job store built from a deployed config keeps the overridden number of log lines,
    and its database waits the overridden busy time: the value travels as an object, not
    through a module constant."""
    from service.app import parse_args
    from service.training.store import JobRecord, JobStore

    cfg = parse_args({"tunables": {"training": {"max_log_lines_per_job": 3}, "state": {"sqlite_busy_timeout_s": 2.5}}})
    store = JobStore(tmp_path / "jobs.sqlite", cfg.tunables.training, cfg.tunables.state)
    try:
        assert store.database.tunables.sqlite_busy_timeout_s == 2.5
        store.create_job(JobRecord(id="job-1", status="PENDING", spec={}, created_at=1.0, updated_at=1.0,
                                   progress={}))
        store.append_logs("job-1", [(i, float(i), f"line {i}") for i in range(1, 8)])
        assert [line for _, line in store.tail_logs("job-1", 100)] == ["line 5", "line 6", "line 7"]
    finally:
        store.close()


def test_an_unknown_tunable_is_refused_naming_it() -> None:
    from service.app import InvalidAppArgs, parse_args

    with pytest.raises(InvalidAppArgs, match=r"tunables\.gang\.probe_intervl_s"):
        parse_args({"tunables": {"gang": {"probe_intervl_s": 1.0}}})
    with pytest.raises(InvalidAppArgs, match=r"tunables\.gangs"):
        parse_args({"tunables": {"gangs": {}}})


def test_a_broken_relation_is_refused_naming_both_numbers() -> None:
    from service.app import InvalidAppArgs, parse_args

    # Two tunables: a store's lock wait must end before the ingress's call to the JobManager gives up.
    with pytest.raises(InvalidAppArgs, match=r"tunables.state.sqlite_busy_timeout_s \(40\) must be below "
                                             r"tunables.ingress.jobs_call_timeout_s \(30\)"):
        parse_args({"tunables": {"state": {"sqlite_busy_timeout_s": 40.0}}})
    assert parse_args({"tunables": {"state": {"sqlite_busy_timeout_s": 40.0},
                                    "ingress": {"jobs_call_timeout_s": 45.0}}}).tunables.state.sqlite_busy_timeout_s == 40
    # A builder argument and a tunable: the ingress drain must outlast the default request deadline.
    with pytest.raises(InvalidAppArgs, match=r"request_timeout_s \(300\) must be below "
                                             r"tunables.ingress.drain_timeout_s \(125\)"):
        parse_args({"request_timeout_s": 300})
    assert parse_args({"request_timeout_s": 300,
                       "tunables": {"ingress": {"drain_timeout_s": 310}}}).serving.request_timeout_s == 300


def test_a_worker_line_is_cut_once_at_the_tunable() -> None:
    """The worker's capture cuts a runaway line at training.output_line_chars, and the run
    actor logs what the worker kept without cutting it again."""
    from service.training.run import TrainRun
    from service.training.worker_output import OutputCapture
    from service.config.tunables import TrainingTunables, Tunables

    limit = 100  # a deployed value, not the default: both sides read the one they are given
    tunables = Tunables(training=TrainingTunables(output_line_chars=limit))
    capture = OutputCapture(tunables.training)
    capture.write("stdout", "x" * (limit + 50) + "\n" + "y" * limit + "\n")  # complete lines: cut, or kept
    capture.write("stdout", "z" * (limit + 50))  # a runaway line without newline: in pieces of the limit
    lines = capture.drain(final=True)
    assert [(line[0], len(line)) for _, line in lines] == [("x", limit), ("y", limit), ("z", limit), ("z", 50)]

    class _Run:  # stands in for the actor's state: worker_output writes through self._log only
        logged: list[str] = []
        _tunables = tunables

        def _log(self, *lines: str) -> None:
            self.logged += lines

    run = _Run()
    TrainRun.worker_output(run, 0, lines)  # type: ignore[arg-type]
    assert run.logged == [f"[rank 0] {line}" for _, line in lines]


def test_inline_decode_bytes_decides_which_bodies_pass_a_full_decoding_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """tunables.ingress.inline_decode_bytes=4096, and the decoding pool's one slot held: an npy
    body of [1, 1, 512] float32 (128 header + 2,048 data = 2,176 bytes) is decoded on the event
    loop and answered (its 512-value reply is encoded there too), while one of [1, 2, 512]
    (4,224 bytes) needs the pool: 503 `overloaded`. At the default (64 KiB) both are decoded
    inline. The ingress's real app, in-process; the gang is a stand-in that answers its input."""
    import io
    import time

    import numpy as np
    from starlette.testclient import TestClient

    from gangserve_client import codecs as wire
    from service.ingress.api import create_api
    from tests.conftest import local_yaml_args
    from tests.helpers import npy_bytes, one_decode_slot_held

    class EchoGang:
        async def infer(self, x: np.ndarray, mask: object, causal: object, deadline: float) -> np.ndarray:
            return x

    monkeypatch.delenv("GANGSERVE_INFER_TOKEN", raising=False)
    small, large = npy_bytes(np.ones((1, 1, 512), np.float32)), npy_bytes(np.ones((1, 2, 512), np.float32))
    assert (len(small), len(large)) == (2176, 4224)
    answers = {}
    for inline_bytes in (4096, 64 * 1024):
        cfg = parse_args({**local_yaml_args(), "decode_threads": 1, "max_pending_decodes": 1,
                          "tunables": {"ingress": {"inline_decode_bytes": inline_bytes}}})
        app = create_api(cfg, gang=EchoGang())  # type: ignore[arg-type]
        try:
            with one_decode_slot_held(app.state.decode_pool), TestClient(app, base_url="http://127.0.0.1") as client:
                started = time.monotonic()
                answers[inline_bytes] = [client.post("/infer", content=small, headers={"content-type": wire.NPY})]
                # Not encoded in the pool either: its one thread is held for 30 s.
                assert time.monotonic() - started < 10
                answers[inline_bytes].append(client.post("/infer", content=large, headers={"content-type": wire.NPY}))
        finally:
            app.state.decode_pool.shutdown()
    (small_reply, large_reply), default_replies = answers[4096], answers[64 * 1024]
    assert small_reply.status_code == 200 and np.load(io.BytesIO(small_reply.content)).shape == (1, 1, 512)
    assert large_reply.status_code == 503 and large_reply.json()["code"] == "overloaded", large_reply.text
    assert [r.status_code for r in default_replies] == [200, 200]


def test_the_environment_reference_is_generated_and_current() -> None:
    """docs/environment.md is `python -m service.environment` (make docs), and the builder
    arguments' reference links it: every variable the service reads, next to the arguments."""
    from service.environment import VARIABLES, environment_markdown

    path = ROOT / "docs" / "environment.md"
    assert path.read_text() == environment_markdown(), "docs/environment.md is stale: run `make docs`"
    names = {v.name for v in VARIABLES}
    assert {"GANGSERVE_DATABASE_URL", "GANGSERVE_STORAGE_URL", "GANGSERVE_API_TOKEN", "GANGSERVE_FAILPOINTS"} <= names
    assert "(environment.md)" in (ROOT / "docs" / "builder-arguments.md").read_text()
