"""The step kinds: each is ONE declaration of its header, rank 0's side and the peers' side.

A step is one header on the header link (service.gang.control), then the step's own
collectives on the data group, in the same order on every rank. What differs between
kinds is only what the header carries and what each rank does after it; everything
else is shared and lives once:

- rank 0's path, the poisoned-output check's follow-up (`step_error`), the timings and
  the failure mapping (503/504, weights-version refusal, BROKEN): `StepRunner.run`
  (service.gang.runner);
- the peers' loop (sequence check, dtype check, refusal vs failure): `Rank._run_loop`,
  which dispatches on the header's op through `KINDS`;
- the collective itself (broadcast, poisoning when this rank holds another weights
  version, the model's computation with its all_reduce, the step clock): `Rank.collective`.

The kinds are ONE table, `KINDS`: each row (`Kind`) holds the kind's op, its name (the words
every message about it uses), its header layout (a frozen dataclass of named int fields:
service.gang.control encodes them after every header's own) and the peers' handler
(`peer`: a peer's part from the header alone). Rank 0's side of a kind is a `Step` bound to
its row (`kind`): `fields()` (its header values, in the row's layout), `root()` (rank 0: its
input in, the all-reduced output out) and `poisoned()` (where a refusal shows in the output:
padded positions stay 0). Both sides read the same row: the step runner encodes
`step.kind`'s header, the peers' loop decodes it with `KINDS[header.op]`.
Adding a kind: its layout, its peer handler and its row here, its `Step`; its model method
(service.parallel.model RankModel); the entry point that builds it (`Gang`).

Imports neither Ray nor the service's configuration: the plain rank runs it without Ray.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Generic, Protocol, TypeVar

import numpy as np
import torch

from service.gang import control
from service.gang.staging import PinnedStaging
from service.parallel.kv_cache import AppendPlan, PagedKVPool
from service.parallel.model import RankModel


class Rank(Protocol):
    """What a step kind uses of a rank (service.gang.worker.Rank): declared here, so that the
    worker imports the kinds and the kinds never import the worker."""

    world_size: int
    device: torch.device
    dtype: torch.dtype
    model: RankModel | None
    staging: PinnedStaging | None

    def collective(self, buf: torch.Tensor, n: int, weights_version: int,
                   compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor: ...

    def broadcast_control(self, values: torch.Tensor) -> None: ...

    def kv_pool_for(self, plan: AppendPlan) -> PagedKVPool: ...


@dataclass(frozen=True)
class ForwardFields:
    """A forward step's header fields: the input's shape [batch, seq_len, width] and FLAG_* bits."""

    batch: int
    seq_len: int
    width: int
    flags: int


FLAG_MASKED = 1  # a key mask [batch, seq_len] follows x in the data broadcast
FLAG_CAUSAL = 2


@dataclass(frozen=True)
class AppendFields:
    """An append step's header fields: how many sessions, their new rows T (of `width`), and
    the int64 values of the plan that follows the header (`Rank.broadcast_control`)."""

    sessions: int
    rows: int
    width: int
    meta_len: int


Layout = TypeVar("Layout")


@dataclass(frozen=True)
class Kind(Generic[Layout]):
    """One row of the step kinds' table: what both sides of the step loop read."""

    op: int  # the header's op (never one of control.LOOP_OPS)
    name: str  # the words every message about this kind uses
    layout: type[Layout]  # its header fields, named (service.gang.control.kind_fields)
    peer: Callable[[Rank, control.Header, Layout], None]  # a peer's part, from the header alone

    def header(self, seq: int, dtype: torch.dtype, version: int, sent_ns: int, values: Layout) -> control.Header:
        """Rank 0's header of one step of this kind."""
        return control.Header(self.op, seq, control.DTYPE_CODES[dtype], version, sent_ns, control.kind_values(values))

    def run_peer(self, rank: Rank, header: control.Header) -> None:
        """The peers' loop: this kind's fields of `header`, handed to its handler."""
        self.peer(rank, header, control.kind_fields(self.layout, header))


class Step(Protocol):
    """Rank 0's side of one step: the row it is a step of, its header fields, its computation."""

    @property
    def kind(self) -> Kind[Any]: ...

    def fields(self) -> Any: ...  # an instance of `kind.layout`

    def root(self, rank: Rank, version: int) -> np.ndarray: ...

    def poisoned(self, out: np.ndarray) -> bool: ...


def _forward_peer(rank: Rank, h: control.Header, f: ForwardFields) -> None:
    masked = bool(f.flags & FLAG_MASKED)
    size = f.batch * f.seq_len * (f.width + 1 if masked else f.width)
    buf = torch.empty(size, dtype=rank.dtype, device=rank.device)
    _forward(rank, buf, (f.batch, f.seq_len, f.width), masked, bool(f.flags & FLAG_CAUSAL), h.version)


def _append_peer(rank: Rank, h: control.Header, f: AppendFields) -> None:
    meta = torch.empty(f.meta_len, dtype=torch.int64)
    rank.broadcast_control(meta)
    buf = torch.empty(f.rows * f.width, dtype=rank.dtype, device=rank.device)
    _append(rank, buf, meta, f.width, h.version)


FORWARD: Kind[ForwardFields] = Kind(1, "step", ForwardFields, _forward_peer)
APPEND: Kind[AppendFields] = Kind(4, "append step", AppendFields, _append_peer)


