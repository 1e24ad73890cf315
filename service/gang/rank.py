"""One rank of the gang: process-group membership plus its shard of the attention model.

The same class runs as rank 0 inside the GangServer replica (so the request tensor
needs no extra actor hop) and as a Ray actor for ranks 1..N-1. Every method that touches
the process group is called by the gang's single sequencer, in one global order.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from service.config import ModelConfig
from service.failpoints import Failpoints
from service.netif import bind_collectives_to
from service.parallel import ParallelGroup, TensorParallelAttention
from service.parallel.weights import load_checkpoint_shard, random_weights, seed_weights, shard_dense
from service.state import artifacts

log = logging.getLogger("gangserve.rank")


class WeightsVersionMismatch(RuntimeError):
    """A step expected another weights version than the one this rank holds."""


@dataclass(frozen=True)
class RankInfo:
    """What a rank reports at creation (the `create` stage) and in GET /gang."""

    rank: int
    node_id: str
    node_ip: str
    pid: int
    device: str
    has_cuda: bool
    gpu_ids: list[str]
    iface: str | None = None  # the interface its collectives use (see service.netif)
    iface_how: str = ""

    def public(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if k in ("rank", "node_id", "node_ip", "pid", "device", "iface")}


def load_rank_shard(model: ModelConfig, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's slice of the configured weights (checkpoint, seed or random init).

    A checkpoint is an absolute local path (the `checkpoint=` builder argument) or a key in
    the artifact store (a recorded `weights/<sha256>.safetensors` copy): the store gives a
    verified local file for it (on S3: this node's cache, downloaded once per node), and
    the rank maps only its own slice of that file."""
    if model.checkpoint:
        local = artifacts.store().materialize(model.checkpoint)
        return load_checkpoint_shard(local, rank, world_size)
    dense = seed_weights(model.embed_dim) if model.init == "seed" else random_weights(model.embed_dim, model.seed)
    return shard_dense(dense, rank, world_size)


