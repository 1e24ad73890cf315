#!/usr/bin/env bash
# The GPU check: one command, three tiers, each under its own timeout, every row printed the
# moment it is measured and logged to $OUT/gpu_check.log. Exits 0 whatever a tier found (the
# rows say it); 2 only when no Python with torch is there at all.
#
#   bash bench/gpu_check.sh            # from anywhere; OUT defaults to bench/results/gpu
#
# Tier A (torch only, one process): TP attention on CUDA vs dense MHA (fp32 seed, bf16/fp16
#   random vs float64; plain, masked, causal), SDPA backends, CUDA-event timings of H2D
#   pageable vs pinned, the step, D2H and a batch sweep, the real rank's root_step at world
#   size 1, max_memory_reserved over 200 mixed shapes with and without expandable segments.
# Tier B (the real rank class, service.gang.worker.Rank, in two processes on GPU 0): NCCL
#   data group + gloo control group, parity, rank 1 killed / stopped mid-step with the chosen
#   error mode and torch's default, teardown time, a second rendezvous in the same process.
# Tier C (the service through Serve at world size 1): only when `import service.app` works
#   (Ray, FastAPI ... carried as bench/gpu/wheels/site.tar.xz.part-*, see bench/gpu/wheelhouse.sh).
#
# Tiers A and B import nothing but torch, numpy, safetensors, the standard library and the
# service's Ray-free modules. On a machine without CUDA each tier prints
# "no CUDA: tier skipped" and the script exits 0. Limits: A 100 s, B 150 s, C 100 s, plus
# the unpacking: at most 6 minutes (docs/operations.md: run it with timeout_s 420).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/clients${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee -a "$LOG") 2>&1
echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname); git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: $PY cannot import torch (set PYTHON=...)"; exit 2
fi
"$PY" -c 'import sys, torch; print("# python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader

tier() {  # tier NAME LIMIT_S SCRIPT: one tier, bounded; its failure is a row, not the end
  local name=$1 limit=$2 script=$3 rc started=$SECONDS
  echo "## tier $name (limit ${limit}s)"
  echo "| tier | row | value |"
  echo "|---|---|---|"
  GPU_CHECK_TIER=$name timeout -k 10 "$limit" "$PY" "$script"
  rc=$?
  case $rc in
    0) ;;
    124|137) echo "| $name | tier | TIMED OUT after ${limit}s (rows above were measured) |" ;;
    *) echo "| $name | tier | exited $rc (rows above were measured; traceback above) |" ;;
  esac
  echo "# tier $name: $((SECONDS - started))s"
}

tier A 100 bench/gpu/tier_a.py
tier B 150 bench/gpu/tier_b.py

# Tier C's packages: the carried parts of bench/gpu/wheelhouse.sh's tree, when they are here.
parts=(bench/gpu/wheels/site.tar.xz.part-*)
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ -e "${parts[0]}" ] && [ "$pyver" != "3.12" ]; then
  echo "# wheelhouse parts are for Python 3.12 (bench/gpu/wheelhouse.sh); $PY is $pyver: not used"
elif [ -e "${parts[0]}" ]; then
  SITE=${TMPDIR:-/tmp}/gangserve-site
  rm -rf "$SITE" && mkdir -p "$SITE"
  started=$SECONDS
  if cat "${parts[@]}" | timeout 60 tar -xJ -C "$SITE"; then
    export PYTHONPATH="$PYTHONPATH:$SITE"
    echo "# unpacked ${#parts[@]} wheelhouse part(s) into $SITE in $((SECONDS - started))s"
  else
    echo "| C | wheelhouse | unpacking ${#parts[@]} part(s) failed (a part missing? all must be carried) |"
  fi
fi
if import_error=$(timeout 60 "$PY" -c 'import ray, ray.serve, fastapi, httpx, service.app' 2>&1); then
  tier C 100 bench/gpu/tier_c.py
else
  echo "## tier C"
  echo "| C | tier | skipped: the service does not import here ($(echo "$import_error" | tail -1)) |"
fi
echo "# gpu_check done in ${SECONDS}s; log: $LOG"
exit 0
