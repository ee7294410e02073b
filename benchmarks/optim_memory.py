"""Per-rank peak memory of one full fine-tune step, pure vs donated (``train_step(..., donate=True)``), on gloo ranks.

The model is ``benchmarks/models/ft512.yaml`` (72.8M parameters: hidden 512, 4 layers, 16 experts top-4, MTP; its
16-byte-a-parameter state is 1.09 GiB). Each mode runs in fresh processes, one per rank (rendezvous through a file),
layout ``fsdp`` by default: each rank builds its shards of the state (sharded init + zero moments), reads its
resident set (the baseline: imports, process group and the state) and resets its high-water mark there (``5`` into
``/proc/self/clear_refs``: the transients of building the state do not count), then runs ``--steps`` full steps of
``--rows`` rows per rank of ``--seq`` tokens and reads its high-water mark (``VmHWM``). The table prints, per mode,
the largest rank's ``(peak - baseline + state) / state``: the peak over the rank's state, what the process holds
beyond the interpreter and torch; ``f/b peak``: the same high-water mark read when forward/backward has returned
(before the optimizer phase); ``opt peak``: the high-water mark of the optimizer phase alone (reset when
forward/backward returns), each over the same baseline plus the state. Beside it the plan's figure for the same step
(``q38.parallel.budget.estimate``: the larger of its forward/backward and optimizer phases, over the state it
prices), and ``awaiting``: the runtime's own count of the most bytes of gradients awaiting an async reduce-scatter
at once (``Gradients.async_reduce_bytes``; 0 with ``overlap_comm: false``).

The workers run with ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`` (as benchmarks/checkpoint_io.py):
freed memory goes back to the OS at once, so the high-water mark is the live peak.

    python benchmarks/optim_memory.py                # 4 ranks, fsdp, seq 512, 1 row per rank, 1 step
    python benchmarks/optim_memory.py --world 1      # one process
    python benchmarks/optim_memory.py --train '{"overlap_comm": false}'   # train settings of the step (JSON)
"""

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "benchmarks" / "models" / "ft512.yaml"
MODES = ("pure", "donated")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(mode: str, rank: int, world: int, work: Path, layout: str, seq: int, rows: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)
    from q38.parallel.layout import Layout
    from q38.parallel.mesh import init_sharded, make_mesh, shard_batch
    from q38.pytree import tree_leaves
    from q38.train.core.state import state_from_params
    from q38.train.core.step import train_step
    from q38.train.core.step_config import TrainConfig

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=rank, world_size=world)
    cfg, tc = ModelConfig.from_yaml(MODEL), TrainConfig(**json.loads(os.environ.get("Q38_OPTIM_TRAIN", "{}")))
    mesh = make_mesh(Layout.preset(layout), world) if world > 1 else None
    if mesh is None:
        from q38.model import init_params

        params = init_params(cfg, seed=0)
    else:
        params = init_sharded(cfg, mesh, seed=0)
    state = state_from_params(params, cfg, tc)
    del params
    shard = sum(getattr(t, "_local_tensor", t).numel() * getattr(t, "_local_tensor", t).element_size()
                for t in tree_leaves(state) if t.dim() > 0)
    sides = _sides(state)  # offload_optimizer: the bytes of the device-side and host-side trees
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (rows * world, seq), generator=g) for _ in range(steps)]
    if world > 1:
        dist.barrier()
    import q38.train.core.step as step_mod

    fb = []  # VmHWM when forward/backward has returned (before the optimizer phase)
    real = step_mod.loss_and_grads

    awaiting = []  # the runtime's count: the most bytes awaiting an async reduce-scatter at once
    grad_bytes = []  # bytes of the gradients the step holds when forward/backward returns

    def tapped(*a, **k):
        r = real(*a, **k)
        fb.append(_status("VmHWM"))
        awaiting.append(r.async_reduce_bytes)
        grad_bytes.append(sum(_nbytes(x) for x in r.grads))
        Path("/proc/self/clear_refs").write_text("5")  # from here VmHWM is the optimizer phase's own peak
        return r

    step_mod.loss_and_grads = tapped
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: building the state's transients do not count
    base = _status("VmRSS")
    t0 = time.perf_counter()
    for ids in batches:
        b = {"input_ids": ids, "labels": ids.clone()}
        sb = shard_batch(b, mesh, cfg.mtp_num_layers) if mesh is not None else b
        state, m = train_step(state, sb, mesh, donate=mode == "donated")
        loss = float(m.loss)
    seconds = time.perf_counter() - t0
    opt_peak = _status("VmHWM")
    peak = max(max(fb), opt_peak)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return {"rank": rank, "base": base, "peak": peak, "fb_peak": max(fb), "opt_peak": opt_peak, "shard": shard,
            "seconds": seconds, "loss": loss, "awaiting": max(awaiting), "grads": max(grad_bytes), **sides}


