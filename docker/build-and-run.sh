#!/usr/bin/env bash
# Build the fedpower image offline and run a SuperLink and two SuperNodes from it to a completed run.
#   docker/build-and-run.sh                 # base image fedpower-base:bookworm (made if missing)
#   BASE_IMAGE=python:3.11-slim docker/build-and-run.sh
#   TORCH_INDEX=https://download.pytorch.org/whl/cpu docker/build-and-run.sh   # where PyPI's torch is CUDA
# Steps: (1) a base image (docker/make-base-image.sh) unless BASE_IMAGE exists; (2) every wheel the
# image needs, downloaded on this host into docker/wheels/ (the image build then uses no network);
# (3) docker build (two stages: the wheels stay in the builder stage); (4) a SuperLink and two
# SuperNode containers (--network=host) and a `flwr run` of conf/tiny.toml from inside the SuperLink's
# container; success = `flwr ls` reports finished:completed (`flwr run` exits 0 even when the run
# fails). Exit code 0 only if the run completed. Containers are removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_IMAGE=${BASE_IMAGE:-fedpower-base:bookworm}
IMAGE=${IMAGE:-fedpower:local}
PORT=${PORT:-18400}
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
LOG=${BUILD_LOG:-/tmp/fedpower-docker-build.log}
t0=$(date +%s)
say() { echo "[build-and-run $(( $(date +%s) - t0 )) s] $*"; }
die() { say "FAILED: $*" >&2; exit 1; }

command -v docker >/dev/null || die "docker is not installed"
docker info >/dev/null 2>&1 || die "no Docker daemon answers (start dockerd; see docs/deployment.md)"

if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    if [[ "$BASE_IMAGE" == fedpower-base:* ]]; then
        say "base image $BASE_IMAGE missing: making it with debootstrap"
        docker/make-base-image.sh "$BASE_IMAGE"
    else
        say "pulling $BASE_IMAGE"; docker pull "$BASE_IMAGE"
    fi
fi
# The wheels are fetched for this host's Python: the image's must be the same minor version.
host_py=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
image_py=$(docker run --rm --network=none "$BASE_IMAGE" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ "$host_py" == "$image_py" ]] || die "$BASE_IMAGE has Python $image_py but $PY is $host_py: the wheels would not fit (set PYTHON)"

say "downloading wheels into docker/wheels/ (torch $TORCH_VERSION CPU, the project's dependencies, its build backend)"
# torch alone first (from TORCH_INDEX if given), then everything with torch pinned and docker/wheels as
# a source, so the resolver keeps that torch and pulls no CUDA build.
"$PY" -m pip download --quiet --dest docker/wheels --only-binary=:all: --no-deps \
    ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==$TORCH_VERSION"
compgen -G "docker/wheels/torch-${TORCH_VERSION}+cpu-*.whl" >/dev/null \
    || die "no CPU torch wheel in docker/wheels/ (PyPI's Linux torch is the CUDA build): rerun with TORCH_INDEX=https://download.pytorch.org/whl/cpu"
out=$("$PY" -m pip download --quiet --dest docker/wheels --find-links docker/wheels \
    "torch==$TORCH_VERSION" hatchling . 2>&1) || { echo "$out" | grep -v "^WARNING: Location" >&2; die "pip download failed"; }
rm -f docker/wheels/fedpower-*.tar.gz docker/wheels/fedpower-*.whl   # the project itself is built in the image
# CUDA wheels (left by an older script, or a CUDA torch) would only bloat the build context: the image
# build installs the CPU torch and checks that no nvidia-*/triton package came in.
cuda=$(find docker/wheels -maxdepth 1 \( -iname 'nvidia_*' -o -iname 'nvidia-*' -o -iname 'triton-*' \
       -o \( -iname 'torch-*' ! -iname "torch-${TORCH_VERSION}+cpu-*" \) \) -print -delete | wc -l)
[[ $cuda == 0 ]] || say "removed $cuda CUDA or other torch wheels from docker/wheels/"
say "docker/wheels/: $(ls docker/wheels/*.whl | wc -l) wheels, $(du -sh docker/wheels | cut -f1)"

say "docker build ($IMAGE from $BASE_IMAGE; log $LOG)"
tb=$(date +%s)
docker build --network=host --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg TORCH_VERSION="$TORCH_VERSION" \
    -t "$IMAGE" . >"$LOG" 2>&1 || { tail -30 "$LOG"; die "docker build failed"; }
say "built $IMAGE in $(( $(date +%s) - tb )) s: $(docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$IMAGE")"

NAMES=(fedpower-superlink fedpower-supernode-0 fedpower-supernode-1)
cleanup() { docker rm -f "${NAMES[@]}" >/dev/null 2>&1 || true; }
trap cleanup EXIT
cleanup
docker run -d --name fedpower-superlink --network=host "$IMAGE" flower-superlink --insecure --host 127.0.0.1 \
    --port "$PORT" --database :flwr-in-memory: --disable-runtime-dependency-installation >/dev/null
# Polled from the host (--network=host): a container per poll would copy the image each time under vfs.
up=0
for _ in $(seq 300); do
    if "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; then
        up=1; break
    fi
    [[ "$(docker inspect -f '{{.State.Running}}' fedpower-superlink)" == true ]] \
        || { docker logs --tail 30 fedpower-superlink; die "the SuperLink container exited"; }
    sleep 1
done
[[ $up == 1 ]] || { docker logs --tail 30 fedpower-superlink; die "the SuperLink did not answer on 127.0.0.1:$PORT"; }
say "SuperLink up on 127.0.0.1:$PORT"
for i in 0 1; do
    docker run -d --name "fedpower-supernode-$i" --network=host "$IMAGE" flower-supernode --insecure \
        --superlink "127.0.0.1:$PORT" --port $((PORT + 10 + i)) \
        --node-config "partition-id=$i num-partitions=2 dp-max-epsilon=1000 ledger-file=\"memory\" send-shard-size=true" \
        --max-retries 10 >/dev/null
done
say "2 SuperNodes started; flwr run conf/tiny.toml (from inside the SuperLink's container)"
set +e
docker exec -e PORT="$PORT" fedpower-superlink sh -c '
    mkdir -p "$FLWR_HOME" &&
    printf "[superlink]\ndefault = \"docker\"\n\n[superlink.docker]\naddress = \"127.0.0.1:%s\"\ninsecure = true\n" "$PORT" > "$FLWR_HOME/config.toml" &&
    flwr run /app docker --stream --run-config "num-server-rounds=2 strategy.min-nodes=2 strategy.client-rate=1.0 task.synthetic-train-size=300 task.synthetic-eval-size=100 task.max-length=32 train.batch-size=16 train.lr=0.003 train.lr-schedule=\"constant\"" >/tmp/run.log 2>&1;
    flwr ls docker --format json > /tmp/ls.json;
    grep -E "final accuracy" /tmp/run.log | tail -1;
    python -c "import json; r = json.load(open(\"/tmp/ls.json\"))[\"runs\"]; print(\"run status:\", r[0][\"status\"] if r else None); raise SystemExit(0 if r and r[0][\"status\"] == \"finished:completed\" else 1)" \
        || { tail -40 /tmp/run.log; exit 1; }'
status=$?
set -e
if [[ $status != 0 ]]; then
    for n in "${NAMES[@]}"; do echo "--- $n"; docker logs --tail 15 "$n" 2>&1; done
fi
say "done (exit $status)"
exit $status
