"""The step kinds: each is ONE declaration of its header, rank 0's side and the peers' side.

A step is one header on the control group (service.gang.control), then the step's own
collectives on the data group, in the same order on every rank. What differs between
kinds is only what the header carries and what each rank does after it; everything
else is shared and lives once:

- rank 0's path, the poisoned-output check's follow-up (`step_error`), the timings and
  the failure mapping (503/504, weights-version refusal, BROKEN): `Gang._run_step`;
- the peers' loop (sequence check, dtype check, refusal vs failure): `Rank._run_loop`,
  which dispatches on the header's OP through `KINDS`;
- the collective itself (broadcast, poisoning when this rank holds another weights
  version, the model's computation with its all_reduce, the step clock): `Rank.collective`.

A kind declares (see `StepKind`): `op` and `name` (its header OP and the words every
message about it uses), `header()` (the values its peers need), `root()` (rank 0: its
input in, the all-reduced output out), `peer()` (a peer: its part from the header alone)
and `poisoned()` (where a refusal shows in the output: padded positions stay 0).
Adding a kind: one class here, added to `KINDS`; its model method (service.parallel.model
RankModel); the entry point that builds it (`Gang`).

Imports neither Ray nor the service's configuration: the plain rank runs it without Ray.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

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


class StepKind(Protocol):
    """One step as rank 0 sends it; `peer` is the same kind's side on ranks 1..N-1."""

    op: ClassVar[int]
    name: ClassVar[str]

    def header(self, seq: int, dtype: torch.dtype, version: int, sent_ns: int) -> torch.Tensor: ...

    def root(self, rank: Rank, version: int) -> np.ndarray: ...

    def poisoned(self, out: np.ndarray) -> bool: ...

    @staticmethod
    def peer(rank: Rank, h: list[int]) -> None: ...


@dataclass(frozen=True, eq=False)
class Forward:
    """OP_STEP: x [batch, seq, E] float32 (+ key mask [batch, seq] bool, True = token),
    causal or not -> the model's forward [batch, seq, E] float32. One data broadcast
    carries x and the mask ([x.flatten(), mask.flatten()] in the compute dtype: 0/1 are
    exact in every float dtype), so the mask costs no extra collective."""

    x: np.ndarray
    mask: np.ndarray | None = None
    causal: bool = False
    op: ClassVar[int] = control.OP_STEP
    name: ClassVar[str] = "step"

    def header(self, seq: int, dtype: torch.dtype, version: int, sent_ns: int) -> torch.Tensor:
        batch, seq_len, width = (int(d) for d in self.x.shape)
        flags = (control.FLAG_MASKED if self.mask is not None else 0) | (control.FLAG_CAUSAL if self.causal else 0)
        return control.header(self.op, seq, sent_ns, batch=batch, seq_len=seq_len, width=width, flags=flags,
                              dtype=dtype, version=version)

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

    @staticmethod
    def peer(rank: Rank, h: list[int]) -> None:
        batch, seq, width = h[control.BATCH], h[control.SEQ_LEN], h[control.WIDTH]
        masked = bool(h[control.FLAGS] & control.FLAG_MASKED)
        buf = torch.empty(batch * seq * (width + 1) if masked else batch * seq * width, dtype=rank.dtype,
                          device=rank.device)
        _forward(rank, buf, (batch, seq, width), masked, bool(h[control.FLAGS] & control.FLAG_CAUSAL),
                 h[control.VERSION])


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
    """OP_APPEND (sessions, service.parallel.kv_cache): `sessions` sessions' new rows
    x [T, E] float32, written to and attending over every rank's KV pool as the plan
    `meta` (`AppendPlan.encode()`) says -> their outputs [T, E]. The plan travels on the
    control group right after the header (META_LEN values), the rows on the data group."""

    sessions: int
    x: np.ndarray
    meta: torch.Tensor
    op: ClassVar[int] = control.OP_APPEND
    name: ClassVar[str] = "append step"

    def header(self, seq: int, dtype: torch.dtype, version: int, sent_ns: int) -> torch.Tensor:
        return control.header(self.op, seq, sent_ns, batch=self.sessions, seq_len=int(self.x.shape[0]),
                              width=int(self.x.shape[1]), dtype=dtype, version=version, meta_len=int(self.meta.numel()))

    def root(self, rank: Rank, version: int) -> np.ndarray:
        if rank.world_size > 1:
            rank.broadcast_control(self.meta)
        xt = torch.from_numpy(np.ascontiguousarray(self.x, dtype=np.float32))
        buf = xt.to(device=rank.device, dtype=rank.dtype).reshape(-1)
        return _append(rank, buf, self.meta, int(self.x.shape[1]), version).to(torch.float32).cpu().numpy()

    def poisoned(self, out: np.ndarray) -> bool:
        return bool(out.size) and bool(np.isnan(out.flat[0]))

    @staticmethod
    def peer(rank: Rank, h: list[int]) -> None:
        meta = torch.empty(h[control.META_LEN], dtype=torch.int64)
        rank.broadcast_control(meta)
        buf = torch.empty(h[control.SEQ_LEN] * h[control.WIDTH], dtype=rank.dtype, device=rank.device)
        _append(rank, buf, meta, h[control.WIDTH], h[control.VERSION])


def _append(rank: Rank, buf: torch.Tensor, meta: torch.Tensor, width: int, version: int) -> torch.Tensor:
    plan = AppendPlan.decode(meta)
    plan.check()
    pool = rank.kv_pool_for(plan)

    def compute(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        assert rank.model is not None
        return rank.model.append(x.view(-1, width), plan, pool)

    return rank.collective(buf, buf.numel(), version, compute)  # [T, E], all-reduced


# The peers' loop dispatches on the header's OP through this table.
KINDS: dict[int, type[Forward] | type[Append]] = {kind.op: kind for kind in (Forward, Append)}
