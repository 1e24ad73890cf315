"""The names of a request's time: the parts of its timeline, and the gang's step timings.

`Part` is the one list of part names. Server-Timing (POST /infer's reply, docs/api.md "Where a
request's time goes") shows them in the order they ended; `StepTimings` (GET /gang's
`step_timings`) gives the step parts' medians over the recent steps, keyed by the same
names; the metrics read the same parts (service.metrics.timeline). Each part is named by
where it ENDS (service.metrics.timeline: a part is the time from the mark before to its own).

This module sits below the subsystems: it imports nothing from `service`.
"""
from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field


class Part(str, enum.Enum):
    """A part of one request's time, in the order a request on the data channel meets them."""

    READ = "read"  # ingress: the body read
    DECODE = "decode"  # ingress: decoded and validated into a float32 tensor
    POLICY = "policy"  # ingress: the request policy chose the gang and the route to rank 0
    LINK_SEND = "link_send"  # ingress: the tensor into the shared region (or the frame built)
    GANG_RECEIVE = "gang_receive"  # GangServer: the frame read off the Unix socket
    QUEUE = "queue"  # GangServer: waiting in the batcher for its step
    HANDOFF = "handoff"  # GangServer: the event loop -> the gang's sequencer thread
    HEADER = "header"  # rank 0: the step's header to the peers (world size > 1)
    BROADCAST = "broadcast"  # rank 0: the input to a tensor, broadcast to every rank
    COMPUTE = "compute"  # rank 0: the model's layers on its shard (the sum over layers)
    ALL_REDUCE = "all_reduce"  # rank 0: the row-parallel outputs' sums (gloo; the slowest peer included)
    TO_NUMPY = "to_numpy"  # rank 0: the output back to a float32 array
    TO_LOOP = "to_loop"  # GangServer: the sequencer thread -> the event loop
    REPLY = "reply"  # GangServer: the request's rows cut out and placed for the reply
    LINK_RECEIVE = "link_receive"  # ingress: the reply frame read (the output copied out)
    RETURN = "return"  # ingress: back to the route
    GANG = "gang"  # ingress: the whole hop to the gang, on a route that brings no marks back
    ENCODE = "encode"  # ingress: the reply encoded


# The parts one gang step marks on rank 0, in order (service.gang.runner): what /gang's
# step timings and the step metrics report.
STEP_PARTS: tuple[Part, ...] = (Part.HEADER, Part.BROADCAST, Part.COMPUTE, Part.ALL_REDUCE, Part.TO_NUMPY)


class StepTimings(BaseModel):
    """GET /gang `step_timings`: where the recent steps' time went (medians, ms), from rank 0's
    step timelines and every peer's wake-up stamps. Empty (`enabled` false, nothing else)
    before the first summary and at world size 1 (no step loop)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=False, description="The peers' step loops run (world size > 1).")
    steps: int = Field(default=0, description="Steps every rank has timestamps of, in the window.")
    heartbeat_s: float | None = Field(default=None, description="The idle gang's heartbeat period.")
    parts_ms: dict[Part, float] = Field(
        default_factory=dict, description="Rank 0's step parts (the Server-Timing names: header, broadcast, "
        "compute, all_reduce, to_numpy), each the median of its own duration; they do not overlap.")
    peer_wake_ms: list[float] = Field(
        default_factory=list, description="Per peer rank: header sent -> that peer awake (the control cost).")
    skew_ms: float | None = Field(
        default=None, description="The latest peer's wake-up minus rank 0's header send: how late the first "
        "collective starts (wall clocks: across nodes, their offset included).")
    error: str | None = Field(default=None, description="Why the peers' timestamps could not be read.")
