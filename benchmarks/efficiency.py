"""Measured kernel efficiencies in the form ``q38 plan --efficiencies`` reads: forward+backward of one kernel per
(op, implementation), its executed FLOPs counted as the plan counts them, achieved TFLOP/s, one JSON line each.

    python benchmarks/efficiency.py --device cuda --dtype bfloat16 --out eff.jsonl [--only matmul,experts]
    python benchmarks/efficiency.py ... --model qwen3_5_35b_a3b --tokens 16384 --local-experts 32 --seq 4096
    q38 plan --model qwen3_8_2_4t --layout qwen3_8_2_4t --world 1024 --hardware h200 --efficiencies eff.jsonl

Cases (shapes of one rank's work in a layer of ``--model``, default the 2.4T production layout's: 8192 tokens, 16
local experts, 8192-token rows; ``--small``: toy sizes for the CPU dry run of benchmarks/gpu.sh): ``matmul/torch``
(one d × d projection), ``experts/grouped_mm`` and ``experts/batched`` (``--local-experts`` experts of the model's
width, each with tokens × top-k / local experts rows), ``attention/sdpa`` (packed rows, a boolean document mask:
every (q, k) pair computed; at most 16 heads) and ``attention/eager``, ``gdn/torch`` (the torch chunked core, its executed FLOPs from
``q38.layers.kinds``' formula), ``loss/torch`` and ``loss/compiled`` (the chunked LM loss). Other kernels (flex,
varlen, FLA) append their own lines to the same file (``q38.parallel.efficiency.measured_line``). The JSON-lines
format: benchmarks/README.md#measured-kernel-efficiencies. A case that cannot run here prints why and writes
nothing.
"""

import argparse
import statistics
import sys
import time

import torch

SMALL = dict(tokens=256, d=64, f=64, experts=4, heads=2, head_dim=16, seq=256, docs=4, vocab=1000, chunk=128,
             slots=256, model="tiny")


def shapes(model: str, tokens: int, local_experts: int, seq: int) -> dict:
    """One rank's shapes in a layer of ``model``: ``tokens`` tokens, ``local_experts`` experts each receiving
    tokens × top-k / local_experts rows, attention over rows of ``seq`` (at most 16 heads: the masked kernels'
    score matrices must fit one device)."""
    from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)

    cfg = ModelConfig.preset(model)
    return {"tokens": tokens, "d": cfg.hidden_size, "f": cfg.moe_intermediate_size, "experts": local_experts,
            "heads": min(16, cfg.num_attention_heads), "head_dim": cfg.head_dim, "seq": seq, "docs": 4,
            "vocab": cfg.vocab_size, "chunk": 4096, "slots": tokens * cfg.num_experts_per_tok, "model": model}


def timed(fn, repeats: int, device: str) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def fwd_bwd(fn, inputs):
    def run():
        out = fn()
        torch.autograd.grad(out.float().sum(), inputs, allow_unused=True)

    return run


