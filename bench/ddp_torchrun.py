"""The default training job's DDP loop without Ray: the reference `make bench` compares
the service's job with (what a user would run instead).

    .venv/bin/torchrun --nproc_per_node 2 bench/ddp_torchrun.py [--spec '{"epochs": 5}'] [--out f.json]

Same model, data, batch, optimizer, loss and threads as the job (service.training: JobSpec's
defaults, `synthetic`, `build_model`, `vector_sq_error`, the runner's per-rank thread
count), and the same loop shape as service.training.runner: a DistributedSampler with
set_epoch every epoch (as the job's workers build it), DDP on gloo, the
epoch loss accumulated on the device and all-reduced once per epoch. What it leaves out is
the job's per-epoch work outside the step loop (the checkpoint, its upload, progress
reports to the run actor): that is the cost the bench row measures.

Rank 0 writes {"epoch_end_s": [monotonic seconds after each epoch], "samples_per_epoch",
"losses", "world_size", "threads"} to --out (default: stdout).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from service.training.datasets import synthetic  # noqa: E402
from service.training.models import build_model  # noqa: E402
from service.training.runner import vector_sq_error  # noqa: E402
from service.training.spec import JobSpec, SyntheticDataset  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="{}", help="job spec JSON (default: POST /train {}'s)")
    parser.add_argument("--out", type=Path, help="rank 0 writes its timings here (default: stdout)")
    args = parser.parse_args()
    spec = JobSpec.model_validate(json.loads(args.spec))
    if not isinstance(spec.dataset, SyntheticDataset) or spec.use_gpu:
        raise SystemExit("this reference runs synthetic-data CPU jobs only")

    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = max(1, int(spec.cpus_per_worker))  # as the runner sets it
    torch.set_num_threads(threads)

    model = build_model(spec.model, spec.seed)
    x, y = synthetic(spec.model, spec.dataset)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=spec.batch_size, sampler=sampler,
                        generator=torch.Generator().manual_seed(spec.seed))
    model = DistributedDataParallel(model)
    optimizer: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=spec.lr) if spec.optimizer == "sgd"
        else torch.optim.Adam(model.parameters(), lr=spec.lr)
    )

    dist.barrier()
    ends: list[float] = []
    losses: list[float] = []
    start = time.monotonic()
    for epoch in range(spec.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, dtype=torch.float64)
        for xb, yb in loader:
            loss = vector_sq_error(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum[0] += loss.detach().double() * xb.shape[0]
            loss_sum[1] += xb.shape[0]
        dist.all_reduce(loss_sum)
        losses.append(float(loss_sum[0] / loss_sum[1]))
        ends.append(time.monotonic())
    if rank == 0:
        doc = {"start_s": start, "epoch_end_s": ends, "samples_per_epoch": len(dataset), "losses": losses,
               "world_size": world, "threads": threads}
        text = json.dumps(doc)
        if args.out:
            args.out.write_text(text)
        else:
            print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
