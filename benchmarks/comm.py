"""Bytes moved per step per collective, measured on a real gloo mesh, next to the analytic minimum.

    python benchmarks/comm.py [--world 4] [--fsdp 2] [--ep 2] [--recompute] [--policy fp32|bf16|both]
                              [--reduce-dtype float32|bfloat16] [--no-reshard]

Every rank runs one ``train_step`` of the tiny model with the ``fsdp_ep`` layout, under the fp32 policy and/or
the bf16 mixed-precision policy (``param_dtype: bfloat16``: each rank casts its shard before the all-gather, so
gathers move half of fp32's bytes; reduce-scatters move ``reduce_dtype``); the torch.distributed
calls are wrapped to count the bytes each rank *receives* from other ranks:
all-gather (k−1)·shard, reduce-scatter (k−1)·shard, all-to-all the off-rank part of the output, all-reduce
2·(k−1)/k·size (ring). The analytic minimum is:

- FSDP all-gather: every FSDP-sharded parameter's gathered bytes (in ``param_dtype``) once per forward, again in
  backward for each layer's parameters when the layer is recomputed or resharded after forward;
- FSDP reduce-scatter: every FSDP-sharded gradient once (in ``reduce_dtype``);
- EP all-to-all: the routed activations that leave their rank, dispatch + combine, forward and backward.

Everything else (counts, expert indices, loss normalisers, replicated-parameter all-reduces) is overhead shown
in its own rows. Printed as a table; never asserted in tests.
"""

import argparse
import collections
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _rank_fn(rank, world, fsdp, ep, recompute, param_dtype="float32", reduce_dtype="float32", reshard=True):
    from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)
    from q38.parallel.layout import Layout
    from q38.parallel.mesh import make_mesh, shard, shard_batch
    from q38.train.core.step_config import TrainConfig
    from q38.train.core.state import init_state
    from q38.train.core.step import train_step

    counts = collections.Counter()
    tags = {"tag": "other"}
    orig = {n: getattr(dist, n) for n in ("all_gather", "reduce_scatter", "all_to_all_single", "all_reduce")}

    def k_of(group):
        return dist.get_world_size(group)

    def all_gather(parts, x, group=None, **kw):
        counts[("all_gather", tags["tag"])] += x.numel() * x.element_size() * (k_of(group) - 1)
        return orig["all_gather"](parts, x, group=group, **kw)

    def reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=None, **kw):
        counts[("reduce_scatter", tags["tag"])] += out.numel() * out.element_size() * (k_of(group) - 1)
        return orig["reduce_scatter"](out, chunks, op=op, group=group, **kw)

    def all_to_all_single(out, inp, out_splits=None, in_splits=None, group=None, **kw):
        me = dist.get_rank(group)
        row = out[0].numel() * out.element_size() if out.numel() else 0
        if out_splits is None:
            n = out.shape[0] // k_of(group)
            moved = (out.shape[0] - n) * row
        else:
            moved = (sum(out_splits) - out_splits[me]) * row
        kind = "a2a activations" if out.is_floating_point() else "a2a counts/indices"
        counts[(kind, tags["tag"])] += moved
        return orig["all_to_all_single"](out, inp, out_splits, in_splits, group=group, **kw)

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, **kw):
        k = k_of(group)
        counts[("all_reduce", tags["tag"])] += int(2 * (k - 1) / k * t.numel() * t.element_size())
        return orig["all_reduce"](t, op=op, group=group, **kw)

    for n, f in (("all_gather", all_gather), ("reduce_scatter", reduce_scatter),
                 ("all_to_all_single", all_to_all_single), ("all_reduce", all_reduce)):
        setattr(dist, n, f)

    cfg = ModelConfig.preset("tiny")
    tc = TrainConfig(recompute=recompute, loss_chunk_size=256, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                     reshard_after_forward=reshard)
    pbytes = torch.tensor([], dtype=tc.torch_param_dtype).element_size()
    rbytes = torch.tensor([], dtype=tc.torch_reduce_dtype).element_size()
    layout = Layout.preset("fsdp_ep").with_mesh(fsdp=fsdp, ep=ep)
    mesh = make_mesh(layout, world)
    state = shard(init_state(cfg, tc, seed=0), mesh)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2 * world, 128), generator=g)
    batch = shard_batch({"input_ids": ids, "labels": ids}, mesh, cfg.mtp_num_layers)
    counts.clear()
    # Routed slots leaving this rank (for the EP minimum): recompute the routing of each MoE call.
    from q38.parallel import ep as rt

    off_rank = collections.Counter()
    orig_call = rt.EPDispatch.__call__

    def counting_call(self, x_nd, w_nk, idx_nk, p, cfg_, *rest, **kw):
        # Off-rank slots this rank sends (S) and receives (R), from the same plan the dispatcher makes.
        expert_m = idx_nk.reshape(-1)
        e_local = p.we_gate_up.shape[0]
        send = torch.bincount(torch.div(expert_m, e_local, rounding_mode="floor"), minlength=self.size)
        recv = torch.empty_like(send)
        orig["all_to_all_single"](recv, send, group=self.group)
        s_out = int(send.sum() - send[self.rank])
        r_in = int(recv.sum() - recv[self.rank])
        row = x_nd.shape[1] * x_nd.element_size()
        off_rank["fwd"] += r_in * (row + w_nk.element_size()) + s_out * row  # dispatch gets R rows + weights, combine S
        return orig_call(self, x_nd, w_nk, idx_nk, p, cfg_, *rest, **kw)

    rt.EPDispatch.__call__ = counting_call
    train_step(state, batch, mesh)
    # FSDP minimum from the layout: gathered bytes per parameter and whether it lives in a (recomputed) layer.
    pl = layout.placements(state.params, mesh.sizes)
    from q38.pytree import named_leaves

    ag_min = rs_min = 0
    for path, t in named_leaves(state.params):
        p = pl[path]
        gathered = [n for n, d in zip(mesh.sizes, p.shard_dims()) if d is not None and n not in
                    {m for m, dd in zip(mesh.sizes, p.shard_dims(compute=True)) if dd is not None}]
        if not gathered:
            continue
        local = t.to_local()
        k = 1
        for n in gathered:
            k *= mesh.sizes[n]
        times = 2 if ((recompute or reshard) and ".layers." in f".{path}") else 1
        ag_min += local.numel() * pbytes * (k - 1) * times
        rs_min += local.numel() * rbytes * (k - 1)
    # Forward calls include the recompute re-run (same routing); backward reverses each layer's two exchanges once.
    a2a_min = int(off_rank["fwd"] * (1.5 if recompute else 2))
    return {"counts": dict(counts), "ag_min": ag_min, "rs_min": rs_min, "a2a_min": a2a_min}


