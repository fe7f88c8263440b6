# gemma4serve on NVIDIA GPUs.
#
#   docker build -t gemma4serve .
#   docker run --gpus all -p 8000:8000 -v hf-cache:/cache/huggingface -e HF_TOKEN gemma4serve \
#       --model google/gemma-4-31B-it --draft google/gemma-4-31B-it-assistant
#
# The server listens on 0.0.0.0:8000 inside the container (the CLI's default host and port); the HEALTHCHECK
# polls that port, so publish a different host port with -p rather than changing --port.
#
# The devel image, not the runtime one: Triton compiles kernels on first use, which needs a C compiler and
# Python's headers (and ptxas, which the devel image carries).
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv gcc g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# A virtualenv: Ubuntu 24.04's system Python refuses pip installs (PEP 668).
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gemma4serve ./gemma4serve
COPY kernels ./kernels
# The README's GPU install command, unchanged (tests/test_dockerfile.py keeps the two equal).
RUN pip install "."

# Run as an unprivileged user with a numeric id (Kubernetes' runAsNonRoot can verify it). Model weights go to
# the volume, so that a restarted container does not download them again.
RUN useradd --create-home --uid 10001 --user-group gemma \
    && mkdir -p /cache/huggingface \
    && chown -R 10001:10001 /cache
USER 10001:10001
WORKDIR /home/gemma
ENV HF_HOME=/cache/huggingface
VOLUME /cache/huggingface

EXPOSE 8000
# /health is 200 only once the weights are loaded and the engine runs: a 31B model can take minutes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]

ENTRYPOINT ["gemma4serve"]
CMD ["--help"]
