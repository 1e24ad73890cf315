# gangserve image: `serve run deployments/gpu.yaml` by default; CONFIG=deployments/local.yaml for CPU.
#   docker build -t gangserve .                                   # GPU (CUDA torch from PyPI)
#   docker build -t gangserve:cpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu \
#                --build-arg CONFIG=deployments/local.yaml .
#   docker run --gpus all -p 8000:8000 --shm-size=8g gangserve
# Multi-node: use this image for the head and worker pods (deployments/kuberay.yaml).
FROM python:3.11-slim

ARG CONFIG=deployments/gpu.yaml
ARG TORCH_INDEX=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GANGSERVE_STATE_DIR=/home/gangserve/state \
    GANGSERVE_CONFIG=${CONFIG}

RUN useradd --create-home --uid 1000 gangserve
WORKDIR /app

# Dependencies first (cached layer), exact pins from constraints.txt.
COPY constraints.txt pyproject.toml README.md ./
RUN if [ -n "$TORCH_INDEX" ]; then pip install --index-url "$TORCH_INDEX" torch==2.13.0; fi \
 && grep -vE '^(#|torch==)' constraints.txt > /tmp/pins.txt \
 && pip install -c /tmp/pins.txt torch==2.13.0 "ray[serve,train]==2.60.0" fastapi uvicorn httpx \
        safetensors pydantic numpy orjson pyyaml

COPY service ./service
COPY clients ./clients
COPY deployments ./deployments
RUN pip install --no-deps -e . && mkdir -p /home/gangserve/state && chown -R gangserve /home/gangserve

USER gangserve
EXPOSE 8000 8265
CMD ["sh", "-c", "exec serve run \"$GANGSERVE_CONFIG\""]
