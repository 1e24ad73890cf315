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
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.testclient import TestClient

from service.config.builder_args import AppConfig, BatchingConfig, GangConfig, ModelConfig
from service.gang.gang import Gang
from service.gang.rank import RankInfo
from service.contract.gang_status import (
    ALL_STATES, DataChannelStatus, GangAnswer, GangRow, GangState, GangStatus, GangsView,
    IngressGangStatus, IngressTransport, ObservedState, SynthesizedStatus, dump,
)
from service.ingress.deps import FleetReader
from service.ingress.diagnosis import Diagnosis
from service.ingress.routes import health
from service.state.fleet import Fleet
from service.config.tunables import FleetTunables, Tunables
from tests.statuses import gang_report

pytestmark = pytest.mark.unit

_CHANNEL = DataChannelStatus(listening=True, requests=3, refused_overloaded=0, disconnected=0, in_flight=1)
_TRANSPORT = IngressTransport(node_id="n0", shm_enabled=True, data_channel_enabled=True, shared_memory=2,
                              object_store=1, shared_memory_fallbacks=0, data_channel=5, data_channel_fallbacks=0)


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

    def __init__(self, status: GangAnswer) -> None:
        self._status = status

    async def describe(self) -> GangAnswer:
        return self._status

    async def infer(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    deadline: float | None = None) -> np.ndarray:
        raise AssertionError("the health routes never infer")

    async def session_call(self, method: str, *args: Any, session_id: str | None, deadline: float,
                           **kwargs: Any) -> Any:
        raise AssertionError("the health routes never open sessions")


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
    for name in ("IngressGangStatus", "GangRow", "SynthesizedStatus", "RankStatus", "GangsView", "Readiness",
                 "LostGangStatus", "BatchingStats", "SessionBatchingStats"):
        assert name in schemas, f"{name} missing from components.schemas: {sorted(schemas)}"
    for path, model in (("/gangs", "GangsView"), ("/readyz", "Readiness")):
        ok = doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok == {"$ref": f"#/components/schemas/{model}"}, (path, ok)
    gang_ok = doc["paths"]["/gang"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert {ref["$ref"] for ref in gang_ok["anyOf"]} == {"#/components/schemas/IngressGangStatus",
                                                          "#/components/schemas/SynthesizedStatus"}, gang_ok
    report_keys = {"state", "reason", "world_size", "backend", "weights_version", "generation", "ranks", "replica_id",
                   "data_channel"}
    # /gang: the gang's report and the ingress's own field; no field of the fleet's.
    gang = schemas["IngressGangStatus"]
    assert gang["additionalProperties"] is False  # closed: an undeclared key is refused
    assert set(gang["required"]) >= report_keys | {"ingress_transport"}
    assert not set(gang["properties"]) & {"code", "reported_s_ago"}
    assert not set(gang["required"]) & {"memory", "sessions"}
    assert gang["properties"]["state"]["$ref"] == "#/components/schemas/GangState"
    assert schemas["GangState"]["enum"] == ["starting", "ready", "broken", "rebuilding", "stopped"]
    assert gang["properties"]["ranks"]["items"] == {"$ref": "#/components/schemas/RankStatus"}
    assert gang["properties"]["reason"]["description"]
    assert gang["properties"]["sessions"]["anyOf"][0] == {"$ref": "#/components/schemas/SessionStats"}
    assert schemas["SessionStats"]["properties"]["batching"] == {
        "$ref": "#/components/schemas/SessionBatchingStats", "description": "The session batcher's counters."}
    # /gangs rows: the gang's report and the fleet's own fields; no field of the ingress's.
    row = schemas["GangRow"]
    assert row["additionalProperties"] is False
    assert set(row["required"]) >= report_keys | {"reported_s_ago"} and "code" not in row["required"]
    assert "ingress_transport" not in row["properties"]
    assert {ref["$ref"] for ref in row["properties"]["state"]["anyOf"]} == {
        "#/components/schemas/GangState", "#/components/schemas/ObservedState"}
    assert schemas["ObservedState"]["enum"] == ["unreachable"]
    assert doc["components"]["schemas"]["GangsView"]["properties"]["gangs"]["items"] == {
        "$ref": "#/components/schemas/GangRow"}
    absent = schemas["SynthesizedStatus"]
    assert absent["properties"]["state"] == {"$ref": "#/components/schemas/AbsentState"}
    assert schemas["AbsentState"]["enum"] == ["scheduling", "unschedulable"]
    assert set(absent["required"]) == {"state", "code", "reason"} and absent["additionalProperties"] is False


# The states docs/api.md names: the gang's own, then those observers synthesize.
DOCUMENTED_STATES = ("starting", "ready", "broken", "rebuilding", "stopped", "scheduling", "unschedulable", "unreachable")


@pytest.mark.parametrize("state", DOCUMENTED_STATES)
def test_every_documented_state_is_served(state: str) -> None:
    """The gang's own states and the ingress's on /gang; the fleet's `unreachable` on /gangs."""
    fleet = Fleet()
    if state == "unreachable":  # a ready gang whose reports stopped
        fleet.report(gang_report(state="ready", reason="ready"), 0.0)
        now = FleetTunables().stale_after_s + 1.0
        answer = _client(_Gang(SynthesizedStatus(state="scheduling", code="gang_scheduling", reason="-")),
                         _Fleet(fleet, now, 1, [])).get("/gangs")
        assert answer.status_code == 200, answer.text
        row = answer.json()["gangs"][0]
        assert (row["state"], row["code"], row["reported_s_ago"]) == (state, "gang_unreachable", now), row
        return
    status: GangAnswer
    if state in ("scheduling", "unschedulable"):
        status = SynthesizedStatus(state=state, code="gang_x", reason="why")
    else:
        status = IngressGangStatus.of(gang_report(state=state, reason="why"), _TRANSPORT)
    answer = _client(_Gang(status), _Fleet(fleet, 0.0, 1, [])).get("/gang")
    assert answer.status_code == 200, answer.text
    assert answer.json() == json.loads(json.dumps(dump(status)))
    assert answer.json()["state"] == state


def test_a_state_outside_a_views_own_is_refused() -> None:
    """Each state is its giver's: the gang reports its own, the ingress synthesizes its own,
    and `unreachable` only the fleet view gives (GangRow.of, below its own argument)."""
    with pytest.raises(ValidationError, match="state"):
        gang_report(state="exploded")
    with pytest.raises(ValidationError, match="state"):
        gang_report(state="unreachable")  # a gang never reports itself unreachable
    with pytest.raises(ValidationError, match="state"):
        SynthesizedStatus(state="ready", code="gang_x", reason="a ready gang is never synthesized")
    assert [s.value for s in ALL_STATES] == list(DOCUMENTED_STATES[:5]) + ["unreachable", "scheduling",
                                                                           "unschedulable"]
    assert {s.value for s in ALL_STATES} == set(DOCUMENTED_STATES)


def test_the_fleet_and_ingress_views_compose_the_report_with_their_own_fields_only() -> None:
    report = gang_report()
    row = GangRow.of(report, reported_s_ago=1.5)
    assert dump(row) == {**dump(report), "reported_s_ago": 1.5}
    # The report's objects, not copies of them: the view adds, it does not rebuild.
    assert row.ranks is report.ranks and row.batching is report.batching
    lost = GangRow.of(report, reported_s_ago=9.0, unreachable_because="no report for 9.0s", code="gang_unreachable")
    assert (lost.state, lost.reason, lost.code) == (ObservedState.UNREACHABLE, "no report for 9.0s", "gang_unreachable")
    assert report.state is GangState.READY and report.reason == "ready"  # the report itself is unchanged
    shown = IngressGangStatus.of(report, _TRANSPORT)
    assert dump(shown) == {**dump(report), "ingress_transport": dump(_TRANSPORT)}
    assert isinstance(shown, GangStatus) and not isinstance(row, GangStatus)
    # A view composes with its own fields only: not another view's, not the report's.
    from service.contract.gang_status import _compose
    with pytest.raises(TypeError, match="ingress_transport"):
        _compose(GangRow, report, {"reported_s_ago": 1.0, "ingress_transport": _TRANSPORT})
    with pytest.raises(TypeError, match="weights_version"):
        _compose(GangRow, report, {"reported_s_ago": 1.0, "weights_version": 7})


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
    fleet.report(full, 100.0)
    fleet.report(full.model_copy(update={"replica_id": "r2"}),
                 100.0 - FleetTunables().stale_after_s)  # stale: shown unreachable
    readers = _Fleet(fleet, 100.5, desired=3, missing=["gang 3 of 3: not started; waiting for 2 CPUs"])
    rows = {row.replica_id: row for row in readers.view.gangs}
    assert dump(rows["r1"]) == {**body, "reported_s_ago": 0.5}
    assert (rows["r2"].state, rows["r2"].code) == ("unreachable", "gang_unreachable")
    gangs = dump(readers.view)

    shown = IngressGangStatus.of(full, _TRANSPORT)
    for describe in (shown, synthesized):
        answer = _client(_Gang(describe), readers).get("/gang")
        assert answer.status_code == 200, answer.text
        assert answer.json() == json.loads(json.dumps(dump(describe)))
        print("/gang keys:", len(_keys(answer.json())))
    client = _client(_Gang(shown), readers)
    answer = client.get("/gangs").json()
    assert answer == json.loads(json.dumps(gangs)) and _keys(answer) == _keys(gangs)
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "world_size": 2, "backend": "unknown", "ready": 1, "desired": 3,
                            "missing": gangs["missing"]}


