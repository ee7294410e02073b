"""Whole training step, tokens/s and MFU: q38 ``train_step`` (torch GDN; FLA GDN where the registry allows it) vs a
transformers forward+backward+AdamW step on the same config and weights, side by side in one process.

    python benchmarks/train_step.py [--device cuda] [--dtype bfloat16] [--hidden 2048] [--layers 8] [--experts 64]
                                    [--top-k 8] [--batch 2] [--seq 4096] [--steps 5]

MFU = tokens/s × FLOPs per token (``q38.train.run.trainer.flops_per_token``: 6 · active params + attention) / the
device's dense 16-bit peak (``PEAK_FLOPS_16BIT``); printed only where the peak is known. Never asserted in tests.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import q38  # noqa: E402
from q38.kernels import KernelConfig, resolve_kernels  # noqa: E402
from q38.layers.kinds import count_by_kind  # noqa: E402
from q38.train.core.step_config import TrainConfig  # noqa: E402
from q38.train.core.state import init_state  # noqa: E402
from q38.train.core.step import train_step  # noqa: E402
from q38.train.run.trainer import flops_per_token, known_peak_flops  # noqa: E402


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, steps, device):
    fn()  # warm-up (autotuning, allocator)
    ts = []
    for _ in range(steps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    if args.layers < 4:  # every 4th layer is full attention
        ap.error("--layers must be at least 4: with no full-attention layer transformers' forward fails in its cache "
                 "(get_seq_length), so there would be no reference to compare with")
    dev, dtype = args.device, getattr(torch, args.dtype)
    cfg = q38.ModelConfig(
        model_type="qwen3_5_moe", vocab_size=32768, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=2, head_dim=128, linear_num_key_heads=8,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.hidden // 4,
        shared_expert_intermediate_size=args.hidden // 4, mtp_num_layers=0,
    )
    tokens = args.batch * args.seq
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev)
    batch = {"input_ids": ids, "labels": ids}
    fpt = flops_per_token(cfg, args.seq)
    peak = known_peak_flops(dev, args.dtype)
    kinds = ", ".join(f"{n} {name}" for name, n in count_by_kind(cfg).items() if n)
    print(f"config: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers ({kinds}), {cfg.num_experts} experts "
          f"top-{cfg.num_experts_per_tok}, {args.batch} × {args.seq} tokens, {dev}/{args.dtype}; "
          f"{fpt / 1e9:.2f} GFLOP/token; peak {peak}")
    rows = []
    tc = TrainConfig(lr=1e-4, total_steps=1000, loss_chunk_size=1024)
    state = init_state(cfg, tc, seed=0, device=dev, dtype=dtype)
    for gdn in ("torch", "fla"):
        try:
            kern = resolve_kernels(KernelConfig(gdn=gdn), device=dev, dtype=args.dtype)
        except q38.ConfigError as e:
            rows.append((f"q38 train_step, gdn={gdn}", None, f"refused: {e}"))
            continue
        holder = {"s": attrs.evolve(state, kernels=kern)}

        def step():
            holder["s"], m = train_step(holder["s"], batch)
            float(m.loss)

        try:
            rows.append((f"q38 train_step, gdn={kern.gdn}", timed(step, args.steps, dev), ""))
        except Exception as e:  # report and go on: the other rows are still worth having
            rows.append((f"q38 train_step, gdn={gdn}", None, f"failed: {type(e).__name__}: {e}"[:200]))
        del holder
    try:
        from transformers import Qwen3_5MoeForCausalLM

        from model import transformers_on_its_torch_path

        transformers_on_its_torch_path(str(dev))
        with tempfile.TemporaryDirectory() as d:
            q38.save_hf(d, cfg, q38.init_params(cfg, seed=0))
            hf = Qwen3_5MoeForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="sdpa").to(dev)
        hf.train()
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=dev.startswith("cuda"))

        def hf_step():
            out = hf(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        rows.append(("transformers fwd+bwd+AdamW", timed(hf_step, args.steps, dev), ""))
    except Exception as e:
        rows.append(("transformers fwd+bwd+AdamW", None, f"failed: {type(e).__name__}: {e}"[:200]))
    ref = next((t for n, t, _ in rows if n.startswith("transformers") and t), None)
    print(f"\n{'variant':<34}{'step (s)':>10}{'tokens/s':>12}{'MFU':>8}{'vs transformers':>17}")
    for name, t, note in rows:
        if t is None:
            print(f"{name:<34}{'—':>10}  {note}")
            continue
        tps = tokens / t
        mfu = f"{tps * fpt / peak:.3f}" if peak else "—"
        ratio = f"{t / ref:.3f}" if ref else "—"
        print(f"{name:<34}{t:>10.4f}{tps:>12.0f}{mfu:>8}{ratio:>17}")


if __name__ == "__main__":
    main()
