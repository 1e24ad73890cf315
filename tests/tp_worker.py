"""Entry point of one rank for the spawn-based numerics tests (real gloo process groups).

One spawn runs every case of a world size (a process start with torch is seconds on this
machine; the cases are many): each case is a directory under workdir, named in workdir/cases,
with its own inputs, model and outputs; the gang's process group is the same for all."""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from service.parallel import ColumnParallelLinear, ParallelGroup, TensorParallelAttention
from service.parallel.weights import shard_dense


def run_rank(rank: int, world_size: int, workdir: str, num_heads: int) -> None:
    """For each case in workdir/cases: load its inputs, run TP attention (and a gathered
    column linear), save this rank's outputs in the case's directory."""
    torch.set_num_threads(1)
    work = Path(workdir)
    store = dist.FileStore(str(work / "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        group = ParallelGroup(rank, world_size, "gloo", torch.device("cpu"), dist.group.WORLD)
        for name in (work / "cases").read_text().split():
            run_case(rank, world_size, work / name, num_heads, group)
    finally:
        dist.destroy_process_group()


def run_case(rank: int, world_size: int, case: Path, num_heads: int, group: ParallelGroup) -> None:
    weights = torch.load(case / "weights.pt")
    embed_dim = weights["q_proj.weight"].shape[0]
    # Optional compute dtype (the dtype tests): weights, activations and collectives in it.
    dtype_file = case / "dtype"
    dtype = getattr(torch, dtype_file.read_text().strip()) if dtype_file.exists() else torch.float32
    model = TensorParallelAttention(embed_dim, num_heads, group, dtype=dtype)
    model.load_shard(shard_dense(weights, rank, world_size))
    # Only rank 0 reads the input; the others receive it by broadcast, as in the service.
    x = torch.load(case / "x.pt").to(dtype) if rank == 0 else torch.empty(torch.load(case / "x_shape.pt"), dtype=dtype)
    group.broadcast_(x, src=0)
    gather = ColumnParallelLinear(embed_dim, embed_dim, group, gather_output=True)
    lo, hi = rank * embed_dim // world_size, (rank + 1) * embed_dim // world_size
    with torch.no_grad():
        gather.weight.copy_(weights["q_proj.weight"][lo:hi])
        gather.bias.copy_(weights["q_proj.bias"][lo:hi])
    # Optional mask/causal (the masked parity tests): every rank applies the same mask.
    mask_file = case / "mask.pt"
    key_mask = torch.load(mask_file) if mask_file.exists() else None
    causal = (case / "causal").exists()
    with torch.inference_mode():
        out = model(x) if key_mask is None and not causal else model(x, key_mask, causal)
        gathered = gather(x.float())
    torch.save(
        {"out": out, "gathered": gathered, "param_bytes": model.parameter_bytes()},
        case / f"rank{rank}.pt",
    )
