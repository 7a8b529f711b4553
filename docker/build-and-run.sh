#!/usr/bin/env bash
# Build the fedpower image offline and run a SuperLink and two SuperNodes from it to a completed run.
#   docker/build-and-run.sh                 # base image fedpower-base:bookworm (made if missing)
#   BASE_IMAGE=python:3.11-slim docker/build-and-run.sh
# Steps: (1) a base image (docker/make-base-image.sh) unless BASE_IMAGE exists; (2) every wheel the
# image needs, downloaded on this host into docker/wheels/ (the image build then uses no network);
# (3) docker build; (4) a SuperLink and two SuperNode containers (--network=host) and a `flwr run`
# of conf/tiny.toml from a third container; success = `flwr ls` reports finished:completed.
# Exit code 0 only if the run completed. Containers are removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_IMAGE=${BASE_IMAGE:-fedpower-base:bookworm}
IMAGE=${IMAGE:-fedpower:local}
PORT=${PORT:-18400}
PY=${PYTHON:-python3}
t0=$(date +%s)
say() { echo "[build-and-run $(( $(date +%s) - t0 )) s] $*"; }

if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    if [[ "$BASE_IMAGE" == fedpower-base:* ]]; then
        say "base image $BASE_IMAGE missing: making it with debootstrap"
        docker/make-base-image.sh "$BASE_IMAGE"
    else
        say "pulling $BASE_IMAGE"; docker pull "$BASE_IMAGE"
    fi
fi

say "downloading wheels into docker/wheels/ (torch CPU, the project's dependencies, its build backend)"
"$PY" -m pip download --quiet --dest docker/wheels --only-binary=:all: "torch==2.13.0" hatchling
"$PY" -m pip download --quiet --dest docker/wheels . 2>&1 | grep -v "^WARNING: Location" || true
rm -f docker/wheels/fedpower-*.tar.gz docker/wheels/fedpower-*.whl   # the project itself is built in the image

say "docker build ($IMAGE from $BASE_IMAGE)"
docker build --network=host --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$IMAGE" . >/tmp/fedpower-docker-build.log 2>&1 \
    || { tail -30 /tmp/fedpower-docker-build.log; exit 1; }
say "image $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE") bytes"

NAMES=(fedpower-superlink fedpower-supernode-0 fedpower-supernode-1)
cleanup() { docker rm -f "${NAMES[@]}" >/dev/null 2>&1 || true; }
trap cleanup EXIT
cleanup
docker run -d --name fedpower-superlink --network=host "$IMAGE" flower-superlink --insecure --host 127.0.0.1 \
    --port "$PORT" --database :flwr-in-memory: --disable-runtime-dependency-installation >/dev/null
for _ in $(seq 120); do
    docker run --rm --network=host "$IMAGE" python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
        >/dev/null 2>&1 && break
    sleep 1
done
say "SuperLink up on 127.0.0.1:$PORT"
for i in 0 1; do
    docker run -d --name "fedpower-supernode-$i" --network=host "$IMAGE" flower-supernode --insecure \
        --superlink "127.0.0.1:$PORT" --port $((PORT + 10 + i)) \
        --node-config "partition-id=$i num-partitions=2" --max-retries 10 >/dev/null
done
say "2 SuperNodes started; flwr run conf/tiny.toml"
docker run --rm --network=host -e PORT="$PORT" "$IMAGE" sh -c '
    mkdir -p "$FLWR_HOME" &&
    printf "[superlink]\ndefault = \"docker\"\n\n[superlink.docker]\naddress = \"127.0.0.1:%s\"\ninsecure = true\n" "$PORT" > "$FLWR_HOME/config.toml" &&
    flwr run /app docker --stream --run-config "num-server-rounds=2 strategy.min-nodes=2 strategy.client-rate=1.0 task.synthetic-train-size=300 task.synthetic-eval-size=100 task.max-length=32 train.batch-size=16 train.lr=0.003 train.lr-schedule=\"constant\"" >/tmp/run.log 2>&1;
    flwr ls docker --format json > /tmp/ls.json;
    python -c "import json; r = json.load(open(\"/tmp/ls.json\"))[\"runs\"]; print(\"run status:\", r[0][\"status\"] if r else None); raise SystemExit(0 if r and r[0][\"status\"] == \"finished:completed\" else 1)" \
        || { tail -40 /tmp/run.log; exit 1; }'
status=$?
say "done (exit $status)"
exit $status
