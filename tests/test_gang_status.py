"""The gang status contract (service.contract.gang_status): the OpenAPI schemas of /gang, /gangs and
/readyz; that the routes answer with every key a producer set and no other; and that the
models are closed, so a renamed or misspelled field fails loudly where it is built or read.

The statuses come from the real producers: a Gang's own describe (no bring-up: nothing
here needs Ray), the fleet view and the diagnosis; the routes are the real health router.
The ingress's request policy and fleet client (which need a Ray cluster) are stood in for
by two small objects implementing the routes' Protocols (service.ingress.deps) over those
statuses.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI
from pydantic import ValidationError
from starlette.testclient import TestClient

from service.config.builder_args import AppConfig, BatchingConfig, GangConfig, ModelConfig
from service.gang.gang import Gang
from service.gang.rank import RankInfo
from service.contract.gang_status import (
    SYNTHESIZED_STATES, AnyGangStatus, DataChannelStatus, GangState, GangStatus, GangsView, SynthesizedStatus, dump,
)
from service.ingress.deps import FleetReader
from service.ingress.diagnosis import Diagnosis
from service.ingress.routes import health
from service.state.fleet import Fleet
from service.config.tunables import FleetTunables, Tunables
from tests.statuses import gang_report

pytestmark = pytest.mark.unit

_CHANNEL = DataChannelStatus(listening=True, requests=3, refused_overloaded=0, disconnected=0, in_flight=1)


def _described(tmp_path: Path, **server: Any) -> GangStatus:
    """A real Gang's describe, with its GangServer's fields (`server` replaces them)."""
    gang = Gang(ModelConfig(), GangConfig(), BatchingConfig().policy, None, tmp_path)
    try:
        gang.lifecycle.rank_infos = [RankInfo(rank=r, node_id=f"n{r}", node_ip="10.0.0.1", pid=100 + r, device="cpu",
                                    has_cuda=False, gpu_ids=[], iface="lo" if r else None) for r in range(2)]
        gang.health.set(GangState.READY, "ready")  # as after a bring-up
        fields: dict[str, Any] = {"replica_id": "r1", "failed_rebuilds": 0, "data_channel": _CHANNEL,
                                  "step_timings": {"enabled": False}, **server}
        return gang.describe(**fields)
    finally:
        gang.shutdown()


class _Gang:
    """The routes' Gang (service.ingress.deps.Gang) answering with one status; this module's
    routes call only `describe`."""

    def __init__(self, status: AnyGangStatus) -> None:
        self._status = status

    async def describe(self) -> AnyGangStatus:
        return self._status

    async def infer(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    deadline: float | None = None) -> np.ndarray:
        raise AssertionError("the health routes never infer")

    async def session_call(self, method: str, *args: Any, session_id: str | None, deadline: float,
                           **kwargs: Any) -> Any:
        raise AssertionError("the health routes never open sessions")

    async def reload_weights(self, checkpoint: str | None, job_id: str | None = None,
                             eval_loss: float | None = None) -> GangStatus:
        raise AssertionError("the health routes never swap weights")

    async def rollback_weights(self, version: int) -> GangStatus:
        raise AssertionError("the health routes never swap weights")


class _Fleet:
    """The routes' FleetReader over a real Fleet's view and a real Diagnosis."""

    def __init__(self, fleet: Fleet, now: float, desired: int, missing: list[str]) -> None:
        self.tunables = Tunables()
        self.diagnosis = Diagnosis(AppConfig())
        view = fleet.view(now, controller_up_s=9.5)
        self.view = GangsView(desired=desired, ready=view.ready, gangs=view.gangs, missing=missing, lost=view.lost,
                              controller_up_s=view.controller_up_s)

    async def gangs(self, for_readiness: bool = False) -> GangsView:
        return self.view


def _client(gang: _Gang, fleet: FleetReader) -> TestClient:
    app = FastAPI()
    app.include_router(health.router)
    app.state.gang, app.state.fleet = gang, fleet
    return TestClient(app)


def _keys(tree: Any, at: str = "") -> set[str]:
    """Every key path in a JSON tree (list items share their list's path)."""
    if isinstance(tree, dict):
        return {f"{at}.{k}" for k in tree} | {p for k, v in tree.items() for p in _keys(v, f"{at}.{k}")}
    if isinstance(tree, list):
        return {p for v in tree for p in _keys(v, at + "[]")}
    return set()


def test_openapi_describes_the_status_routes() -> None:
    app = FastAPI()
    app.include_router(health.router)
    doc = app.openapi()
    schemas = doc["components"]["schemas"]
    for name in ("GangStatus", "SynthesizedStatus", "RankStatus", "GangsView", "Readiness", "LostGangStatus",
                 "BatchingStats"):
        assert name in schemas, f"{name} missing from components.schemas: {sorted(schemas)}"
    for path, model in (("/gangs", "GangsView"), ("/readyz", "Readiness")):
        ok = doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok == {"$ref": f"#/components/schemas/{model}"}, (path, ok)
    gang_ok = doc["paths"]["/gang"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert {ref["$ref"] for ref in gang_ok["anyOf"]} == {"#/components/schemas/GangStatus",
                                                          "#/components/schemas/SynthesizedStatus"}, gang_ok
    gang = schemas["GangStatus"]
    assert gang["additionalProperties"] is False  # closed: an undeclared key is refused
    assert set(gang["required"]) >= {"state", "reason", "world_size", "backend", "weights_version", "generation",
                                     "ranks", "replica_id", "data_channel"}
    assert not set(gang["required"]) & {"code", "memory", "sessions", "reported_s_ago", "ingress_transport"}
    assert set(gang["properties"]["state"]["enum"]) == {s.value for s in GangState} | {"unreachable"}
    assert gang["properties"]["ranks"]["items"] == {"$ref": "#/components/schemas/RankStatus"}
    assert gang["properties"]["reason"]["description"]
    absent = schemas["SynthesizedStatus"]
    assert set(absent["properties"]["state"]["enum"]) == {"scheduling", "unschedulable"}
    assert set(absent["required"]) == {"state", "code", "reason"} and absent["additionalProperties"] is False


# The states docs/api.md names: the gang's own, then those observers synthesize.
DOCUMENTED_STATES = ("starting", "ready", "broken", "rebuilding", "stopped", "scheduling", "unschedulable", "unreachable")


@pytest.mark.parametrize("state", DOCUMENTED_STATES)
def test_every_documented_state_is_served_by_gang(state: str) -> None:
    status: AnyGangStatus
    if state in ("scheduling", "unschedulable"):
        status = SynthesizedStatus(state=state, code="gang_x", reason="why")
    else:
        status = gang_report(state=state, reason="why", **({"code": "gang_x"} if state == "unreachable" else {}))
    answer = _client(_Gang(status), _Fleet(Fleet(), 0.0, 1, [])).get("/gang")
    assert answer.status_code == 200, answer.text
    assert answer.json() == json.loads(json.dumps(dump(status)))
    assert answer.json()["state"] == state


def test_a_state_outside_the_contract_is_refused_and_the_gangs_own_are_not_synthesized() -> None:
    with pytest.raises(ValidationError, match="state"):
        gang_report(state="exploded")
    with pytest.raises(ValidationError, match="state"):
        SynthesizedStatus(state="ready", code="gang_x", reason="a ready gang is never synthesized")
    assert {s.value for s in GangState} | SYNTHESIZED_STATES == set(DOCUMENTED_STATES)
    assert not SYNTHESIZED_STATES & {s.value for s in GangState}


def test_gang_routes_return_every_key_a_producer_set(tmp_path: Path) -> None:
    full = _described(tmp_path)
    body = dump(full)
    assert body["ranks"][0] == {"rank": 0, "node_id": "n0", "node_ip": "10.0.0.1", "pid": 100, "device": "cpu",
                                "iface": None}
    assert body["spare"] == {"state": "none"} and body["last_bring_up"] == {}
    # Optional keys the producer did not set stay absent (a CPU gang has no `memory`).
    assert not {"memory", "sessions", "code", "reported_s_ago", "ingress_transport"} & set(body), sorted(body)
    # The models cross Ray calls pickled: the fields set travel with them.
    assert dump(pickle.loads(pickle.dumps(full))) == body
    synthesized = SynthesizedStatus(state="scheduling", code="gang_scheduling", reason="waiting for 2 CPUs")
    assert set(dump(synthesized)) == {"state", "code", "reason"}

    fleet = Fleet()
    fleet.report("r1", full, 100.0)
    fleet.report("r2", full.model_copy(update={"replica_id": "r2"}),
                 100.0 - FleetTunables().stale_after_s)  # stale: shown unreachable
    readers = _Fleet(fleet, 100.5, desired=3, missing=["gang 3 of 3: not started; waiting for 2 CPUs"])
    rows = {row.replica_id: row for row in readers.view.gangs}
    assert dump(rows["r1"]) == {**body, "reported_s_ago": 0.5}
    assert (rows["r2"].state, rows["r2"].code) == ("unreachable", "gang_unreachable")
    gangs = dump(readers.view)

    for describe in (full, synthesized):
        answer = _client(_Gang(describe), readers).get("/gang")
        assert answer.status_code == 200, answer.text
        assert answer.json() == json.loads(json.dumps(dump(describe)))
        print("/gang keys:", len(_keys(answer.json())))
    client = _client(_Gang(full), readers)
    answer = client.get("/gangs").json()
    assert answer == json.loads(json.dumps(gangs)) and _keys(answer) == _keys(gangs)
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "world_size": 2, "backend": "unknown", "ready": 1, "desired": 3,
                            "missing": gangs["missing"]}


def test_a_renamed_or_misspelled_field_fails_loudly_instead_of_turning_a_feature_off(tmp_path: Path) -> None:
    """The last review found a renamed field that turned the data channel off without a word
    (the link read `data_channel` from a dict, got nothing, and chose the handle). Now each
    step of the way refuses it: the producer, the model at a Ray hop, and the reader."""
    report = _described(tmp_path)
    body = dump(report)
    # The producer: Gang.describe takes the GangServer's fields by name.
    with pytest.raises(TypeError, match="data_chanel"):
        _described(tmp_path, data_chanel=_CHANNEL)
    # The model: a renamed key (data_channel -> channel) is both missing and unknown.
    renamed = {k: v for k, v in body.items() if k != "data_channel"} | {"channel": body["data_channel"]}
    with pytest.raises(ValidationError) as refused:
        GangStatus.model_validate(renamed)
    problems = {(e["type"], e["loc"][0]) for e in refused.value.errors()}
    assert problems == {("missing", "data_channel"), ("extra_forbidden", "channel")}, problems
    with pytest.raises(ValidationError, match="weights_verison"):
        GangStatus.model_validate({**body, "weights_verison": 3})
    with pytest.raises(ValidationError, match="listenning"):  # nested models are closed too
        GangStatus.model_validate({**body, "data_channel": {**body["data_channel"], "listenning": True}})
    # The reader: an attribute the model does not have is an error, not a silent None.
    with pytest.raises(AttributeError, match="weights_verison"):
        getattr(report, "weights_verison")
