"""Attention over packed rows: ``kernels.attention: flex`` (compiled FlexAttention over a block mask) vs ``sdpa`` (SDPA
with the dense ``[b, 1, s, t]`` document mask, kv heads repeated), time and peak memory, side by side.

    python benchmarks/attention.py [--seq 4096] [--docs 8] [--heads 8] [--kv-heads 2] [--head-dim 128]
                                   [--dtype float32] [--repeats 5] [--rounds 2] [--variants flex sdpa sdpa-causal]
    python benchmarks/attention.py --device cuda --dtype bfloat16 --backward [--variants ... varlen]
                                   [--json OUT/efficiencies.jsonl]

CPU: forward only (torch has no FlexAttention backward there). CUDA (``benchmarks/gpu.sh``): forward+backward, the
peak is ``torch.cuda.max_memory_allocated`` over the allocation before the call, every variant in this process
(alternating per round), and ``--json`` appends one line per variant in the form the hardware profile reads:
``{"op": "attention", "impl": <kernels.attention name>, "layout": "packed" | "unpacked", "dtype", "device",
"tflops", "flops", "time_s", "ref": "sdpa", "vs_ref", "shape": {...}, "source"}``. ``flops`` counts what ``q38 plan``
prices for attention (4·h·c per query-key pair over the causal row, documents not subtracted; × 3 with the backward),
so ``tflops`` / peak is the efficiency the plan should use for that kernel on packed rows.

Both run q38's own implementation callables (``q38.layers.attention.flex_attention`` / ``sdpa_attention``) on the
same ``AttentionMask`` (one row of ``--docs`` equal documents), under ``torch.no_grad`` (FlexAttention has no backward
on CPU). ``sdpa-causal`` is SDPA with ``is_causal`` and no document mask: wrong for packed rows (a query sees the
earlier documents), shown only as the flash-kernel bound. Each variant runs in its own subprocess per round
(``--variant``): it compiles / warms up first, then resets the peak RSS (``/proc/self/clear_refs``), and the peak
printed is the growth of the peak RSS over the RSS before the timed forward, with glibc's mmap threshold pinned at
64 KiB (``MALLOC_MMAP_THRESHOLD_``) so large blocks go back to the OS when freed and RSS follows the live tensors.
Time: the median of ``--repeats`` forwards, then the median over rounds; rounds alternate the variants.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

VARIANTS = ("flex", "sdpa", "sdpa-causal", "varlen")
# per variant: (kernels.attention implementation, row layout it stands for)
IMPL = {"flex": ("flex", "packed"), "sdpa": ("sdpa", "packed"), "sdpa-causal": ("sdpa", "unpacked"),
        "varlen": ("varlen", "packed")}
MiB = 2**20


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _setup(args, variant: str):
    """The inputs and the call of ``variant`` (one row of ``--docs`` equal documents)."""
    from q38.layers.attention import AttentionMask, flex_attention, sdpa_attention, varlen_attention

    torch.manual_seed(0)
    dt, dev = getattr(torch, args.dtype), torch.device(args.device)
    b, s = 1, args.seq
    q = torch.randn(b, args.heads, s, args.head_dim, dtype=dt, device=dev, requires_grad=args.backward)
    k, v = (torch.randn(b, args.kv_heads, s, args.head_dim, dtype=dt, device=dev, requires_grad=args.backward)
            for _ in range(2))
    idx = torch.arange(s, device=dev).expand(b, s)
    doc = (idx * args.docs // s).contiguous()  # --docs documents of equal length
    mask = AttentionMask(idx, doc, idx, doc)
    attn = {"flex": flex_attention, "sdpa": sdpa_attention, "sdpa-causal": sdpa_attention,
            "varlen": varlen_attention}[variant]
    m = None if variant == "sdpa-causal" else mask
    dy = torch.randn_like(q)

    def call():
        o = attn(q, k, v, m, args.head_dim**-0.5)
        if args.backward:
            torch.autograd.grad(o, (q, k, v), dy)

    return call


def _sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def run_variant(args) -> dict:
    """CPU, in a subprocess of its own: warm-up (compile), then the peak RSS growth of one call and the median time."""
    fn = _setup(args, args.variant)
    with torch.enable_grad() if args.backward else torch.no_grad():
        t0 = time.perf_counter()
        fn()  # compile (flex) / warm up
        first = time.perf_counter() - t0
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS
        base = _rss("VmRSS")
        fn()
        peak = _rss("VmHWM") - base
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return {"first": first, "time": statistics.median(times), "peak": peak}


def run_cuda(args, variants, failed: dict[str, str]) -> dict[str, list[dict]]:
    """Every variant in this process: warm-up, the allocation peak of one call, then ``--repeats`` timed calls;
    ``--rounds`` rounds, alternating the order."""
    calls = {v: _setup(args, v) for v in variants}
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            if v in failed:
                continue
            fn = calls[v]
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as e:  # one kernel that cannot run here must not cost the others their measurement
                failed[v] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                print(f"{v}: failed: {failed[v]}")
                continue
            _sync(args)
            first = time.perf_counter() - t0
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            _sync(args)
            peak = torch.cuda.max_memory_allocated() - base
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                _sync(args)
                times.append(time.perf_counter() - t0)
            results[v].append({"first": first, "time": statistics.median(times), "peak": peak})
    return results


def plan_flops(args) -> float:
    """What ``q38 plan`` counts for this call: 4·h·c per (query, key) pair of the causal row (``layers.kinds``'
    attention term), × 3 with the backward."""
    pairs = args.seq * (args.seq + 1) / 2
    return 4 * args.heads * args.head_dim * pairs * (3 if args.backward else 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--backward", action="store_true", help="forward+backward (CUDA only: flex has none on CPU)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=["flex", "sdpa", "sdpa-causal"])
    ap.add_argument("--json", default=None, help="append one efficiency line per variant to this file (JSON lines)")
    ap.add_argument("--variant", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.backward and args.device == "cpu" and "flex" in args.variants:
        ap.error("--backward with flex needs --device cuda (torch has no FlexAttention backward on CPU)")
    if args.variant is not None:
        print(json.dumps(run_variant(args)))
        return
    variants = tuple(args.variants)
    if args.device == "cuda":
        failed: dict[str, str] = {}
        results = run_cuda(args, variants, failed)
        variants = tuple(v for v in variants if v not in failed)
        mem = "CUDA max_memory_allocated growth"
    else:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        argv = [a for a in sys.argv[1:]]
        results = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in (variants if r % 2 == 0 else variants[::-1]):
                out = subprocess.run([sys.executable, __file__, *argv, "--variant", v], env=env, check=True,
                                     capture_output=True, text=True).stdout
                results[v].append(json.loads(out.strip().splitlines()[-1]))
        mem = "peak RSS growth"
    what = "forward+backward" if args.backward else "forward (no_grad)"
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}; {dev}; seq {args.seq}, {args.docs} documents, {args.heads} query / "
          f"{args.kv_heads} kv heads × {args.head_dim}, {args.dtype}, batch 1, {what}, {args.rounds} rounds × median "
          f"of {args.repeats}; peak: {mem}")
    times = {v: statistics.median(x["time"] for x in results[v]) for v in variants}
    ref = times.get("sdpa")
    flops = plan_flops(args)
    print(f"{'variant':<13}{'time [ms]':>11}{'× sdpa':>9}{'peak [MiB]':>12}{'first call [s]':>16}{'TFLOP/s':>10}")
    lines = []
    for v in variants:
        t = times[v]
        peak = max(x["peak"] for x in results[v])
        first = max(x["first"] for x in results[v])
        rel = f"{t / ref:>9.3f}" if ref else f"{'-':>9}"
        print(f"{v:<13}{t * 1e3:>11.1f}{rel}{peak / MiB:>12.1f}{first:>16.1f}{flops / t / 1e12:>10.2f}")
        impl, layout = IMPL[v]
        lines.append({"op": "attention", "impl": impl, "layout": layout, "dtype": args.dtype, "device": dev,
                      "tflops": flops / t / 1e12, "flops": flops, "time_s": t, "ref": "sdpa",
                      "vs_ref": (ref / t) if ref else None, "peak_bytes": peak,
                      "shape": {"seq": args.seq, "docs": args.docs, "heads": args.heads, "kv_heads": args.kv_heads,
                                "head_dim": args.head_dim, "batch": 1, "backward": args.backward},
                      "source": "benchmarks/attention.py " + " ".join(a for a in sys.argv[1:])})
    if args.json:
        with open(args.json, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