def _nbytes(t) -> int:
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def _sides(state) -> dict:
    """Bytes of this rank's state by the side it lives on under ``offload_optimizer`` (summed tensor sizes, not
    measured memory: on a CPU run both sides are this one process): ``device_params`` (the ``params`` leaves: the
    compute copies, and the fp32 masters of the leaves that keep them on the device), ``device_moments`` (those
    leaves' moments), ``host`` (the host masters and the moments of the offloaded leaves)."""
    from q38.pytree import named_leaves, tree_leaves

    hosted = set() if state.host_master is None else {n for n, _ in named_leaves(state.host_master)}
    moments = [(n.removesuffix(".codes").removesuffix(".scales"), m)  # (int8: codes and scales)
               for tree in (state.exp_avg, state.exp_avg_sq) for n, m in named_leaves(tree)]
    return {"device_params": sum(_nbytes(t) for t in tree_leaves(state.params)),
            "device_moments": sum(_nbytes(m) for n, m in moments if n not in hosted),
            "host": (sum(_nbytes(t) for t in tree_leaves(state.host_master or {}))
                     + sum(_nbytes(m) for n, m in moments if n in hosted))}


def plan_sides(world: int, layout: str, seq: int, rows: int, mode: str, train: str) -> tuple[float, float, float]:
    """The plan's ``(compute-dtype shards, gradients, host bytes)`` per rank of an offloaded step (``q38 plan
    --offload-optimizer``; the host figure per node of the h200 profile over its devices per node)."""
    from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)
    from q38.parallel.budget import estimate
    from q38.parallel.hardware import Hardware
    from q38.parallel.layout import Layout

    t, hw = json.loads(train), Hardware.load("h200")
    b = estimate(ModelConfig.from_yaml(MODEL), Layout.preset(layout if world > 1 else "single"), world, seq_len=seq,
                 rows_per_rank=rows, param_dtype="bf16", adamw_impl="foreach", donated=mode == "donated",
                 reduce_dtype={"bfloat16": "bf16"}.get(t.get("reduce_dtype"), "fp32"),
                 moment_dtype=t.get("moment_dtype", "float32"), offload_optimizer=True, hardware=hw)
    items = {it.name: it.bytes for it in b.optimizer_phase}
    return items["compute-dtype shards"], items["gradients"], b.host_optimizer[0] / hw.devices_per_node


def plan_figure(world: int, layout: str, seq: int, rows: int, mode: str,
                train: str = "{}") -> tuple[float, float, float] | None:
    """The plan's (forward/backward peak, optimizer peak, state) bytes per rank for this step, or None when the plan
    has no model of ``mode`` (the donated optimizer phase is another change's: a ``donated`` / ``pure_step``
    argument of ``estimate``). ``train``: the step's train settings (JSON); the communication overlap they set
    (``overlap_comm``, ``fsdp_prefetch``) and their dtypes (``param_dtype``, ``reduce_dtype``, ``moment_dtype``,
    ``master_dtype``) are priced as ``q38 plan`` prices a run's."""
    from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)
    from q38.parallel.budget import estimate
    from q38.parallel.layout import Layout
    from q38.parallel.search import _dtype_name

    cfg = ModelConfig.from_yaml(MODEL)
    params = inspect.signature(estimate).parameters
    kw = {}
    if "donated" in params:
        kw["donated"] = mode == "donated"
    elif "pure_step" in params:
        kw["pure_step"] = mode == "pure"
    elif mode == "donated":
        return None
    t = json.loads(train)
    overlap = bool(t.get("overlap_comm", True))
    kw.update(async_reduce=overlap, cp_early=overlap,
              prefetch=overlap if t.get("fsdp_prefetch") is None else bool(t["fsdp_prefetch"]))
    for key in ("moment_dtype", "master_dtype"):  # the state's dtypes, as the run holds them
        if key in t:
            kw[key] = t[key]
    b = estimate(cfg, Layout.preset(layout if world > 1 else "single"), world, seq_len=seq, rows_per_rank=rows,
                 micro_batches=int(t.get("micro_batches", 1)),
                 param_dtype=_dtype_name(t.get("param_dtype", "float32")),
                 reduce_dtype=_dtype_name(t.get("reduce_dtype", "float32")), adamw_impl="foreach", **kw)
    state = sum(it.bytes for it in b.optimizer_phase if it.name in ("master weights", "optimizer moments"))
    return max(b.peak_fwd_bwd, b.peak_accumulate), b.peak_optimizer, state  # (accumulation: inside loss_and_grads)


