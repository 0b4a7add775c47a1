#!/usr/bin/env bash
# Accelerator check on one NVIDIA GPU (the lent H200 image as it is: Python 3.12 with JAX and
# CUDA installed, no network, no package index), in two calls of the device tool.
#
#   bash scripts/device_check.sh [--part 1|2|all] [--dry-run] [OUT_DIR]
#
# What the calls carry was prepared here by scripts/device_wheels.sh (ignored by git):
#   .whl/         wheels of what the image lacks (scripts/device_requirements.txt)
#   .devw/partN/  SmolLM2's GGUF, xz-compressed, one part per call (scripts/device_package.json
#                 is the plan: sizes, SHA-256s, each call's carry list)
# The two calls, back to back (the machine stays warm 30 s between them; /tmp survives):
#   run(carry=[".whl", ".devw/part1"], command="bash scripts/device_check.sh --part 1", timeout_s=320)
#   run(carry=[".devw/part2"], command="bash scripts/device_check.sh --part 2", timeout_s=440)
#
# Part 1: setup (wheels installed with pip --no-index into $WORK/site; weight parts stored),
#   kernels_test (Triton attention + allocator kernels against their references),
#   kernels (copy bandwidth, bf16 matmul rate, attention and allocator kernels against HBM),
#   rows (stage a: step time per token rows, random bf16 SmolLM2- and Llama-3-8B-shaped engines,
#   plain / MTP / n-gram, batch 1/8/64; no checkpoint needed).
# Part 2: weights (rebuilt from the parts, SHA-256 checked), speedup (stage b: SmolLM2's real
#   weights, plain vs MTP vs n-gram at batch 1 and 8, outputs identical to plain), train (stage c:
#   the engine generates training data on the device, hidden states captured in batches there,
#   MTP head trained, all time-boxed), evalhead (the new head in the engine).
# Each part ends with a report: OUT_DIR/report.json and report.md (every stage so far, each
# measured figure beside the prediction of scripts/device_prediction.json), logs.tgz, plots and
# the trained head; at most 8 files, as the tool brings back.
# --part all: every stage in one call (all weight parts present, e.g. on a machine with disk).
# --part store: only store the weight part this call carries (the middle calls of a plan that
#   needs three; scripts/device_check.py package-size prints the calls of the current plan).
# --dry-run: the same stages and commands on this machine's CPU at tiny sizes (a tiny random GGUF
#   with SmolLM2's tokenizer stands in for the weights and goes through the same pack / rebuild
#   path; the wheel install runs against $DRY_WHEELS, default .whl). tests/test_device_check.py
#   runs it.
# Stage time limits (s): T_SETUP T_KTEST T_KERNELS T_ROWS T_WEIGHTS T_SPEEDUP T_TRAIN T_EVALHEAD;
# STAGES=a,b,... runs only those stages. HYBRID=1: part 1 also runs issue 51's hybrid stages (gdn_gpu: the
#   gated-delta-rule Triton kernels against the jnp references; hybrid_prefix: hybrid prefix
#   caching with state checkpoints on the GPU; limits T_GDNGPU T_HPREFIX).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DRY=0 PART=all OUT_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --part) PART=$2; shift ;;
    --part=*) PART=${1#--part=} ;;
    -h|--help) sed -n 2,40p "$0"; exit 0 ;;
    *) OUT_DIR=$1 ;;
  esac
  shift
done
case "$PART" in 1|2|all|store) ;; *) echo "--part must be 1, 2, store or all" >&2; exit 2 ;; esac
OUT_DIR=${OUT_DIR:-${OUT:-runs/device_check}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)

