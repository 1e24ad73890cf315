"""Which device a rank computes on. Ray-free: the caller passes what Ray assigned.

One rank per GPU. Ray sets CUDA_VISIBLE_DEVICES to the GPU it assigned an actor, so the
rank usually sees exactly one device, `cuda:0`. It can see more: with
`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`, with a runtime that shares the visible
devices, or outside Ray (torchrun: LOCAL_RANK). Then `cuda:0` on every rank would put every
rank on the same GPU, which NCCL refuses ("Duplicate GPU detected"), so the index is
derived from the assignment instead, and a rank that cannot tell which GPU is its own
fails with what it needed and what it found.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class DeviceChoice:
    device: torch.device
    has_cuda: bool
    why: str  # how the device was chosen, or why there is no CUDA device


def cuda_unavailable_reason() -> str:
    """Why torch sees no CUDA device here, in words an operator can act on."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (install a CUDA wheel)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable device "
            f"(CUDA_VISIBLE_DEVICES={visible!r}; driver missing, too old for this CUDA, or no --gpus)")


def cuda_index(gpu_ids: list[str], device_count: int, env: Mapping[str, str]) -> tuple[int, str]:
    """The CUDA index (within this process's visible devices) of this rank's GPU.

    `gpu_ids`: the GPUs Ray assigned this process (`ray.get_gpu_ids()`, physical ids);
    empty outside Ray. Raises RuntimeError when several devices are visible and nothing
    says which one is this rank's."""
    if device_count < 1:
        raise RuntimeError("no CUDA device visible")
    if device_count == 1:
        return 0, "the one visible device"
    if gpu_ids:
        mine = str(gpu_ids[0])
        visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if visible:
            if mine not in visible:
                raise RuntimeError(f"Ray assigned GPU {mine}, which is not in CUDA_VISIBLE_DEVICES={visible}")
            return visible.index(mine), f"Ray's GPU {mine} at position {visible.index(mine)} of CUDA_VISIBLE_DEVICES"
        if mine.isdigit() and int(mine) < device_count:
            return int(mine), f"Ray's GPU {mine} (CUDA_VISIBLE_DEVICES unset)"
        raise RuntimeError(f"Ray assigned GPU {mine!r}, but only {device_count} devices are visible "
                           "and CUDA_VISIBLE_DEVICES is unset")
    local = env.get("LOCAL_RANK")
    if local is not None and local.isdigit() and int(local) < device_count:
        return int(local), f"LOCAL_RANK={local}"
    raise RuntimeError(
        f"{device_count} CUDA devices are visible and nothing says which is this rank's: "
        f"no GPU assigned by Ray, LOCAL_RANK={local!r} (need one GPU per rank)"
    )


def choose_device(use_gpu: bool, gpu_ids: list[str], env: Mapping[str, str] | None = None) -> DeviceChoice:
    """The rank's device: its own GPU when `use_gpu` and CUDA works here, else the CPU
    (with the reason; `backend: nccl` then refuses the gang at its create stage)."""
    env = os.environ if env is None else env
    if not use_gpu:
        return DeviceChoice(torch.device("cpu"), False, "use_gpu=false")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return DeviceChoice(torch.device("cpu"), False, cuda_unavailable_reason())
    index, how = cuda_index(gpu_ids, torch.cuda.device_count(), env)
    return DeviceChoice(torch.device("cuda", index), True, how)
