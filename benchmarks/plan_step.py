"""Predicted vs measured one-device step: ``q38 plan``'s budget (step time, peak memory) next to a real
``train_step`` on the same config.

    python benchmarks/plan_step.py [--device cuda] [--dtype bfloat16] [--hardware h200] [--gdn fla] [--recompute]

Measured: median wall time of ``--repeats`` steps after one warm-up (synchronised), and the allocator's peak
(``torch.cuda.max_memory_allocated``; on CPU the live-storage count of tests/mem_utils.py). Predicted:
q38/parallel/budget.py with the layout ``single`` on one device, every dtype as the run stores it. Prints a table of
both and the ratio; never asserted. On CPU the time prediction is meaningless (the profile is an accelerator's):
use it there only as a smoke test.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--gdn", default="torch")
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()

    from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)
    from q38.kernels import KernelConfig, resolve_kernels
    from q38.parallel.budget import Hardware, estimate
    from q38.parallel.layout import Layout
    from q38.train.core.step_config import TrainConfig
    from q38.train.core.optim import default_impl
    from q38.train.core.state import init_state
    from q38.train.core.step import train_step

    cfg = ModelConfig(
        model_type="qwen3_5_moe", vocab_size=32768, hidden_size=a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=a.experts,
        num_experts_per_tok=a.top_k, moe_intermediate_size=a.hidden // 2,
        shared_expert_intermediate_size=a.hidden // 2, mtp_num_layers=1,
    )
    # kernels are a run setting (q38.kernels), not a model field: the GDN core from --gdn, the rest torch / SDPA
    kernels = resolve_kernels(KernelConfig(gdn=a.gdn, causal_conv1d="torch", attention="sdpa"), device=a.device,
                              dtype=a.dtype)
    tc = TrainConfig(loss_chunk_size=1024, recompute=a.recompute)
    dtype = getattr(torch, a.dtype)
    state = init_state(cfg, tc, seed=0, device=a.device, dtype=dtype, kernels=kernels)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g).to(a.device)
    batch = {"input_ids": ids, "labels": ids}

    def sync():
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()

    def step_once():
        return train_step(state, batch)

    step_once()  # warm-up
    sync()
    if a.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(a.repeats):
        sync()
        t = time.perf_counter()
        step_once()
        sync()
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    if a.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated()
        del base
    else:
        from tests.mem_utils import PeakMemory

        with PeakMemory(state) as pm:
            step_once()
        peak = pm.peak
    name = {"bfloat16": "bf16", "float16": "fp16"}.get(a.dtype, "fp32")
    hw = Hardware.load(a.hardware)
    b = estimate(cfg, Layout.preset("single"), 1, seq_len=a.seq, rows_per_rank=a.batch,
                 recompute="full" if a.recompute else "none", param_dtype=name, reduce_dtype=name, master_dtype=name,
                 loss_chunk_tokens=1024, aux_global=False, hardware=hw, gdn_kernel=a.gdn != "torch",
                 adamw_impl=default_impl(torch.device(a.device)))
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    print(f"one-device step on {dev}: {a.layers} layers, d {a.hidden}, {a.experts} experts top-{a.top_k}, "
          f"{a.batch}×{a.seq} tokens, {a.dtype}, gdn {a.gdn}, recompute {a.recompute}; profile {hw.name}")
    print(f"| {'quantity':<22} | {'predicted':>12} | {'measured':>12} | {'ratio':>6} |")
    print(f"|{'-' * 24}|{'-' * 14}|{'-' * 14}|{'-' * 8}|")
    print(f"| {'step time (s)':<22} | {b.step_s:>12.4f} | {step:>12.4f} | {b.step_s / step:>6.3f} |")
    print(f"| {'peak memory (GiB)':<22} | {b.peak_bytes / 2**30:>12.3f} | {peak / 2**30:>12.3f} | "
          f"{b.peak_bytes / peak:>6.3f} |")
    tokens = a.batch * a.seq
    print(f"| {'tokens/s':<22} | {b.tokens_per_s:>12,.0f} | {tokens / step:>12,.0f} | "
          f"{b.tokens_per_s * step / tokens:>6.3f} |")
    mfu = b.flops.model / (step * hw.peak(name))
    print(f"measured MFU {100 * mfu:.1f}% (model FLOPs {b.flops.model:.3e} per step); predicted {100 * (b.mfu or 0):.1f}%"
          f"; achieved fraction of peak on executed FLOPs {b.flops.executed / step / hw.peak(name):.3f} "
          f"(profile assumes {hw.achievable_fraction})")


if __name__ == "__main__":
    main()
