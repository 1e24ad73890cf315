"""The gang's status as typed contracts, one per owner: GET /gang, GET /gangs, GET /readyz.

Who builds what, and what crosses which call (each model itself, pickled by Ray: never a
dict read back by key). Each view owns its fields: a gang's report holds what the gang
knows, and the fleet and the ingress compose it with their own, as types of their own:
- `GangStatus`, a gang's report: the Gang (its lifecycle, weights, ranks) and its
  GangServer (rebuild count, replica id, data channel, step timings) build it in one
  constructor call (service.gang.gang.Gang.describe); it travels GangServer -> Controller
  (`report_gang`) and GangServer -> ingress (`describe`, the weights swaps).
- `GangRow`, a row of the Controller's `FleetView` (service.state.fleet): a gang's report
  plus the fleet's own fields: the report's age (`reported_s_ago`), and for a gang whose
  reports stopped, the state the fleet observes (`unreachable`), why, and the `code` a
  request gets (its last report is still all true but its state, so the row keeps it). It
  travels Controller -> ingress (`fleet`, `watch_fleet`).
- `IngressGangStatus`, GET /gang: a gang's report plus how this ingress replica hands
  tensors to the gang (`ingress_transport`).
- `SynthesizedStatus`: what the ingress says when no gang server answers at all
  (`scheduling` / `unschedulable`, from the cluster's resources). It is a model of its own,
  not a GangStatus with every field optional: there is no gang, so it has no world size, no
  ranks and no weights, and a reader holding `GangStatus | SynthesizedStatus` must say which
  one it handles (mypy checks it) instead of reading a field that may be missing.
- `GangsView`, `Readiness`: the ingress's answers to GET /gangs and GET /readyz.

The states are defined once, as three enums by who gives them: `GangState` (the gang's
own), `ObservedState` (the fleet's `unreachable`) and `AbsentState` (the ingress's).

Every model is closed (`extra="forbid"`) and a field its producer always sets is required,
so a renamed or misspelled field fails where it is built, loudly, instead of turning a
reader's feature off. The routes declare these models as their `response_model` (so
/openapi.json describes them) with `response_model_exclude_unset`: an optional field a
producer did not set (`memory` on a CPU gang, `code` on a reachable row) stays absent
from the JSON rather than becoming null. Pickling keeps the set of fields set.

This module sits below the subsystems (the gang, the ingress, training) and the state
package: it imports nothing from `service` but the contract's own `timing` (the step timings).
"""
from __future__ import annotations

import enum
from typing import Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field

from service.contract.timing import StepTimings


class GangState(str, enum.Enum):
    """The states a Gang itself goes through (service.gang.gang): what its own report says."""

    STARTING = "starting"
    READY = "ready"
    BROKEN = "broken"
    REBUILDING = "rebuilding"
    STOPPED = "stopped"


class ObservedState(str, enum.Enum):
    """A state only the fleet view gives a gang (its row in GET /gangs): the gang's last report
    said ready, but it is stale or its replica cannot be pinged."""

    UNREACHABLE = "unreachable"


class AbsentState(str, enum.Enum):
    """The states the ingress synthesizes when no gang server answers (GET /gang)."""

    SCHEDULING = "scheduling"  # the cluster can hold the gang; it waits for its bundles
    UNSCHEDULABLE = "unschedulable"  # the cluster can never hold it, or schedule_timeout_s passed


# Every state a reader of /gang or /gangs can meet: the only definitions are the three enums above.
AnyState = Union[GangState, ObservedState, AbsentState]
ALL_STATES: tuple[AnyState, ...] = (*GangState, *ObservedState, *AbsentState)
SpareState = Literal["none", "starting", "warm", "dead"]


class _Closed(BaseModel):
    """A field no model declares is refused (a typo or a rename fails where it is made)."""

    model_config = ConfigDict(extra="forbid")


class RankStatus(_Closed):
    """One rank's placement (service.gang.rank.RankInfo.public)."""

    rank: int = Field(description="0..world_size-1; rank 0 is the GangServer replica's process.")
    node_id: str = Field(description="Ray node id.")
    node_ip: str
    pid: int
    device: str = Field(description="torch device, e.g. `cpu` or `cuda:0`.")
    iface: str | None = Field(description="The network interface its collectives use (null: gloo's choice).")


