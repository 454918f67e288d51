# Image of diloco-peer; `diloco-peer` is the entry point, so arguments are its command line:
#
#   docker build -t diloco-peer .                                    # CPU build of torch
#   docker build --build-arg TORCH_VARIANT=cu126 -t diloco-peer:cu126 .   # a CUDA build
#   docker run --rm -v diloco-data:/data diloco-peer keygen --out /data/identity.key
#   docker run --init -p 31337:31337 -v diloco-data:/data diloco-peer join --run demo \
#       --port 31337 --identity /data/identity.key --checkpoint-dir /data/checkpoints
#
# hivemind ships its libp2p daemon in an x86-64 wheel only: on an ARM host build and run with
# --platform linux/amd64. compose.yaml starts a three-peer swarm from this image.
FROM python:3.11-slim

# torch comes from PyTorch's own wheel index, which has one sub-index per build: cpu, or a CUDA
# tag that PyTorch publishes for TORCH_VERSION (cu126, cu128, ...). The CUDA builds bring the
# CUDA libraries as wheels, so the slim base runs them (with --gpus and the NVIDIA runtime).
# TORCH_INDEX_URL is the only package index address in this repository; point it at a mirror
# with --build-arg TORCH_INDEX_URL=... where that index cannot be reached.
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl

# No pip cache in the layers; log lines reach `docker logs` at once, not when a buffer fills.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/data/huggingface

# The runtime user and its two writable places, made before any volume is mounted on them: a
# fresh named volume takes the owner of the image's folder, so `peer` can write to it.
# /data holds keys, checkpoints, event logs and the Hugging Face cache; /swarm is where
# compose.yaml's founder publishes its address for the other peers.
RUN groupadd --gid 10001 peer \
    && useradd --no-log-init --create-home --uid 10001 --gid peer peer \
    && mkdir /data /swarm \
    && chown peer:peer /data /swarm

WORKDIR /app

# Layers from the one that changes least to the one that changes most: torch (GBs with CUDA),
# then the project's dependencies (read from pyproject.toml alone), then its code. Editing the
# code or the README reinstalls only the last layer.
RUN pip install --index-url "${TORCH_INDEX_URL}/${TORCH_VARIANT}" "torch==${TORCH_VERSION}"

COPY pyproject.toml ./
# torch is already there and satisfies `torch>=2.3`, so pip keeps the build installed above.
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
    && pip install --requirement requirements.txt \
    && rm requirements.txt

COPY README.md ./
COPY diloco_peer ./diloco_peer
RUN pip install . && rm -rf build

# compose.yaml's entry point. (--chmod needs BuildKit, Docker's default builder since 23.0.)
COPY --chmod=0755 docker/swarm-peer.sh /usr/local/bin/swarm-peer

# Numeric, so a runtime that enforces non-root users (Kubernetes runAsNonRoot) can check it.
USER 10001:10001
WORKDIR /data
VOLUME ["/data"]

# libp2p (DHT, all-reduce): `join --port 31337`. Prometheus metrics: `join --metrics-port 9100
# --metrics-host 0.0.0.0` (join binds metrics to 127.0.0.1 unless told, unreachable from outside
# the container). There is no HEALTHCHECK here because the metrics endpoint, the natural probe,
# is off unless asked for; compose.yaml adds one to the peers that serve it.
EXPOSE 31337 9100

ENTRYPOINT ["diloco-peer"]
CMD ["--help"]
