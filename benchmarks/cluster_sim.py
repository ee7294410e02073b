"""A simulated cluster: the real ``train_step`` on gloo ranks grouped into "nodes", every collective held until a
slow link model would have delivered it, with the runtime's overlap off and on, next to what ``q38 plan``
predicts for the same cluster.

    python benchmarks/cluster_sim.py [--world 4] [--ranks-per-node 2] [--steps 4] [--inter-mbps 40]
                                     [--intra-mbps 400] [--latency-us 200] [--cases fsdp,hsdp,...]

**It is a simulation, and assumes:**

- ranks ``r`` and ``r'`` share a node when ``r // ranks_per_node == r' // ranks_per_node`` (torchrun's numbering);
- every collective goes through ``q38.parallel.links``, which counts the bytes each rank receives from each peer
  (the real tensors, not an estimate) and holds the collective until ``latency + max(intra / intra bandwidth,
  inter / inter bandwidth)`` after it could start (``links.LinkModel``: ring collectives over a group spanning
  nodes charge every byte to the NIC, ``g`` NICs for a group with ``g`` ranks per node; an all-to-all charges each
  peer's rows to the link between the two ranks). A rank's collectives queue one after another (one NCCL stream);
- async collectives are really in flight on gloo's own threads while the step computes; the hold is applied when
  the step waits for them, so a collective issued early enough costs nothing;
- compute is this CPU's: the plan's compute time is calibrated to the same run without the link model ("base", with
  the same overlap setting), so the prediction is only about communication: bytes, links and what overlaps. The
  real (local, fast) transfers stay inside every measurement: a held collective takes the larger of its real and
  its simulated time, which makes the measured "off" a little faster than base + link time;
- 4 ranks share this machine's 2 cores: a rank sleeping in a held collective lends its core to the others.

Reported per case: bytes per step received per rank over intra- and inter-node links (counted), the link model's
total time for them, the step time without links (base) and with them, overlap off and on (median over steps, the
slowest rank each step), the share of the link time hidden (``1 − (on − base on) / link time``), and the plan's
bytes, link time and step times for the same cluster. Results: benchmarks/README.md.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# (name, layout preset, mesh sizes, extra train keys)
CASES = {
    "fsdp": ("fsdp", {"fsdp": -1}, {}),
    "hsdp": ("hsdp", {"dp_replicate": -1, "fsdp": 2}, {}),
    "fsdp_ep": ("fsdp_ep", {"fsdp": -1, "ep": 2}, {}),
    "ep4": ("fsdp_ep", {"fsdp": 1, "ep": -1}, {}),
    "ep4_hier": ("fsdp_ep", {"fsdp": 1, "ep": -1}, {"ep_dispatch": "hierarchical"}),
    "fsdp_ep_cp": ("fsdp_ep_cp", {"fsdp": 1, "cp": 2, "ep": -1}, {}),
}

# what "overlap on" turns on in the runtime (train config keys), and how the plan models it (estimate kwargs)
OVERLAP_TRAIN = {True: {"overlap_comm": True, "ep_overlap": True}, False: {"overlap_comm": False, "ep_overlap": False}}
OVERLAP_PLAN = {True: {"prefetch": True, "async_reduce": True, "ep_overlap": True, "cp_early": True},
                False: {"prefetch": False, "async_reduce": False, "ep_overlap": False, "cp_early": False}}


def _model():
    from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)

    return ModelConfig.preset("tiny").replace(mtp_num_layers=1)


def _batch(seed, rows, seq):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 384, (rows, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _rank_fn(rank, world, layout_name, mesh_sizes, train_kw, link, ranks_per_node, steps, rows, seq):
    import torch.distributed as dist

    from q38.parallel import links
    from q38.parallel.layout import Layout
    from q38.parallel.mesh import batch_row_rank, make_mesh, shard, shard_batch
    from q38.train.core.step_config import TrainConfig
    from q38.train.core.state import init_state
    from q38.train.core.step import train_step

    cfg = _model()
    tc = TrainConfig(loss_chunk_size=64, aux_loss_coef=0.01, lr=1e-3, **train_kw)
    layout = Layout.preset(layout_name).with_mesh(**mesh_sizes)
    mesh = make_mesh(layout, world)
    state = shard(init_state(cfg, tc, seed=0), mesh)
    model = links.LinkModel(**link) if link else None
    times, ledgers = [], []
    with links.simulate(model, links.Topology(ranks_per_node)):
        for i in range(steps + 1):  # step 0 warms up
            sb = shard_batch(_batch(i, rows * batch_row_rank(mesh)[1], seq), mesh, cfg.mtp_num_layers)
            dist.barrier()
            links.Ledger.reset()
            links.CommClock.take()
            t0 = time.perf_counter()
            state, _ = train_step(state, sb, mesh)
            dt = time.perf_counter() - t0
            if i:
                times.append((dt, links.CommClock.take()))
                ledgers.append((dict(links.Ledger.bytes), links.Ledger.model_seconds,
                                {k: dict(v) for k, v in links.Ledger.by_kind.items()}))
    return {"times": times, "ledgers": ledgers}


def _measure(case, world, rpn, link, overlap, steps, rows, seq):
    from tests.dist_utils import run_distributed

    layout, mesh, extra = CASES[case]
    kw = {**extra, **OVERLAP_TRAIN[overlap]}
    outs = run_distributed(_rank_fn, world, layout, mesh, kw, link, rpn, steps, rows, seq, timeout=900)
    step = statistics.median(max(o["times"][i][0] for o in outs) for i in range(steps))
    # the busiest rank's own time: its step minus the host seconds it waited in collectives
    own = statistics.median(max(t - w for t, w in (o["times"][i] for o in outs)) for i in range(steps))
    led = outs[0]["ledgers"][-1]
    inter = max(o["ledgers"][-1][0]["inter"] for o in outs)
    intra = max(o["ledgers"][-1][0]["intra"] for o in outs)
    link_s = max(o["ledgers"][-1][1] for o in outs)
    return {"step": step, "own": own, "intra": intra, "inter": inter, "link_s": link_s, "kinds": led[2]}


def _plan(case, world, rpn, link, overlap, rows, seq, compute_s):
    """``estimate`` for the same cluster: the link model as a hardware profile, compute calibrated to the run
    without links (so compute_s equals it)."""
    from q38.parallel.budget import Hardware, estimate
    from q38.parallel.layout import Layout
    from q38.train.core.step_config import TrainConfig

    layout_name, mesh, extra = CASES[case]
    layout = Layout.preset(layout_name).with_mesh(**mesh)
    cfg = _model()
    tc = TrainConfig()
    dp_rows = rows  # rows per data-parallel rank (the benchmark's batch is `rows` per rank's row group)
    common = dict(seq_len=seq, rows_per_rank=dp_rows, recompute="none", param_dtype="fp32", reduce_dtype="fp32",
                  loss_chunk_tokens=64, grad_clip=tc.grad_clip is not None, adamw_impl="foreach", packed_rows=False,
                  reshard_after_forward=tc.reshard_after_forward, ep_dispatch=extra.get("ep_dispatch", "flat"),
                  **OVERLAP_PLAN[overlap])
    probe = estimate(cfg, layout, world, **common)
    rate = probe.flops.executed / compute_s
    hw = Hardware(name="simulated", peak_bf16_flops=rate, peak_fp32_flops=rate, achievable_fraction=1.0,
                  hbm_bytes=1e15, hbm_bandwidth=1e30, intra_node_bandwidth=link["intra_bandwidth"],
                  inter_node_bandwidth=link["inter_bandwidth"], devices_per_node=rpn)
    b = estimate(cfg, layout, world, hardware=hw, **common)
    intra = sum(t.bytes - t.inter_bytes for t in b.comm)
    inter = sum(t.inter_bytes for t in b.comm)
    return {"step": b.step_s, "intra": intra, "inter": inter, "link_s": sum(t.seconds for t in b.comm),
            "exposed": b.comm_exposed_s}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=2, help="rows per data-parallel rank")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--inter-mbps", type=float, default=40.0, help="inter-node MB/s per rank")
    ap.add_argument("--intra-mbps", type=float, default=400.0, help="intra-node MB/s per rank")
    ap.add_argument("--latency-us", type=float, default=200.0, help="inter-node latency (intra: a tenth)")
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    link = {"intra_bandwidth": a.intra_mbps * 1e6, "inter_bandwidth": a.inter_mbps * 1e6,
            "intra_latency": a.latency_us * 1e-7, "inter_latency": a.latency_us * 1e-6}
    print(f"simulated cluster: {a.world} gloo ranks, {a.ranks_per_node} per node; links: inter {a.inter_mbps:g} MB/s"
          f" + {a.latency_us:g} us, intra {a.intra_mbps:g} MB/s + {a.latency_us / 10:g} us per rank; tiny model, "
          f"{a.rows} rows x {a.seq_len} tokens per data-parallel rank, fp32; median of {a.steps} steps")
    hdr = (f"{'case':<11} {'':<9} {'intra MB':>9} {'inter MB':>9} {'link s':>7} {'base off':>7} {'base on':>7} "
           f"{'off s':>7} {'on s':>7} {'hidden':>7}")
    print(hdr)
    for case in a.cases.split(","):
        # the same step without the link model, overlap off and on: this CPU's compute (and real local transfers)
        base = {ov: _measure(case, a.world, a.ranks_per_node, None, ov, a.steps, a.rows, a.seq_len)["step"]
                for ov in (False, True)}
        off = _measure(case, a.world, a.ranks_per_node, link, False, a.steps, a.rows, a.seq_len)
        on = _measure(case, a.world, a.ranks_per_node, link, True, a.steps, a.rows, a.seq_len)
        p_off = _plan(case, a.world, a.ranks_per_node, link, False, a.rows, a.seq_len, base[False])
        p_on = _plan(case, a.world, a.ranks_per_node, link, True, a.rows, a.seq_len, base[True])

        def hidden(on_s, link_s):
            return 1 - max(0.0, on_s - base[True]) / link_s if link_s else 0.0

        print(f"{case:<11} {'measured':<9} {on['intra'] / 1e6:>9.2f} {on['inter'] / 1e6:>9.2f} {on['link_s']:>7.3f} "
              f"{base[False]:>7.3f} {base[True]:>7.3f} {off['step']:>7.3f} {on['step']:>7.3f} "
              f"{100 * hidden(on['step'], on['link_s']):>6.0f}%")
        print(f"{'':<11} {'plan':<9} {p_on['intra'] / 1e6:>9.2f} {p_on['inter'] / 1e6:>9.2f} {p_on['link_s']:>7.3f} "
              f"{'':>7} {'':>7} {p_off['step']:>7.3f} {p_on['step']:>7.3f} "
              f"{100 * hidden(p_on['step'], p_on['link_s']):>6.0f}%")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
