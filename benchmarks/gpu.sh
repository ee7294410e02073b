#!/usr/bin/env bash
# One prepared device check (H200): FLA kernel parity vs the torch reference, then the bf16 benchmarks.
# Usage (from the repo root, with the flash-linear-attention wheels in .whl/): bash benchmarks/gpu.sh OUT_DIR
set -euo pipefail
out="${1:?usage: benchmarks/gpu.sh OUT_DIR}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python3 benchmarks/gdn_kernel.py 2>&1 | tee "$out/gdn_kernel.txt" || echo "step failed: see above" | tee -a "$out/failures.txt"
python3 benchmarks/loss.py --device cuda --dtype bfloat16 --tokens 16384 --hidden 4096 --vocab 248320 2>&1 | tee "$out/loss.txt" || echo "step failed: see above" | tee -a "$out/failures.txt"
PYTHONPATH="$PWD" python3 benchmarks/model.py --device cuda --dtype bfloat16 --seq 4096 --batch 2 --hidden 1024 --experts 64 --top-k 8 --repeats 5 2>&1 | tee "$out/model_torch_gdn.txt" || echo "step failed: see above" | tee -a "$out/failures.txt"
python3 benchmarks/model.py --device cuda --dtype bfloat16 --seq 4096 --batch 2 --hidden 1024 --experts 64 --top-k 8 --repeats 5 --gdn fla 2>&1 | tee "$out/model_fla_gdn.txt" || echo "step failed: see above" | tee -a "$out/failures.txt"
# q38 plan: predicted vs measured one-GPU step time and peak memory (issue 13); not yet run
python3 benchmarks/plan_step.py --device cuda --dtype bfloat16 --hardware h200 --gdn fla --repeats 5 2>&1 | tee "$out/plan_step.txt" || echo "step failed: see above" | tee -a "$out/failures.txt"
python3 benchmarks/plan_step.py --device cuda --dtype bfloat16 --hardware h200 --gdn fla --recompute --repeats 5 2>&1 | tee "$out/plan_step_recompute.txt" || echo "step failed: see above" | tee -a "$out/failures.txt"
# whole train_step, tokens/s + MFU (bf16, hidden 2048, 8 layers, 64 experts top-8, 2 × 4096): torch GDN, FLA GDN where
# the kernel registry allows it (FLA >= 0.5.2 with Triton >= 3.7.1 or TileLang), transformers
python3 benchmarks/train_step.py --device cuda --dtype bfloat16 --hidden 2048 --layers 8 --experts 64 --top-k 8 --batch 2 --seq 4096 --steps 5 2>&1 | tee "$out/train_step.txt" || echo "step failed: see above" | tee -a "$out/failures.txt"
# bf16 mixed-precision policy: the tiny run on CUDA (bf16 compute, fp32 masters) vs the CPU fp32 losses, 50 steps
PYTHONPATH="$PWD" python3 benchmarks/bf16_train.py --device cuda --steps 50 --out "$out/bf16_train" 2>&1 | tee "$out/bf16_train.txt" || echo "step failed: see above" | tee -a "$out/failures.txt"
