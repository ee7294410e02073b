"""Compiled vs eager decoder blocks (``kernels.block``): forward+backward time of one GDN layer, one attention layer
or the whole model, side by side in one process, and the ratio compiled / eager.

    python benchmarks/compile.py [--device cpu|cuda] [--dtype float32|bfloat16] [--seq 512] [--batch 2]
                                 [--what gdn,attention,model] [--repeats 5] [--json]

The first compiled call (the compile, minutes on a loaded CPU) is excluded: one warm-up call each. Prints a table;
``--json`` prints one JSON line per case instead (``{"op": "block", "impl": "compiled", "layer": ..., "ratio":
compiled / eager, "ref": "eager", ...}``, read by ``benchmarks/gpu.sh``'s callers). Never asserted in tests.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import bench_config, timeit_pair  # noqa: E402

import q38  # noqa: E402
from q38.kernels import resolve_kernels, KernelConfig  # noqa: E402
from q38.layers.block import layer_apply  # noqa: E402
from q38.layers.context import seq_info  # noqa: E402
from q38.pytree import tree_leaves, tree_map  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--what", default="gdn,attention,model")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--docs", type=int, default=4, help="documents packed per row")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    cfg = bench_config(args)
    params = tree_map(lambda t: t.to(args.device, dtype), q38.init_params(cfg, seed=0))
    b, s = args.batch, args.seq
    doc = (torch.arange(s, device=args.device) * args.docs // s).expand(b, s).contiguous()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, cfg.hidden_size, generator=gen).to(args.device, dtype)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen).to(args.device)
    eager_k = resolve_kernels(KernelConfig(block="eager"), device=args.device, dtype=args.dtype, model=cfg)
    # the same kernels but the block (grouped_mm is not traceable in fp32: both sides then run the padded experts)
    comp_k = resolve_kernels(KernelConfig(block="compiled"), device=args.device, dtype=args.dtype, model=cfg)
    eager_k = eager_k.replace(experts=comp_k.experts)

    def layer_case(kind):
        lp = params.layers[cfg.layer_types.index(kind)]

        def run(kc):
            apply = kc.fn("block")(layer_apply)
            info = seq_info(doc, b, s, args.device, kernels=kc)

            def step():
                p = tree_map(lambda t: t.detach().requires_grad_(), lp)
                xi = x.detach().requires_grad_()
                y, logits = apply(p, xi, cfg, info)
                torch.autograd.grad(y.float().square().sum() + logits.float().sum(), [xi, *tree_leaves(p)])
            return step
        return run

    def model_case():
        def run(kc):
            info = seq_info(doc, b, s, args.device, kernels=kc)

            def step():
                p = tree_map(lambda t: t.detach().requires_grad_(), params)
                h = q38.forward(p, ids, cfg, info=info).hidden
                torch.autograd.grad(h.float().square().sum(), tree_leaves(p), allow_unused=True)
            return step
        return run

    cases = {"gdn": lambda: layer_case("linear_attention"), "attention": lambda: layer_case("full_attention"),
             "model": model_case}
    rows = []
    for what in args.what.split(","):
        run = cases[what]()
        t_compiled, t_eager = timeit_pair(run(comp_k), run(eager_k), args.repeats, args.device)
        rows.append((what, t_eager, t_compiled))
        if args.json:
            print(json.dumps({"op": "block", "impl": "compiled", "ref": "eager", "layer": what,
                              "ratio": round(t_compiled / t_eager, 4), "seconds": round(t_compiled, 6),
                              "ref_seconds": round(t_eager, 6), "device": args.device, "dtype": args.dtype,
                              "seq": s, "batch": b}), flush=True)
    if not args.json:
        print(f"{args.device} {args.dtype}, batch {b} x seq {s} ({args.docs} documents per row), hidden "
              f"{cfg.hidden_size}, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, experts={comp_k.experts}")
        print("| case | eager fwd+bwd (s) | compiled fwd+bwd (s) | compiled / eager |")
        print("|---|---|---|---|")
        for what, te, tc in rows:
            print(f"| {what} | {te:.4f} | {tc:.4f} | {tc / te:.3f} |")


if __name__ == "__main__":
    main()
