# fedpower: one image for the SuperLink, the SuperNodes and simulations (subprocess isolation).
#   docker build -t fedpower .
#   docker run --rm fedpower fedpower-privacy --set dp.noise-at=server --method fedpower --level sample --epsilon 3 \
#       --rounds 200 --client-rate 0.5 --num-clients 6 --dataset-size 67349 --batch-size 128
#   docker run --rm -p 8000:8000 fedpower flower-superlink --insecure --host 0.0.0.0 --port 8000 \
#       --disable-runtime-dependency-installation
#   docker run --rm fedpower flower-supernode --insecure --superlink <host>:8000 \
#       --node-config 'partition-id=0 num-partitions=6'
# Build arg TORCH_INDEX selects the torch wheel (CPU by default; e.g. .../whl/cu124 for CUDA).
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_HOME=/app/.flwr \
    FEDPOWER_CACHE=/app/.cache

WORKDIR /app
# Torch first, from the chosen index, so the project's `torch` requirement is already met.
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md LICENSE ./
COPY fedpower_app/ fedpower_app/
COPY strategies/ strategies/
COPY client_app/ client_app/
COPY server_app/ server_app/
COPY conf/ conf/
RUN pip install . && python -c "import fedpower_app.accounting, strategies, client_app.app, server_app.app"
RUN useradd --create-home --uid 1000 fedpower && mkdir -p /app/.flwr /app/.cache /app/outputs \
    && chown -R fedpower /app
USER fedpower
EXPOSE 8000
CMD ["fedpower-run", "--help"]
