"""Readiness: ONE answer to "can this app serve a request right now?".

`GET /readyz`, `GET /v2/health/ready` and the OIP model-ready routes all call `readiness()`.
The truth comes from the Controller's fleet view (service.state.fleet): ready while at
least one gang's latest report says ready, is fresh, and its replica process is not known
to be dead (the Controller pings every gang twice a second, so the loss of the only gang
turns readiness off within about a second). When no gang serves, the 503 names why: a
gang's own state and reason (rebuilding, broken), a gang lost moments ago, or, when no gang
is there at all, what the cluster lacks (needed vs free, unschedulable, schedule timeout).

If the Controller itself cannot answer (it is being restarted), readiness asks a gang
directly, as the only other source of truth.
"""
from __future__ import annotations

from typing import Any

from service.ingress.auth import redact_paths
from service.errors import ErrorCode, GangServeError, GangUnavailable
from service.gang_status import Readiness, dump
from service.ingress.gang_client import GangClient, unavailable_error

# A controller up for less than this may not have heard from every gang yet.


async def readiness(gang: GangClient) -> dict[str, Any]:
    """The 200 body (service.gang_status.Readiness, as a dict); raises the 503
    (a GangServeError naming why) when no gang can serve now."""
    try:
        fleet = await gang.gangs(for_readiness=True)
    except GangServeError:
        fleet = None  # the controller is restarting: ask whichever gang the handle reaches
    up_s = fleet.get("controller_up_s") if fleet is not None else None
    if fleet is not None and not fleet["gangs"] and not fleet["lost"] and up_s is not None and up_s < gang.tunables.fleet.warm_up_s:
        fleet = None  # a controller that just (re)started has not heard from the gangs yet
    if fleet is None:
        info = await gang.describe()
        if info["state"] != "ready":
            raise unavailable_error(redact_paths(info))
        return _ready(info, ready=1, desired=None, missing=[])
    serving = [g for g in fleet["gangs"] if g.get("state") == "ready"]
    if serving:
        gang.saw_ready()
        return _ready(serving[0], ready=fleet["ready"], desired=fleet["desired"], missing=fleet["missing"])
    raise await _why_not(gang, fleet)


async def _why_not(gang: GangClient, fleet: dict[str, Any]) -> GangServeError:
    if fleet["gangs"]:  # gangs exist but none serves: the first one's own words
        return unavailable_error(redact_paths(fleet["gangs"][0]))
    lost = fleet["lost"]
    what = (f"gang {lost[0]['replica_id']} was lost {lost[0]['s_ago']:g}s ago ({lost[0]['reason']})"
            if lost else "no gang has reported yet")
    status = await gang.diagnose(what)
    if lost and status["state"] == "scheduling":
        return GangUnavailable(f"no gang can serve: {redact_paths(status['reason'])}", code=ErrorCode.GANG_RESTARTING,
                               retry_after_s=2.0)
    return unavailable_error(redact_paths(status))


def _ready(info: dict[str, Any], *, ready: int, desired: int | None, missing: list[str]) -> dict[str, Any]:
    return dump(Readiness(status="ready", world_size=info["world_size"], backend=info["backend"],
                          ready=ready, desired=desired if desired is not None else ready,
                          missing=redact_paths(missing)))
