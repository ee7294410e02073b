"""Bytes one GDN layer saves for backward: the custom gated-delta-rule backward vs plain autograd through the chunk
loop (today's reference path), counted with saved-tensor hooks (distinct storages, so views are counted once).

    python benchmarks/gdn_memory.py [--model qwen3_8_2_4t] [--seqs 4096 32768] [--dtype bfloat16] [--device meta]

Runs the forward of ``gdn_apply`` (the whole layer: projections, conv, gated delta rule, gated norm, output
projection) and of the gated delta rule alone on ``meta`` tensors by default (no memory, no compute: the counts
equal a real run's; ``--device cpu`` checks that on small sizes). Batch 1, one packed row (document masking on).
"""

import argparse

import torch

from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)
from q38.layers.context import SeqInfo
from q38.layers.gdn import gdn_apply
from q38.model import abstract_params
from q38.layers.common import materialize
from q38.kernels import GDN_CHUNK  # the chunk of DEFAULT_KERNELS, which the SeqInfo below runs


def saved_bytes(fn) -> int:
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3_8_2_4t")
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="meta")
    args = ap.parse_args()
    cfg = ModelConfig.preset(args.model)
    dtype, dev = getattr(torch, args.dtype), args.device
    i = cfg.layer_types.index("linear_attention")
    abstract = abstract_params(cfg).layers[i].mixer
    p = torch.utils._pytree.tree_map(lambda info: materialize(info, "gdn", seed=0, device=dev, dtype=dtype)
                                     .requires_grad_(), abstract)
    print(f"model {args.model}: hidden {cfg.hidden_size}, GDN {cfg.linear_num_key_heads} key / "
          f"{cfg.linear_num_value_heads} value heads × {cfg.linear_key_head_dim}, chunk {GDN_CHUNK}, "
          f"{args.dtype} activations (the core runs in fp32), batch 1, packed row, device {dev}")
    print(f"\n{'seq':>7} {'what':<22}{'autograd (MiB)':>16}{'custom (MiB)':>14}{'custom/autograd':>17}")
    for s in args.seqs:
        x = torch.randn(1, s, cfg.hidden_size, device=dev, dtype=dtype, requires_grad=True)
        doc = torch.zeros(1, s, dtype=torch.long, device=dev)
        doc[:, s // 3 :] = 1  # two documents (a boundary inside a chunk)
        info = SeqInfo(doc, torch.arange(s, device=dev)[None], torch.arange(s, device=dev)[None], True)
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        # as the layer calls it: q, k per key head, v (and g, β) per value head
        core_in = [torch.randn(1, s, h, c, device=dev, dtype=dtype, requires_grad=True)
                   for h, c in ((nk, dk), (nk, dk), (nv, dv))]
        core_in += [torch.randn(1, s, nv, device=dev, dtype=torch.float32, requires_grad=True) for _ in range(2)]
        from q38.layers.gdn import gated_delta_rule_chunked

        rows = [("whole GDN layer", lambda mode: gdn_apply(p, x, cfg, info, backward=mode)),
                ("gated delta rule",
                 lambda mode: gated_delta_rule_chunked(*core_in, doc, chunk_size=GDN_CHUNK, backward=mode))]
        for name, fn in rows:
            n = {}
            for mode in ("autograd", "custom"):
                n[mode] = saved_bytes(lambda: fn(mode))
            print(f"{s:>7} {name:<22}{n['autograd'] / 2**20:>16.1f}{n['custom'] / 2**20:>14.1f}"
                  f"{n['custom'] / n['autograd']:>17.3f}")


if __name__ == "__main__":
    main()
