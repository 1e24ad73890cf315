"""Per-backend choices a rank makes around its process group, and the bounded call it makes them with.

Nothing here imports Ray (the GPU check drives it on a machine without Ray).

Error mode (NCCL). NCCL collectives return to the host at once; in torch's default mode
(`TORCH_NCCL_ASYNC_ERROR_HANDLING=3`, SkipCleanUp) a collective that never completes is
found by the watchdog thread at the group timeout, which then takes the whole process
down (SIGABRT): rank 0 is the GangServer replica, so no 504 and no in-place rebuild would
ever happen. We set `TORCH_NCCL_BLOCKING_WAIT=1` instead (the constructor of
ProcessGroupNCCL reads it; it turns the watchdog's error handling off): every `wait()`
(each synchronous collective) then blocks the calling thread until the collective
completes or the group timeout passes, and on timeout or NCCL error aborts the
communicator and raises DistBackendError ("... timed out in blocking wait") in that
thread, where the gang's 504/rebuild logic reads it. The price is host polling (1 ms
granularity in torch 2.11-2.13) on each of a step's two collectives; the GPU check
measures it (bench/gpu_check.sh tier B). `TORCH_NCCL_ASYNC_ERROR_HANDLING=0` goes with it,
as `_abort_process_group` requires. A value the user set wins (setdefault), so the check
can run the default mode next to ours.

gloo needs none of this: its collectives run on the calling thread and raise on timeout.

Leaving a group. On NCCL, `destroy_process_group` finalizes the communicators and waits
for their kernels, which never finish once a peer is dead (pytorch#180611): we abort
instead (`_abort_process_group`: every group of the process, the gloo control group
included, and torch's group registry cleared so `init_process_group` works again in the
same process). On gloo, `destroy_process_group` is local and safe. Either way the call runs
under a deadline (`call_with_deadline`): a teardown that does not return is reported as
`DeadlineExceeded`, never waited for.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Callable, MutableMapping, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# What a rank sets (unless already set) before it creates an NCCL group; see the module docstring.
NCCL_ERROR_MODE = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
# The caching allocator's setting for mixed shapes (the step batcher makes many): segments
# grow and shrink in place instead of fragmenting into many reserved blocks.
CUDA_ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


class DeadlineExceeded(TimeoutError):
    """A bounded call (rendezvous, teardown) did not return within its deadline. Its text
    says "timed out", which the gang reads as a timeout (service.gang.failures.is_timeout)."""


def prepare_env(backend: str, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the environment `backend` needs before this process creates its group (values
    the user set are kept); returns the variables that matter for it, as they now are."""
    env = os.environ if env is None else env
    if backend != "nccl":
        return {}
    for key, value in NCCL_ERROR_MODE.items():
        env.setdefault(key, value)
    return {key: env[key] for key in NCCL_ERROR_MODE}


def prepare_cuda_allocator(env: MutableMapping[str, str] | None = None) -> str:
    """Ask for expandable segments before this process's first CUDA allocation (the
    allocator reads PYTORCH_CUDA_ALLOC_CONF once, at its first use); a user's value is kept.
    Returns the value in force for this process."""
    env = os.environ if env is None else env
    key, value = CUDA_ALLOC_CONF
    current = env.get(key, "")
    if not current:
        env[key] = value
        return value
    if "expandable_segments" not in current:
        env[key] = f"{current},{value}"
    return env[key]


def set_tf32_matmuls(allow: bool) -> str:
    """float32 matmuls on CUDA in TF32 (`allow`: the `allow_tf32` builder argument) or in IEEE
    float32 (torch's default). Process-wide (cuBLAS reads it at each call); CPU matmuls are
    untouched. Returns the setting in force: "tf32" or "ieee".

    TF32 keeps float32's range and 10 of its 23 mantissa bits in each product (sums stay
    float32): several times the matmul throughput on Ampere and later, for an error of about
    1e-3 relative (docs/api.md#compute-dtype; bench/gpu_check.sh tier A measures both).
    The CUDA-only flag, on purpose: torch.set_float32_matmul_precision would change oneDNN's
    CPU matmuls too, and writing torch >= 2.9's `fp32_precision` makes every later read of
    the legacy API (torch.get_float32_matmul_precision) raise; this flag keeps both readable."""
    torch.backends.cuda.matmul.allow_tf32 = allow
    return "tf32" if allow else "ieee"


def leave_group_plan(backend: str) -> str:
    """How a rank on `backend` leaves its groups: "abort" (NCCL) or "destroy" (gloo)."""
    return "abort" if backend == "nccl" else "destroy"


def leave_group(backend: str) -> None:
    """Leave every process group of this process, by `leave_group_plan(backend)`."""
    if not dist.is_initialized():
        return
    if leave_group_plan(backend) == "abort":
        # torch >= 2.3 (experimental there, present through 2.13): without it only destroy is left.
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()
            return
    dist.destroy_process_group()


def call_with_deadline(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """fn() on a helper thread, waited for at most `timeout_s`.

    Returns fn's result or raises its exception; raises DeadlineExceeded ("<what> timed out
    after <timeout_s>s ...") when it has not returned by then. The helper thread is a daemon
    and is left behind: the caller must treat whatever fn was doing as lost (a process
    whose teardown timed out is to be replaced, not reused)."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:  # handed to the caller below
            done.set_exception(exc)

    threading.Thread(target=run, name=f"bounded-{what}", daemon=True).start()
    try:
        return done.result(timeout=timeout_s)
    except TimeoutError:
        if done.done():  # fn itself raised a TimeoutError: that one is the answer
            raise
        raise DeadlineExceeded(
            f"{what} timed out after {timeout_s:.1f}s (it has not returned; its thread is abandoned)"
        ) from None
