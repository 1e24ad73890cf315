"""The one object that carries a rank's process-group state.

Every layer and every collective receives a `ParallelGroup` explicitly; this package has
no module-level state of its own.

One global remains, and it is torch's: a rank's group is torch.distributed's default
(WORLD) group, because torch can only create other groups after `init_process_group`.
That is safe here because a process holds at most one rank of one gang (the GangServer
replica is rank 0 of its gang; every peer rank is its own actor process), and it is why
`RankWorker.close` must `destroy_process_group()` before a rebuild in the same process
calls `init_process_group` again. `group` below is that WORLD group, passed explicitly
so no layer reaches for the global itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class CollectiveTimer:
    """Host nanoseconds this rank spent in `all_reduce_` since the last `reset()`: the
    all_reduce part of a step (service.metrics.timeline). Meaningful where collectives are
    synchronous (gloo on CPU); on CUDA a call returns once queued, so `ns` says little."""

    def __init__(self) -> None:
        self.ns = 0

    def reset(self) -> None:
        self.ns = 0


@dataclass(frozen=True)
class ParallelGroup:
    """Membership of one rank in one tensor-parallel process group.

    Attributes:
        rank: this process's rank, 0 <= rank < world_size.
        world_size: number of ranks in the group.
        backend: "gloo" or "nccl" ("none" for a single rank without a group).
        device: where this rank's tensors live (cpu or cuda:N).
        group: the torch process group, or None when world_size == 1
            (a single rank needs no communication).
    """

    rank: int
    world_size: int
    backend: str
    device: torch.device
    group: dist.ProcessGroup | None
    timer: CollectiveTimer = field(default_factory=CollectiveTimer, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.world_size > 1 and self.group is None:
            raise ValueError(f"world_size={self.world_size} needs a process group, got None")

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelGroup":
        """A group of one: every collective is the identity."""
        return cls(rank=0, world_size=1, backend="none", device=torch.device(device), group=None)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over all ranks, in place; identity for one rank."""
        if self.world_size > 1:
            started = time.perf_counter_ns()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
            self.timer.ns += time.perf_counter_ns() - started
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy rank `src`'s `tensor` into every rank's `tensor`, in place."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` along the last dim, in rank order.

        [..., n] on each rank -> [..., n * world_size] on every rank.
        """
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

