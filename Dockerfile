# syntax=docker/dockerfile:1
# dpd-router: the router alone, no test tools. Build from the repository root:
#   docker build -t dpd-router:0.1.0 .
# Run (settings by DPD_* env and/or a mounted YAML file; see deploy/README.md):
#   docker run -p 8000:8000 -v "$PWD/router.yaml:/etc/dpd-router/router.yaml:ro" \
#     -e DPD_CONFIG=/etc/dpd-router/router.yaml dpd-router:0.1.0

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# Stage 1: build the wheel and install it, with its runtime dependencies only, into a venv.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN python -m venv /opt/dpd-router \
    && /opt/dpd-router/bin/pip install --no-cache-dir . \
    && /opt/dpd-router/bin/pip uninstall --yes pip setuptools

# Stage 2: the venv on a clean slim base, run as an unprivileged user.
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="dpd-router" \
      org.opencontainers.image.description="OpenAI-compatible gateway for disaggregated prefill/decode serving on vLLM" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 dpd \
    && useradd --system --uid 10001 --gid dpd --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin dpd \
    && mkdir -p /var/lib/dpd-router && chown dpd:dpd /var/lib/dpd-router
COPY --from=build /opt/dpd-router /opt/dpd-router
# The router listens on 127.0.0.1 by default; in a container it must listen on every interface.
# The environment wins over the YAML file, so DPD_HOST here is the host whatever the file says.
# Tokenizers are read from local directories only: nothing is downloaded at run time.
ENV PATH=/opt/dpd-router/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DPD_HOST=0.0.0.0 \
    DPD_RESPONSES_STORE=/var/lib/dpd-router/responses.sqlite3 \
    HF_HOME=/tmp/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TRANSFORMERS_NO_ADVISORY_WARNINGS=1
# Stored Responses API responses (a volume here keeps them across containers; Redis for replicas).
VOLUME /var/lib/dpd-router
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
# Liveness only (/health): readiness depends on the engines and is /ready. The port is DPD_PORT, default 8000.
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('DPD_PORT', '8000'), timeout=2)"]
ENTRYPOINT ["dpd-router", "serve"]