if [ "$DRY" = 1 ]; then
  WORK=${JMTP_DEVICE_WORK:-$OUT_DIR/work}
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  [ -x "$PY" ] || PY=python3
  export JAX_PLATFORMS=cpu
  # the test suite's quick XLA:CPU compiles (tests/conftest.py: the emitter flag only where it
  # was measured, jaxlib 0.10; XLA aborts on a flag it does not know), unless the caller set flags
  if [ -z "${XLA_FLAGS:-}" ]; then
    XLA_FLAGS=--xla_backend_optimization_level=0
    if "$PY" -c 'import importlib.metadata as m, sys; sys.exit(not m.version("jaxlib").startswith("0.10."))' 2>/dev/null; then
      XLA_FLAGS="$XLA_FLAGS --xla_cpu_use_fusion_emitters=false"
    fi
    export XLA_FLAGS
  fi
  WHEELS=${DRY_WHEELS:-$ROOT/.whl}
  # a shared CPU is slow and noisy: generous limits; the stages' own time boxes (--seconds,
  # --gen-seconds, --train-seconds) are off (DRY_BOX s), so every path runs however loaded the
  # machine is (a box that cut an engine would leave a path unrehearsed)
  for v in T_SETUP T_KTEST T_KERNELS T_ROWS T_WEIGHTS T_SPEEDUP T_TRAIN T_EVALHEAD; do
    export "$v=${!v:-600}"
  done
  BOX=${DRY_BOX:-100000}
else
  WORK=${JMTP_DEVICE_WORK:-/tmp/jmtp_device_check}   # outlives a call while the machine is warm
  PY=${PYTHON:-python3}
  WHEELS=$ROOT/.whl
fi
RES=$WORK/results LOG=$WORK/logs SITE=$WORK/site WDIR=$WORK/weights
if [ "$PART" = 1 ] || [ "$PART" = all ]; then rm -rf "$RES" "$LOG"; fi   # a fresh check
mkdir -p "$RES" "$LOG" "$SITE" "$WDIR"
if [ "$DRY" = 1 ]; then   # the dry run imports from this machine's environment
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 JMTP_CACHE_DIR=$WORK/xla_cache JMTP_WEIGHTS_CACHE_DIR=$WORK/weights_cache
T0=$(date +%s)

# stage NAME LIMIT_S COMMAND...: run under timeout, log to $LOG/NAME.log, record the outcome.
stage() {
  local name=$1 limit=$2; shift 2
  if [ -n "${STAGES:-}" ] && [[ ",$STAGES," != *",$name,"* ]]; then
    record "$name" SKIPPED 0; return 0
  fi
  local t rc status=ok c0 c1
  t=$(date +%s)
  cpu_mark; c0=$(cat "$WORK/.cpu")
  echo "=== [$name] (limit ${limit}s) $*" | tee "$LOG/$name.log"
  timeout --kill-after=10 "$limit" "$@" >> "$LOG/$name.log" 2>&1
  rc=$?
  cpu_mark; c1=$(cat "$WORK/.cpu")
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=TIMEOUT; elif [ $rc -ne 0 ]; then status="FAILED (rc $rc)"; fi
  record "$name" "$status" $(( $(date +%s) - t )) "$(awk "BEGIN{print $c1 - $c0}")"
  echo "=== [$name] $status in $(( $(date +%s) - t ))s ($(awk "BEGIN{print $c1 - $c0}") CPU s)"
  [ "$status" = ok ] || tail -n 5 "$LOG/$name.log"
  return 0
}
cpu_mark() {   # user + system CPU seconds of this shell's finished children, into $WORK/.cpu
  times > "$WORK/.times"    # (in this shell: a $(...) subshell would count its own children)
  tail -n 1 "$WORK/.times" | awk '{ for (i = 1; i <= 2; i++) { split($i, a, "m");
    sub("s", "", a[2]); s += a[1] * 60 + a[2] } } END { printf "%.1f", s }' > "$WORK/.cpu"
}
record() {   # the stage table of the report ($RES/stages.json), one entry per stage name
  "$PY" - "$RES/stages.json" "$1" "$2" "$3" "${4:-0}" <<'PYEOF'
import json, os, sys
path, name, status, sec, cpu = sys.argv[1:]
rows = json.load(open(path)) if os.path.exists(path) else []
rows = [r for r in rows if r["stage"] != name] + [{"stage": name, "status": status,
                                                   "seconds": int(sec), "cpu_seconds": float(cpu)}]
json.dump(rows, open(path, "w"), indent=1)
PYEOF
}