class RankMemory(_Closed):
    """One CUDA rank's device memory (service.gang.worker.Rank.memory_stats), refreshed in the
    background like the step timings."""

    rank: int
    device: str = Field(description="e.g. `cuda:0`.")
    memory_allocated_bytes: int = Field(description="Bytes in live tensors.")
    memory_reserved_bytes: int = Field(description="Bytes the caching allocator holds from the driver (what "
                                       "nvidia-smi counts for the process, less the CUDA context).")
    max_memory_reserved_bytes: int = Field(description="The peak of memory_reserved_bytes since the rank started.")
    pinned_host_bytes: int = Field(description="Rank 0's pinned staging buffers on the host.")


class SpareStatus(_Closed):
    """The warm spare: an idle rank process a rebuild adopts."""

    state: SpareState
    pid: int | None = Field(default=None, description="Only while warm.")


class BringUpTimings(_Closed):
    """Where the last (re)build's time went (empty before the first one ends)."""

    ms: dict[str, float] | None = Field(default=None, description="Milliseconds per stage (teardown, create, "
                                        "rendezvous, load, warmup).")
    spare_adopted_as_rank: int | None = Field(default=None, description="The rank the warm spare became, if any.")


class BatchingStats(_Closed):
    """A StepBatcher's counters (service.gang.batching.StepBatcher.stats)."""

    steps: int
    requests: int
    inline_steps: int = Field(description="Steps run at once because the batcher was idle.")
    recent_step_ms_p50: float
    mixed_length_steps: int
    tokens: int
    padded_tokens: int
    padded_token_share: float = Field(description="Share of all steps' tokens that was padding.")
    recent_padded_token_share_mean: float = Field(description="The same per step, over the recent steps.")
    max_padding_fraction: float
    expired_queued: int
    expired_running: int
    cancelled_queued: int


class DataChannelStatus(_Closed):
    """The gang server's same-node socket (service.transport.channel)."""

    listening: bool = Field(description="The ingress connects to it (when on rank 0's node) only while true.")
    requests: int
    refused_overloaded: int
    disconnected: int
    in_flight: int


class IngressTransport(_Closed):
    """How this ingress replica has been handing tensors to the gang (GET /gang only)."""

    node_id: str
    shm_enabled: bool
    data_channel_enabled: bool
    shared_memory: int
    object_store: int
    shared_memory_fallbacks: int
    data_channel: int
    data_channel_fallbacks: int


class SessionCacheRank(_Closed):
    """One rank's K/V cache for sessions."""

    rank: int
    capacity_bytes: int
    used_bytes: int
    allocated_bytes: int | None = Field(default=None, description="Rank 0 only: the pool's bytes as allocated.")


class SessionAttention(_Closed):
    """How a session step's attention reads the KV pool (service.parallel.paged_kernel), and the
    chunked prefill's size (service.sessions.batcher)."""

    path: Literal["in_place", "varlen", "gather", "mixed"] = Field(
        description="`in_place`: a C++ decode kernel, built at bring-up, reads the pool's blocks where they lie "
        "for one-row appends (CPU ranks; appends of several rows gather); "
        "`varlen`: torch's varlen_attn reads them through a block table (CUDA ranks in bfloat16/float16 with "
        "session_block_tokens a multiple of 256, checked against the gather path at bring-up); `gather`: each "
        "session's blocks are copied first (no C++ compiler, a device or dtype neither kernel serves, or "
        "tunables.gang.session_attention=gather); `mixed`: ranks differ (each is still exact).")
    reason: str = Field(description="Why this path, in words.")
    compile_s: float = Field(description="Seconds the slowest rank spent building (or loading) and checking its "
                             "kernel at bring-up (0: none).")
    compiled_shapes: int = Field(description="Warm-up steps every rank checked its kernel on against a reference "
                                 "(`in_place`: 1; `varlen`: 2; 0: none).")
    prefill_chunk_tokens: int = Field(description="Rows per step of a long append, at most (fewer beside other "
                                      "appends: tunables.gang.session_prefill_step_ratio; 0: not chunked).")


