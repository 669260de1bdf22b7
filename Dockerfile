# syntax=docker/dockerfile:1
# mps-exporter image: docs/deploy.md, "Container image".
#
#   docker build -t <registry>/mps-exporter:0.1.0 \
#     --build-arg VERSION=0.1.0 --build-arg REVISION=$(git rev-parse HEAD) .
#
# The base is pinned to an exact Python and Debian release; pin its digest too
# (python:3.11.13-slim-bookworm@sha256:...) where your registry policy asks for it.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# Build stage: the exporter and its dependencies as wheels (all of them pure Python
# or manylinux wheels: no compiler enters the image).
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY exporter ./exporter
# tzdata: --mps.log-timezone names are resolved by zoneinfo, which falls back on
# this wheel where the base image carries no time zone database.
RUN pip wheel --no-cache-dir --wheel-dir /wheels . tzdata

# Runtime stage: the wheels installed, nothing else from the build.
FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="mps-exporter" \
      org.opencontainers.image.description="Prometheus exporter for NVIDIA MPS (CUDA Multi-Process Service)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"

RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels mps-exporter tzdata \
    && groupadd --system --gid 10138 mps-exporter \
    && useradd --system --uid 10138 --gid 10138 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin mps-exporter

# The NVIDIA container runtime injects NVML (utility) and nvidia-cuda-mps-control
# (compute) only into containers that ask for them.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# Non-root by default: NVML, the MPS control pipe and the world-readable parts of
# /proc need no privilege. Reading the CUDA_MPS_* limits in other users'
# /proc/PID/environ does (CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH): the Helm chart
# and the compose file run this image as uid 0 with exactly those two capabilities,
# because Kubernetes cannot grant capabilities to a non-root process.
USER 10138:10138
EXPOSE 10138
ENTRYPOINT ["mps-exporter"]