def cases(s: dict, dev: str, dt: torch.dtype):
    """(op, impl, run, executed FLOPs) per case; ``run`` is forward + backward."""
    import torch.nn.functional as F

    from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)
    from q38.layers.context import seq_info
    from q38.layers.kinds import MIXER_KINDS, Workload

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, dtype=torch.float32) * scale).to(dt).requires_grad_()

    n, d, f = s["tokens"], s["d"], s["f"]
    x, w = leaf(n, d), leaf(d, d, scale=d**-0.5)
    yield "matmul", "torch", fwd_bwd(lambda: F.linear(x, w), [x, w]), 3 * 2 * n * d * d

    e, m = s["experts"], s["slots"]
    counts = torch.full((e,), m // e, device=dev, dtype=torch.long)
    m = m // e * e
    xe, wgu, wd = leaf(m, d), leaf(e, 2 * f, d, scale=d**-0.5), leaf(e, d, f, scale=f**-0.5)
    wm = torch.rand(m, device=dev, dtype=dt)
    from q38.kernels import REGISTRY, _unsupported

    for impl in ("grouped_mm", "batched"):
        why = _unsupported("experts", impl, REGISTRY["experts"][impl], dev.split(":")[0], False, True, True,
                           str(dt).removeprefix("torch."))
        if why:
            print(f"experts/{impl}: skipped ({why})", file=sys.stderr)
            continue
        fn = REGISTRY["experts"][impl].load("experts", impl)
        yield "experts", impl, fwd_bwd(lambda fn=fn: fn(xe, counts, wgu, wd, wm), [xe, wgu, wd]), 3 * 2 * m * 3 * d * f

    h, c, sq = s["heads"], s["head_dim"], s["seq"]
    q, k, v = leaf(1, h, sq, c), leaf(1, h, sq, c), leaf(1, h, sq, c)
    from q38.layers.attention import AttentionMask

    doc = (torch.arange(sq, device=dev) // (sq // s["docs"]))[None]
    idx = torch.arange(sq, device=dev)[None]
    mask = AttentionMask(q_idx=idx, q_doc=doc, k_idx=idx, k_doc=doc)  # packed documents: sdpa/eager build it dense
    for impl in ("sdpa", "eager"):
        fn = REGISTRY["attention"][impl].load("attention", impl)
        # both compute every (q, k) pair under a mask: 4·s·t·h·c forward, twice that backward
        yield "attention", impl, fwd_bwd(lambda fn=fn: fn(q, k, v, mask, c**-0.5), [q, k, v]), 3 * 4 * sq * sq * h * c

    cfg = ModelConfig.preset(s["model"])
    H, Hk, a, p = (cfg.linear_num_value_heads, cfg.linear_num_key_heads, cfg.linear_key_head_dim,
                   cfg.linear_value_head_dim)
    gs = sq // 2
    gq, gk, gv = leaf(1, gs, Hk, a), leaf(1, gs, Hk, a), leaf(1, gs, H, p)
    g = (-torch.rand(1, gs, H, device=dev)).requires_grad_()
    beta = torch.rand(1, gs, H, device=dev, dtype=dt).requires_grad_()
    from q38.kernels import GDN_CHUNK, KernelConfig, resolve_kernels

    kc = resolve_kernels(KernelConfig(gdn="torch", gdn_chunk_size=GDN_CHUNK), device=dev.split(":")[0])
    info = seq_info(None, 1, gs, dev, kernels=kc)
    core = REGISTRY["gdn"]["torch"].load("gdn", "torch")
    fl = MIXER_KINDS["linear_attention"].flops(cfg, Workload(rows=1, seq=gs, gdn_chunk=GDN_CHUNK))
    gdn_flops = fl.terms["gdn_core"] + fl.terms["solve"] + fl.backward
    yield "gdn", "torch", fwd_bwd(lambda: core(gq, gk, gv, g, beta, info, chunk_size=GDN_CHUNK, backward="custom"),
                                  [gq, gk, gv, g, beta]), gdn_flops

    vocab, lt = s["vocab"], min(n, 4096)
    hid, wh = leaf(lt, d), leaf(vocab, d, scale=d**-0.5)
    tgt = torch.randint(0, vocab, (lt,), device=dev)
    for impl in ("torch", "compiled"):
        why = _unsupported("loss", impl, REGISTRY["loss"][impl], dev.split(":")[0], False, True, True)
        if impl == "compiled" and s is SMALL:
            why = "not at toy sizes (the dry run's loss step compiles it)"
        if why:
            print(f"loss/{impl}: skipped ({why})", file=sys.stderr)
            continue
        fn = REGISTRY["loss"][impl].load("loss", impl)
        # the chunked loss recomputes its logits in backward: 1 forward + 3 backward head products
        yield "loss", impl, fwd_bwd(lambda fn=fn: fn(hid, wh, tgt, s["chunk"], -100), [hid, wh]), 4 * 2 * lt * d * vocab


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", help="append the measured JSON lines to this file (benchmarks/README.md)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="toy sizes (the CPU dry run)")
    ap.add_argument("--only", default="", help="comma-separated ops (matmul, experts, attention, gdn, loss)")
    ap.add_argument("--label", default="", help="the device name written with each line (default: torch's)")
    ap.add_argument("--model", default="qwen3_8_2_4t", help="the model preset whose layer shapes are measured")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens a rank computes in one layer call")
    ap.add_argument("--local-experts", type=int, default=16, help="routed experts on a rank (num_experts / ep)")
    ap.add_argument("--seq", type=int, default=8192, help="tokens of one row on a rank (seq_len / cp)")
    args = ap.parse_args()
    from q38.parallel.efficiency import measured_line

    dev, dt = args.device, getattr(torch, args.dtype)
    name = args.label or (torch.cuda.get_device_name() if dev.startswith("cuda") else f"{dev} ({torch.__version__})")
    only = {o for o in args.only.split(",") if o}
    command = "python benchmarks/efficiency.py " + " ".join(sys.argv[1:])
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[args.dtype]
    lines = []
    print(f"{'op':<10} {'kernel':<11} {'fwd+bwd (s)':>12} {'FLOPs':>10} {'TFLOP/s':>9}   on {name}, {args.dtype}")
    s = SMALL if args.small else shapes(args.model, args.tokens, args.local_experts, args.seq)
    width = {"experts": s["f"]}
    for op, impl, run, flops in cases(s, dev, dt):
        if only and op not in only:
            continue
        try:
            t = timed(run, args.repeats, dev)
        except (RuntimeError, NotImplementedError) as e:  # a kernel this device refuses: say so, record nothing
            print(f"{op:<10} {impl:<11} failed: {' '.join(str(e).split())[:200]}")
            continue
        tf = flops / t / 1e12
        print(f"{op:<10} {impl:<11} {t:>12.5f} {flops:>10.3e} {tf:>9.3f}")
        lines.append(measured_line(op, impl, device=name, command=command, tflops=tf, dtype=short,
                                   width=width.get(op, s["d"])))
    if args.out:
        with open(args.out, "a") as fh:
            fh.write("".join(line + "\n" for line in lines))
        print(f"appended {len(lines)} line(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
