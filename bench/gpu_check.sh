#!/usr/bin/env bash
# The GPU check: one command, three tiers, each under its own timeout, every row printed the
# moment it is measured and logged to $OUT/gpu_check.log. Exits 0 whatever a tier found (the
# rows say it); 2 only when no Python with torch is there at all.
#
#   bash bench/gpu_check.sh                          # from anywhere; OUT defaults to bench/results/gpu
#   GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh      # the whole command on a CPU (checks the script)
#   GPU_CHECK_SIMULATE_IMAGE=1 GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh
#       # ... as the GPU machine would run it: everything its image lacks (bench/gpu/image.txt)
#       # unimportable here and in every child (=wheelhouse: as if the wheelhouse were unpacked)
#
# THE TOTAL: at most 490 s, every bound included: the prelude (torch probe, nvidia-smi) 20 s,
# tier A 90 s, tier B 120 s, the wheelhouse's unpacking 30 s, the import probe 30 s, tier C
# 170 s (460 s of limits) plus 5 s of kill grace for each of those 6 bounded steps. Each limit
# is also cut to what is left of TOTAL_S, so the sum holds whatever happens. Run it with
# timeout_s=540 (docs/operations.md): 50 s of margin. Measured by the CPU dry run with the
# image simulated (2 busy cores): A 6-47 s, B 15-45 s, C 121 s (Ray, four deploys, shutdown).
#
# Tier A (torch only, one process): TP attention and the 12-layer stack on CUDA vs dense
#   references, TF32 vs IEEE float32, SDPA backends, CUDA-event timings of H2D pageable vs
#   pinned, the step, D2H and a batch sweep, the real rank's root_step at world size 1, a real
#   world-size-1 NCCL group, max_memory_reserved over 200 mixed shapes with and without
#   expandable segments, the decode step against the memory floor (bench/decode.py's rows).
# Tier B (the real rank class, service.gang.worker.Rank, in two processes on GPU 0): NCCL
#   data group + gloo control group, parity, rank 1 killed / stopped mid-step with the chosen
#   error mode and torch's default, teardown time, a second rendezvous in the same process.
#   No wait there is blind: a child that dies is a row at once, with its exit code or signal.
# Tier C (the service through Serve at world size 1, the front door as users get it): only
#   when `import service.app` works (Ray, FastAPI ... carried as
#   bench/gpu/wheels/site.tar.xz.part-*, see bench/gpu/wheelhouse.sh).
#
# Tiers A and B import nothing but torch, numpy, safetensors, pyyaml, the standard library and
# the service's Ray-free modules (tests/test_gpu_check.py runs this script's dry run with
# everything else unimportable). Without CUDA (and no dry run) each tier prints
# "no CUDA: tier skipped" and the script exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
PY=${PYTHON:-python3}
TOTAL_S=490 GRACE_S=5
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/clients${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${GPU_CHECK_SIMULATE_IMAGE:-}" ]; then
  # The image simulated (bench/gpu/image_sim.py): the blocker first on PYTHONPATH, its file named.
  sim="$(cd "$OUT" && pwd)/image-sim.json"
  extra=$([ "$GPU_CHECK_SIMULATE_IMAGE" = wheelhouse ] && echo --with-wheelhouse)
  "$PY" bench/gpu/image_sim.py simulate "$sim" $extra >/dev/null || exit 2
  export GPU_IMAGE_SIM="$sim" PYTHONPATH="$PWD/bench/gpu/blocker:$PYTHONPATH"
fi
exec > >(tee -a "$LOG") 2>&1
echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname); git $(git rev-parse --short HEAD 2>/dev/null || echo '?');" \
     "budget ${TOTAL_S}s${GPU_CHECK_DRY_RUN:+; DRY RUN}${GPU_IMAGE_SIM:+; image simulated by $GPU_IMAGE_SIM}"

left() {  # left LIMIT: LIMIT, cut to what is left of TOTAL_S after this step's kill grace (>= 1)
  local rest=$((TOTAL_S - SECONDS - GRACE_S))
  rest=$(( $1 < rest ? $1 : rest ))
  echo $(( rest > 1 ? rest : 1 ))
}

# 60 s: torch's first import reads ~1 GB of shared objects, and with a cold page cache on a busy
# machine (make test's dry run beside the Ray tests) it took over 15 s; a healthy one takes ~2 s.
if ! timeout -k $GRACE_S "$(left 60)" "$PY" -c 'import sys, torch; print("# python", sys.version.split()[0],
    "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'; then
  echo "gpu_check: $PY cannot import torch (set PYTHON=...)"; exit 2
fi
command -v nvidia-smi >/dev/null && timeout -k $GRACE_S 5 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader

tier() {  # tier NAME LIMIT SCRIPT: one tier, bounded; its failure is a row, not the end
  local name=$1 limit rc started=$SECONDS
  limit=$(left "$2")
  echo "## tier $name (limit ${limit}s)"
  echo "| tier | row | value |"
  echo "|---|---|---|"
  if [ "$limit" -lt 10 ]; then
    echo "| $name | tier | skipped: ${limit}s left of the ${TOTAL_S}s budget |"; return
  fi
  GPU_CHECK_TIER=$name timeout -k $GRACE_S "$limit" "$PY" "$3"
  rc=$?
  case $rc in
    0) ;;
    124|137) echo "| $name | tier | TIMED OUT after ${limit}s (rows above were measured) |" ;;
    *) echo "| $name | tier | exited $rc (rows above were measured; traceback above) |" ;;
  esac
  echo "# tier $name: $((SECONDS - started))s"
}

tier A 90 bench/gpu/tier_a.py
tier B 120 bench/gpu/tier_b.py

# Tier C's packages: the carried parts of bench/gpu/wheelhouse.sh's tree, when they are here.
parts=(bench/gpu/wheels/site.tar.xz.part-*)
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ -e "${parts[0]}" ] && [ "$pyver" != "3.12" ]; then
  echo "# wheelhouse parts are for Python 3.12 (bench/gpu/wheelhouse.sh); $PY is $pyver: not used"
elif [ -e "${parts[0]}" ]; then
  SITE=${TMPDIR:-/tmp}/gangserve-site
  rm -rf "$SITE" && mkdir -p "$SITE"
  started=$SECONDS
  if cat "${parts[@]}" | timeout -k $GRACE_S "$(left 30)" tar -xJ -C "$SITE"; then
    export PYTHONPATH="$PYTHONPATH:$SITE"
    echo "# unpacked ${#parts[@]} wheelhouse part(s) into $SITE in $((SECONDS - started))s"
  else
    echo "| C | wheelhouse | unpacking ${#parts[@]} part(s) failed (a part missing? all must be carried) |"
  fi
fi
if import_error=$(timeout -k $GRACE_S "$(left 30)" "$PY" -c 'import ray, ray.serve, fastapi, httpx, service.app' 2>&1); then
  tier C 170 bench/gpu/tier_c.py
else
  echo "## tier C"
  echo "| C | tier | skipped: the service does not import here ($(echo "$import_error" | tail -1)) |"
fi
echo "# gpu_check done in ${SECONDS}s of the ${TOTAL_S}s budget; log: $LOG"
exit 0
