"""Forward+backward time of q38 vs the transformers reference on the same config and weights, side by side.

    python benchmarks/model.py [--device cpu|cuda] [--dtype float32|bfloat16] [--seq 512] [--batch 2] [--repeats 3]
                               [--rounds 1] [--layers]

Prints a table of both timings and the ratio q38 / transformers (goal: ≤ 0.5). Never asserted in tests.
``--malloc tuned`` applies the CPU allocator setting ``q38 train`` uses (process-wide: both sides get it).
"""

import argparse
import statistics
import tempfile
import time

import torch

import q38


def bench_config(args) -> q38.ModelConfig:
    return q38.ModelConfig(
        model_type="qwen3_5_moe", vocab_size=4096, hidden_size=args.hidden, num_hidden_layers=args.num_layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.hidden // 2,
        shared_expert_intermediate_size=args.hidden // 2, mtp_num_layers=0,
    )


def timeit_pair(fa, fb, repeats, device, *more, pairs: list | None = None):
    """Median seconds of ``fa``, of ``fb`` (and of each of ``more``), called in turn (A, B, A, B, ...) so that load
    on a shared machine hits every side alike; one warm-up call each. ``pairs`` (a list) receives ``fa``'s time over
    the ``fb`` call right after it, per repeat."""
    fns = (fa, fb, *more)
    for fn in fns:
        fn()
    times = tuple([] for _ in fns)
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t)
        if pairs is not None:
            pairs.append(times[0][-1] / times[1][-1])
    return tuple(statistics.median(t) for t in times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--num-layers", type=int, default=4, help="every 4th layer is full attention, the rest GDN")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--experts-kernel", default="auto", help="kernels.experts (auto | grouped_mm | batched)")
    ap.add_argument("--gdn", default="torch", help="kernels.gdn (torch | fla)")
    ap.add_argument("--gdn-chunk", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="kernels.gdn_chunk_size (auto: 32 on CPU at these head dims, 64 elsewhere)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the whole-model comparison this many times in the same process and print each "
                         "round's ratio with their median and range (the machine's drift shows as spread)")
    ap.add_argument("--malloc", choices=("default", "tuned"), default="default",
                    help="tuned: glibc mallopt as `q38 train` sets it on CPU (q38.train.run.launch.tune_cpu_allocator), "
                         "for both sides alike")
    ap.add_argument("--layers", action="store_true", help="also time each layer family on the same input")
    ap.add_argument("--vs-gdn-chunk", type=int, default=None,
                    help="also time q38 with this kernels.gdn_chunk_size in the same interleaved loop (an A/B of the "
                         "chunk length; printed as its own row)")
    args = ap.parse_args()
    from q38.kernels import KernelConfig, resolve_kernels
    from q38.train.run.launch import tune_cpu_allocator

    if args.malloc == "tuned":
        print(tune_cpu_allocator() or "malloc: not glibc, left as it is")

    kernels = resolve_kernels(KernelConfig(gdn=args.gdn, causal_conv1d="torch", attention="sdpa",
                                           experts=args.experts_kernel, gdn_chunk_size=args.gdn_chunk),
                               device=args.device, dtype=args.dtype, model=bench_config(args))
    print(f"kernels: {kernels.to_dict()}")
    run(args, kernels, None if args.vs_gdn_chunk is None else kernels.replace(gdn_chunk_size=args.vs_gdn_chunk))


def transformers_on_its_torch_path(device: str) -> None:
    """Off CUDA, transformers' Qwen3.5 reference runs its own torch gated delta rule even where flash-linear-attention
    is installed (it swaps FLA's Triton kernels in whenever ``fla`` imports; they need a GPU)."""
    if device.startswith("cuda"):
        return
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
               "causal_conv1d_update"):
        f = getattr(m, fn, None)
        if f is not None and hasattr(f, "__wrapped__"):
            setattr(m, fn, f.__wrapped__)


