# One image for every shoal service: `docker run IMAGE NAME [flags]` runs `shoal-service NAME`
# (resource-manager, job-scheduler, parameter-sync, host-agent); `shoal` (the CLI),
# `shoal-dashboard` (the web dashboard) and `shoal-healthcheck` are in it too.
# compose/compose.yaml builds and runs it.
#
# PyTorch is installed first, from TORCH_INDEX_URL, so that pip never resolves a multi-GB CUDA
# build by accident. The default is the CPU build; for NVIDIA hosts build a CUDA variant:
#   docker build -t shoal:cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"

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

# DL3013 (pin versions): the pin is TORCH_SPEC's.
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

COPY clients /src/clients
COPY learner /src/learner
COPY services /src/services
# The [gpu] extra is nvidia-ml-py (NVML bindings, pure Python): the host agent finds real GPUs
# with it and finds none, with one log line, where there is no driver.
RUN pip install /src/clients /src/learner "/src/services[gpu]" \
    && rm -rf /src

USER 10001:10001
WORKDIR /var/lib/shoal
ENTRYPOINT ["shoal-service"]
CMD ["--help"]
