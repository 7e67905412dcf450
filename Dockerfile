# Two images from one Dockerfile, both running `shoal-service NAME [flags]`
# (resource-manager, job-scheduler, parameter-sync, host-agent); `shoal` (the CLI),
# `shoal-dashboard` (the web dashboard) and `shoal-healthcheck` are in both.
#
# * target "full" (the default, the last stage): everything, PyTorch included; the data plane
#   (parameter-sync runs torch.optim; host agents start learners) needs it.
# * target "control": the control plane only (resource-manager, job-scheduler, the dashboard,
#   `shoal-service auth`), no torch, numpy or shoal-learner: a fraction of the size
#   (docs/operations.md, "Images"). `shoal-service parameter-sync` or `host-agent` in it exits
#   with a clear error naming what is missing.
#
#   docker build --target control -t shoal-control:latest .
#   docker build -t shoal:latest .
#
# compose/compose.yaml builds and runs both.
#
# PyTorch is installed first, from TORCH_INDEX_URL, so that pip never resolves a multi-GB CUDA
# build by accident. The default is the CPU build; for NVIDIA hosts build a CUDA variant:
#   docker build -t shoal:cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The unprivileged user every service runs as (uid 10001: compose/init-secrets.sh gives it the
# secrets it reads). It owns the state directories, so named volumes mounted there start out
# writable by it.
RUN groupadd --system --gid 10001 shoal \
    && useradd --system --uid 10001 --gid shoal --home-dir /var/lib/shoal \
        --shell /usr/sbin/nologin shoal \
    && mkdir -p /var/lib/shoal/storage /var/lib/shoal/work \
    && chown -R shoal:shoal /var/lib/shoal

FROM base AS control

COPY clients /src/clients
COPY services /src/services
RUN pip install /src/clients /src/services \
    && rm -rf /src

USER 10001:10001
WORKDIR /var/lib/shoal
ENTRYPOINT ["shoal-service"]
CMD ["--help"]

FROM base AS full

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"

# DL3013 (pin versions): the pin is TORCH_SPEC's.
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

COPY clients /src/clients
COPY learner /src/learner
COPY services /src/services
# [dataplane]: shoal-learner, numpy, safetensors. [gpu]: nvidia-ml-py (NVML bindings, pure
# Python): the host agent finds real GPUs with it and finds none, with one log line, where
# there is no driver.
RUN pip install /src/clients /src/learner "/src/services[gpu,dataplane]" \
    && rm -rf /src

USER 10001:10001
WORKDIR /var/lib/shoal
ENTRYPOINT ["shoal-service"]
CMD ["--help"]
