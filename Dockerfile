# syntax=docker/dockerfile:1
# One image for every rankwatch container: the operator (`rankwatch operator`, the default), the
# sidecar (`rankwatch sidecar`) and the init container that copies the tracing library into worker
# pods (`cp /opt/rankwatch/lib/librankwatch-nccl.so ...`, see operator/lifecycle/pod_spec.py).
#
# Every stage starts from the same pinned Debian-based Python image, so the library is compiled
# against the glibc it runs beside. No secrets enter the build; the runtime user is 65532, the uid
# the operator's pod specs run as. Its RUN steps are exercised without Docker by
# tests/unit/test_dockerfile.py (same commands, in a temporary directory and a clean venv).
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# -- 1: the NCCL tracing library (C, gcc only) -------------------------------------------------
FROM ${PYTHON_IMAGE} AS native
# Versions come from the Debian release the pinned base image fixes; libc6-dev must match the image's
# own libc6, which a hard pin would break at the next Debian security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY nccl_patch/ nccl_patch/
RUN make -C nccl_patch build/librankwatch-nccl.so

# -- 2: the Python package in its own venv (wheels only; no compiler needed) -------------------
FROM ${PYTHON_IMAGE} AS python
ENV VENV=/opt/rankwatch/venv \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY rankwatch/ rankwatch/
COPY operator/ operator/
COPY sidecar/ sidecar/
COPY analysis/ analysis/
COPY cluster/ cluster/
COPY alerting/ alerting/
RUN python -m venv "$VENV" \
    && "$VENV/bin/pip" install . \
    && "$VENV/bin/rankwatch" --help > /dev/null

# -- 3: runtime ----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="rankwatch" \
      org.opencontainers.image.description="NCCL tracing operator, sidecar and tracing library" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/rankwatch/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=python /opt/rankwatch/venv /opt/rankwatch/venv
COPY --from=native /src/nccl_patch/build/librankwatch-nccl.so /opt/rankwatch/lib/librankwatch-nccl.so
RUN rankwatch --help > /dev/null \
    && test -r /opt/rankwatch/lib/librankwatch-nccl.so
USER 65532:65532
CMD ["rankwatch", "operator"]