def _table(*kinds: Kind[Any]) -> dict[int, Kind[Any]]:
    """The kinds by op; refuses an op taken twice or by the loop, and a layout the header cannot hold."""
    table: dict[int, Kind[Any]] = {}
    for kind in kinds:
        if kind.op in table or kind.op in control.LOOP_OPS:
            raise ValueError(f"step kind {kind.name!r}: op {kind.op} is taken")
        if len(fields(kind.layout)) > control.KIND_FIELDS:
            raise ValueError(f"step kind {kind.name!r}: {len(fields(kind.layout))} header fields, "
                             f"a header holds {control.KIND_FIELDS}")
        table[kind.op] = kind
    return table


# The peers' loop dispatches on the header's op through this table; rank 0's steps name their row.
KINDS: dict[int, Kind[Any]] = _table(FORWARD, APPEND)


@dataclass(frozen=True, eq=False)
class Forward:
    """A forward step: x [batch, seq, E] float32 (+ key mask [batch, seq] bool, True = token),
    causal or not -> the model's forward [batch, seq, E] float32. One data broadcast
    carries x and the mask ([x.flatten(), mask.flatten()] in the compute dtype: 0/1 are
    exact in every float dtype), so the mask costs no extra collective."""

    x: np.ndarray
    mask: np.ndarray | None = None
    causal: bool = False
    kind: ClassVar[Kind[ForwardFields]] = FORWARD

    def fields(self) -> ForwardFields:
        batch, seq_len, width = (int(d) for d in self.x.shape)
        flags = (FLAG_MASKED if self.mask is not None else 0) | (FLAG_CAUSAL if self.causal else 0)
        return ForwardFields(batch, seq_len, width, flags)

    def root(self, rank: Rank, version: int) -> np.ndarray:
        x = np.ascontiguousarray(self.x, dtype=np.float32)
        shape = tuple(int(d) for d in x.shape)
        if rank.staging is not None:  # CUDA: through pinned buffers, one DMA each way
            buf = rank.staging.upload(x, self.mask, rank.dtype)
            return rank.staging.download(_forward(rank, buf, shape, self.mask is not None, self.causal, version))
        if not x.flags.writeable:  # arrays from Ray's object store are read-only views
            x = x.copy()
        xt = torch.from_numpy(x)  # [batch, seq, E]
        if self.mask is None:
            buf = xt.to(device=rank.device, dtype=rank.dtype).reshape(-1)  # no copy for float32 on CPU
        else:
            n = xt.numel()
            buf = torch.empty(n + shape[0] * shape[1], dtype=rank.dtype, device=rank.device)
            buf[:n].copy_(xt.reshape(-1))
            buf[n:].copy_(torch.from_numpy(np.ascontiguousarray(self.mask, dtype=np.bool_)).reshape(-1))
        return _forward(rank, buf, shape, self.mask is not None, self.causal, version).to(torch.float32).cpu().numpy()

    def poisoned(self, out: np.ndarray) -> bool:
        # The first token's first element: padded positions are 0 even in a poisoned step.
        first = 0 if self.mask is None else int(np.argmax(self.mask.reshape(-1))) * int(self.x.shape[2])
        return bool(out.size) and bool(np.isnan(out.flat[first]))


def _forward(rank: Rank, buf: torch.Tensor, shape: tuple[int, ...], masked: bool, causal: bool,
             version: int) -> torch.Tensor:
    batch, seq, width = shape
    n = batch * seq * width

    def compute(x: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        assert rank.model is not None
        if not masked and not causal:
            return rank.model(x.view(batch, seq, width))
        key_mask = rest.view(batch, seq) > 0.5 if masked else None  # [batch, seq] bool
        return rank.model(x.view(batch, seq, width), key_mask, causal)

    return rank.collective(buf, n, version, compute)  # [batch, seq, E], all-reduced


@dataclass(frozen=True, eq=False)
class Append:
    """An append step (sessions, service.parallel.kv_cache): `sessions` sessions' new rows
    x [T, E] float32, written to and attending over every rank's KV pool as the plan
    `meta` (`AppendPlan.encode()`) says -> their outputs [T, E]. The plan follows the header
    (`meta_len` values: over the header link, or on the control group when larger than
    the link carries), the rows on the data group."""

    sessions: int
    x: np.ndarray
    meta: torch.Tensor
    kind: ClassVar[Kind[AppendFields]] = APPEND

    def fields(self) -> AppendFields:
        return AppendFields(self.sessions, int(self.x.shape[0]), int(self.x.shape[1]), int(self.meta.numel()))

    def root(self, rank: Rank, version: int) -> np.ndarray:
        if rank.world_size > 1:
            rank.broadcast_control(self.meta)
        xt = torch.from_numpy(np.ascontiguousarray(self.x, dtype=np.float32))
        buf = xt.to(device=rank.device, dtype=rank.dtype).reshape(-1)
        return _append(rank, buf, self.meta, int(self.x.shape[1]), version).to(torch.float32).cpu().numpy()

    def poisoned(self, out: np.ndarray) -> bool:
        return bool(out.size) and bool(np.isnan(out.flat[0]))


def _append(rank: Rank, buf: torch.Tensor, meta: torch.Tensor, width: int, version: int) -> torch.Tensor:
    plan = AppendPlan.decode(meta)
    plan.check()
    pool = rank.kv_pool_for(plan)

    def compute(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        assert rank.model is not None
        return rank.model.append(x.view(-1, width), plan, pool)

    return rank.collective(buf, buf.numel(), version, compute)  # [T, E], all-reduced