def _table(r, title):
    c = collections.Counter()
    for (kind, _), v in r["counts"].items():
        c[kind] += v
    rows = [
        ("FSDP all-gather (fwd + bwd re-gather)", c["all_gather"], r["ag_min"]),
        ("FSDP reduce-scatter (grads)", c["reduce_scatter"], r["rs_min"]),
        ("EP all-to-all (activations)", c["a2a activations"], r["a2a_min"]),
        ("EP all-to-all (counts, indices)", c["a2a counts/indices"], 0),
        ("all-reduce (replicated grads, normalisers)", c["all_reduce"], 0),
    ]
    print(title)
    print(f"| {'collective':<44} | {'measured':>12} | {'analytic min':>12} | {'ratio':>6} |")
    print(f"|{'-' * 46}|{'-' * 14}|{'-' * 14}|{'-' * 8}|")
    for name, got, want in rows:
        ratio = f"{got / want:.3f}" if want else "—"
        print(f"| {name:<44} | {got:>12,} | {want:>12,} | {ratio:>6} |")
    core = sum(v for _, v, m in rows if m)
    core_min = sum(m for _, _, m in rows if m)
    print(f"| {'FSDP + EP activations':<44} | {core:>12,} | {core_min:>12,} | {core / core_min:>6.3f} |")
    total = sum(v for _, v, _ in rows)
    print(f"| {'everything (goal: within 5% of the minimum)':<44} | {total:>12,} | {core_min:>12,} | "
          f"{total / core_min:>6.3f} |")
    print()
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--fsdp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--policy", choices=("fp32", "bf16", "both"), default="both")
    ap.add_argument("--reduce-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--no-reshard", action="store_true", help="reshard_after_forward: false")
    a = ap.parse_args()
    from tests.dist_utils import run_distributed

    policies = {"fp32": ("float32", "float32"), "bf16": ("bfloat16", a.reduce_dtype)}
    chosen = list(policies) if a.policy == "both" else [a.policy]
    measured = {}
    for name in chosen:
        pd, rd = policies[name]
        r = run_distributed(_rank_fn, a.world, a.fsdp, a.ep, a.recompute, pd, rd, not a.no_reshard)[0]
        measured[name] = _table(
            r, f"tiny model, fsdp={a.fsdp} × ep={a.ep} on {a.world} gloo ranks, recompute={a.recompute}, "
               f"reshard_after_forward={not a.no_reshard}, param_dtype={pd}, reduce_dtype={rd}; "
               "bytes received by rank 0 in one train_step",
        )
    if len(measured) == 2:
        f, b = measured["fp32"], measured["bf16"]
        print("bf16 policy / fp32 policy, measured bytes (analytic: all-gather 0.5, reduce-scatter "
              f"{0.5 if a.reduce_dtype == 'bfloat16' else 1.0})")
        for kind in ("all_gather", "reduce_scatter"):
            print(f"  {kind:<16} {b[kind] / f[kind]:.3f}")


if __name__ == "__main__":
    main()
