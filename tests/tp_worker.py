"""Entry point of one rank for the spawn-based numerics tests (real gloo process groups)."""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from service.parallel import ColumnParallelLinear, ParallelGroup, TensorParallelAttention
from service.parallel.weights import shard_dense


def run_rank(rank: int, world_size: int, workdir: str, num_heads: int) -> None:
    """Load inputs from workdir, run TP attention (and a gathered column linear), save outputs."""
    torch.set_num_threads(1)
    work = Path(workdir)
    store = dist.FileStore(str(work / "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        group = ParallelGroup(rank, world_size, "gloo", torch.device("cpu"), dist.group.WORLD)
        weights = torch.load(work / "weights.pt")
        embed_dim = weights["q_proj.weight"].shape[0]
        # Optional compute dtype (the dtype tests): weights, activations and collectives in it.
        dtype_file = work / "dtype"
        dtype = getattr(torch, dtype_file.read_text().strip()) if dtype_file.exists() else torch.float32
        model = TensorParallelAttention(embed_dim, num_heads, group, dtype=dtype)
        model.load_shard(shard_dense(weights, rank, world_size))
        # Only rank 0 reads the input; the others receive it by broadcast, as in the service.
        x = torch.load(work / "x.pt").to(dtype) if rank == 0 else torch.empty(torch.load(work / "x_shape.pt"), dtype=dtype)
        group.broadcast_(x, src=0)
        gather = ColumnParallelLinear(embed_dim, embed_dim, group, gather_output=True)
        lo, hi = rank * embed_dim // world_size, (rank + 1) * embed_dim // world_size
        with torch.no_grad():
            gather.weight.copy_(weights["q_proj.weight"][lo:hi])
            gather.bias.copy_(weights["q_proj.bias"][lo:hi])
        # Optional mask/causal (the masked parity tests): every rank applies the same mask.
        mask_file = work / "mask.pt"
        key_mask = torch.load(mask_file) if mask_file.exists() else None
        causal = (work / "causal").exists()
        with torch.inference_mode():
            out = model(x) if key_mask is None and not causal else model(x, key_mask, causal)
            gathered = gather(x.float())
        torch.save(
            {"out": out, "gathered": gathered, "param_bytes": model.parameter_bytes()},
            work / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