def _model_paths(model: BaseModel, at: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], BaseModel]]:
    """Every model inside `model` (itself first), with its path in `dump(model)`: fields set
    that hold a model, or a list of models (each item)."""
    yield at, model
    for name in model.model_fields_set:
        value = getattr(model, name)
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, BaseModel):
                yield from _model_paths(item, (*at, name) if index is None else (*at, name, index))


def _edited(body: dict[str, Any], at: tuple[str | int, ...], edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A deep copy of `body` with `edit` applied to the object at path `at`."""
    copy = json.loads(json.dumps(body))
    node: Any = copy
    for step in at:
        node = node[step]
    edit(node)
    return copy


def test_a_renamed_or_misspelled_field_fails_loudly_instead_of_turning_a_feature_off(tmp_path: Path) -> None:
    """The last review found a renamed field that turned the data channel off without a word
    (the link read `data_channel` from a dict, got nothing, and chose the handle). Now each
    step of the way refuses it. The producer: Gang.describe takes the GangServer's fields by
    name. The report, as it crosses a Ray hop and is read back: every key of a real report, at
    every depth, misspelled in turn, and an unknown key in every object of it, is refused
    naming that key (a nested model left open, or a field given a default, would let one
    through and the reader would see the default)."""
    with pytest.raises(TypeError, match="data_chanel"):
        _described(tmp_path, data_chanel=_CHANNEL)
    report = _described(tmp_path)
    # The gang's report, and the two views that compose it with their own fields (GET /gang's
    # answer and a row of GET /gangs), as a client reads their JSON back.
    for view in (report, IngressGangStatus.of(report, _TRANSPORT), GangRow.of(report, 0.5)):
        model_class, body = type(view), dump(view)
        assert model_class.model_validate(body) == view  # the real body itself is accepted
        checked = 0
        for at, model in _model_paths(view):
            for key in [*model.model_fields_set, None]:
                def misspell(node: dict[str, Any], key: str | None = key) -> None:
                    if key is None:
                        node["zz_unknown"] = 1
                    else:
                        node[key + "_"] = node.pop(key)
                refused_key = "zz_unknown" if key is None else key + "_"
                with pytest.raises(ValidationError) as refused:
                    model_class.model_validate(_edited(body, at, misspell))
                named = {(e["type"], e["loc"]) for e in refused.value.errors()}
                assert ("extra_forbidden", (*at, refused_key)) in named, (model_class.__name__, at, key, named)
                checked += 1
        assert checked > 40, checked  # the walk reached the nested objects (ranks, data channel, spare, ...)
    # The reader: an attribute the model does not have is an error, not a silent None.
    with pytest.raises(AttributeError, match="weights_verison"):
        getattr(report, "weights_verison")
