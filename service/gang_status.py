"""The gang's status as a typed contract: GET /gang, the rows of GET /gangs, GET /readyz.

One description of a gang is built in several places: the Gang (its lifecycle, weights,
ranks), the GangServer (rebuild count, replica id, data channel, step timings), the
ingress (how it sends tensors; and, when no gang server answers, a status it synthesizes
from the cluster's resources: `scheduling` / `unschedulable`), and the Controller's fleet
view (a gang whose reports stopped is shown `unreachable`). Each of them builds a
`GangStatus` here; where the status crosses a Ray call it travels as
`model_dump(exclude_unset=True)` (a plain dict: the keys each producer set, nothing more),
and the HTTP routes declare these models as their `response_model` (so /openapi.json
describes them).

The models are open (`extra="allow"`): a key a producer adds that is not declared here is
kept, never dropped. Every field but `state` and `reason` is optional, because a
synthesized status has only those (and `code`); the routes serialize with
`response_model_exclude_unset`, so an absent key stays absent rather than becoming null.

This module sits below the subsystems (the gang, the ingress, training) and the state
package: it imports nothing from `service`.
"""
from __future__ import annotations

import enum
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field


class GangState(str, enum.Enum):
    """The states a Gang itself goes through (service.gang.gang)."""

    STARTING = "starting"
    READY = "ready"
    BROKEN = "broken"
    REBUILDING = "rebuilding"
    STOPPED = "stopped"


# Every `state` a status can carry: the Gang's own, plus the ones observers synthesize for a
# gang that cannot say for itself.
StatusState = Literal[
    "starting", "ready", "broken", "rebuilding", "stopped",
    "scheduling",  # (ingress) no gang server answers yet; the cluster can hold the gang
    "unschedulable",  # (ingress) the cluster can never hold it, or schedule_timeout_s passed
    "unreachable",  # (fleet view) its last report said ready, but it is stale or its replica cannot be pinged
]
SYNTHESIZED_STATES = frozenset(get_args(StatusState)) - {s.value for s in GangState}
SpareState = Literal["none", "starting", "warm", "dead"]


class _Open(BaseModel):
    """Undeclared keys are kept (the contract is additive)."""

    model_config = ConfigDict(extra="allow")


class RankStatus(_Open):
    """One rank's placement (service.gang.rank.RankInfo.public)."""

    rank: int = Field(description="0..world_size-1; rank 0 is the GangServer replica's process.")
    node_id: str = Field(description="Ray node id.")
    node_ip: str
    pid: int
    device: str = Field(description="torch device, e.g. `cpu` or `cuda:0`.")
    iface: str | None = Field(default=None, description="The network interface its collectives use (null: gloo's choice).")


class RankMemory(_Open):
    """One CUDA rank's device memory (service.gang.worker.Rank.memory_stats), refreshed in the
    background like the step timings."""

    rank: int
    device: str = Field(description="e.g. `cuda:0`.")
    memory_allocated_bytes: int = Field(description="Bytes in live tensors.")
    memory_reserved_bytes: int = Field(description="Bytes the caching allocator holds from the driver (what "
                                       "nvidia-smi counts for the process, less the CUDA context).")
    max_memory_reserved_bytes: int = Field(description="The peak of memory_reserved_bytes since the rank started.")
    pinned_host_bytes: int = Field(description="Rank 0's pinned staging buffers on the host.")


class SpareStatus(_Open):
    """The warm spare: an idle rank process a rebuild adopts."""

    state: SpareState
    pid: int | None = Field(default=None, description="Only while warm.")


class BringUpTimings(_Open):
    """Where the last (re)build's time went (empty before the first one ends)."""

    ms: dict[str, float] | None = Field(default=None, description="Milliseconds per stage (teardown, create, "
                                        "rendezvous, load, warmup).")
    spare_adopted_as_rank: int | None = Field(default=None, description="The rank the warm spare became, if any.")


