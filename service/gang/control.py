"""The gang's own control channel: rank 0 tells the peers' step loops what comes next.

Protocol
--------
After bring-up every peer rank (1..N-1) runs one thread, its *step loop*, that blocks in
a broadcast from rank 0 of a fixed-size header over the gang's **control group**: a gloo
group on CPU (the process group's own connections, so nothing crosses Ray), created
next to the data group at rendezvous. On GPUs the data group is NCCL and the control
group is still gloo, so a waiting peer never holds a CUDA stream.

Header: `HEADER_LEN` int64 values, indices named by the constants below::

    [OP, SEQ, BATCH, SEQ_LEN, WIDTH, FLAGS, DTYPE, VERSION, SENT_NS, META_LEN]

    OP       OP_HEARTBEAT, OP_STOP, or a step kind's (service.gang.steps.KINDS: OP_STEP,
             OP_APPEND, a session append step: BATCH is the number of sessions, SEQ_LEN
             the step's new rows T; see below)
    SEQ      rank 0's sequence number of this header (+1 per header, heartbeats included)
    BATCH, SEQ_LEN, WIDTH   the step's input shape [batch, seq, E] (steps only)
    FLAGS    FLAG_MASKED: a key mask follows x in the data broadcast; FLAG_CAUSAL
    DTYPE    DTYPE_CODES[compute dtype]: a peer computing in another dtype refuses the step
    VERSION  the weights version the step expects (a peer holding another computes on
             NaN and records the mismatch; see Rank.collective)
    SENT_NS  rank 0's time.time_ns() when it sent the header (instrumentation only)
    META_LEN OP_APPEND only: the int64 values of the step's plan (0 otherwise)

OP_APPEND (sessions, service.parallel.kv_cache): the header is followed on the control
group by one broadcast of the plan (`AppendPlan.encode()`, META_LEN int64 values: which
blocks of each rank's KV pool every session's rows go to, and its cached length), then on
the data group by the new rows [T, E] and the out projection's all_reduce, as a step.

Ordering: rank 0 sends headers only from the gang's sequencer thread, and a step's
header is followed by that step's collectives on the data group, in the same order on
every rank. Ray calls to a peer (staging and committing weights, describe, failpoints,
teardown) never touch a group; the sequencer issues them only between steps (after the
previous step's all_reduce completed on rank 0, i.e. after every peer entered it), and
sends the next header only once they returned, so a Ray call and a step never overlap
in a way that matters (a commit swaps a pointer the loop reads only after its next
header).

Timeouts: the control group's timeout is `collective_timeout_s`. Rank 0 sends
OP_HEARTBEAT when no header went out for `tunables.gang.heartbeat_interval(collective_timeout_s)`, so
an idle gang never trips it; a peer whose wait fails (rank 0's process gone: at once,
its connection closes; rank 0 stopped: after `collective_timeout_s`) records why and
exits its process within `PEER_EXIT_GRACE_S`, leaving nothing behind.
"""
from __future__ import annotations

import torch


HEADER_LEN = 10
OP, SEQ, BATCH, SEQ_LEN, WIDTH, FLAGS, DTYPE, VERSION, SENT_NS, META_LEN = range(10)

OP_STEP = 1
OP_HEARTBEAT = 2
OP_STOP = 3
OP_APPEND = 4

FLAG_MASKED = 1
FLAG_CAUSAL = 2

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}

def header(op: int, seq: int, sent_ns: int, *, batch: int = 0, seq_len: int = 0, width: int = 0, flags: int = 0,
           dtype: torch.dtype | None = None, version: int = 0, meta_len: int = 0) -> torch.Tensor:
    """One header (the layout above); a step kind's fields come from its declaration
    (service.gang.steps), a heartbeat's or a stop's are 0."""
    code = DTYPE_CODES[dtype] if dtype is not None else 0
    return torch.tensor([op, seq, batch, seq_len, width, flags, code, version, sent_ns, meta_len], dtype=torch.int64)


def empty_header() -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.int64)
