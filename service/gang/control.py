"""The gang's own control channel: rank 0 tells the peers' step loops what comes next.

Protocol
--------
After bring-up every peer rank (1..N-1) runs one thread, its *step loop*, that blocks
reading a fixed-size header from rank 0 over the gang's **header link**
(service.gang.header_link: one TCP connection per peer, made at rendezvous through the
gang's store to rank 0's node address, so it reaches peers on other nodes as the process
group does, and nothing crosses Ray). No collective carries a header: rank 0's send needs
no thread hand-off and the kernel wakes the waiting peer directly. Next to the data group
the gang also has a **control group**, gloo whatever the data backend (a peer waiting on it
never holds a CUDA stream), for what is too large for the link (below).

Header: `HEADER_LEN` int64 values. The first five are every header's (`Header`)::

    [OP, SEQ, DTYPE, VERSION, SENT_NS, <the kind's own fields>...]

    OP       OP_HEARTBEAT, OP_STOP, or a step kind's op (service.gang.steps.KINDS, the one
             table of the kinds: each row's op, its header fields and its handlers)
    SEQ      rank 0's sequence number of this header (+1 per header, heartbeats included)
    DTYPE    DTYPE_CODES[compute dtype] (steps only): a peer computing in another dtype
             refuses the step
    VERSION  the weights version the step expects (a peer holding another computes on
             NaN and records the mismatch; see Rank.collective)
    SENT_NS  rank 0's time.time_ns() when it sent the header (instrumentation only)

The rest, up to `KIND_FIELDS` values, are the step kind's own, each named by its row's
`layout` (a frozen dataclass of ints, encoded in field order; a heartbeat's and a stop's
are 0): a forward step's [batch, seq_len, width, flags], an append step's [sessions,
rows, width, meta_len]. No field is reused by another kind under another meaning.

An append step (sessions, service.parallel.kv_cache): the header is followed by the plan
(`AppendPlan.encode()`, `meta_len` int64 values: which blocks of each rank's KV pool every
session's rows go to, and its cached length), over the header link when it is at most
`header_link.DATA_MAX_BYTES`, else by one broadcast on the control group; then on the data
group by the new rows [T, E] and the out projection's all_reduce, as a step. When every rank
computes on CPU (one decision for the gang, made when the link connects), a forward step's
input of at most `DATA_MAX_BYTES` also follows its header over the link instead of the data
group's broadcast (the peer is awake already: one wake, not a second one through gloo's threads).

Ordering: rank 0 sends headers only from the gang's sequencer thread, and a step's
header is followed by that step's collectives on the data group, in the same order on
every rank. Ray calls to a peer (staging and committing weights, describe, failpoints,
teardown) never touch a group; the sequencer issues them only between steps (after the
previous step's all_reduce completed on rank 0, i.e. after every peer entered it), and
sends the next header only once they returned, so a Ray call and a step never overlap
in a way that matters (a commit swaps a pointer the loop reads only after its next
header).

Timeouts: every read and send on the header link, and the control group, are bounded by
`collective_timeout_s`. Rank 0 sends
OP_HEARTBEAT when no header went out for `tunables.gang.heartbeat_interval(collective_timeout_s)`, so
an idle gang never trips it; a peer whose wait fails (rank 0's process gone: at once,
its connection closes; rank 0 stopped: after `collective_timeout_s`) records why and
exits its process within `PEER_EXIT_GRACE_S`, leaving nothing behind.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import Any, TypeVar

import torch


HEADER_LEN = 10
COMMON_FIELDS = 5  # op, seq, dtype, version, sent_ns
KIND_FIELDS = HEADER_LEN - COMMON_FIELDS

# The step loop's own ops; the step kinds' ops are their rows' (service.gang.steps.KINDS).
OP_HEARTBEAT = 2
OP_STOP = 3
LOOP_OPS = frozenset({OP_HEARTBEAT, OP_STOP})

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


@dataclass(frozen=True)
class Header:
    """One header as both sides read it: every header's fields, named, and the kind's own
    values (`kind_fields` reads them into the kind's layout)."""

    op: int
    seq: int
    dtype: int = 0  # DTYPE_CODES[compute dtype]; 0: no step (a heartbeat, a stop)
    version: int = 0
    sent_ns: int = 0
    kind_values: tuple[int, ...] = ()

    def encode(self) -> torch.Tensor:
        """The HEADER_LEN int64 values rank 0 broadcasts (the kind's values zero-padded)."""
        if len(self.kind_values) > KIND_FIELDS:
            raise ValueError(f"a header holds {KIND_FIELDS} kind fields, op {self.op} has {len(self.kind_values)}")
        pad = (0,) * (KIND_FIELDS - len(self.kind_values))
        return torch.tensor([self.op, self.seq, self.dtype, self.version, self.sent_ns, *self.kind_values, *pad],
                            dtype=torch.int64)

    @classmethod
    def decode(cls, values: torch.Tensor) -> "Header":
        v = values.tolist()
        return cls(v[0], v[1], v[2], v[3], v[4], tuple(v[COMMON_FIELDS:]))


Layout = TypeVar("Layout")


def kind_fields(layout: type[Layout], header: Header) -> Layout:
    """The kind's own fields of `header`, as its `layout` (a dataclass of ints) names them."""
    return layout(*header.kind_values[:len(fields(layout))])  # type: ignore[arg-type]


def kind_values(layout_values: Any) -> tuple[int, ...]:
    """A kind's layout instance as the header's values, in field order."""
    return tuple(int(v) for v in astuple(layout_values))


def loop_header(op: int, seq: int, sent_ns: int) -> Header:
    """A heartbeat's or a stop's header (no kind fields)."""
    if op not in LOOP_OPS:
        raise ValueError(f"op {op} is a step kind's, not the loop's own")
    return Header(op, seq, sent_ns=sent_ns)


def empty_header() -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.int64)
