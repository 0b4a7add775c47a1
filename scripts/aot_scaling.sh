#!/usr/bin/env bash
# The compiles behind docs/scaling.md's `jmtp compile` table (§0; CPU only, libtpu's
# compiler; about 15 minutes on 2 cores). Writes docs/aot/<name>.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
J=".venv/bin/jmtp compile --buckets largest --fit"
$J --topology v5e:1x1 --max-num-seqs 64 --max-model-len 2048 \
   --json docs/aot/smollm2.json --markdown docs/aot/smollm2.md
$J --model configs/llama-3-8b.json --topology v5e:2x2 --tensor-parallel-size 4 \
   --max-num-seqs 64 --max-model-len 4096 --json docs/aot/llama3-8b.json --markdown docs/aot/llama3-8b.md
$J --model configs/llama-3.1-70b.json --topology v6e:2x4 --tensor-parallel-size 8 \
   --max-num-seqs 64 --max-model-len 4096 --json docs/aot/llama31-70b-v6e8.json \
   --markdown docs/aot/llama31-70b-v6e8.md || true
$J --model configs/llama-3.1-70b.json --topology v5e:4x4 --tensor-parallel-size 16 \
   --max-num-seqs 64 --max-model-len 4096 --json docs/aot/llama31-70b-v5e16.json \
   --markdown docs/aot/llama31-70b-v5e16.md || true
$J --model configs/llama-3.1-70b.json --topology v5e:16x16 --tensor-parallel-size 16 \
   --data-parallel-size 16 --max-num-seqs 256 --max-model-len 4096 \
   --json docs/aot/llama31-70b-v5e256.json --markdown docs/aot/llama31-70b-v5e256.md || true
# Qwen3-Next-80B-A3B (hybrid gated DeltaNet + MoE, its MTP layer, K=2) on 4 v5p chips: the linear
# layers' Pallas kernel under shard_map over value heads, experts split over the model axis.
.venv/bin/jmtp compile --buckets largest --model configs/qwen3-next-80b-a3b.json \
   --topology v5p:2x2x1 --tensor-parallel-size 4 --max-num-seqs 16 --max-model-len 4096 \
   --num-speculative-tokens 2 --json docs/aot/qwen3-next-80b.json --markdown docs/aot/qwen3-next-80b.md
# Expert parallelism (issue 47): the routed experts split over every device of the mesh, each
# token dispatched to its experts' devices and back (docs/moe.md). bf16 weights: the FP8
# block-scaled checkpoints (kept 8-bit) halve the routed experts' bytes; re-run these with
# --quantization fp8 once that lands (docs/scaling.md, section 0b).
# Qwen3-Next-80B with expert parallelism, against the 755-collective step above.
.venv/bin/jmtp compile --buckets largest --model configs/qwen3-next-80b-a3b.json \
   --topology v5p:2x2x1 --tensor-parallel-size 4 --max-num-seqs 16 --max-model-len 4096 \
   --num-speculative-tokens 2 --enable-expert-parallel \
   --json docs/aot/qwen3-next-80b-ep.json --markdown docs/aot/qwen3-next-80b-ep.md
# DeepSeek-V3 + its MTP layer (K=1, its trained depth): attention data parallel 4 x MLA heads
# over 8, 256 experts over 32 v5p chips.
.venv/bin/jmtp compile --buckets largest --model configs/deepseek-v3.json \
   --topology v5p:2x4x4 --data-parallel-size 4 --tensor-parallel-size 8 \
   --enable-expert-parallel --max-num-seqs 64 --max-model-len 4096 --num-speculative-tokens 1 \
   --json docs/aot/deepseek-v3-ep.json --markdown docs/aot/deepseek-v3-ep.md
# GLM-4.5 + its MTP layer (K=3): attention data parallel 2 x heads over 8, 160 experts over 16
# v5p chips.
.venv/bin/jmtp compile --buckets largest --model configs/glm-4.5.json \
   --topology v5p:2x2x4 --data-parallel-size 2 --tensor-parallel-size 8 \
   --enable-expert-parallel --max-num-seqs 64 --max-model-len 4096 --num-speculative-tokens 3 \
   --json docs/aot/glm-4.5-ep.json --markdown docs/aot/glm-4.5-ep.md
