"""The GPU check stays runnable on the GPU machine (bench/gpu_check.sh, docs/operations.md).

That machine is lent only at times and has an image of its own: bench/gpu/image.txt lists
what it has; it has no Ray, pydantic, FastAPI, SQLAlchemy ... and reaches no registry. So
the check is run here the way that machine would run it: this checkout, this venv, with
every installed distribution the image lacks made unimportable in the check's processes and
in every process they start (bench/gpu/blocker/sitecustomize.py on PYTHONPATH, configured
by bench/gpu/image_sim.py). A change that breaks the check there (an import the image lacks
in the rank class, a tier that waits blind, a package tier C needs that the wheelhouse does
not carry) fails here.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import image_sim

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
# The script's own budget (stated at its top and in docs/operations.md) and its tiers' limits.
TOTAL_S = int(re.search(r"^TOTAL_S=(\d+)", SCRIPT.read_text(), re.M).group(1))  # type: ignore[union-attr]
LIMITS = {name: int(limit) for name, limit in re.findall(r"^tier ([ABC]) (\d+) ", SCRIPT.read_text(), re.M)}
# The modules tier C's process and its own imports need (bench/gpu/tier_c.py, gpu_check.sh's probe).
TIER_C_IMPORTS = ("import ray, ray.serve, fastapi, httpx, starlette, service.app, service.config.builder_args, "
                  "service.parallel.registry, bench.peers, harness.local, harness.reference")


def simulated_env(tmp_path: Path, with_wheelhouse: bool = False, drop: str | None = None) -> dict[str, str]:
    """The environment of a process on the GPU machine's image (plus the wheelhouse, if asked;
    less the module `drop`, to show what a list without it would do)."""
    sim = tmp_path / ("sim-wheelhouse.json" if with_wheelhouse else "sim.json")
    found = image_sim.simulate(sim, with_wheelhouse)
    if drop is not None:
        sim.write_text(json.dumps({**found, "blocked": [*found["blocked"], drop]}))  # type: ignore[list-item]
    assert len(found["blocked"]) > 10  # type: ignore[arg-type]  (not vacuous: this venv has far more than the image)
    return {**os.environ, "GPU_IMAGE_SIM": str(sim),
            "PYTHONPATH": f"{image_sim.BLOCKER_DIR}:{ROOT}:{ROOT / 'clients'}"}


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_gpu_check_runs_on_the_gpu_machines_image(tmp_path: Path) -> None:
    """The whole command's dry run (GPU_CHECK_DRY_RUN=1: tier A's CPU parts, tier B's drills on
    gloo) as the GPU machine would run it prints every row, none FAILED, each tier within its
    limit and the whole within the stated total; tier C says why it cannot start without the
    wheelhouse; generation 3's rank 0 death is seen within about a second."""
    env = simulated_env(tmp_path)
    blocked = run_python("import pydantic", env)
    assert blocked.returncode != 0 and "not on the GPU machine's image" in blocked.stderr, blocked.stderr[-500:]
    assert run_python("import torch, numpy, safetensors, yaml, httpx, service.gang.worker", env).returncode == 0
    # tier A's decode rows (CUDA only, not in the dry run) read bench.decode: it imports on the image
    imported = run_python("import bench.decode; bench.decode.stack_def('llama')", env)
    assert imported.returncode == 0, imported.stderr[-1500:]

    env.update(GPU_CHECK_DRY_RUN="1", OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TOTAL_S + 60)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    rows = re.findall(r"^\| ([ABC]) \| (.+?) \| (.*) \|$", out, re.M)
    failed = [r for r in rows if "FAILED" in r[1] + r[2] or re.search(r"TIMED OUT|exited \d", r[2])]
    assert not failed, f"failed rows: {failed}\n{out[-3000:]}"
    names = {tier: [name for t, name, _ in rows if t == tier] for tier in "ABC"}
    for part in ("rel err vs dense, float32 seed, plain", "12-layer stack rel err vs dense float64, float32, plain",
                 "rank root_step 128x8x512 (pinned in/out, sync), wall p50 ms", "ws1 gloo all_reduce 2 MiB, ms"):
        assert part in names["A"], (part, names["A"])
    for gen in (1, 2, 3):
        assert any(n.startswith(f"g{gen} gloo") and "rel err vs dense" in n for n in names["B"]), (gen, names["B"])
    values = {name: value for _, name, value in rows}
    assert float(values["g1 gloo chosen mode float32 seed: rel err vs dense, plain"]) < 1e-5
    assert "after" in values["g1 gloo chosen mode float32 seed: rank 1 killed mid-step -> rank 0"]
    assert "Timed out" in values["g2 gloo chosen mode bfloat16 random: rank 1 stopped (never returns) mid-step -> rank 0"]
    died = values["g3 gloo default mode float32 seed: rank 1 killed mid-step -> rank 0"]
    seen = re.search(r"was killed by SIGABRT, seen ([\d.]+)s after the drill began", died)
    assert seen and float(seen.group(1)) < 3.0, died
    assert "skipped: the service does not import here" in values["tier"] and "No module named" in values["tier"], values
    for tier, took in re.findall(r"^# tier ([AB]): (\d+)s$", out, re.M):
        assert int(took) <= LIMITS[tier], (tier, took, LIMITS)
    total = re.search(r"^# gpu_check done in (\d+)s of the (\d+)s budget", out, re.M)
    assert total and int(total.group(1)) <= TOTAL_S, out[-500:]


