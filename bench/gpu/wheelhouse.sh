#!/usr/bin/env bash
# Build, here (where the package registry is reachable), what tier C of bench/gpu_check.sh
# needs on the GPU machine (Python 3.12, torch 2.11+cu130, the packages of bench/gpu/image.txt
# and nothing else, no registry, 64 MiB carried per call):
#
#   1. the list: every distribution `import service.app` needs that the image lacks, derived
#      from pyproject.toml's dependencies by walking the installed distributions' own
#      requirements (bench/gpu/image_sim.py wheelhouse-list; pins from constraints.txt).
#      Never written by hand: tests/test_gpu_check.py imports service.app with exactly the
#      image plus this list importable;
#   2. pip download exactly those (--no-deps: the list is the closure) as cp312 manylinux wheels;
#   3. unpack them with `pip install --target --no-deps --only-binary=:all:
#      --python-version 3.12` (the proof that they install without touching torch: the
#      target must hold no torch);
#   4. drop what tier C never runs (tests, headers, the dashboard's web client, caches)
#      and compress the tree solid (xz), split into parts of at most 56 MiB each;
#   5. report the sizes against the 64 MiB limit.
#
#   bash bench/gpu/wheelhouse.sh            # writes bench/gpu/wheels/ (git-ignored)
#   bash bench/gpu/wheelhouse.sh --list     # only prints the list (no download)
#
# On the GPU machine, carry one part per call (the working tree keeps ignored files between
# warm calls): docs/operations.md#the-gpu-path-nccl-and-the-gpu-check says in which order.
# bench/gpu_check.sh unpacks them itself (cat site.tar.xz.part-* | tar -xJ) when all are there.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-/work/main/.venv/bin/python}
OUTDIR=bench/gpu/wheels
WH=$OUTDIR/whl SITE=$OUTDIR/site
# pip matches each --platform tag exactly: every manylinux level the machine's glibc (Ubuntu
# 24.04's 2.39, with Python 3.12.3) accepts that these wheels are built for.
PLAT=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in 17 24 27 28 31 34 35 36 39; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
# 64 MiB per call covers the working tree too (about 2 MiB): parts of 56 MiB leave room.
LIMIT=$((64 * 1024 * 1024)) PART=$((56 * 1024 * 1024))
# The list, derived (see 1. above); the image's own packages (torch, numpy ...) are never in it.
list=$("$PY" bench/gpu/image_sim.py wheelhouse-list)
if [ "${1:-}" = "--list" ]; then echo "$list"; exit 0; fi
# The downloaded wheels are kept between runs (pip download skips those already there).
rm -rf "$SITE" "$OUTDIR"/site.tar.xz* && mkdir -p "$WH" "$SITE"
echo "$list" > "$OUTDIR/requirements-gpu.txt"
t0=$(date +%s)
"$PY" -m pip download -q --no-color --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none "${PLAT[@]}" -r "$OUTDIR/requirements-gpu.txt" -d "$WH" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
# Exactly the list: one wheel per line, at its version (a leftover from an older list would be
# unpacked too).
"$PY" - "$WH" "$OUTDIR/requirements-gpu.txt" <<'CHECK'
import sys
from pathlib import Path
from packaging.utils import canonicalize_name, parse_wheel_filename
wheels, listed = Path(sys.argv[1]), Path(sys.argv[2]).read_text().split()
have = {(canonicalize_name(n), str(v)) for n, v, *_ in (parse_wheel_filename(w.name) for w in wheels.glob("*.whl"))}
want = {(canonicalize_name(line.split("==")[0]), line.split("==")[1]) for line in listed}
if have != want:
    sys.exit(f"wheelhouse: the wheels differ from the list: missing {sorted(want - have)}, extra {sorted(have - want)} "
             f"(a missing one has no cp312 manylinux wheel at that pin; remove {wheels} to drop old ones)")
CHECK
echo "downloaded $(ls "$WH" | wc -l) wheels (the list's $(wc -l < "$OUTDIR/requirements-gpu.txt")), $(du -sm "$WH" | cut -f1) MiB, in $(( $(date +%s) - t0 ))s"

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