class BatchingStats(_Open):
    """A StepBatcher's counters (service.batching.StepBatcher.stats)."""

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


class DataChannelStatus(_Open):
    """The gang server's same-node socket (service.transport.channel)."""

    listening: bool = Field(description="The ingress connects to it (when on rank 0's node) only while true.")
    requests: int
    refused_overloaded: int
    disconnected: int
    in_flight: int


class IngressTransport(_Open):
    """How this ingress replica has been handing tensors to the gang (GET /gang only)."""

    node_id: str
    shm_enabled: bool
    data_channel_enabled: bool
    shared_memory: int
    object_store: int
    shared_memory_fallbacks: int
    data_channel: int
    data_channel_fallbacks: int


class GangStatus(_Open):
    """One gang's status (GET /gang; each row of GET /gangs)."""

    world_size: int | None = None
    backend: str | None = Field(default=None, description="gloo or nccl (`unknown` before the first bring-up).")
    step_loop: bool | None = Field(default=None, description="The peers run the step loop (steps as headers).")
    state: StatusState = Field(description="The gang's lifecycle state, or one synthesized by an observer "
                               "(scheduling, unschedulable, unreachable).")
    reason: str = Field(description="Why it is in that state, in words.")
    code: str | None = Field(default=None, description="Synthesized states only: the error code a request gets.")
    weights_version: int | None = Field(default=None, description="The app's recorded version the ranks hold (0: none yet).")
    weights_source: str | None = Field(default=None, description="`config` or `swap`.")
    weights_sha256: str | None = None
    weights_description: str | None = None
    generation: int | None = Field(default=None, description="Successful (re)builds.")
    last_bring_up: BringUpTimings | None = None
    spare: SpareStatus | None = None
    param_bytes_per_rank: list[int] | None = None
    batching: BatchingStats | None = Field(default=None, description="The gang's own batcher.")
    ranks: list[RankStatus] | None = None
    failed_rebuilds: int | None = Field(default=None, description="Rebuild attempts failed in a row.")
    replica_id: str | None = Field(default=None, description="The GangServer replica owning the gang.")
    data_channel: DataChannelStatus | None = None
    step_timings: dict[str, Any] | None = Field(default=None, description="Where the recent steps' time went, "
                                                "per rank (medians, ms).")
    memory: list[RankMemory] | None = Field(default=None, description="Device memory per CUDA rank (absent on "
                                            "CPU gangs); also /metrics' gangserve_gpu_memory_reserved_bytes.")
    sessions: dict[str, Any] | None = Field(default=None, description="Stateful sessions (service.sessions): "
                                            "active, KV cache bytes per rank, evictions, recomputed tokens.")
    reported_s_ago: float | None = Field(default=None, description="GET /gangs: age of this gang's last report.")
    ingress_transport: IngressTransport | None = None


class LostGangStatus(_Open):
    """A gang whose replica process died recently."""

    replica_id: str
    reason: str
    s_ago: float


class GangsView(_Open):
    """GET /gangs: every gang of the app."""

    desired: int = Field(description="Gangs the app should have (num_replicas, or the autoscaler's target).")
    ready: int = Field(description="Gangs serving now.")
    gangs: list[GangStatus]
    missing: list[str] = Field(description="For each desired gang that is not serving, what it waits for.")
    lost: list[LostGangStatus]
    controller_up_s: float | None = Field(default=None, description="Age of the Controller holding the view "
                                          "(null: it did not answer).")


class Readiness(_Open):
    """GET /readyz's 200 body."""

    status: Literal["ready"]
    world_size: int
    backend: str
    ready: int = Field(description="Gangs serving now.")
    desired: int
    missing: list[str]


def dump(model: BaseModel) -> dict[str, Any]:
    """The dict that crosses a Ray call: the keys the producer set (nested too)."""
    return model.model_dump(exclude_unset=True)