class RankWorker:
    """A rank's state. Stages: __init__ (create) -> rendezvous -> load_weights -> serve steps."""

    def __init__(self, rank: int, world_size: int, *, use_gpu: bool, torch_threads: int) -> None:
        import ray  # only for node identity; the math below never touches Ray

        torch.set_num_threads(torch_threads)
        self.rank = rank
        self.world_size = world_size
        ctx = ray.get_runtime_context()
        gpu_ids = [str(g) for g in ray.get_gpu_ids()] if use_gpu else []
        # Ray sets CUDA_VISIBLE_DEVICES to the assigned GPU, so it is cuda:0 here.
        has_cuda = use_gpu and torch.cuda.is_available() and torch.cuda.device_count() > 0
        if use_gpu and not has_cuda:
            log.warning(
                "rank %d holds GPU resource %s but has no CUDA device; falling back to CPU/gloo",
                rank, gpu_ids,
            )
        self.device = torch.device("cuda", 0) if has_cuda else torch.device("cpu")
        node_ip = ray.util.get_node_ip_address()
        # Before any process group exists in this process: gloo/NCCL read it at creation.
        choice = bind_collectives_to(node_ip)
        self.info = RankInfo(
            rank=rank,
            node_id=ctx.get_node_id(),
            node_ip=node_ip,
            pid=os.getpid(),
            device=str(self.device),
            has_cuda=has_cuda,
            gpu_ids=gpu_ids,
            iface=choice.iface,
            iface_how=choice.how,
        )
        log.info("rank %d on %s: collectives use interface %s (%s)", rank, node_ip, choice.iface, choice.how)
        self.group: ParallelGroup | None = None
        self.model: TensorParallelAttention | None = None
        self._staged: TensorParallelAttention | None = None
        self.weights_version = 0  # the recorded version self.model holds (0: none yet)
        self._store: dist.TCPStore | None = None
        self.failpoints = Failpoints()

    # -- stage: create -------------------------------------------------------------------
    def describe(self) -> RankInfo:
        return self.info

    # -- stage: rendezvous ---------------------------------------------------------------
    def open_store(self, timeout_s: float) -> int:
        """Rank 0 only: host the rendezvous store on this node; returns the OS-chosen port."""
        self._store = dist.TCPStore(
            self.info.node_ip, 0, self.world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False
        )
        return int(self._store.port)

    def rendezvous(self, host: str, port: int, backend: str, timeout_s: float) -> None:
        """Join the gang's process group through rank 0's store at host:port."""
        if self.world_size == 1:
            self.group = ParallelGroup.single(self.device)
            return
        store = self._store or dist.TCPStore(
            host, port, self.world_size, False, timedelta(seconds=timeout_s)
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend=backend, store=store, rank=self.rank, world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.group = ParallelGroup(self.rank, self.world_size, backend, self.device, dist.group.WORLD)

    # -- stage: load (and hot-swap) -----------------------------------------------------
    def load_weights(self, model_cfg: ModelConfig, version: int) -> int:
        """Build this rank's shard of `model_cfg` as weights `version`; returns its parameter bytes."""
        nbytes = self._build(model_cfg)
        self.commit_weights(version)
        return nbytes

    def stage_weights(self, model_cfg: ModelConfig) -> int:
        """Phase 1 of a swap: read this rank's slice into a new model, not yet serving."""
        self.failpoints.fire("stage_weights", f"rank {self.rank}")
        return self._build(model_cfg)

    def commit_weights(self, version: int) -> None:
        """Phase 2: serve the staged model as `version` from the next step on (a pointer swap)."""
        self.failpoints.fire("commit_weights", f"rank {self.rank}")
        if self._staged is None:
            raise RuntimeError(f"rank {self.rank}: nothing staged to commit")
        if self.failpoints.take("commit_weights_noop"):  # claims success, keeps the old weights
            self._staged = None
            return
        self.model, self._staged = self._staged, None
        self.weights_version = version

    def discard_staged(self) -> None:
        self._staged = None

    def arm_failpoint(self, name: str) -> None:
        """Tests only (needs GANGSERVE_FAILPOINTS=1): make this rank fail once at `name`."""
        self.failpoints.arm(name)

    def _build(self, model_cfg: ModelConfig) -> int:
        if self.group is None:
            raise RuntimeError(f"rank {self.rank}: weights loaded before rendezvous")
        model = TensorParallelAttention(model_cfg.embed_dim, model_cfg.num_heads, self.group)
        model.load_shard(load_rank_shard(model_cfg, self.rank, self.world_size))
        self._staged = model.eval()
        return model.parameter_bytes()

    # -- serving -------------------------------------------------------------------------
    def step(self, shape: tuple[int, ...], weights_version: int) -> None:
        """Ranks 1..N-1: receive rank 0's input by broadcast and compute this rank's heads.

        `shape` and the weights version the step expects arrive in a tiny control message;
        the tensor itself only travels through the process group.
        """
        x = torch.empty(shape, dtype=torch.float32, device=self.device)
        self._forward(x, weights_version)

    def root_step(self, x: np.ndarray, weights_version: int) -> np.ndarray:
        """Rank 0: broadcast x [batch, seq, E] float32 to the gang and return the reduced output."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if not x.flags.writeable:  # arrays from Ray's object store are read-only views
            x = x.copy()
        xt = torch.from_numpy(x).to(self.device)  # [batch, seq, E]
        return self._forward(xt, weights_version).cpu().numpy()

    def _forward(self, x: torch.Tensor, weights_version: int) -> torch.Tensor:
        """One step: broadcast, this rank's heads, all-reduce.

        A rank holding another weights version than the step expects must not contribute
        to an answer, yet must still take part in every collective (or the others would
        wait out the group timeout). So it computes on NaN: its partial output is NaN in
        every element (every output element depends on all of this rank's inputs), the
        all-reduced output is NaN everywhere, and rank 0 refuses it by looking at one
        element. The rank then raises, so its ack names the mismatch.
        """
        if self.model is None or self.group is None:
            raise RuntimeError(f"rank {self.rank}: not ready (no weights loaded)")
        with torch.inference_mode():
            self.group.broadcast_(x, src=0)  # [batch, seq, E] on every rank
            mismatch = weights_version != self.weights_version
            if mismatch:
                x = torch.full_like(x, float("nan"))
            out = self.model(x)  # [batch, seq, E], all-reduced
        if mismatch:
            raise WeightsVersionMismatch(
                f"rank {self.rank} holds weights version {self.weights_version}, "
                f"the step expected {weights_version}"
            )
        return out

    def close(self) -> None:
        """Leave the process group (idempotent)."""
        self.model = None
        if self.group is not None and self.group.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None
        self._store = None
