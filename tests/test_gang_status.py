"""The gang status contract (service.gang_status): the OpenAPI schemas of /gang, /gangs and
/readyz, and that declaring the models changed no answer (every key a producer sets comes
back, unchanged, and no key it did not set appears).

The statuses come from the real producers: a Gang's own describe (no bring-up: nothing
here needs Ray), the fleet view, and readiness(); the routes are the real health router.
Only the ingress's GangClient (which needs a Ray cluster) is stood in for by an object
handing those statuses out.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.tunables import FleetTunables
from fastapi import FastAPI
from pydantic import ValidationError
from starlette.testclient import TestClient

from service.config import GangConfig, ModelConfig
from service.gang.gang import Gang
from service.gang.rank import RankInfo
from service.gang_status import (
    SYNTHESIZED_STATES, DataChannelStatus, GangState, GangStatus, dump,
)
from service.ingress.routes import health
from service.state.fleet import Fleet

pytestmark = pytest.mark.unit


def _server_status(tmp_path: Path) -> dict[str, Any]:
    """A GangServer-shaped /gang: the Gang's describe plus the server's own fields."""
    gang = Gang(ModelConfig(), GangConfig(), None, tmp_path)
    try:
        gang.rank_infos = [RankInfo(rank=r, node_id=f"n{r}", node_ip="10.0.0.1", pid=100 + r, device="cpu",
                                    has_cuda=False, gpu_ids=[], iface="lo" if r else None) for r in range(2)]
        gang.state, gang.reason = GangState.READY, "ready"  # as after a bring-up
        status = gang.describe()
    finally:
        gang.shutdown()
    status.failed_rebuilds, status.replica_id, status.step_timings = 0, "r1", {"enabled": False}
    status.data_channel = DataChannelStatus(listening=True, requests=3, refused_overloaded=0, disconnected=0,
                                            in_flight=1)
    return dump(status)


class _Statuses:
    """Stands in for the ingress's GangClient: the calls the health routes make."""

    def __init__(self, describe: dict[str, Any], fleet: dict[str, Any]) -> None:
        self._describe, self._fleet = describe, fleet

    async def describe(self) -> dict[str, Any]:
        return self._describe

    async def gangs(self, for_readiness: bool = False) -> dict[str, Any]:
        return self._fleet

    def saw_ready(self) -> None:
        pass


def _client(source: _Statuses) -> TestClient:
    app = FastAPI()
    app.include_router(health.router)
    app.state.gang = source
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
    for name in ("GangStatus", "RankStatus", "GangsView", "Readiness", "LostGangStatus", "BatchingStats"):
        assert name in schemas, f"{name} missing from components.schemas: {sorted(schemas)}"
    for path, model in (("/gang", "GangStatus"), ("/gangs", "GangsView"), ("/readyz", "Readiness")):
        ok = doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok == {"$ref": f"#/components/schemas/{model}"}, (path, ok)
    gang = schemas["GangStatus"]
    assert gang["additionalProperties"] is True  # undeclared keys are kept, not dropped
    assert set(gang["required"]) == {"state", "reason"}
    assert set(gang["properties"]["state"]["enum"]) >= {"ready", "scheduling", "unschedulable", "unreachable"}
    assert gang["properties"]["ranks"]["anyOf"][0]["items"] == {"$ref": "#/components/schemas/RankStatus"}
    assert gang["properties"]["reason"]["description"]


# The states docs/api.md names: the gang's own, then those observers synthesize.
DOCUMENTED_STATES = ("starting", "ready", "broken", "rebuilding", "stopped", "scheduling", "unschedulable", "unreachable")


@pytest.mark.parametrize("state", DOCUMENTED_STATES)
def test_every_documented_state_is_served_by_gang(state: str) -> None:
    status = dump(GangStatus(state=state, code="gang_x", reason="why"))
    answer = _client(_Statuses(status, {})).get("/gang")
    assert answer.status_code == 200 and answer.json() == {"state": state, "code": "gang_x", "reason": "why"}


def test_a_state_outside_the_contract_is_refused_and_the_gangs_own_are_not_synthesized() -> None:
    with pytest.raises(ValidationError, match="state"):
        GangStatus(state="exploded", reason="why")
    assert {s.value for s in GangState} | SYNTHESIZED_STATES == set(DOCUMENTED_STATES)
    assert not SYNTHESIZED_STATES & {s.value for s in GangState}


def test_gang_routes_return_every_key_a_producer_set(tmp_path: Path) -> None:
    full = _server_status(tmp_path)
    # Every key the gang and its server set today is declared in the model.
    assert set(full) <= set(GangStatus.model_fields), set(full) - set(GangStatus.model_fields)
    assert full["ranks"][0] == {"rank": 0, "node_id": "n0", "node_ip": "10.0.0.1", "pid": 100, "device": "cpu",
                                "iface": None}
    assert full["spare"] == {"state": "none"} and full["last_bring_up"] == {}
    full["added_later"] = {"anything": [1, 2.5]}  # a key no model declares: kept as it is
    synthesized = dump(GangStatus(state="scheduling", code="gang_scheduling", reason="waiting for 2 CPUs"))
    assert set(synthesized) == {"state", "code", "reason"}

    fleet = Fleet()
    fleet.report("r1", full, 100.0)
    fleet.report("r2", {**full, "replica_id": "r2"}, 100.0 - FleetTunables().stale_after_s)  # stale: shown unreachable
    view = fleet.view(100.5)
    rows = {row["replica_id"]: row for row in view["gangs"]}
    assert rows["r1"] == {**full, "reported_s_ago": 0.5}
    assert (rows["r2"]["state"], rows["r2"]["code"]) == ("unreachable", "gang_unreachable")
    gangs = {**view, "desired": 3, "missing": ["gang 3 of 3: not started; waiting for 2 CPUs"], "controller_up_s": 9.5}

    for describe in (full, synthesized):
        client = _client(_Statuses(describe, gangs))
        answer = client.get("/gang")
        assert answer.status_code == 200, answer.text
        assert answer.json() == json.loads(json.dumps(describe))
        print("/gang keys:", len(_keys(answer.json())))
    client = _client(_Statuses(full, gangs))
    answer = client.get("/gangs").json()
    assert answer == json.loads(json.dumps(gangs)) and _keys(answer) == _keys(gangs)
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "world_size": 2, "backend": "unknown", "ready": 1, "desired": 3,
                            "missing": gangs["missing"]}


def test_a_malformed_report_is_refused_by_the_fleet() -> None:
    fleet = Fleet()
    with pytest.raises(ValueError, match=r"gang A's report is not a GangStatus .*state: Field required"):
        fleet.report("A", {"reason": "no state"}, 0.0)
    with pytest.raises(ValueError, match=r"state: Input should be .*'unreachable'.* \(found 'confused'\)"):
        fleet.report("A", {"state": "confused", "reason": "not a state"}, 0.0)
    assert fleet.view(0.0)["gangs"] == []
