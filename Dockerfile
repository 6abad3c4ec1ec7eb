# syntax=docker/dockerfile:1
# One image for every rankwatch container: the operator (`rankwatch operator`, the default), the
# sidecar (`rankwatch sidecar`) and the init container that copies the tracing library into worker
# pods (`cp /opt/rankwatch/lib/librankwatch-nccl.so ...`, see operator/lifecycle/pod_spec.py).
#
# Every stage starts from the same pinned Debian-based Python image, so the library and the C
# extension are compiled against the glibc they run beside; compilers stay in the build stages.
# No secrets enter the build; the runtime user is 65532, the uid the operator's pod specs run as.
# Built without a Docker engine by tests/unit/test_dockerfile.py (its RUN steps in a temporary
# directory and a clean venv) and, in a real Debian root filesystem, by `make image-rootfs`.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# -- 1: the NCCL tracing library (C) ------------------------------------------------------------
# Built for glibc 2.17 with zig's cross toolchain (PyPI's ziglang, in a venv of its own), whatever the
# base image's glibc: it is preloaded into trainer images that may be much older than ours.
FROM ${PYTHON_IMAGE} AS native
# Versions come from the Debian release the pinned base image fixes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY nccl_patch/ nccl_patch/
RUN python -I -m venv /opt/rankwatch/zig \
    && /opt/rankwatch/zig/bin/pip install --no-cache-dir ziglang==0.17.1 \
    && make -C nccl_patch build/librankwatch-nccl.so ZIG_PYTHON=/opt/rankwatch/zig/bin/python

# -- 2: the Python package in its own venv -----------------------------------------------------
# The Megatrace tokeniser is a C extension (the base image has Python's headers, not a compiler).
# What only development and tests use is removed from the venv, by folder: the local-cluster harness
# (rankwatch.cluster) and the stand-ins (rankwatch.standins: the simulator with its Python rank and
# noisy neighbour, the trace generators); `rankwatch cluster` and `rankwatch simulate` say so in the
# image. Test doubles live under tests/, which is never copied.
# `python -I`: the source tree's operator/ folder must not shadow the standard library's operator.
FROM ${PYTHON_IMAGE} AS python
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
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
COPY standins/ standins/
RUN python -I -m venv "$VENV" \
    && "$VENV/bin/pip" install . \
    && site="$("$VENV/bin/python" -I -c 'import rankwatch, os; print(os.path.dirname(rankwatch.__file__))')" \
    && rm -r "$site/cluster" "$site/standins" \
    && "$VENV/bin/python" -I -c 'import rankwatch.analysis._megatrace_tokenizer' \
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
    && python -c 'import rankwatch.operator.handlers, rankwatch.sidecar.main' \
    && test -r /opt/rankwatch/lib/librankwatch-nccl.so
USER 65532:65532
CMD ["rankwatch", "operator"]
