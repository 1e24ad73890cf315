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

from service.contract.errors import ErrorCode, GangServeError, GangUnavailable
from service.contract.gang_status import AnyGangStatus, GangStatus, GangsView, Readiness
from service.ingress.auth import redact_paths
from service.ingress.deps import FleetReader, Gang
from service.ingress.status_view import unavailable_error


async def readiness(gang: Gang, fleet: FleetReader) -> Readiness:
    """The 200 body; raises the 503 (a GangServeError naming why) when no gang can serve now."""
    view: GangsView | None
    try:
        view = await fleet.gangs(for_readiness=True)
    except GangServeError:
        view = None  # the controller is restarting: ask whichever gang the handle reaches
    if (view is not None and not view.gangs and not view.lost and view.controller_up_s is not None
            and view.controller_up_s < fleet.tunables.fleet.warm_up_s):
        view = None  # a controller that just (re)started has not heard from the gangs yet
    if view is None:
        info = await gang.describe()
        if not isinstance(info, GangStatus) or info.state != "ready":
            raise _unavailable(info)
        return _ready(info, ready=1, desired=None, missing=[])
    serving = [g for g in view.gangs if g.state == "ready"]
    if serving:
        fleet.diagnosis.saw_ready()
        return _ready(serving[0], ready=view.ready, desired=view.desired, missing=view.missing)
    raise await _why_not(fleet, view)


async def _why_not(fleet: FleetReader, view: GangsView) -> GangServeError:
    if view.gangs:  # gangs exist but none serves: the first one's own words
        return _unavailable(view.gangs[0])
    lost = view.lost
    what = (f"gang {lost[0].replica_id} was lost {lost[0].s_ago:g}s ago ({lost[0].reason})"
            if lost else "no gang has reported yet")
    status = await fleet.diagnosis.diagnose(what)
    if lost and status.state == "scheduling":
        return GangUnavailable(f"no gang can serve: {redact_paths(status.reason)}", code=ErrorCode.GANG_RESTARTING,
                               retry_after_s=2.0)
    return _unavailable(status)


def _unavailable(status: AnyGangStatus) -> GangServeError:
    return unavailable_error(status, reason=redact_paths(status.reason))


def _ready(info: GangStatus, *, ready: int, desired: int | None, missing: list[str]) -> Readiness:
    return Readiness(status="ready", world_size=info.world_size, backend=info.backend, ready=ready,
                     desired=desired if desired is not None else ready, missing=redact_paths(missing))
