# gemma4serve on NVIDIA GPUs (README.md, "Docker", says how it was built and verified).
#
#   docker build -t gemma4serve .
#   docker run --gpus all -p 8000:8000 -v hf-cache:/cache/huggingface -e HF_TOKEN gemma4serve \
#       --model google/gemma-4-31B-it --draft google/gemma-4-31B-it-assistant
#
# The server listens on 0.0.0.0:8000 inside the container (the CLI's default host and port); the
# HEALTHCHECK polls that port, so publish a different host port with -p rather than changing --port.
#
# PyPI's torch 2.13.0 is built for CUDA 13.0 (its wheels bring every CUDA library: cuBLAS, cuDNN,
# NCCL, NVRTC), so the base needs only CUDA 13.0's `base` flavour: the NVIDIA Container Toolkit's
# settings and its driver check (NVIDIA driver 580 or newer). Any other base with apt and Python 3.10+
# works too: --build-arg BASE_IMAGE=...
ARG BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04
FROM ${BASE_IMAGE}

# torch pins triton and its CUDA 13.0 libraries exactly; change it together with BASE_IMAGE's CUDA.
ARG TORCH_VERSION=2.13.0
# Off by default (the server uses FlashInfer only with --attention-backend flashinfer, for eager
# prompt steps): FlashInfer's prefill kernel is JIT-built on first use by nvcc and g++, and the nvcc
# it pulls from pip (13.2) rejects torch's CUDA 13.0 headers; a 13.0 `devel` base puts a matching
# nvcc on PATH. Its prebuilt cubins ship as a separate wheel of the same version.
ARG FLASHINFER_VERSION=

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# Triton compiles a small C launcher on first use: a C compiler and Python's headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-dev python3-venv gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# A virtualenv: Ubuntu 24.04's system Python refuses pip installs (PEP 668).
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch and its CUDA libraries (most of the image) in a layer of their own, so that a code change
# rebuilds and re-pulls only the small layers below.
RUN pip install --no-compile "torch==${TORCH_VERSION}"
# torch named again so that the resolver keeps its exact CUDA pins.
RUN if [ -n "${FLASHINFER_VERSION}" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/* \
        && pip install --no-compile "torch==${TORCH_VERSION}" \
            "flashinfer-python==${FLASHINFER_VERSION}" "flashinfer-cubin==${FLASHINFER_VERSION}"; \
    fi

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gemma4serve ./gemma4serve
COPY kernels ./kernels
# The README's GPU install command, unchanged (tests/test_dockerfile.py keeps the two equal).
RUN pip install "."

# Run as an unprivileged user with a numeric id (Kubernetes' runAsNonRoot can verify it), in group 0
# so that an arbitrary uid (OpenShift, `docker run --user 12345:0`) can write the same folders: every
# cache is set by env under /cache or $HOME, both owned by group 0 with the owner's rights.
RUN useradd --uid 10001 --gid 0 --home-dir /home/gemma --create-home gemma \
    && mkdir -p /cache/huggingface /cache/triton /cache/gemma4serve \
    && chown -R 10001:0 /cache /home/gemma \
    && chmod -R g=u /cache /home/gemma
USER 10001:0
WORKDIR /home/gemma
# HOME too: an arbitrary uid has no passwd entry, and Docker would give it HOME=/.
ENV HOME=/home/gemma \
    USER=gemma \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    GEMMA4SERVE_CACHE=/cache/gemma4serve
# Model weights go to the volume, so that a restarted container does not download them again.
VOLUME /cache/huggingface

# `docker stop` sends SIGTERM and kills after 10 s: drain for 5 s, leaving the server 5 s to end the
# aborted streams and exit 0. With a longer grace (`docker run --stop-timeout`, Kubernetes'
# terminationGracePeriodSeconds) raise this to the grace minus 5.
STOPSIGNAL SIGTERM
ENV GEMMA4SERVE_DRAIN_TIMEOUT=5

EXPOSE 8000
# /health is 200 only once the weights are loaded and the engine runs: a 31B model can take minutes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]

ENTRYPOINT ["gemma4serve"]
CMD ["--help"]
