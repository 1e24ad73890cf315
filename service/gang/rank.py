"""One rank of the gang: process-group membership plus its shard of the attention model.

The same class runs as rank 0 inside the GangServer replica (so the request tensor
needs no extra actor hop) and as a Ray actor for ranks 1..N-1. Every method that touches
the process group is called by the gang's single sequencer, in one global order.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from service.config import ModelConfig
from service.gang.failpoints import Failpoints
from service.gang.failures import WeightsVersionMismatch, first_line
from service.gang import control
from service.cluster.netif import bind_collectives_to
from service.parallel import ParallelGroup, TensorParallelAttention
from service.parallel.weights import (
    checkpoint_causal,
    load_checkpoint_shard,
    random_weights,
    seed_weights,
    shard_dense,
)
from service.state import artifacts

log = logging.getLogger("gangserve.rank")

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    iface: str | None = None  # the interface its collectives use (see service.cluster.netif)
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
        # The model's default for requests that do not say (builder `causal`, or the
        # checkpoint's recorded one): staged and committed with the weights.
        self.default_causal = False
        self._staged_causal = False
        self.dtype = torch.float32  # compute dtype: weights, activations and collectives
        self.weights_version = 0  # the recorded version self.model holds (0: none yet)
        self._store: dist.TCPStore | None = None
        self.failpoints = Failpoints()
        # The step loop (see service.gang.control): the control group rank 0's headers
        # arrive on, the loop thread, and what the loop records for rank 0 to ask about.
        self._control: dist.ProcessGroup | None = None
        self._loop: threading.Thread | None = None
        self.loop_error: str | None = None  # why the loop stopped (it then exits the process)
        self.step_seq = 0  # the header sequence number of the step being computed
        self._mismatches: deque[tuple[int, str]] = deque(maxlen=64)  # (seq, why) refused steps
        # (seq, header sent, woke, broadcast done, forward done), time.time_ns() each
        self._timings: deque[tuple[int, int, int, int, int]] = deque(maxlen=control.TIMINGS_KEPT)
        self.last_bcast_ns = 0
        self.last_forward_ns = 0

    # -- stage: create -------------------------------------------------------------------
    def describe(self) -> RankInfo:
        return self.info

    def adopt(self, rank: int) -> RankInfo:
        """A warm spare (created with rank -1, see Gang's spare) becomes `rank` of the next
        generation: its process, torch and interface choice are already up; rendezvous and
        the weights follow as for any new rank."""
        if self.rank != -1 or self.group is not None:
            raise RuntimeError(f"rank {self.rank}: only an unused spare (rank -1) can be adopted")
        if not 0 < rank < self.world_size:
            raise ValueError(f"a spare can become a peer rank 1..{self.world_size - 1}, not {rank}")
        self.rank = rank
        self.info = replace(self.info, rank=rank)
        log.info("spare pid %d adopted as rank %d", self.info.pid, rank)
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
        # The control group: gloo whatever the data backend (a peer waiting for the next
        # header must not hold a CUDA stream), with the same bounded timeout.
        self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

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
        self.default_causal = self._staged_causal
        self.weights_version = version

    def discard_staged(self) -> None:
        self._staged = None

    def arm_failpoint(self, name: str) -> None:
        """Tests only (needs GANGSERVE_FAILPOINTS=1): make this rank fail once at `name`."""
        self.failpoints.arm(name)

    def _build(self, model_cfg: ModelConfig) -> int:
        if self.group is None:
            raise RuntimeError(f"rank {self.rank}: weights loaded before rendezvous")
        dtype = COMPUTE_DTYPES[model_cfg.compute_dtype]
        if dtype == torch.float16 and self.device.type != "cuda":
            raise ValueError(
                f"rank {self.rank}: compute_dtype=float16 needs a CUDA device; this rank computes on "
                f"{self.device} (use bfloat16 or float32 on CPU)"
            )
        model = TensorParallelAttention(model_cfg.embed_dim, model_cfg.num_heads, self.group, dtype=dtype)
        # A recorded checkpoint may be an artifact key: one verified local file for both reads.
        local = artifacts.store().materialize(model_cfg.checkpoint) if model_cfg.checkpoint else None
        if local is not None:
            model_cfg = model_cfg.model_copy(update={"checkpoint": str(local)})
        model.load_shard(load_rank_shard(model_cfg, self.rank, self.world_size))
        recorded = checkpoint_causal(local) if local is not None else None
        self._staged_causal = model_cfg.causal if recorded is None else recorded
        self.dtype = dtype  # one dtype per gang (the config's): a swap keeps it
        self._staged = model.eval()
        return model.parameter_bytes()

    # -- serving -------------------------------------------------------------------------
    def step(self, shape: tuple[int, ...], weights_version: int, masked: bool = False, causal: bool = False) -> None:
        """Ranks 1..N-1: receive rank 0's input by broadcast and compute this rank's heads.

        `shape`, whether a key mask comes along, the causal flag and the weights version
        the step expects arrive in a tiny control message; the tensors themselves only
        travel through the process group (see `_forward`).
        """
        batch, seq, width = shape
        buf = torch.empty(batch * seq * (width + 1) if masked else batch * seq * width, dtype=self.dtype,
                          device=self.device)
        self._forward(buf, tuple(shape), masked, causal, weights_version)

    def root_step(self, x: np.ndarray, weights_version: int, mask: np.ndarray | None = None,
                  causal: bool = False) -> np.ndarray:
        """Rank 0: broadcast x [batch, seq, E] float32 (and the key mask [batch, seq] bool) to
        the gang and return the reduced output [batch, seq, E] float32."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if not x.flags.writeable:  # arrays from Ray's object store are read-only views
            x = x.copy()
        shape = tuple(int(d) for d in x.shape)
        xt = torch.from_numpy(x)  # [batch, seq, E]
        if mask is None:
            buf = xt.to(device=self.device, dtype=self.dtype).reshape(-1)  # no copy for float32 on CPU
        else:
            # One broadcast carries both: [x.flatten(), mask.flatten()] in the compute dtype
            # (0/1 are exact in every float dtype), so the mask costs no extra collective.
            n = xt.numel()
            buf = torch.empty(n + shape[0] * shape[1], dtype=self.dtype, device=self.device)
            buf[:n].copy_(xt.reshape(-1))
            buf[n:].copy_(torch.from_numpy(np.ascontiguousarray(mask, dtype=np.bool_)).reshape(-1))
        out = self._forward(buf, shape, mask is not None, causal, weights_version)
        return out.to(torch.float32).cpu().numpy()

    def _forward(self, buf: torch.Tensor, shape: tuple[int, ...], masked: bool, causal: bool,
                 weights_version: int) -> torch.Tensor:
        """One step: broadcast, this rank's heads, all-reduce.

        `buf` is x flattened ([batch * seq * E]), followed with `masked` by the key mask
        ([batch * seq], 1.0 = token), in the compute dtype.

        A rank holding another weights version than the step expects must not contribute
        to an answer, yet must still take part in every collective (or the others would
        wait out the group timeout). So it computes on NaN: its partial output is NaN in
        every element (every output element depends on all of this rank's inputs), the
        all-reduced output is NaN everywhere except at padded query positions (set to 0),
        and rank 0 refuses it by looking at one token's element. The rank then raises, so
        its ack names the mismatch.
        """
        if self.model is None or self.group is None:
            raise RuntimeError(f"rank {self.rank}: not ready (no weights loaded)")
        batch, seq, width = shape
        with torch.inference_mode():
            self.group.broadcast_(buf, src=0)  # on every rank
            self.last_bcast_ns = time.time_ns()
            n = batch * seq * width
            x = buf[:n].view(batch, seq, width)  # [batch, seq, E]
            key_mask = buf[n:].view(batch, seq) > 0.5 if masked else None  # [batch, seq] bool
            mismatch = weights_version != self.weights_version
            if mismatch:
                why = (f"rank {self.rank} holds weights version {self.weights_version}, "
                       f"the step expected {weights_version}")
                # Recorded before the all_reduce: once rank 0's all_reduce is done, it can ask.
                self._mismatches.append((self.step_seq, why))
                x = torch.full_like(x, float("nan"))
            out = self.model(x) if key_mask is None and not causal else self.model(x, key_mask, causal)
            self.last_forward_ns = time.time_ns()
        if mismatch:
            raise WeightsVersionMismatch(why)
        return out  # [batch, seq, E], all-reduced

    # -- the step loop (ranks 1..N-1; protocol in service.gang.control) -----------------
    def send_header(self, header: torch.Tensor) -> None:
        """Rank 0 only (the gang's sequencer): broadcast one header to the peers' loops."""
        if self._control is None:
            raise RuntimeError(f"rank {self.rank}: no control group (world_size {self.world_size})")
        dist.broadcast(header, src=0, group=self._control)

    def start_loop(self) -> None:
        """Peers: from now on take steps from rank 0's headers, not from Ray calls."""
        if self.rank == 0 or self._control is None:
            raise RuntimeError(f"rank {self.rank}: a step loop needs a peer rank with a control group")
        if self._loop is not None:
            raise RuntimeError(f"rank {self.rank}: the step loop is already running")
        self._loop = threading.Thread(target=self._run_loop, name=f"step-loop-{self.rank}", daemon=True)
        self._loop.start()

    def step_error(self, seq: int) -> str | None:
        """Why this rank refused step `seq` (a weights version mismatch), or why its loop
        stopped; None if it took part normally."""
        for s, why in self._mismatches:
            if s == seq:
                return why
        return self.loop_error

    def loop_timings(self) -> list[tuple[int, int, int, int, int]]:
        """The last steps' (seq, header sent, woke, broadcast done, forward done), ns."""
        return list(self._timings)

    def _run_loop(self) -> None:
        header = control.empty_header()
        expected: int | None = None
        while True:
            try:
                # Blocks until rank 0's next header; bounded by the control group's timeout
                # (rank 0 sends heartbeats well inside it while idle).
                dist.broadcast(header, src=0, group=self._control)
            except Exception as exc:  # rank 0 gone (connection closed) or stopped (timeout)
                self._loop_failed(f"waiting for rank 0's next header failed: {type(exc).__name__}: "
                                  f"{first_line(exc)}")
                return
            woke = time.time_ns()
            h = header.tolist()
            if expected is not None and h[control.SEQ] != expected:
                self._loop_failed(f"header sequence gap: expected {expected}, got {h[control.SEQ]}")
                return
            expected = h[control.SEQ] + 1
            op = h[control.OP]
            if op == control.OP_HEARTBEAT:
                continue
            if op == control.OP_STOP:
                log.info("rank %d: step loop stopped by rank 0", self.rank)
                return
            if op != control.OP_STEP:
                self._loop_failed(f"unknown header op {op} (header {h})")
                return
            if h[control.DTYPE] != control.DTYPE_CODES[self.dtype]:
                self._loop_failed(f"the step computes in dtype code {h[control.DTYPE]}, this rank in "
                                  f"{self.dtype} (code {control.DTYPE_CODES[self.dtype]})")
                return
            self.step_seq = h[control.SEQ]
            flags = h[control.FLAGS]
            try:
                self.step((h[control.BATCH], h[control.SEQ_LEN], h[control.WIDTH]), h[control.VERSION],
                          bool(flags & control.FLAG_MASKED), bool(flags & control.FLAG_CAUSAL))
            except WeightsVersionMismatch:
                pass  # took part in every collective on NaN; recorded for rank 0 (step_error)
            except Exception as exc:  # the group is out of step now: only a rebuild helps
                self._loop_failed(f"step {h[control.SEQ]} failed: {type(exc).__name__}: {first_line(exc)}")
                return
            self._timings.append((h[control.SEQ], h[control.SENT_NS], woke, self.last_bcast_ns,
                                  self.last_forward_ns))

    def _loop_failed(self, why: str) -> None:
        """Mark this rank broken and exit its process after a short grace (no orphans when
        rank 0 is gone; rank 0 may still ask `step_error` meanwhile)."""
        self.loop_error = f"rank {self.rank}: {why}"
        log.error("%s; exiting in %.0fs", self.loop_error, control.PEER_EXIT_GRACE_S)
        timer = threading.Timer(control.PEER_EXIT_GRACE_S, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    def close(self) -> None:
        """Leave the process group (idempotent)."""
        self.model = None
        if self.group is not None and self.group.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None
        self._control = None
        self._store = None