class SessionBatchingStats(_Closed):
    """The session batcher's counters (service.sessions.batcher.AppendBatcher.stats)."""

    steps: int = Field(description="Steps run for session appends.")
    appends: int = Field(description="Appends those steps held.")
    max_sessions_in_a_step: int
    prefill_chunks: int = Field(description="Steps that ran one chunk of a long append.")
    queued: int = Field(description="Appends waiting now.")
    expired_queued: int = Field(description="Appends whose deadline passed while they waited.")
    appends_per_step: float = Field(description="appends / steps (0 before the first step).")


class SessionStats(_Closed):
    """Stateful sessions (service.sessions.service.SessionService.stats)."""

    active: int
    max_sessions: int
    max_session_tokens: int
    idle_timeout_s: float
    block_tokens: int
    num_blocks: int
    free_blocks: int
    bytes_per_token_per_rank: int
    capacity_bytes_per_rank: int
    used_bytes_per_rank: int
    cached_tokens: int
    kept_input_bytes: int
    evictions: int
    recomputed_tokens: int = Field(description="Tokens recomputed for sessions whose cache a rebuild lost.")
    expired: int
    opened: int
    ended: int
    appends: int
    append_steps: int
    per_rank: list[SessionCacheRank]
    batching: SessionBatchingStats = Field(description="The session batcher's counters.")
    append_latency_ms_p50_by_context: dict[str, float]
    attention: SessionAttention


class GangReportFields(_Closed):
    """What every view of one gang shows of its report, state aside (each view types its own
    state): what the Gang and its GangServer know."""

    world_size: int
    backend: str = Field(description="gloo or nccl (`unknown` before the first bring-up).")
    reason: str = Field(description="Why it is in that state, in words.")
    weights_version: int = Field(description="The app's recorded version the ranks hold (0: none yet).")
    weights_source: str | None = Field(description="`config` or `swap` (null before the first load).")
    weights_sha256: str | None = None
    weights_description: str | None = None
    generation: int = Field(description="Successful (re)builds.")
    last_bring_up: BringUpTimings
    spare: SpareStatus
    param_bytes_per_rank: list[int]
    batching: BatchingStats = Field(description="The gang's own batcher.")
    ranks: list[RankStatus]
    failed_rebuilds: int = Field(description="Rebuild attempts failed in a row.")
    replica_id: str = Field(description="The GangServer replica owning the gang.")
    data_channel: DataChannelStatus
    step_timings: StepTimings = Field(description="Where the recent steps' time went (medians, ms; "
                                      "`enabled` false and nothing else before the first summary).")
    memory: list[RankMemory] | None = Field(default=None, description="Device memory per CUDA rank (absent on "
                                            "CPU gangs); also /metrics' gangserve_gpu_memory_reserved_bytes.")
    sessions: SessionStats | None = Field(default=None, description="Stateful sessions (service.sessions): "
                                          "active, KV cache bytes per rank, evictions, recomputed tokens.")


class GangStatus(GangReportFields):
    """A gang's report: what the gang knows, nothing more. The Gang and its GangServer set
    every required field on every report (service.gang.gang.Gang.describe)."""

    state: GangState = Field(description="The gang's lifecycle state.")


View = TypeVar("View", bound=GangReportFields)


def _compose(view: type[View], report: GangStatus, own: dict[str, Any]) -> View:
    """`view` made of `report`'s fields as the gang set them (its objects, unchanged: the
    report was validated where it was built) and the view's `own` fields, which its
    constructor's typed arguments give. No dump, no merge of dicts: a name of `own` the view
    does not declare is refused here."""
    undeclared = set(own) - set(view.model_fields)
    the_reports = set(own) & (set(report.model_fields) - {"state", "reason"})  # a view may restate only these two
    unknown = undeclared | the_reports
    if unknown:
        raise TypeError(f"{view.__name__} composes a gang's report with its own fields only; "
                        f"{sorted(unknown)} are not its own")
    taken = {name: getattr(report, name) for name in report.model_fields_set}
    return view.model_construct(_fields_set=report.model_fields_set | set(own), **{**taken, **own})


