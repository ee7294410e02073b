"""Forward+backward time and peak memory of ``chunked_lm_loss`` vs ``unchunked_lm_loss``, side by side.

    python benchmarks/loss.py [--tokens 4096 --hidden 2048 --vocab 248320 --chunk 1024 --repeats 2]
                              [--device cpu|cuda] [--dtype float32|bfloat16] [--compiled]

``--compiled`` adds a third column: the chunked loss with ``kernels.loss: compiled`` (its block epilogues as
``torch.compile``'d kernels; built in the untimed warm-up).

Each variant runs in a fresh subprocess of this script (``--variant``), so the peaks do not mix. CPU peak memory is
``ru_maxrss`` (peak RSS) of that subprocess; the delta subtracts the RSS measured after the inputs were created.
CUDA peak memory is ``torch.cuda.max_memory_allocated`` (the delta subtracts the allocation after the inputs).
"grad" is the size of the returned gradients (``dhidden`` + ``dw_head``), which any implementation must hold;
"workspace" = delta - grad is what the loss itself needs on top.

At the defaults (fp32) the unchunked reference peaks at about 13.6 GiB RSS on CPU (2 GiB head, two or three live
``[4096, 248320]`` fp32 tensors of 3.8 GiB: logits, log-softmax and their gradients, plus the 2 GiB head gradient);
the chunked one at about 5.1 GiB. Timings on a shared 2-core VM swing by 2x between repeats: use ``--rounds``.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 1024**3


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_variant(args) -> dict:
    import torch

    from q38.train.core.loss import chunked_lm_loss, unchunked_lm_loss

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen, device=device, dtype=dtype)
    w_head = (torch.randn(args.vocab, args.hidden, generator=gen, device=device) / args.hidden**0.5).to(dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen, device=device)
    targets[:: 16] = -100  # some padding
    normalizer = (targets != -100).sum()
    hidden.requires_grad_(True)
    w_head.requires_grad_(True)
    if args.variant in ("chunked", "compiled"):
        from q38.kernels import DEFAULT_KERNELS

        kernels = DEFAULT_KERNELS.replace(loss="torch" if args.variant == "chunked" else "compiled")

        def loss_fn():
            return chunked_lm_loss(hidden, w_head, targets, normalizer=normalizer, chunk_size=args.chunk,
                                   kernels=kernels)
    else:
        def loss_fn():
            return unchunked_lm_loss(hidden, w_head, targets, normalizer=normalizer)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    times = []
    for _ in range(args.warmup):  # untimed (the compiled variant builds its kernels here)
        loss_fn().backward()
    hidden.grad = None
    w_head.grad = None
    for _ in range(args.repeats):
        hidden.grad = None
        w_head.grad = None
        sync()
        t0 = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_rss_bytes()
    grad_bytes = sum(t.grad.numel() * t.grad.element_size() for t in (hidden, w_head))
    return {
        "variant": args.variant,
        "times": times,
        "peak": peak,
        "base": base,
        "grad_bytes": grad_bytes,
        "loss": loss.item(),
        "dx_norm": hidden.grad.float().norm().item(),
        "dw_norm": w_head.grad.float().norm().item(),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2, help="timed fwd+bwd per subprocess")
    p.add_argument("--rounds", type=int, default=1, help="subprocess pairs, alternating the variants")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--warmup", type=int, default=1, help="untimed fwd+bwd per subprocess before the timed ones")
    p.add_argument("--compiled", action="store_true",
                   help="also time the chunked loss with kernels.loss: compiled (torch.compile'd block epilogues)")
    p.add_argument("--variant", choices=["chunked", "unchunked", "compiled"],
                   help="internal: run one variant and print JSON")
    args = p.parse_args()

    if args.variant:
        print(json.dumps(run_variant(args)))
        return

    # rounds alternate the two subprocesses, so a slow phase of a shared machine hits both variants
    results = {}
    variants = ["unchunked", "chunked", "compiled"] if args.compiled else ["unchunked", "chunked"]
    for _ in range(args.rounds):
        for variant in list(variants):
            cmd = [sys.executable, __file__, *[a for a in sys.argv[1:] if a != "--compiled"], "--variant", variant]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                if variant != "compiled":
                    sys.exit(f"{variant} failed (rc={proc.returncode}):\n{proc.stderr}")
                # the optional column: report why and keep the others' table (one device run measures them all)
                print(f"compiled failed (rc={proc.returncode}); its column is left out:\n{proc.stderr[-4000:]}")
                variants.remove("compiled")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            if variant in results:  # merge: all times, the worst peak
                prev = results[variant]
                r["times"] = prev["times"] + r["times"]
                if prev["peak"] - prev["base"] > r["peak"] - r["base"]:
                    r["peak"], r["base"] = prev["peak"], prev["base"]
            results[variant] = r

    mem = "CUDA max_memory_allocated" if args.device == "cuda" else "peak RSS (ru_maxrss)"
    print(
        f"tokens={args.tokens} hidden={args.hidden} vocab={args.vocab} chunk={args.chunk} "
        f"repeats={args.repeats} rounds={args.rounds} device={args.device} dtype={args.dtype}; memory = {mem}"
    )
    rows = [
        ("fwd+bwd time, best [s]", lambda r: min(r["times"]), "{:.3f}"),
        ("fwd+bwd time, mean [s]", lambda r: sum(r["times"]) / len(r["times"]), "{:.3f}"),
        ("peak memory [GiB]", lambda r: r["peak"] / GiB, "{:.2f}"),
        ("peak - after inputs [GiB]", lambda r: (r["peak"] - r["base"]) / GiB, "{:.2f}"),
        ("  of which grads [GiB]", lambda r: r["grad_bytes"] / GiB, "{:.2f}"),
        ("  workspace = delta - grads [GiB]", lambda r: (r["peak"] - r["base"] - r["grad_bytes"]) / GiB, "{:.2f}"),
        ("loss", lambda r: r["loss"], "{:.6f}"),
        ("|dhidden|", lambda r: r["dx_norm"], "{:.6f}"),
        ("|dw_head|", lambda r: r["dw_norm"], "{:.6f}"),
    ]
    others = variants[1:]
    header = (f"| {'metric':<34} | " + " | ".join(f"{v:>10}" for v in variants) + " | "
              + " | ".join(f"{v + '/unchunked':>19}" for v in others) + " |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for name, get, fmt in rows:
        vals = {v: get(results[v]) for v in variants}
        u = vals["unchunked"]
        ratios = " | ".join(f"{(f'{vals[v] / u:.3f}' if u else '-'):>19}" for v in others)
        print(f"| {name:<34} | " + " | ".join(f"{fmt.format(vals[v]):>10}" for v in variants) + f" | {ratios} |")
    print("per-repeat times [s]: " + ", ".join(f"{v}: {[round(t, 3) for t in results[v]['times']]}" for v in results))


if __name__ == "__main__":
    main()
