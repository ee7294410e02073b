#!/usr/bin/env bash
# One prepared device check (H200): FLA kernel parity vs the torch reference, then the bf16 benchmarks.
# Usage (from the repo root, with the flash-linear-attention wheels in .whl/): bash benchmarks/gpu.sh OUT_DIR
# Every step has its own time limit (seconds) so that one hang cannot eat the device session (~9 min in all);
# a failed or timed-out step is recorded in OUT_DIR/failures.txt and the next one runs.
set -euo pipefail
out="${1:?usage: benchmarks/gpu.sh OUT_DIR}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"

step() {  # step NAME LIMIT_S CMD...: run CMD with a time limit, output to OUT_DIR/NAME.txt
    local name="$1" limit="$2"
    shift 2
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt" || echo "step $name failed or timed out (limit ${limit}s)" | tee -a "$out/failures.txt"
}

step gdn_kernel 60 python3 benchmarks/gdn_kernel.py
# chunked loss vs unchunked, eager and compiled block epilogues (kernels.loss: torch / compiled; goal ≤ 1.2)
step loss 120 python3 benchmarks/loss.py --device cuda --dtype bfloat16 --tokens 16384 --hidden 4096 --vocab 248320 --compiled
# q38 vs transformers fwd+bwd (kernels: auto → experts grouped_mm on bf16 CUDA); torch GDN (auto chunk 64, and 128 in
# the same interleaved loop: kernels.gdn_chunk_size's accelerator default is not measured yet), then FLA GDN
step model_torch_gdn 60 python3 benchmarks/model.py --device cuda --dtype bfloat16 --seq 4096 --batch 2 --hidden 1024 --experts 64 --top-k 8 --repeats 5 --layers --vs-gdn-chunk 128
step model_fla_gdn 45 python3 benchmarks/model.py --device cuda --dtype bfloat16 --seq 4096 --batch 2 --hidden 1024 --experts 64 --top-k 8 --repeats 5 --gdn fla
# whole train_step, tokens/s + MFU (bf16, hidden 2048, 8 layers, 64 experts top-8, 2 × 4096): torch GDN, FLA GDN where
# the kernel registry allows it (FLA >= 0.5.2 with Triton >= 3.7.1 or TileLang), transformers
step train_step 120 python3 benchmarks/train_step.py --device cuda --dtype bfloat16 --hidden 2048 --layers 8 --experts 64 --top-k 8 --batch 2 --seq 4096 --steps 5
# q38 plan: predicted vs measured one-GPU step time and peak memory (issue 13)
step plan_step 45 python3 benchmarks/plan_step.py --device cuda --dtype bfloat16 --hardware h200 --gdn fla --repeats 5
step plan_step_recompute 45 python3 benchmarks/plan_step.py --device cuda --dtype bfloat16 --hardware h200 --gdn fla --recompute --repeats 5
# bf16 mixed-precision policy: the tiny run on CUDA (bf16 compute, fp32 masters) vs the CPU fp32 losses, 50 steps
step bf16_train 60 python3 benchmarks/bf16_train.py --device cuda --steps 50 --out "$out/bf16_train"
