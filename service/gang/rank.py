"""The rank as the gang runs it: the plain `Rank` (service.gang.worker) with Ray's identity.

The same class runs as rank 0 inside the GangServer replica (so the request tensor
needs no extra actor hop) and as a Ray actor for ranks 1..N-1 (service.gang.gang wraps it
with `ray.remote`). Everything that rendezvouses, loads shards, steps and tears down is
the plain class's; this wrapper only asks Ray where the rank runs (node, IP, assigned
GPU) and raises the gang's own error types. Ray is imported when a RankWorker is made,
not when this module is: `import service.gang.rank` works without Ray.
"""
from __future__ import annotations

import logging

from service.cluster.heap import keep_freed_buffers
from service.gang.backends import set_tf32_matmuls
from service.gang.devices import choose_device
from service.config.tunables import GangTunables, StateTunables
from service.gang.worker import (  # re-exported: the gang and its tests import them from here
    COMPUTE_DTYPES,
    PlainModel,
    Rank,
    RankInfo,
    load_rank_shard,
)

log = logging.getLogger("gangserve.rank")

__all__ = ["COMPUTE_DTYPES", "PlainModel", "Rank", "RankInfo", "RankWorker", "load_rank_shard"]


class RankWorker(Rank):
    """A `Rank` placed by Ray: its node identity and GPU come from Ray's runtime context."""

    def __init__(self, rank: int, world_size: int, *, use_gpu: bool, torch_threads: int, allow_tf32: bool = False,
                 tunables: GangTunables = GangTunables(), state_tunables: StateTunables = StateTunables()) -> None:
        import ray

        keep_freed_buffers()  # each step's tensors reuse the heap, no page faults (rank 0: the GangServer's process)
        ctx = ray.get_runtime_context()
        gpu_ids = [str(g) for g in ray.get_gpu_ids()] if use_gpu else []
        choice = choose_device(use_gpu, gpu_ids)
        if use_gpu and not choice.has_cuda:
            log.warning("rank %d holds GPU resource %s but has no CUDA device: %s", rank, gpu_ids, choice.why)
        super().__init__(
            rank, world_size, device=choice.device, node_ip=ray.util.get_node_ip_address(),
            node_id=ctx.get_node_id(), gpu_ids=gpu_ids, torch_threads=torch_threads, device_how=choice.why,
            tunables=tunables, state_tunables=state_tunables,
        )
        # Process-wide, before this rank's first matmul (the builder argument allow_tf32).
        self.matmul_precision = set_tf32_matmuls(allow_tf32) if choice.has_cuda else "ieee"
