#!/usr/bin/env bash
# The prepared device checks (H100 / H200), in two parts, each ONE device call of at most 10 minutes: the step
# limits of a part (seconds, the second argument of each `step`) add up to at most 570 s (tests/test_gpu_script.py
# sums them), leaving 30 s for the start; a failed or timed-out step is recorded in OUT_DIR/failures.txt and the
# next one runs.
#   calib  (the default): what `q38 plan` is calibrated with: the per-op table (benchmarks/efficiency.py) at the
#          shapes of the 2.4T layer and of the Qwen3.5-35B-A3B layer, attention and FLA GDN kernels, one whole
#          train_step of a small model with the plan's prediction beside it; all measured efficiencies in
#          OUT_DIR/efficiencies.jsonl (what `q38 plan --efficiencies` reads), then both plans priced with them.
#   checks: the device path's parity with the CPU fp32 reference (tests/test_cuda.py), FLA kernel parity, the loss,
#          model, compile and bf16-policy benchmarks, a profiler trace.
#
#   bash benchmarks/gpu_wheels.sh                        here, once: the wheels the device lacks, into .whl/ (~3 MB)
#   bash benchmarks/gpu.sh OUT_DIR [calib|checks]        there (device tool: carry [".whl"], OUT_DIR "$OUT")
#   Q38_GPU_SH=cpu bash benchmarks/gpu.sh OUT_DIR PART   here: every step at toy sizes on CPU in fp32 (the
#                                                        CUDA-only steps skipped, each named): checks the script and
#                                                        what it calls, measures nothing (tests/test_gpu_script.py)
set -euo pipefail
out="${1:?usage: benchmarks/gpu.sh OUT_DIR [calib|checks]}"
part="${2:-calib}"
mode="${Q38_GPU_SH:-cuda}"
if [[ $part != calib && $part != checks ]]; then
    echo "gpu.sh: the part must be calib (the default) or checks, got '$part'" >&2
    exit 2
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1
case "$mode" in
cuda)
    shopt -s nullglob
    wheels=(.whl/*.whl)
    shopt -u nullglob
    if ((${#wheels[@]} == 0)); then
        echo "gpu.sh: no wheels in .whl/ (q38 needs cattrs there): run 'bash benchmarks/gpu_wheels.sh' here first" \
            "and carry .whl" >&2
        exit 2
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
    export PYTHONPATH="/tmp/site:$PWD"
    nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
    dev=(--device cuda --dtype bfloat16)
    loss_size=(--tokens 16384 --hidden 4096 --vocab 248320)
    model_size=(--seq 4096 --batch 2 --hidden 1024 --experts 64 --top-k 8 --repeats 5)
    vs_chunk=128
    step_size=(--hidden 2048 --layers 8 --experts 64 --top-k 8 --batch 2 --seq 4096 --steps 5)
    plan_size=(--hardware h200 --repeats 5)
    plan_gdn=fla
    eff_size=()
    eff_35b=(--model qwen3_5_35b_a3b --tokens 16384 --local-experts 32 --seq 4096)
    bf16_steps=50
    test_device=cuda
    # one 16384-token row of 8 documents, 16 query / 1 kv heads × 256 (the production head shape, a quarter of its heads)
    attn_size=(--device cuda --dtype bfloat16 --seq 16384 --docs 8 --heads 16 --kv-heads 1 --head-dim 256 --repeats 5
        --rounds 2 --variants flex sdpa sdpa-causal varlen)
    ;;
cpu)
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    dev=(--device cpu --dtype float32)
    loss_size=(--tokens 256 --hidden 64 --vocab 1000 --chunk 128 --repeats 1)
    model_size=(--seq 128 --batch 1 --hidden 64 --experts 4 --top-k 2 --repeats 1)
    vs_chunk=16
    step_size=(--hidden 64 --layers 4 --experts 4 --top-k 2 --batch 1 --seq 128 --steps 2)
    plan_size=(--hardware h200 --repeats 1 --seq 128 --batch 1 --hidden 64 --layers 4 --experts 4 --top-k 2)
    plan_gdn=torch
    eff_size=(--small --repeats 1)
    eff_35b=(--model qwen3_5_35b_a3b)
    bf16_steps=3
    test_device=cpu
    # flex compiles for minutes on CPU and has no backward there: the SDPA variants only, to check the script
    attn_size=(--device cpu --dtype float32 --seq 256 --docs 4 --heads 4 --kv-heads 2 --head-dim 32 --repeats 1
        --rounds 1 --variants sdpa sdpa-causal)
    ;;
*)
    echo "gpu.sh: Q38_GPU_SH must be cuda (the device run) or cpu (the dry run here), got '$mode'" >&2
    exit 2
    ;;
esac

step() { # step NAME LIMIT_S CMD...: run CMD with a time limit (the device's; 4x on the CPU dry run, which measures
    # nothing and shares a loaded machine), output to OUT_DIR/NAME.txt
    local name="$1" limit="$2"
    [[ $mode == cpu ]] && limit=$((limit * 4))
    shift 2
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt" || echo "step $name failed or timed out (limit ${limit}s)" | tee -a "$out/failures.txt"
}
cuda_only() { # cuda_only NAME WHY: a step the CPU dry run cannot take, recorded as skipped
    echo "step $1 skipped on CPU: $2" | tee -a "$out/skipped.txt"
}

# first: q38 imports, the versions there, and what kernels.auto picks (and why FLA is or is not allowed); without
# it nothing below can run, so a failure here ends the script
python3 -m q38.cli kernels "${dev[@]}" 2>&1 | tee "$out/kernels.txt"
eff="$out/efficiencies.jsonl"

# ---- part calib -----------------------------------------------------------------------------------------------------
if [[ $part == calib ]]; then
    # measured kernel efficiencies, one JSON line per (op, kernel, width) in OUT_DIR/efficiencies.jsonl (the form q38
    # plan --efficiencies reads; benchmarks/README.md#measured-kernel-efficiencies): matmul, experts, masked SDPA /
    # eager attention, the torch GDN core, the chunked loss, at the 2.4T layer's shapes, then at the 35B-A3B's (its
    # lines carry their widths: the plan prices each model at the measurement nearest its shapes)
    step efficiency 120 python3 benchmarks/efficiency.py "${dev[@]}" "${eff_size[@]}" --out "$eff"
    step efficiency_35b 90 python3 benchmarks/efficiency.py "${dev[@]}" "${eff_size[@]}" "${eff_35b[@]}" --out "$eff"
    # attention on packed rows, fwd+bwd: flex (block mask) vs SDPA with the dense document mask, SDPA causal (one
    # document per row: the flash bound) and varlen; appends the measured TFLOP/s per kernel to efficiencies.jsonl
    step attention 90 python3 benchmarks/attention.py "${attn_size[@]}" --backward --json "$eff"
    # the GDN core as a run calls it, FLA vs torch, on packed rows and on one CP rank's shard: one JSON line per
    # (layout, impl) with the useful TFLOP/s, for the hardware profile
    if [[ $mode == cuda ]]; then
        step gdn_layouts 60 python3 benchmarks/gdn_layouts.py "${dev[@]}" --batch 2 --seq 4096 --docs 8 --heads 16 \
            --key-heads 16 --head-dim 128 --repeats 5
    else
        step gdn_layouts 60 python3 benchmarks/gdn_layouts.py "${dev[@]}" --batch 1 --seq 128 --docs 2 --heads 2 \
            --key-heads 1 --head-dim 32 --repeats 1 --impls torch
    fi
    grep -h '"tflops"' "$out/gdn_layouts.txt" >> "$eff" || true  # the GDN lines, for q38 plan
    # one whole train_step of a small model (bf16, hidden 2048, 8 layers, 64 experts top-8, 2 x 4096): tokens/s and
    # MFU with the torch and FLA GDN cores and transformers; then q38 plan's predicted one-GPU step time and peak
    # memory beside a measured train_step (the check of the plan as a whole)
    step train_step 90 python3 benchmarks/train_step.py "${dev[@]}" "${step_size[@]}"
    step plan_step 45 python3 benchmarks/plan_step.py "${dev[@]}" "${plan_size[@]}" --gdn "$plan_gdn"
    # both plans with what was measured over the profile's published and assumed ranges (per-op table, ranges)
    step plan_measured 20 python3 -m q38.cli plan --model qwen3_8_2_4t --layout qwen3_8_2_4t --world 1024 \
        --hardware h200 --efficiencies "$eff"
    step plan_35b_measured 20 python3 -m q38.cli plan --model qwen3_5_35b_a3b --layout fsdp_ep --mesh ep=8 \
        --world 16 --hardware h100 --seq-len 4096 --global-batch 512 --dtype bf16 --micro-batches 8 \
        --recompute selective_attention+gdn --efficiencies "$eff"
fi

# ---- part checks ----------------------------------------------------------------------------------------------------
if [[ $part == checks ]]; then
    # the device path against the CPU fp32 reference: each layer family and a bf16 train_step (tests/test_cuda.py,
    # -s: each case prints its measured relative errors for the record; a UserWarning is reported there, not turned
    # into a failure as in CI)
    step cuda_tests 60 env Q38_TEST_DEVICE="$test_device" python3 -m pytest -q -s -p no:cacheprovider \
        -W default::UserWarning -rs tests/test_cuda.py
    if [[ $mode == cuda ]]; then
        step gdn_kernel 60 python3 benchmarks/gdn_kernel.py
    else
        cuda_only gdn_kernel "FLA's kernels need CUDA"
    fi
    # chunked loss vs unchunked, eager and compiled block epilogues (kernels.loss: torch / compiled; goal <= 1.2)
    step loss 80 python3 benchmarks/loss.py "${dev[@]}" "${loss_size[@]}" --compiled
    # q38 vs transformers fwd+bwd (kernels: auto -> experts grouped_mm on bf16 CUDA); torch GDN (auto chunk 64, and
    # 128 in the same interleaved loop: kernels.gdn_chunk_size's accelerator default is not measured yet), then FLA
    step model_torch_gdn 60 python3 benchmarks/model.py "${dev[@]}" "${model_size[@]}" --layers --vs-gdn-chunk "$vs_chunk"
    if [[ $mode == cuda ]]; then
        step model_fla_gdn 45 python3 benchmarks/model.py "${dev[@]}" "${model_size[@]}" --gdn fla
        # compiled vs eager decoder blocks (kernels.block), fwd+bwd of one GDN layer and one attention layer: one JSON
        # line each ({"op": "block", "impl": "compiled", "ref": "eager", "layer": ..., "ratio": ...}); the compile
        # itself is excluded
        step compile_block 90 python3 benchmarks/compile.py "${dev[@]}" --seq 4096 --batch 2 --hidden 1024 \
            --experts 64 --top-k 8 --repeats 3 --what gdn,attention --json
    else
        cuda_only model_fla_gdn "kernels.gdn: fla runs on CUDA only"
        cuda_only compile_block "compiling takes minutes on this CPU (benchmarks/compile.py measures it here, README)"
    fi
    step plan_step_recompute 45 python3 benchmarks/plan_step.py "${dev[@]}" "${plan_size[@]}" --gdn "$plan_gdn" \
        --recompute
    # bf16 mixed-precision policy: the tiny run on the device (bf16 compute, fp32 masters) vs the CPU fp32 losses
    step bf16_train 60 python3 benchmarks/bf16_train.py --device "${dev[1]}" --steps "$bf16_steps" \
        --out "$out/bf16_train"
    # run.profile (issue 27): a trace of 2 steps of the embedded run, with memory (on CUDA also the allocator's history)
    step profile_memory 60 python3 -m q38.cli train --set run.device="$test_device" --set run.steps=4 \
        --set run.eval_every=0 --set "run.profile={start: 2, steps: 2, memory: true}" \
        --set run.out_dir="$out/profile_run" --set run.progress=false
    ls -l "$out/profile_run/profile" 2>&1 | tee "$out/profile_files.txt"
fi