def run_mode(mode: str, world: int, layout: str, seq: int, rows: int, steps: int, train: str = "{}") -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO), MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               OMP_NUM_THREADS="1", Q38_OPTIM_TRAIN=train)
    with tempfile.TemporaryDirectory(prefix="q38_optim_memory_") as d:
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", mode, "--rank", str(r), "--world",
                                   str(world), "--work", d, "--layout", layout, "--seq", str(seq), "--rows",
                                   str(rows), "--steps", str(steps)], env=env, stdout=subprocess.PIPE, text=True)
                 for r in range(world)]
        outs = []
        for p in procs:
            out, _ = p.communicate()
            if p.returncode:
                raise SystemExit(f"optim_memory: a {mode} rank failed (exit {p.returncode})")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layout", default="fsdp")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rows", type=int, default=1, help="rows per rank and step")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--train", default="{}", help='train settings as JSON, e.g. \'{"overlap_comm": false}\'')
    ap.add_argument("--worker", choices=MODES)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--work", type=Path)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a.rank, a.world, a.work, a.layout, a.seq, a.rows, a.steps)))
        return 0
    print(f"ft512 (72.8M params), {a.world} rank(s), layout {a.layout if a.world > 1 else 'single'}, seq {a.seq}, "
          f"{a.rows} row(s) per rank, {a.steps} step(s); peak = VmHWM - RSS with the state built + the state")
    print(f"{'mode':8} {'state/rank':>10} {'f/b peak':>9} {'opt peak':>9} {'peak/rank':>10} {'peak/state':>10} "
          f"{'plan f/b':>9} {'plan opt':>9} {'plan/state':>10} {'s':>6} {'awaiting':>9} loss")
    losses = {}
    for mode in a.modes.split(","):
        outs = run_mode(mode, a.world, a.layout, a.seq, a.rows, a.steps, a.train)
        worst = max(outs, key=lambda o: (o["peak"] - o["base"] + o["shard"]) / o["shard"])
        peak = worst["peak"] - worst["base"] + worst["shard"]
        plan = plan_figure(a.world, a.layout, a.seq, a.rows, mode, a.train)
        pf = "n/a" if plan is None else f"{plan[0] / 2**30:.3f}"
        po = "n/a" if plan is None else f"{plan[1] / 2**30:.3f}"
        pr = "n/a" if plan is None else f"{max(plan[0], plan[1]) / plan[2]:.2f}"
        losses[mode] = worst["loss"]
        fbp = worst["fb_peak"] - worst["base"] + worst["shard"]
        opp = worst["opt_peak"] - worst["base"] + worst["shard"]
        print(f"{mode:8} {worst['shard'] / 2**30:>9.3f}G {fbp / 2**30:>8.3f}G {opp / 2**30:>8.3f}G "
              f"{peak / 2**30:>9.3f}G "
              f"{peak / worst['shard']:>10.2f} "
              f"{pf:>8}G {po:>8}G {pr:>10} {max(o['seconds'] for o in outs):>6.1f} "
              f"{max(o['awaiting'] for o in outs) / 2**20:>8.1f}M {worst['loss']:.6f}")
        # summed tensor bytes of each side (offload_optimizer: beside the plan's items)
        o = max(outs, key=lambda o: o["device_params"] + o["device_moments"] + o["host"])
        print(f"  largest rank's trees (summed tensor sizes; on CPU both sides are this process): device params "
              f"{o['device_params'] / 2**20:.1f}M + moments {o['device_moments'] / 2**20:.2f}M + gradients "
              f"{o['grads'] / 2**20:.1f}M, host {o['host'] / 2**20:.1f}M", end="")
        if json.loads(a.train).get("offload_optimizer"):
            ps, pg, ph = plan_sides(a.world, a.layout, a.seq, a.rows, mode, a.train)
            print(f"; plan: compute-dtype shards {ps / 2**20:.1f}M + gradients {pg / 2**20:.1f}M, host "
                  f"{ph / 2**20:.1f}M", end="")
        print()
    if len(set(losses.values())) > 1:
        print(f"note: the modes' last losses differ: {losses}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