class GangRow(GangReportFields):
    """One row of the fleet view (GET /gangs; the Controller's, service.state.fleet): a gang's
    last report with the fleet's own fields: its age, and, for a gang whose reports stopped
    or whose replica cannot be pinged although its last report said ready, the state the
    fleet observes (`unreachable`), why, and the code a request gets."""

    state: GangState | ObservedState = Field(description="The gang's own state, or `unreachable` (its last report "
                                             "said ready, but it is stale or its replica cannot be pinged).")
    code: str | None = Field(default=None, description="`unreachable` rows only: the error code a request gets.")
    reported_s_ago: float = Field(description="Age of this gang's last report.")

    @classmethod
    def of(cls, report: GangStatus, reported_s_ago: float, unreachable_because: str | None = None,
           code: str | None = None) -> GangRow:
        """The row of `report`, `reported_s_ago` seconds old; `unreachable_because`: the fleet
        sees it unreachable (with the `code` a request gets), and says why in `reason`."""
        own: dict[str, Any] = {"reported_s_ago": reported_s_ago}
        if unreachable_because is not None:
            own.update(state=ObservedState.UNREACHABLE, reason=unreachable_because, code=code)
        return _compose(cls, report, own)


class IngressGangStatus(GangStatus):
    """GET /gang from a gang server that answers: its report, with how this ingress replica
    has been handing tensors to the gang (the ingress's own field)."""

    ingress_transport: IngressTransport = Field(description="How this ingress replica hands tensors to the gang.")

    @classmethod
    def of(cls, report: GangStatus, transport: IngressTransport) -> IngressGangStatus:
        return _compose(cls, report, {"ingress_transport": transport})


class SynthesizedStatus(_Closed):
    """GET /gang when no gang server answers: why, from the cluster's resources (see the
    module docstring for why this is not a GangStatus). The ingress builds it, every field."""

    state: AbsentState
    code: str = Field(description="The error code a request gets meanwhile.")
    reason: str = Field(description="What the gang waits for, needed vs free.")
    ingress_transport: IngressTransport | None = None


# What the ingress acts on of "the gang": a gang's own report, its row in the pushed fleet
# view, or why there is none.
AnyGangStatus = Union[GangStatus, GangRow, SynthesizedStatus]
# What GET /gang answers.
GangAnswer = Union[IngressGangStatus, SynthesizedStatus]


class LostGangStatus(_Closed):
    """A gang whose replica process died recently."""

    replica_id: str
    reason: str
    s_ago: float


class FleetView(_Closed):
    """The Controller's view of the app's gangs (service.state.fleet.Fleet.view)."""

    gangs: list[GangRow] = Field(description="Every live gang's latest report, by replica id.")
    ready: int = Field(description="Gangs serving now.")
    lost: list[LostGangStatus] = Field(description="Gangs whose replica process died recently, newest first.")
    controller_up_s: float | None = Field(description="Age of the Controller holding the view (null: none).")
    version: int = Field(description="Moves on every change a request path acts on (-1: no Controller).")


class GangsView(_Closed):
    """GET /gangs: every gang of the app."""

    desired: int = Field(description="Gangs the app should have (num_replicas, or the autoscaler's target).")
    ready: int = Field(description="Gangs serving now.")
    gangs: list[GangRow]
    missing: list[str] = Field(description="For each desired gang that is not serving, what it waits for.")
    lost: list[LostGangStatus]
    controller_up_s: float | None = Field(description="Age of the Controller holding the view "
                                          "(null: it did not answer).")


class Readiness(_Closed):
    """GET /readyz's 200 body."""

    status: Literal["ready"]
    world_size: int
    backend: str
    ready: int = Field(description="Gangs serving now.")
    desired: int
    missing: list[str]


def dump(model: BaseModel) -> dict[str, Any]:
    """The JSON-shaped body of an answer: the keys the producer set (nested too)."""
    return model.model_dump(exclude_unset=True)
