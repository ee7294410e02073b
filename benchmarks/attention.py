"""Attention over packed rows: ``kernels.attention: flex`` (compiled FlexAttention over a block mask) vs ``sdpa`` (SDPA
with the dense ``[b, 1, s, t]`` document mask, kv heads repeated), forward time and peak memory, side by side.

    python benchmarks/attention.py [--seq 4096] [--docs 8] [--heads 8] [--kv-heads 2] [--head-dim 128]
                                   [--dtype float32] [--repeats 5] [--rounds 2]

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

VARIANTS = ("flex", "sdpa", "sdpa-causal")
MiB = 2**20


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_variant(args) -> dict:
    from q38.layers.attention import AttentionMask, flex_attention, sdpa_attention

    torch.manual_seed(0)
    dt = getattr(torch, args.dtype)
    b, s = 1, args.seq
    q = torch.randn(b, args.heads, s, args.head_dim, dtype=dt)
    k, v = (torch.randn(b, args.kv_heads, s, args.head_dim, dtype=dt) for _ in range(2))
    idx = torch.arange(s).expand(b, s)
    doc = (idx * args.docs // s).contiguous()  # --docs documents of equal length
    mask = AttentionMask(idx, doc, idx, doc)
    fn = {
        "flex": lambda: flex_attention(q, k, v, mask, args.head_dim**-0.5),
        "sdpa": lambda: sdpa_attention(q, k, v, mask, args.head_dim**-0.5),
        "sdpa-causal": lambda: sdpa_attention(q, k, v, None, args.head_dim**-0.5),
    }[args.variant]
    with torch.no_grad():
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
    ap.add_argument("--variant", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant is not None:
        print(json.dumps(run_variant(args)))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", v], env=env, check=True,
                                 capture_output=True, text=True).stdout
            results[v].append(json.loads(out.strip().splitlines()[-1]))
    print(f"torch {torch.__version__}; seq {args.seq}, {args.docs} documents, {args.heads} query / {args.kv_heads} kv "
          f"heads × {args.head_dim}, {args.dtype}, batch 1, forward (no_grad), {args.rounds} rounds × median of "
          f"{args.repeats}")
    ref = statistics.median(x["time"] for x in results["sdpa"])
    print(f"{'variant':<13}{'time [ms]':>11}{'× sdpa':>9}{'peak [MiB]':>12}{'first call [s]':>16}")
    for v in VARIANTS:
        t = statistics.median(x["time"] for x in results[v])
        peak = max(x["peak"] for x in results[v])
        first = max(x["first"] for x in results[v])
        print(f"{v:<13}{t * 1e3:>11.1f}{t / ref:>9.3f}{peak / MiB:>12.1f}{first:>16.1f}")


if __name__ == "__main__":
    main()