# ------------------------------------------------------------------------------ part 1
setup() {
  python3 --version 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    # the device tool README's command: no index, no dependency resolution, a target folder.
    # The dry run adds the device's tags (CPython 3.12, manylinux x86-64) so pip judges the
    # wheels as the device's pip will, and does not import from the folder afterwards.
    local tags=()
    if [ "$DRY" = 1 ]; then
      tags=(--python-version 3.12 --implementation cp --only-binary=:all:)
      for n in 17 27 28 31 34 35; do tags+=(--platform "manylinux_2_${n}_x86_64"); done
      tags+=(--platform manylinux2014_x86_64 --platform any)
    fi
    rm -rf "$SITE" && mkdir -p "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${tags[@]}" "$WHEELS"/*.whl || return 1
    "$PY" - "$WHEELS" "$SITE" <<'PYEOF' || return 1
import os, sys
wheels = {f.split("-")[0].lower() for f in os.listdir(sys.argv[1]) if f.endswith(".whl")}
have = {d.split("-")[0].lower() for d in os.listdir(sys.argv[2]) if d.endswith(".dist-info")}
missing = sorted(wheels - have)
print(f"installed {len(have & wheels)}/{len(wheels)} wheels into {sys.argv[2]}: {sorted(have)}")
sys.exit(f"not installed: {missing}" if missing else 0)
PYEOF
  else
    echo "no wheels in $WHEELS (run scripts/device_wheels.sh here first)"
    [ "$DRY" = 1 ] || return 1
  fi
  if [ -d "$PARTS" ]; then   # store the carried weight parts where the next call finds them
    "$PY" scripts/device_check.py receive-weights --parts "$PARTS" --into "$WDIR" $EXPECT
    [ $? -le 3 ] || return 1
  fi
  "$PY" - "$RES/env.json" "$DRY" <<'PYEOF' || return 1
import importlib.metadata as md, json, sys
import jax
import jmtp.runtime.host.llm, jmtp.train.selfgen, jmtp.runtime.host.structured.params  # noqa: F401
import gguf, jsonschema, llguidance  # noqa: F401  (what the wheels bring)
d = jax.devices()[0]
vers = {}
for n in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "tokenizers",
          "safetensors", "gguf", "jsonschema", "llguidance", "jax-cuda13-plugin"):
    try:
        vers[n] = md.version(n)
    except md.PackageNotFoundError:
        vers[n] = None
env = {"backend": jax.default_backend(), "device_kind": d.device_kind, "jax": jax.__version__,
       "devices": jax.device_count(), "python": sys.version.split()[0], "packages": vers,
       "dry_run": sys.argv[2] == "1"}
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(env)
if sys.argv[2] != "1" and jax.default_backend() != "gpu":
    sys.exit("no GPU backend: jax sees " + str(jax.devices()))
PYEOF
}

if [ "$DRY" = 1 ]; then
  # the dry run's weights: a tiny random GGUF with SmolLM2's tokenizer, packed in two parts like
  # the real ones and checked against the weights.json packed with them
  EXPECT="--expect found" DEVW=$WORK/devw
  if [ "$PART" != 2 ]; then
    rm -rf "$DEVW" "$WDIR"
    "$PY" scripts/device_check.py make-tiny-gguf "$WORK/tiny.gguf" > /dev/null &&
    "$PY" scripts/device_check.py pack-weights "$WORK/tiny.gguf" --out "$DEVW" \
      --budgets 1.5,64 > /dev/null
  fi
else
  EXPECT="" DEVW=$ROOT/.devw
fi
if [ "$PART" = store ]; then   # a middle call of a plan in three parts: store its part only
  "$PY" scripts/device_check.py receive-weights --parts "$DEVW" --into "$WDIR" $EXPECT
  exit 0
fi

if [ "$PART" != 2 ]; then
  # (the dry run's call 1 carries part 1 only, as the real one does)
  PARTS=$DEVW
  [ "$DRY" = 1 ] && PARTS=$DEVW/part1
  stage setup "${T_SETUP:-40}" bash -c "$(declare -f setup); DRY=$DRY PY='$PY' WHEELS='$WHEELS' \
    SITE='$SITE' ROOT='$ROOT' WDIR='$WDIR' RES='$RES' EXPECT='$EXPECT' PARTS='$PARTS' setup"
  # Triton kernels compiled for real on a GPU (interpret mode elsewhere: the dry run only checks
  # that the selection is not empty)
  KSEL="TestPallasGPU or gpu_block_size or pallas_gpu"
  if [ "$DRY" = 1 ]; then KARGS=(--collect-only); else KARGS=(); fi
  stage kernels_test "${T_KTEST:-60}" "$PY" -m pytest -q -p no:cacheprovider "${KARGS[@]}" \
    tests/pallas/test_ragged_paged_attention.py tests/pallas/test_block_allocator.py -k "$KSEL" \
    --junitxml="$LOG/kernels_test.xml"
  if [ "$DRY" = 1 ]; then
    stage kernels "${T_KERNELS:-60}" "$PY" scripts/device_bench.py kernels --tiny --seconds "$BOX" \
      --json "$RES/kernels.json"
    stage rows "${T_ROWS:-120}" "$PY" scripts/device_bench.py rows --tiny --shapes 0 --batches 2 \
      --k 1 --context 16 --new-tokens 6 --methods plain,mtp --seconds "$BOX" --json "$RES/rows.json"
  else
    stage kernels "${T_KERNELS:-45}" "$PY" scripts/device_bench.py kernels --seconds 25 \
      --json "$RES/kernels.json"
    stage rows "${T_ROWS:-150}" "$PY" scripts/device_bench.py rows --seconds 120 \
      --json "$RES/rows.json"
  fi
  # Hybrid models (issue 51): the gated-delta-rule GPU kernels compiled for real against the
  # jnp references, then exact hybrid prefix caching on the GPU (fp32 at "highest" precision).
  # Opt-in (HYBRID=1): they do not fit the two calls' time plan (scripts/device_package.json).
  GSEL=gpu PSEL=""
  if [ "$DRY" = 1 ]; then GSEL="gpu and (packed or lens0)"; PSEL="hand_worked or lru"; fi
  if [ "${HYBRID:-0}" = 1 ]; then
  stage gdn_gpu "${T_GDNGPU:-120}" "$PY" -m pytest -q -p no:cacheprovider \
    tests/pallas/test_gated_delta_rule_varlen.py -k "$GSEL" --junitxml="$LOG/gdn_gpu.xml"
  stage hybrid_prefix "${T_HPREFIX:-180}" env JAX_DEFAULT_MATMUL_PRECISION=highest \
    "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_hybrid_prefix.py \
    ${PSEL:+-k "$PSEL"} --junitxml="$LOG/hybrid_prefix.xml"
  fi
fi

# ------------------------------------------------------------------------------ part 2
if [ "$PART" != 1 ]; then
  PARTS=$DEVW
  [ "$DRY" = 1 ] && PARTS=$DEVW/part2       # the dry run's call 2 carries part 2 only
  stage weights "${T_WEIGHTS:-40}" "$PY" scripts/device_check.py receive-weights \
    --parts "$PARTS" --into "$WDIR" $EXPECT
  MODEL=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['file'])" \
    "$WDIR/parts/weights.json" 2>/dev/null)
  MODEL=$WDIR/$MODEL
  if [ -f "$MODEL" ]; then
    if [ "$DRY" = 1 ]; then
      SARGS=(--batches 2 --ks 1 --ngram-k 0 --num-prompts 2 --prompts-per-batch 1 --max-tokens 8
             --seconds "$BOX")
      TARGS=(--gen-batch 4 --samples 1 --gen-max-tokens 12 --num-prompts 10 --batch 2
             --seq-len 32 --epochs 2 --train-seconds "$BOX" --eval-every 1000 --eval-passes 2 --ckpt-every 1000
             --train-vocab 256 --capture-batch-tokens 256 --gen-seconds "$BOX" --no-hidden-cache)
      EARGS=(--batches 2 --ks 1 --ngram-k 0 --num-prompts 2 --prompts-per-batch 1 --max-tokens 8
             --seconds "$BOX" --plain-from "$RES/speedup.json")
    else
      SARGS=(--batches 1,8 --ks 1,3 --ngram-k 3 --max-tokens 128 --seconds 90)
      # as many self-generated tokens as ~70 s allow (1024 slots, responses of <= 256 tokens, up
      # to 400 samples per training prompt), hidden states captured in 64k-row batches, then a
      # time-boxed training of 64x512-row batches from the shipped head
      TARGS=(--gen-batch 1024 --samples 400 --gen-max-tokens 256 --gen-seconds 70 --batch 64
             --seq-len 512 --lr 5e-4 --epochs 1 --train-seconds 40 --eval-every 100000 --eval-passes 4
             --ckpt-every 100000 --train-vocab 8192 --capture-batch-tokens 65536
             --device-data --no-hidden-cache)
      EARGS=(--batches 1,8 --ks 3 --ngram-k 0 --max-tokens 128 --seconds 50
             --plain-from "$RES/speedup.json")
    fi
    stage speedup "${T_SPEEDUP:-110}" "$PY" scripts/device_bench.py speedup --model "$MODEL" \
      "${SARGS[@]}" --json "$RES/speedup.json"
    rm -rf "$WORK/train"
    # --init model: from the head jmtp ships for the model (SmolLM2's), else a fresh one
    stage train "${T_TRAIN:-200}" "$PY" scripts/train_mtp.py --model "$MODEL" --out "$WORK/train" \
      --generator engine --labels target --prompt-rows --num-passes 2 --kl-weight 0.5 \
      --feature-noise 0.05 --no-progress --init model "${TARGS[@]}" \
      --report-json "$RES/train.json"
    if [ -f "$WORK/train/mtp_head.safetensors" ]; then
      stage evalhead "${T_EVALHEAD:-60}" "$PY" scripts/device_bench.py speedup --model "$MODEL" \
        --mtp-head "$WORK/train/mtp_head.safetensors" "${EARGS[@]}" --json "$RES/evalhead.json"
    else
      record evalhead "SKIPPED (no trained head)" 0
    fi
  else
    record speedup "SKIPPED (weights incomplete)" 0
    record train "SKIPPED (weights incomplete)" 0
  fi
fi

# ------------------------------------------------------------------------------ report
rm -f "$OUT_DIR"/report.* "$OUT_DIR"/logs.tgz "$OUT_DIR"/*.png "$OUT_DIR"/mtp_head.safetensors
"$PY" scripts/device_check.py report "$RES" "$OUT_DIR" > "$LOG/report.log" 2>&1 ||
  echo "report FAILED: $(tail -n 3 "$LOG/report.log")"
[ -f "$RES/speedup.json" ] && "$PY" scripts/device_check.py plot-bench "$RES/speedup.json" \
  "$OUT_DIR/speedup.png" > /dev/null 2>&1
[ -f "$WORK/train/metrics.jsonl" ] && "$PY" scripts/device_check.py plot-train \
  "$WORK/train/metrics.jsonl" "$OUT_DIR/train.png" > /dev/null 2>&1
[ -f "$WORK/train/mtp_head.safetensors" ] && cp "$WORK/train/mtp_head.safetensors" "$OUT_DIR/"
tar -czf "$OUT_DIR/logs.tgz" -C "$WORK" logs results 2>/dev/null
echo
cat "$OUT_DIR/report.md" 2>/dev/null
echo "part $PART done in $(( $(date +%s) - T0 ))s; outputs in $OUT_DIR: $(ls "$OUT_DIR" | tr '\n' ' ')"
