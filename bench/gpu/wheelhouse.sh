#!/usr/bin/env bash
# Build, here (where the package registry is reachable), what tier C of bench/gpu_check.sh
# needs on the GPU machine (Python 3.12, torch 2.11+cu130, no Ray/FastAPI/pydantic..., no
# registry, 64 MiB carried per call):
#
#   1. pip download the service's dependencies except torch (and numpy, which the image
#      has) as cp312 manylinux wheels, resolved against constraints.txt;
#   2. unpack them with `pip install --target --no-deps --only-binary=:all:
#      --python-version 3.12` (the proof that they install without touching torch: the
#      target must hold no torch);
#   3. drop what tier C never runs (tests, headers, the dashboard's web client, caches)
#      and compress the tree solid (xz), split into parts of at most 56 MiB each;
#   4. report the sizes against the 64 MiB limit.
#
#   bash bench/gpu/wheelhouse.sh            # writes bench/gpu/wheels/ (git-ignored)
#
# On the GPU machine, carry one part per call (the working tree keeps ignored files between
# warm calls): cat bench/gpu/wheels/site.tar.xz.part-* | tar -xJ -C /tmp/gs-site, then
# PYTHONPATH=/tmp/gs-site (bench/gpu_check.sh does this itself when the parts are there).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-/work/main/.venv/bin/python}
OUTDIR=bench/gpu/wheels
WH=$OUTDIR/whl SITE=$OUTDIR/site
PLAT=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_34_x86_64 --platform linux_x86_64)
# 64 MiB per call covers the working tree too (about 2 MiB): parts of 56 MiB leave room.
LIMIT=$((64 * 1024 * 1024)) PART=$((56 * 1024 * 1024))
# The downloaded wheels are kept between runs (pip download skips those already there).
rm -rf "$SITE" "$OUTDIR"/site.tar.xz* && mkdir -p "$WH" "$SITE"

# The service's own requirements (pyproject), minus what the GPU image has or must keep.
grep -v -E '^(torch|numpy|nvidia-|triton|sympy|networkx|mpmath|jinja2|markupsafe|filelock|fsspec)==' constraints.txt \
  | grep -E '^[A-Za-z0-9_.-]+==' > "$OUTDIR/constraints-gpu.txt"
cat > "$OUTDIR/requirements-gpu.txt" <<'REQ'
ray[serve,train]
fastapi
uvicorn
httpx
pydantic>=2
orjson
pyyaml
ml_dtypes
fastapi-offline
prometheus-client
pyarrow
stamina
psycopg[binary,pool]
REQ
t0=$(date +%s)
"$PY" -m pip download -q --no-color --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  "${PLAT[@]}" -c "$OUTDIR/constraints-gpu.txt" -r "$OUTDIR/requirements-gpu.txt" -d "$WH" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
# numpy comes in as a dependency, but the GPU image has its own (torch was built against it).
rm -f "$WH"/numpy-*.whl
if ls "$WH" | grep -qiE '^(torch|nvidia|triton)'; then
  echo "wheelhouse: torch or a CUDA wheel was pulled in: $(ls "$WH" | grep -iE '^(torch|nvidia|triton)')" >&2; exit 1
fi
echo "downloaded $(ls "$WH" | wc -l) wheels, $(du -sm "$WH" | cut -f1) MiB, in $(( $(date +%s) - t0 ))s"

# --ignore-requires-python: pip checks Requires-Python against the interpreter it runs on
# (3.11 here), not --python-version; the wheels were chosen for 3.12 above.
"$PY" -m pip install -q --no-color --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLAT[@]}" --ignore-requires-python --target "$SITE" "$WH"/*.whl
if [ -e "$SITE/torch" ] || ls "$SITE" | grep -qi '^torch-'; then echo "wheelhouse: torch in the target" >&2; exit 1; fi
echo "unpacked into $SITE without torch: $(du -sm "$SITE" | cut -f1) MiB installed"

# What tier C never runs (Serve starts with include_dashboard=False; no test suites, no C headers).
find "$SITE" -depth \( -name __pycache__ -o -name tests -o -name test -o -name include \) -type d -exec rm -rf {} +
rm -rf "$SITE/ray/dashboard/client/build" "$SITE/bin"
find "$SITE" \( -name '*.pxd' -o -name '*.pyx' -o -name '*.h' \) -delete
echo "trimmed: $(du -sm "$SITE" | cut -f1) MiB"

t0=$(date +%s)
tar -C "$SITE" -cf - . | xz -T2 -6 > "$OUTDIR/site.tar.xz"
size=$(stat -c %s "$OUTDIR/site.tar.xz")
( cd "$OUTDIR" && split -b "$PART" -d site.tar.xz site.tar.xz.part- && rm site.tar.xz )
echo "compressed: $((size / 1024 / 1024)) MiB (xz -6, $(( $(date +%s) - t0 ))s); limit per call $((LIMIT / 1024 / 1024)) MiB"
for p in "$OUTDIR"/site.tar.xz.part-*; do
  s=$(stat -c %s "$p"); echo "  $p: $((s / 1024 / 1024)) MiB $([ "$s" -le "$LIMIT" ] && echo fits || echo 'OVER THE LIMIT')"
done
echo "parts: $(ls "$OUTDIR"/site.tar.xz.part-* | wc -l) (one per warm call; the last call runs the check)"
rm -rf "$SITE"