def run(args, kernels, other_kernels=None):
    from transformers import Qwen3_5MoeForCausalLM

    transformers_on_its_torch_path(args.device)

    from q38.layers.context import seq_info

    dtype = getattr(torch, args.dtype)
    cfg = bench_config(args)
    params = q38.init_params(cfg, seed=0, device=args.device, dtype=dtype)
    with tempfile.TemporaryDirectory() as d:
        q38.save_hf(d, cfg, q38.init_params(cfg, seed=0))
        hf = Qwen3_5MoeForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="sdpa").to(args.device)
    hf.train()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=args.device)
    leaves = [t.requires_grad_() for t in torch.utils._pytree.tree_leaves(params)]

    def run_q38(kc=kernels):
        out = q38.forward(params, ids, cfg, info=seq_info(None, args.batch, args.seq, args.device, kernels=kc))
        loss = (out.hidden.float() ** 2).mean()
        torch.autograd.grad(loss, leaves, allow_unused=True)

    def run_hf():
        out = hf.model(input_ids=ids)
        loss = (out.last_hidden_state.float() ** 2).mean()
        torch.autograd.grad(loss, [p for p in hf.model.parameters()], allow_unused=True)

    def run_other():
        run_q38(other_kernels)

    more = () if other_kernels is None else (run_other,)
    pairs: list[float] = []
    rounds = [timeit_pair(run_q38, run_hf, args.repeats, args.device, *more, pairs=pairs) for _ in range(args.rounds)]
    t_q, t_h, *t_o = sorted(rounds, key=lambda r: r[0] / r[1])[len(rounds) // 2]  # the median round
    print(f"config: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers} "
          f"({cfg.layer_types.count('linear_attention')} GDN + {cfg.layer_types.count('full_attention')} attn), experts "
          f"{cfg.num_experts} top-{cfg.num_experts_per_tok}, batch {args.batch} × seq {args.seq}, {args.device}/{args.dtype}")
    print(f"{'implementation':<28}{'fwd+bwd (s)':>14}")
    print(f"{'q38':<28}{t_q:>14.4f}")
    print(f"{'transformers (reference)':<28}{t_h:>14.4f}")
    print(f"{'ratio q38 / transformers':<28}{t_q / t_h:>14.3f}")
    if t_o:
        other = f"q38, gdn_chunk_size {other_kernels.gdn_chunk_size}"
        print(f"{other:<28}{t_o[0]:>14.4f}   ratio {t_o[0] / t_h:.3f}; q38 / this: {t_q / t_o[0]:.3f}")
    if len(rounds) > 1:
        ratios = [r[0] / r[1] for r in rounds]
        print(f"rounds: {', '.join(f'{r:.3f}' for r in ratios)} (median {sorted(ratios)[len(ratios) // 2]:.3f}, "
              f"range {min(ratios):.3f}–{max(ratios):.3f}; the table above is the median round)")
        if other_kernels is not None:
            vs = sorted(r[0] / r[2] for r in rounds)
            print(f"rounds, q38 / q38 with gdn_chunk_size {other_kernels.gdn_chunk_size}: "
                  f"{', '.join(f'{r[0] / r[2]:.3f}' for r in rounds)} (median {vs[len(vs) // 2]:.3f})")
    qs = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
    print(f"paired: each q38 call / the transformers call right after it, over all {len(pairs)} pairs: median "
          f"{qs[1]:.3f} (quartiles {qs[0]:.3f}–{qs[2]:.3f}; slow drift of the machine's load cancels in each pair)")
    if args.layers:
        per_layer(args, cfg, params, hf, dtype, kernels)


def per_layer(args, cfg, params, hf, dtype, kernels):
    """fwd+bwd of one GDN, attention and MoE layer of each implementation on the same random input."""
    from q38.layers.attention import attention_apply
    from q38.layers.context import seq_info
    from q38.layers.gdn import gdn_apply
    from q38.layers.moe import moe_apply

    b, s, d = args.batch, args.seq, cfg.hidden_size
    x = torch.randn(b, s, d, device=args.device, dtype=dtype, requires_grad=True)
    info = seq_info(None, b, s, args.device, kernels=kernels)
    gdn_i = cfg.layer_types.index("linear_attention")
    att_i = cfg.layer_types.index("full_attention")
    # text positions as the (3, b, s) multimodal-RoPE ids transformers' Qwen3.5 rotary module takes (5.17 requires
    # the 3-d form; 5.23 also takes (b, s) and expands it to the same)
    pos = hf.model.rotary_emb(x, torch.arange(s, device=args.device)[None, None].expand(3, b, s))

    def fb(fn):
        return lambda: fn().float().sum().backward()

    rows = [
        ("GDN layer", fb(lambda: gdn_apply(params.layers[gdn_i].mixer, x, cfg, info)),
         fb(lambda: hf.model.layers[gdn_i].linear_attn(x))),
        ("attention layer", fb(lambda: attention_apply(params.layers[att_i].mixer, x, cfg, info)),
         fb(lambda: hf.model.layers[att_i].self_attn(x, pos, None)[0])),
        ("MoE layer", fb(lambda: moe_apply(params.layers[0].moe, x, cfg, kernels=kernels)[0]),
         fb(lambda: hf.model.layers[0].mlp(x))),
    ]
    print(f"\n{'layer (fwd+bwd)':<28}{'q38 (s)':>12}{'transformers (s)':>18}{'ratio':>8}")
    for name, fq, fh in rows:
        tq, th = timeit_pair(fq, fh, args.repeats, args.device)
        print(f"{name:<28}{tq:>12.4f}{th:>18.4f}{tq / th:>8.3f}")


if __name__ == "__main__":
    main()