def test_tier_c_needs_nothing_beyond_the_image_and_the_wheelhouse_list(tmp_path: Path) -> None:
    """Every distribution `import service.app` needs is on the image or in the list the
    wheelhouse downloads (bench/gpu/wheelhouse.sh --list, derived from pyproject.toml): with
    exactly those importable, tier C's imports work; without one of them (SQLAlchemy, which the
    hand-written list once lacked) they fail, naming it."""
    listed = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "wheelhouse.sh"), "--list"], cwd=ROOT,
                            env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    names = {image_sim.normalize(line.split("==")[0]) for line in listed.stdout.split()}
    assert all("==" in line for line in listed.stdout.split()), listed.stdout  # each pinned
    assert {"ray", "pydantic", "fastapi", "uvicorn", "sqlalchemy", "alembic", "mako", "orjson", "psycopg"} <= names
    assert not names & image_sim.image_distributions(), names & image_sim.image_distributions()

    env = simulated_env(tmp_path, with_wheelhouse=True)
    done = run_python(TIER_C_IMPORTS, env)
    assert done.returncode == 0, done.stderr[-2000:]
    without = run_python(TIER_C_IMPORTS, simulated_env(tmp_path, with_wheelhouse=True, drop="sqlalchemy"))
    assert without.returncode != 0 and "No module named 'sqlalchemy'" in without.stderr, without.stderr[-1000:]


# -- the GPU settings users need (their GPU-side effect is measured by the check's tier A) ----
def test_allow_tf32_is_a_builder_argument_that_sets_cudas_float32_matmuls() -> None:
    import torch

    from service.config.builder_args import AppConfig
    from service.gang.backends import set_tf32_matmuls

    assert AppConfig().gang.allow_tf32 is False  # IEEE float32 unless asked
    assert AppConfig.model_validate({"use_gpu": True, "allow_tf32": True}).gang.allow_tf32 is True  # what the gang hands its ranks
    try:
        assert set_tf32_matmuls(True) == "tf32"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.get_float32_matmul_precision() == "high"  # the legacy reader still works (no API mix)
        assert set_tf32_matmuls(False) == "ieee"
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        set_tf32_matmuls(False)


def test_cuda_ranks_memory_reaches_gang_and_metrics() -> None:
    """GET /gang's `memory` (each CUDA rank's Rank.memory_stats) becomes one gauge pair per rank."""
    from service.contract.gang_status import RankMemory, dump
    from service.metrics.exposition import exposition, merge
    from service.metrics.process import MetricSet
    from service.metrics.recorders import GangServerMetrics

    stats = {"rank": 1, "device": "cuda:0", "memory_allocated_bytes": 10, "memory_reserved_bytes": 2 << 20,
             "max_memory_reserved_bytes": 3 << 20, "pinned_host_bytes": 0}
    from tests.statuses import gang_report

    info = gang_report(memory=[RankMemory(**stats)])
    assert dump(info)["memory"] == [stats]
    text = exposition(merge([GangServerMetrics("r1", MetricSet()).snapshot(info)])).decode()
    assert 'gangserve_gpu_memory_reserved_bytes{rank="1",replica="r1"} 2.097152e+06' in text, text
    assert 'gangserve_gpu_max_memory_reserved_bytes{rank="1",replica="r1"} 3.145728e+06' in text, text


def test_gpu_1_yaml_serves_one_gpu_at_world_size_1() -> None:
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from service.app import compose_app, parse_args

    doc = yaml.safe_load((ROOT / "deployments" / "gpu-1.yaml").read_text())
    ServeDeploySchema.model_validate(doc)  # what `serve run` checks
    (app,) = doc["applications"]
    cfg = parse_args(app["args"])
    assert (cfg.gang.world_size, cfg.gang.use_gpu, cfg.gang.backend, doc["http_options"]["port"]) == (1, True, "nccl", 8000)
    assert compose_app(cfg) is not None  # builds without a cluster
