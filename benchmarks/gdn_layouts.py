"""The GDN core as a run calls it (``kernels.gdn``: ``fla`` vs ``torch``) on packed rows and on one CP rank's shard,
forward+backward time side by side, one JSON line per (layout, implementation).

    python benchmarks/gdn_layouts.py [--device cuda] [--dtype bfloat16] [--batch 2] [--seq 4096] [--docs 8]
                                     [--heads 16] [--key-heads 16] [--head-dim 128] [--repeats 5] [--impls fla,torch]

Layouts: ``packed`` (``--docs`` documents per row, through ``cu_seqlens`` for FLA, the document mask for torch) and
``cp`` (one CP rank's share: the same packed shard run through the exact state carry, ``a`` extra value columns
with an identity initial state; the carry's collectives are replaced by an in-process comm that hands every rank a
zero incoming state, so the time is the rank's compute only).

Each line: ``{"op": "gdn", "impl": "fla"|"torch", "layout": "packed"|"cp", "tflops": ..., "ref": "torch",
"ref_tflops": ..., "seconds": ..., ...}``. ``tflops`` counts the useful forward+backward FLOPs of the core (three
times the forward, ``q38 plan``'s model-FLOP convention for ``gdn_core``, without the CP extra columns) over the
measured time: the efficiency a hardware profile can record for (gdn, impl). ``ref`` is the torch core, measured in
the same run (the FLA line repeats its numbers as ``ref_tflops``). Never asserted in tests.
"""

import argparse
import json
import sys
import statistics
import time

import torch
import torch.nn.functional as F

from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)
from q38.kernels import DEFAULT_KERNELS, GDN_CHUNK
from q38.layers.context import LocalSeqComm, SeqInfo
from q38.layers.gdn import gdn_core_fla, gdn_core_torch
from q38.layers.cost import Workload
from q38.layers.gdn_cost import gdn_flops
from q38.layers.rope import positions_from_docs


class OneRankCP(LocalSeqComm):
    """The CP code path on one process: ``is_local`` False so the core runs the carry's augmented form; exchanges
    complete at once and the carry hands this rank a zero initial state (compute only, no collectives)."""

    is_local = False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16, help="value heads")
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impls", default="fla,torch")
    ap.add_argument("--layouts", default="packed,cp")
    args = ap.parse_args()
    dev, dtype = args.device, getattr(torch, args.dtype)
    b, s, h, hk, a = args.batch, args.seq, args.heads, args.key_heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, hk, a, generator=gen)
    k = torch.randn(b, s, hk, a, generator=gen)
    v = torch.randn(b, s, h, a, generator=gen)
    g = -F.softplus(torch.randn(b, s, h, generator=gen) + 1.0)
    beta = torch.rand(b, s, h, generator=gen)
    ins = [t.to(dev, dtype) if t is not g else t.to(dev) for t in (q, k, v, g, beta)]
    doc = (torch.arange(s) * args.docs // s).expand(b, s).contiguous().to(dev)
    cfg = ModelConfig.preset("tiny").replace(linear_num_key_heads=hk, linear_num_value_heads=h,
                                             linear_key_head_dim=a, linear_value_head_dim=a)
    fl = gdn_flops(cfg, Workload(rows=b, seq=s, gdn_chunk=GDN_CHUNK))
    useful = 3 * (fl.terms["gdn_core"] + fl.terms["solve"])
    cores = {"fla": gdn_core_fla, "torch": gdn_core_torch}

    def timed(core, info):
        def once():
            xs = [t.detach().requires_grad_() for t in ins]
            o = core(*xs, info, chunk_size=GDN_CHUNK, backward="custom")
            torch.autograd.grad(o.float().square().sum(), xs)
        once()
        times = []
        for _ in range(args.repeats):
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            once()
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    for layout in args.layouts.split(","):
        comm = OneRankCP() if layout == "cp" else LocalSeqComm()
        seq_idx = torch.arange(s, device=dev).expand(b, s)
        results = {}
        for impl in ["torch", *(i for i in args.impls.split(",") if i != "torch")]:
            kc = DEFAULT_KERNELS.replace(gdn=impl)
            info = SeqInfo(doc, positions_from_docs(doc), seq_idx, True, comm=comm, kernels=kc)
            try:
                results[impl] = timed(cores[impl], info)
            except Exception as e:  # e.g. FLA not installed: say so on its line, keep the others
                print(json.dumps({"op": "gdn", "impl": impl, "layout": layout, "error": f"{type(e).__name__}: {e}"}))
                continue
        for impl, sec in results.items():
            line = {"op": "gdn", "impl": impl, "layout": layout, "tflops": round(useful / sec / 1e12, 6),
                    "ref": "torch", "seconds": round(sec, 6), "device": dev, "dtype": args.dtype, "batch": b,
                    "seq": s, "docs": args.docs, "heads": h, "key_heads": hk, "head_dim": a,
                    "command": "python benchmarks/gdn_layouts.py " + " ".join(sys.argv[1:])}
            if "torch" in results:
                line["ref_tflops"] = round(useful / results["torch"] / 1e12, 6)
                line["speedup_vs_ref"] = round(results["torch"] / sec, 3)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
