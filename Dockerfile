# Image of diloco-peer. torch is installed first and pinned, so `pip install .` keeps it.
# For a small CPU-only image pass a CPU wheel: --build-arg TORCH_SPEC=<path or URL of the wheel>
FROM python:3.11-slim
ARG TORCH_SPEC=torch==2.13.0
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app
RUN pip install "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY diloco_peer ./diloco_peer
RUN pip install .
# libp2p (DHT, all-reduce) listens here; publish it with -p 31337:31337.
EXPOSE 31337
ENTRYPOINT ["diloco-peer"]
CMD ["--help"]
