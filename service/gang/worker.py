"""One rank of the gang as a plain class: process-group membership plus its shard of the model.

`Rank` rendezvouses, loads its shard, runs the peers' step loop (dispatching on each
header's op through the step kinds' table, service.gang.steps) and every step's collectives.
It imports neither Ray nor pydantic nor the service's configuration (torch, numpy,
safetensors and the standard library only), so the same code runs as rank 0 inside the
GangServer replica, as a Ray actor for ranks 1..N-1 (service.gang.rank.RankWorker wraps
it with Ray's node identity, as vLLM's executors wrap their plain workers), under
torch.multiprocessing in the tests, and in the GPU check on a machine without Ray.

Every method that touches the process group is called by the gang's single sequencer, in
one global order (service.gang.gang). Every wait is bounded: the store and the groups by
`timeout_s`, the whole rendezvous and the teardown by a deadline (service.gang.backends).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch
import torch.distributed as dist

from service.cluster.netif import bind_collectives_to
from service.gang import control
from service.gang.backends import (
    DeadlineExceeded,
    call_with_deadline,
    leave_group,
    leave_group_plan,
    prepare_cuda_allocator,
    prepare_env,
)
from service.gang.failpoints import Failpoints
from service.gang.failures import WeightsVersionMismatch, first_line
from service.gang.header_link import DATA_MAX_BYTES, STORE_KEY, HeaderListener, HeaderReceiver, HeaderSender
from service.gang.staging import PinnedStaging
from service.gang.stepclock import StepClock
from service.gang.steps import KINDS
from service.parallel import ParallelGroup
from service.parallel import linear
from service.parallel.huge_pages import advice_said as huge_pages_said
from service.parallel.kv_cache import AppendPlan, PagedKVPool, warm_varlen
from service.parallel.model import (
    ModelDef,
    RankModel,
    check_checkpoint,
    is_causal_only,
    kv_heads_per_rank,
    load_checkpoint_shard,
    unused_tensors,
    new_kv_pool,
    shard_dense,
)
from service.parallel.paged_kernel import InPlaceAttention, KernelShape, KernelStatus, compile_shape, compiler_problem
from service.parallel.paged_varlen import VarlenAttention
from service.parallel.registry import ModelArgs, resolve
from service.parallel.weights import checkpoint_causal
from service.config.tunables import GangTunables, StateTunables

log = logging.getLogger("gangserve.rank")

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Leaving the groups (abort on NCCL, destroy on gloo) must return within this, or the
# process is marked unusable (see `abandoned`). The shutdown bound is the right size: a
# healthy teardown takes milliseconds (measured by bench/gpu_check.sh tier B).
# A rendezvous is three waits in a row, each bounded by the group timeout: the default
# group's connections (and, on NCCL, its eagerly created communicator), then the control
# group's. Past this, rank 0 (whose side no Ray call bounds) stops waiting.
RENDEZVOUS_WAITS = 3

# Why this process can no longer form a group (a rendezvous or a teardown that did not
# return: its thread may still hold torch's group registry). Process-wide: a new Rank in
# the same process (rank 0's next bring-up) refuses to rendezvous, so the rebuild fails,
# the GangServer counts it, and Serve replaces the replica with a fresh process.
abandoned: str | None = None


class ModelSpec(ModelArgs, Protocol):
    """What a rank needs to know of the model (service.config.builder_args.ModelConfig has these fields;
    the architecture's, ModelArgs, are read by service.parallel.registry.resolve)."""

    init: str
    seed: int
    checkpoint: str | None
    causal: bool
    compute_dtype: str


@dataclass(frozen=True)
class PlainModel:
    """A ModelSpec for callers without the service's configuration (tests, the GPU check)."""

    embed_dim: int = 512
    num_heads: int = 8
    kind: str = "attention"  # the builder argument `model`
    num_layers: int = 2
    ffn_dim: int = 2048
    activation: str = "relu"
    norm_first: bool = False
    layer_norm_eps: float = 1e-5
    model_args: Mapping[str, Any] = field(default_factory=dict)
    init: str = "seed"
    seed: int = 0
    checkpoint: str | None = None
    causal: bool = False
    compute_dtype: str = "float32"


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
    device_how: str = ""  # how the device was chosen, or why there is no CUDA device

    def public(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if k in ("rank", "node_id", "node_ip", "pid", "device", "iface")}


def check_dtype_fits(model: ModelSpec) -> None:
    """Refuse a model whose weights the compute dtype cannot hold, before anything is built:
    the seed init's W[i, j] = i*E + j + offset reaches E*E - 1 (262143 at E=512), and
    float16's largest finite value is 65504, so every answer would be NaN with a 200."""
    if model.compute_dtype == "float16" and not model.checkpoint and model.init == "seed" and model.kind == "attention":
        peak = model.embed_dim * model.embed_dim - 1
        if peak > 65504:
            raise ValueError(
                f"compute_dtype=float16 cannot hold init=seed weights at embed_dim={model.embed_dim} "
                f"(they reach {peak}, float16's largest finite value is 65504): use bfloat16 or "
                "float32, or init=random, or a checkpoint"
            )


def load_rank_shard(model: ModelSpec, rank: int, world_size: int, local: Path | None = None,
                    arch: ModelDef | None = None, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """This rank's slice of the configured weights (checkpoint, seed or random init).

    `local`: the checkpoint as a verified local file or directory (see `materialize`); the
    rank maps only its own slice of it, read straight into `dtype` (the compute dtype).
    `arch`: the model's architecture when the caller resolved it already (a user's factory
    is then not imported and called again)."""
    arch = arch or resolve(model)
    if model.checkpoint:
        return load_checkpoint_shard(arch, local or materialize(model.checkpoint, StateTunables()), rank, world_size,
                                     dtype)
    return shard_dense(arch, arch.init_weights(model.init, model.seed), rank, world_size)


def materialize(checkpoint: str, tunables: StateTunables) -> Path:
    """A checkpoint (an absolute local path, or a key in the artifact store) as a verified
    local file: on S3, this node's cache, downloaded once per node (the store's waits: `tunables`). The artifact store is
    imported only here, so a rank without checkpoints needs none of its dependencies."""
    from service.state import artifacts

    return artifacts.store(tunables).materialize(checkpoint)


def query_heads_per_rank(model: ModelDef, world_size: int) -> int:
    """The query heads one rank computes per cached layer: the architecture's `num_heads`
    (the built-in attention and transformer; a Llama's `arch.num_heads`) / p; a model that names
    neither is taken to have as many query heads as K/V heads. Only the in-place kernel's
    warm-up needs it (the heads it is built for): a wrong guess costs the gather path, never a
    wrong answer (service.parallel.paged_kernel: `matches`)."""
    heads = getattr(model, "num_heads", None) or getattr(getattr(model, "arch", None), "num_heads", None)
    return int(heads) // world_size if heads else kv_heads_per_rank(model, world_size)


class Rank:
    """A rank's state. Stages: __init__ (create) -> rendezvous -> load_weights -> serve steps.

    `device`: where this rank computes (service.gang.devices.choose_device); `node_ip`:
    the address its peers reach this node at (its collectives bind to that interface).
    """

    def __init__(self, rank: int, world_size: int, *, device: torch.device, node_ip: str, node_id: str = "",
                 gpu_ids: list[str] | None = None, torch_threads: int = 1, device_how: str = "",
                 tunables: GangTunables = GangTunables(), state_tunables: StateTunables = StateTunables()) -> None:
        torch.set_num_threads(torch_threads)
        if device.type == "cpu":
            log.info("rank %d: float32 matmuls: %s", rank, linear.configure(tunables.cpu_matmul))
        self.tunables = tunables  # the gang section: exit grace, leave-group bound, timings kept
        self.state_tunables = state_tunables  # the artifact store's waits (checkpoint downloads)
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.allocator_conf = ""  # PYTORCH_CUDA_ALLOC_CONF as this rank runs with it (CUDA only)
        if device.type == "cuda":
            self._prepare_cuda()
        # Before any process group exists in this process: gloo/NCCL read it at creation.
        choice = bind_collectives_to(node_ip)
        self.info = RankInfo(
            rank=rank, node_id=node_id, node_ip=node_ip, pid=os.getpid(), device=str(device),
            has_cuda=device.type == "cuda", gpu_ids=list(gpu_ids or []), iface=choice.iface,
            iface_how=choice.how, device_how=device_how,
        )
        log.info("rank %d on %s: device %s (%s); collectives use interface %s (%s)", rank, node_ip, device,
                 device_how, choice.iface, choice.how)
        self.backend = "none"
        self.group: ParallelGroup | None = None
        self.model: RankModel | None = None
        self._staged: RankModel | None = None
        # The architecture self.model / self._staged implement (service.parallel.model).
        self.model_def: ModelDef | None = None
        self._staged_def: ModelDef | None = None
        # The model's default for requests that do not say (builder `causal`, or the
        # checkpoint's recorded one): staged and committed with the weights.
        self.default_causal = False
        self._staged_causal = False
        self.dtype = torch.float32  # compute dtype: weights, activations and collectives
        self.weights_version = 0  # the recorded version self.model holds (0: none yet)
        self._store: dist.TCPStore | None = None
        self.failpoints = Failpoints()
        self.staging = PinnedStaging(device) if device.type == "cuda" else None
        # The step loop (see service.gang.control): the control group (an append step's plan
        # follows its header there), the header link (rank 0's sender, or a peer's receiver:
        # service.gang.header_link), the loop thread, and what it records for rank 0 to ask about.
        self._control: dist.ProcessGroup | None = None
        self._link: HeaderSender | HeaderReceiver | None = None  # rank 0's end, or a peer's
        self._loop: threading.Thread | None = None
        self.loop_error: str | None = None  # why the loop stopped (it then exits the process)
        self.step_seq = 0  # the header sequence number of the step being computed
        self._mismatches: deque[tuple[int, WeightsVersionMismatch]] = deque(maxlen=64)  # (seq, why) refused steps
        # (seq, header sent ns, woke ns, the step's clock: broadcast done, forward done)
        self._timings: deque[tuple[int, int, int, StepClock]] = deque(maxlen=tunables.timings_kept)
        self._clock: StepClock | None = None  # the last step's
        # World size 1: the last step's (input ready, computed), monotonic ns (see `_alone`).
        self.alone_ns: tuple[int, int] = (0, 0)
        # Sessions' K/V for this rank's heads (service.parallel.kv_cache), allocated on the
        # first append step with the shape rank 0's plan names; gone with this object.
        self.kv_pool: PagedKVPool | None = None
        # The in-place attention over that pool (service.parallel.paged_kernel on CPU,
        # service.parallel.paged_varlen on CUDA), made by `warm_sessions` at bring-up, and which
        # path session steps use and why (GET /gang).
        self._kernel: InPlaceAttention | VarlenAttention | None = None
        self.session_attention = KernelStatus("gather", "not warmed up (no session pool at bring-up)")

    def _prepare_cuda(self) -> None:
        """Ask for expandable segments, then select this rank's device. The order matters:
        `torch.cuda.set_device` initializes CUDA (and with it the caching allocator, which
        reads PYTORCH_CUDA_ALLOC_CONF once), so the environment is set first; a process that
        initialized CUDA before this rank existed gets the allocator's runtime setting."""
        if not torch.cuda.is_initialized():
            self.allocator_conf = prepare_cuda_allocator()
            torch.cuda.set_device(self.device)
            return
        torch.cuda.set_device(self.device)
        try:  # this process allocated on CUDA already: the allocator's runtime setting still applies
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
            self.allocator_conf = "expandable_segments:True (set at runtime)"
        except Exception as exc:  # not fatal: only fragmentation is at stake
            self.allocator_conf = f"unchanged ({type(exc).__name__}: {first_line(exc)})"

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

    def prewarm_sessions(self, shape: KernelShape, budget_s: float) -> RankInfo:
        """A warm spare (rank -1), before it is adopted: load and check its gang's in-place
        attention (`shape`, the peers' own) in this process, at most `budget_s` of building, so
        the adopting rebuild's `warm_sessions` finds it loaded. A failure is logged only:
        `warm_sessions` meets it again and says which path runs."""
        if self.rank != -1:
            raise RuntimeError(f"rank {self.rank}: only an unused spare (rank -1) compiles ahead")
        try:
            status = compile_shape(shape, budget_s)
            log.info("spare pid %d: in-place attention loaded ahead (%s, %.1f s)", self.info.pid, status.path,
                     status.compile_s)
        except Exception as exc:  # noqa: BLE001 - the adopting bring-up's warm-up decides the path
            log.warning("spare pid %d: loading the in-place attention ahead failed (%s: %s)", self.info.pid,
                        type(exc).__name__, first_line(exc)[:200])
        return self.info

    @property
    def kernel_shape(self) -> KernelShape | None:
        """The in-place attention this rank warmed at bring-up (None: its sessions gather, or
        read the pool through varlen_attn, which builds nothing)."""
        return self._kernel.shape if isinstance(self._kernel, InPlaceAttention) else None

    def memory_stats(self) -> dict[str, int | str]:
        """This rank's device memory (CUDA only; {} on CPU): what the caching allocator holds
        (`memory_reserved_bytes`, the figure that grows with mixed shapes), its peak, and
        the pinned host buffers."""
        if self.device.type != "cuda":
            return {}
        return {
            "device": str(self.device),
            "memory_allocated_bytes": int(torch.cuda.memory_allocated(self.device)),
            "memory_reserved_bytes": int(torch.cuda.memory_reserved(self.device)),
            "max_memory_reserved_bytes": int(torch.cuda.max_memory_reserved(self.device)),
            "pinned_host_bytes": self.staging.pinned_bytes if self.staging else 0,
        }

    # -- stage: rendezvous ---------------------------------------------------------------
    def open_store(self, timeout_s: float) -> int:
        """Rank 0 only: host the rendezvous store on this node; returns the OS-chosen port."""
        self._store = dist.TCPStore(
            self.info.node_ip, 0, self.world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False
        )
        return int(self._store.port)

    def rendezvous(self, host: str, port: int, backend: str, timeout_s: float) -> None:
        """Join the gang's process group through rank 0's store at host:port.

        On NCCL the communicator is created here, eagerly (`device_id`), so a peer lost
        before the first step fails this bounded stage rather than hanging the warmup.
        The whole call returns within RENDEZVOUS_WAITS * timeout_s or raises
        DeadlineExceeded (and this process is marked `abandoned`)."""
        if abandoned is not None:
            raise RuntimeError(f"rank {self.rank}: this process cannot form a new group: {abandoned}")
        if backend == "nccl" and self.device.type != "cuda":
            raise RuntimeError(f"rank {self.rank}: backend=nccl needs a CUDA device; this rank has "
                               f"{self.device} ({self.info.device_how})")
        self.backend = backend
        if self.world_size == 1:
            self.group = ParallelGroup.single(self.device)
            return
        prepare_env(backend)
        deadline_s = RENDEZVOUS_WAITS * timeout_s
        try:
            call_with_deadline(lambda: self._join(host, port, backend, timeout_s), deadline_s,
                               f"rank {self.rank}'s rendezvous ({backend}, {host}:{port})")
        except DeadlineExceeded as exc:
            self._abandon(str(exc))
            raise

    def _join(self, host: str, port: int, backend: str, timeout_s: float) -> None:
        store = self._store or dist.TCPStore(host, port, self.world_size, False, timedelta(seconds=timeout_s))
        dist.init_process_group(
            backend=backend, store=store, rank=self.rank, world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=self.device if backend == "nccl" else None,
        )
        self.group = ParallelGroup(self.rank, self.world_size, backend, self.device, dist.group.WORLD)
        # The control group: gloo whatever the data backend (a peer waiting for the next
        # header must not hold a CUDA stream), with the same bounded timeout.
        self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        # The header link: rank 0's headers wake a peer's loop over a socket, not a collective.
        if self.rank == 0:
            listener = HeaderListener(self.info.node_ip)
            store.set(STORE_KEY, str(listener.port))
            self._link = listener.accept(self.world_size - 1, timeout_s, self.device.type == "cpu")
        else:
            link_port = int(store.get(STORE_KEY).decode())
            self._link = HeaderReceiver(host, link_port, self.rank, self.device.type == "cpu", timeout_s)

    def _abandon(self, why: str) -> None:
        global abandoned
        abandoned = why
        log.error("rank %d: %s; this process must be replaced", self.rank, why)

    # -- stage: load (and hot-swap) -----------------------------------------------------
    def load_weights(self, model_cfg: ModelSpec, version: int) -> int:
        """Build this rank's shard of `model_cfg` as weights `version`; returns its parameter bytes."""
        nbytes = self._build(model_cfg)
        self.commit_weights(version)
        return nbytes

    def stage_weights(self, model_cfg: ModelSpec) -> int:
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
        self.model_def = self._staged_def
        self.default_causal = self._staged_causal
        self.weights_version = version

    @property
    def causal_only(self) -> bool:
        """The served model declares itself causal: a request for bidirectional attention is refused."""
        return self.model_def is not None and is_causal_only(self.model_def)

    def discard_staged(self) -> None:
        self._staged = None

    def arm_failpoint(self, name: str) -> None:
        """Tests only (needs GANGSERVE_FAILPOINTS=1): make this rank fail once at `name`."""
        self.failpoints.arm(name)

    def _build(self, model_cfg: ModelSpec) -> int:
        if self.group is None:
            raise RuntimeError(f"rank {self.rank}: weights loaded before rendezvous")
        dtype = COMPUTE_DTYPES[model_cfg.compute_dtype]
        if dtype == torch.float16 and self.device.type != "cuda":
            raise ValueError(
                f"rank {self.rank}: compute_dtype=float16 needs a CUDA device; this rank computes on "
                f"{self.device} (use bfloat16 or float32 on CPU)"
            )
        check_dtype_fits(model_cfg)
        arch = resolve(model_cfg)
        arch.check_world_size(self.world_size)
        model = arch.build(self.group, dtype)
        # A recorded checkpoint may be an artifact key: one verified local file for both reads.
        local = materialize(model_cfg.checkpoint, self.state_tunables) if model_cfg.checkpoint else None
        if local is not None:
            check_checkpoint(arch, local)  # every missing or wrong tensor named, before any is read
            if self.rank == 0 and (unused := unused_tensors(arch, local)):
                log.info("checkpoint %s: model %s does not use %s; not loaded", local, arch.kind, ", ".join(unused))
        model.load_shard(load_rank_shard(model_cfg, self.rank, self.world_size, local, arch, dtype))
        nbytes = model.parameter_bytes()
        if self.device.type == "cpu":  # said once the memory was asked for: a refusal shows here
            log.info("rank %d: weights loaded (%d bytes); transparent huge pages for those of 2 MiB or more: %s",
                     self.rank, nbytes, huge_pages_said())
        recorded = checkpoint_causal(local) if local is not None else None
        model.eval()
        if self.device.type == "cuda":
            self._warm_kernels(model, arch.embed_dim)
        # A model that declares itself causal (a decoder) serves causal requests only.
        self._staged_causal = True if is_causal_only(arch) else model_cfg.causal if recorded is None else recorded
        self.dtype = dtype  # one dtype per gang (the config's): a swap keeps it
        self._staged, self._staged_def = model, arch
        return nbytes

    def _warm_kernels(self, model: RankModel, width: int) -> None:
        """Run this rank's local kernels once per kind of step (plain, causal, masked,
        masked + causal) so the first such request does not pay CUDA's lazy module loading
        and cuBLAS/SDPA set-up; no collective (the gang's warmup step covers those)."""
        x = torch.zeros(2, 16, width, dtype=next(model.parameters()).dtype, device=self.device)
        key_mask = torch.ones(2, 16, dtype=torch.bool, device=self.device)
        key_mask[1, :5] = False  # left padding in one row
        with torch.inference_mode():
            for mask in (None, key_mask):
                for causal in (False, True):
                    model.warm_local(x, mask, causal)
        torch.cuda.synchronize(self.device)

    # -- serving (the step kinds: service.gang.steps) -------------------------------------
    def collective(self, buf: torch.Tensor, n: int, weights_version: int,
                   compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Every step kind's collectives on this rank: broadcast `buf` from rank 0, then
        `compute(x, rest)` (the kind's model call, its all_reduce included) on the first
        `n` values and the rest; returns the all-reduced output.

        A rank holding another weights version than the step expects must not contribute
        to an answer, yet must still take part in every collective (or the others would
        wait out the group timeout). So it computes on NaN: its partial output is NaN in
        every element (every output element depends on all of this rank's inputs), the
        all-reduced output is NaN everywhere except at padded query positions (set to 0),
        and rank 0 refuses it by looking at one token's element (the kind's `poisoned`).
        The rank then raises WeightsVersionMismatch; its step loop keeps it for rank 0
        (`step_error`).
        """
        group = self.group
        if self.model is None or group is None:
            raise RuntimeError(f"rank {self.rank}: not ready (no weights loaded)")
        if self.world_size == 1:
            return self._alone(buf, n, weights_version, compute)
        clock = self._clock = StepClock(self.device)
        self.group.timer.reset()
        with torch.inference_mode():
            self._broadcast_input(buf, group)  # on every rank
            clock.mark()
            x, refusal = self._poison_if_stale(buf[:n], weights_version)
            out = compute(x, buf[n:])
            clock.mark()
        if refusal is not None:
            raise refusal
        return out

    def _broadcast_input(self, buf: torch.Tensor, group: ParallelGroup) -> None:
        """Rank 0's `buf` into every rank's. When every rank computes on CPU (the link's
        `carries_data`, one decision for the gang) an input of at most
        header_link.DATA_MAX_BYTES follows the header over the header link (the peer is awake
        already: no second wake through gloo's threads); otherwise the group's broadcast. Every
        rank decides alike: the gang's decision and the size (the header's)."""
        link = self._link
        if link is not None and link.carries_data and buf.numel() * buf.element_size() <= DATA_MAX_BYTES:
            link.broadcast(buf, "step's input")
        else:
            group.broadcast_(buf, src=0)

    def _alone(self, buf: torch.Tensor, n: int, weights_version: int,
               compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """World size 1, the shortest path: no peer, so no broadcast and no step clock (its CUDA
        events); the step's parts are two host stamps (`alone_ns`, monotonic: the step runner's
        timeline takes them as they are). On CUDA the compute stamp is when the kernels were
        queued: their GPU time lands in the output's copy back (the timeline's to_numpy)."""
        self._clock = None
        started = time.monotonic_ns()
        with torch.inference_mode():
            x, refusal = self._poison_if_stale(buf[:n], weights_version)
            out = compute(x, buf[n:])
        self.alone_ns = (started, time.monotonic_ns())
        if refusal is not None:
            raise refusal
        return out

    def broadcast_control(self, values: torch.Tensor) -> None:
        """A step's own int64 values (an append step's plan), after its header: over the header
        link when at most header_link.DATA_MAX_BYTES (the peer is reading it already), else on
        the control group. Every rank decides alike (the size is the header's)."""
        if values.numel() * values.element_size() <= DATA_MAX_BYTES:
            if self._link is None:
                raise RuntimeError(f"rank {self.rank}: this step's plan needs the header link (made at rendezvous)")
            self._link.broadcast(values, "step's plan")
            return
        if self._control is None:
            raise RuntimeError(f"rank {self.rank}: this step needs the step loop's control group")
        dist.broadcast(values, src=0, group=self._control)

    def kv_pool_for(self, plan: AppendPlan) -> PagedKVPool:
        """This rank's KV pool, (re)allocated when `plan` needs another shape than it has; a new
        pool of the warmed-up shape gets the in-place attention (`warm_sessions`)."""
        arch = self.model_def
        if arch is None:
            raise RuntimeError(f"rank {self.rank}: not ready (no weights loaded)")
        # The K/V heads this rank holds: kv / p, or one when fewer K/V heads than ranks (the
        # pool's own count: kv // p would be 0 there, and the pool rebuilt, empty, every step).
        heads_local = kv_heads_per_rank(arch, self.world_size)
        if self.kv_pool is None or not self.kv_pool.fits(plan, arch.kv_layers, heads_local, arch.head_dim, self.dtype):
            self.kv_pool = new_kv_pool(arch, self.world_size, plan, self.dtype, self.device)
            kernel = self._kernel
            if kernel is not None and (kernel.num_blocks, kernel.block_size) == (plan.num_blocks, plan.block_size):
                self.kv_pool.attention = kernel
            log.info("rank %d: KV pool of %d layers x %d blocks x %d tokens (%d bytes), attention %s%s", self.rank,
                     arch.kv_layers, plan.num_blocks, plan.block_size, self.kv_pool.nbytes,
                     "in place" if self.kv_pool.attention is not None else "by gather",
                     f"; transparent huge pages: {huge_pages_said()}" if self.device.type == "cpu" else "")
        return self.kv_pool

    def warm_sessions(self, num_blocks: int, block_size: int, mode: str, budget_s: float) -> KernelStatus:
        """Bring-up, before the first session step (no collective: each rank alone): allocate
        this rank's KV pool in the sessions' shape and build (or load) and check the in-place
        decode kernel over it (service.parallel.paged_kernel), at most `budget_s` of building;
        a CUDA rank instead checks varlen_attn over the pool's pages
        (service.parallel.paged_varlen: bf16/fp16, pages of a multiple of 256) against the
        gather path. `mode`: tunables.gang.session_attention ("auto" | "gather"). Returns which
        path session steps use and why; without a C++ compiler on CPU that is the gather path."""
        arch = self.model_def
        if arch is None:
            raise RuntimeError(f"rank {self.rank}: not ready (no weights loaded)")
        pool = self.kv_pool_for(AppendPlan(num_blocks, block_size, (), (), ()))
        q_heads, kv = query_heads_per_rank(arch, self.world_size), kv_heads_per_rank(arch, self.world_size)
        if mode != "gather" and self.device.type == "cuda":
            varlen = VarlenAttention(num_blocks, block_size, q_heads, kv, arch.head_dim, self.dtype)
            self.session_attention = warm_varlen(varlen, self.device, arch.head_dim ** -0.5)
            if self.session_attention.path == "varlen":
                self._kernel = pool.attention = varlen
            return self.session_attention
        problem = "tunables.gang.session_attention is 'gather'" if mode == "gather" else compiler_problem(self.device)
        if problem is not None:
            self.session_attention = KernelStatus("gather", problem)
            return self.session_attention
        try:
            kernel = InPlaceAttention(num_blocks, block_size, q_heads, kv, arch.head_dim, self.dtype)
            status = kernel.warm(budget_s)
        except Exception as exc:  # noqa: BLE001 - a kernel that does not build leaves today's path
            self.session_attention = KernelStatus(
                "gather", f"building the in-place attention failed ({type(exc).__name__}: {first_line(exc)[:200]})")
            return self.session_attention
        if status.in_place:
            self._kernel = pool.attention = kernel
        self.session_attention = status
        return status

    @property
    def last_bcast_ns(self) -> int:
        """When the last step's broadcast completed (wall-clock ns; on CUDA, on the GPU)."""
        return self._clock.stamps()[0] if self._clock else 0

    @property
    def last_forward_ns(self) -> int:
        """When the last step's forward (its all_reduce included) completed."""
        return self._clock.stamps()[1] if self._clock else 0

    @property
    def last_all_reduce_ns(self) -> int | None:
        """Nanoseconds the last step spent in its all_reduces (waiting for the slowest peer
        included); None with no peers (no all_reduce) and on CUDA, where a collective returns
        once queued."""
        if self.group is None or self.world_size == 1 or self.device.type == "cuda":
            return None
        return self.group.timer.ns

    # -- the step loop (ranks 1..N-1; protocol in service.gang.control) -----------------
    def send_header(self, header: control.Header) -> None:
        """Rank 0 only (the gang's sequencer): one header to every peer's loop, over the header
        link (service.gang.header_link: no collective, so no thread hand-off on either side)."""
        if not isinstance(self._link, HeaderSender):
            raise RuntimeError(f"rank {self.rank}: no header link to peers (world_size {self.world_size}, "
                               f"rank 0 makes one at rendezvous)")
        self._link.send(header.encode())

    def wait_header(self, into: torch.Tensor | None = None) -> control.Header:
        """Peers: rank 0's next header (into `into`, a reused buffer), bounded by the collective
        timeout. First polls for it up to tunables.gang.header_spin_us(device) (a header that
        comes within that skips this thread's sleep and wake-up, and the poll costs up to that
        much of a core), then sleeps in a blocking read the kernel wakes it from."""
        if not isinstance(self._link, HeaderReceiver):
            raise RuntimeError(f"rank {self.rank}: no header link from rank 0 (a peer makes one at rendezvous)")
        buf = into if into is not None else control.empty_header()
        self._link.receive(buf, int(self.tunables.header_spin_us(self.device.type) * 1000))
        return control.Header.decode(buf)

    def start_loop(self) -> None:
        """Peers: from now on take steps from rank 0's headers, not from Ray calls."""
        if self.rank == 0 or self._control is None or not isinstance(self._link, HeaderReceiver):
            raise RuntimeError(f"rank {self.rank}: a step loop needs a peer rank with a control group and a header link")
        if self._loop is not None:
            raise RuntimeError(f"rank {self.rank}: the step loop is already running")
        self._loop = threading.Thread(target=self._run_loop, name=f"step-loop-{self.rank}", daemon=True)
        self._loop.start()

    def step_error(self, seq: int) -> RuntimeError | None:
        """Why this rank refused step `seq` (the WeightsVersionMismatch it raised), or why
        its loop stopped (a RuntimeError); None if it took part normally."""
        for s, refusal in self._mismatches:
            if s == seq:
                return refusal
        return RuntimeError(self.loop_error) if self.loop_error else None

    def loop_timings(self) -> list[tuple[int, int, int, int, int]]:
        """The last steps' (seq, header sent, woke, broadcast done, forward done), ns; on
        CUDA only steps the GPU has finished (the rest are not known yet)."""
        done = []
        for seq, sent, woke, clock in list(self._timings):
            if clock.ready():
                bcast, forward = clock.stamps()
                done.append((seq, sent, woke, bcast, forward))
        return done

    def _run_loop(self) -> None:
        header = control.empty_header()
        expected: int | None = None
        while True:
            try:
                # Blocks until rank 0's next header; bounded by the control group's timeout
                # (rank 0 sends heartbeats well inside it while idle).
                h = self.wait_header(header)
            except Exception as exc:  # rank 0 gone (connection closed) or stopped (timeout)
                self._loop_failed(f"waiting for rank 0's next header failed: {type(exc).__name__}: "
                                  f"{first_line(exc)}")
                return
            woke = time.time_ns()
            if expected is not None and h.seq != expected:
                self._loop_failed(f"header sequence gap: expected {expected}, got {h.seq}")
                return
            expected = h.seq + 1
            if h.op == control.OP_HEARTBEAT:
                continue
            if h.op == control.OP_STOP:
                log.info("rank %d: step loop stopped by rank 0", self.rank)
                return
            kind = KINDS.get(h.op)
            if kind is None:
                self._loop_failed(f"unknown header op {h.op} (header {h})")
                return
            if h.dtype != control.DTYPE_CODES[self.dtype]:
                self._loop_failed(f"the {kind.name} computes in dtype code {h.dtype}, this rank in "
                                  f"{self.dtype} (code {control.DTYPE_CODES[self.dtype]})")
                return
            self.step_seq = h.seq
            try:
                kind.run_peer(self, h)
            except WeightsVersionMismatch:
                pass  # took part in every collective on NaN; recorded for rank 0 (step_error)
            except Exception as exc:  # the group is out of step now: only a rebuild helps
                self._loop_failed(f"{kind.name} {h.seq} failed: {type(exc).__name__}: {first_line(exc)}")
                return
            assert self._clock is not None
            self._timings.append((h.seq, h.sent_ns, woke, self._clock))

    def _poison_if_stale(self, x: torch.Tensor, weights_version: int
                         ) -> tuple[torch.Tensor, WeightsVersionMismatch | None]:
        """x, or NaN in its shape when this rank holds another weights version than the step
        expects (its contribution then poisons the all_reduce, so no answer mixes versions),
        with the refusal. It is recorded before the all_reduce: once rank 0's is done, it can ask."""
        if weights_version == self.weights_version:
            return x, None
        refusal = WeightsVersionMismatch(
            f"rank {self.rank} holds weights version {self.weights_version}, the step expected {weights_version}")
        self._mismatches.append((self.step_seq, refusal))
        return torch.full_like(x, float("nan")), refusal

    def kv_pool_bytes(self) -> int:
        """Bytes this rank's KV pool holds on its device (0 before the first append step)."""
        return self.kv_pool.nbytes if self.kv_pool is not None else 0

    def _loop_failed(self, why: str) -> None:
        """Mark this rank broken and exit its process after a short grace (no orphans when
        rank 0 is gone; rank 0 may still ask `step_error` meanwhile)."""
        self.loop_error = f"rank {self.rank}: {why}"
        log.error("%s; exiting in %.0fs", self.loop_error, self.tunables.peer_exit_grace_s)
        timer = threading.Timer(self.tunables.peer_exit_grace_s, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    def close(self, timeout_s: float | None = None) -> None:
        """Leave the process groups (idempotent): abort on NCCL, destroy on gloo
        (service.gang.backends), within `timeout_s` (default: tunables.shutdown_timeout_s). Raises DeadlineExceeded when that did
        not return in time; this process is then marked `abandoned` (to be replaced)."""
        timeout_s = self.tunables.shutdown_timeout_s if timeout_s is None else timeout_s
        self.model = self._staged = None
        self.model_def = self._staged_def = None
        self.kv_pool = None
        self._kernel = None
        group, self.group, self._control, self._store = self.group, None, None, None
        if self._link is not None:
            self._link.close()
            self._link = None
        if group is None or group.world_size == 1 or not dist.is_initialized():
            return
        backend = group.backend
        started = time.monotonic()
        try:
            call_with_deadline(lambda: leave_group(backend), timeout_s,
                               f"rank {self.rank} leaving its {backend} group ({leave_group_plan(backend)})")
        except DeadlineExceeded as exc:
            self._abandon(str(exc))
            raise
        log.info("rank %d left its %s group (%s) in %.1f ms", self.rank, backend, leave_group_plan(backend),
                 (time.monotonic() - started) * 1000)
