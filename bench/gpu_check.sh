#!/usr/bin/env bash
# GPU check for a single-GPU machine: CUDA/NCCL path end to end through Serve at
# world_size 1, next to in-process dense attention on the same GPU. Prints a table.
#
#   bash bench/gpu_check.sh            # from the repository root
#
# Needs: python3 with torch (CUDA build) and the project's other dependencies
# (ray[serve]==2.60.0, fastapi, uvicorn, httpx, safetensors, pydantic, numpy, orjson, pyyaml).
# With no network, install them beforehand from wheels:  pip install -c constraints.txt -e .
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: $PY has no CUDA-enabled torch (or no GPU is visible): need torch with CUDA and one GPU" >&2
  exit 2
fi
missing=$("$PY" - <<'PYEOF'
import importlib.util
need = ["ray", "ray.serve", "fastapi", "uvicorn", "httpx", "safetensors", "pydantic", "numpy", "orjson", "yaml"]
print(" ".join(m for m in need if importlib.util.find_spec(m.split(".")[0]) is None))
PYEOF
)
if [ -n "$missing" ]; then
  echo "gpu_check: missing Python packages: $missing" >&2
  echo "gpu_check: install them with: $PY -m pip install -c constraints.txt -e ." >&2
  exit 2
fi
exec "$PY" bench/gpu_check.py "$@"
