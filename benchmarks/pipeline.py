"""The pipeline axis on gloo ranks, beside the plan: per-rank peak memory of a ``pp`` layout, and the step time of
1F1B against the micro-batch count.

``memory``: the model is ``benchmarks/models/ft512.yaml`` (4 layers, 72.8M parameters), layout ``pp: 2`` × ``fsdp``
(2 stages of 2 ranks on 4 processes, automatic split), fp32. Each rank builds its stage's shards (sharded init, zero
moments), resets its high-water mark (``5`` into ``/proc/self/clear_refs``, as benchmarks/optim_memory.py), runs
``--steps`` donated steps and reads ``VmHWM``; the table prints each rank's ``peak - baseline + state`` beside the
plan's figure for its stage (``q38.parallel.budget.estimate`` of the same layout: ``Budget.pipeline``).

``bubble``: for each micro-batch count ``m``, the same rows split into ``m`` micro-batches run twice: on one process
(the whole model, no ``pp``: every micro-batch through every layer, one after another) and on 2 ranks, ``pp: 2`` ×
``fsdp: 1`` (1F1B). With one core a rank (``OMP_NUM_THREADS=1``; run it on an otherwise idle machine with at least 2
cores) the pipelined step over the one-process step measures what the schedule gives: ``1/p`` of the work per rank
with perfect overlap, stretched by the bubble. The plan's figure for the same ratio is its pipelined step compute
(the fullest stage's share of the layer costs times ``(m + p - 1) / m``) over its one-process compute: the two are
printed side by side. Both runs build the same micro-batches, so a micro-batch's own efficiency (small matmuls are
slower per FLOP) cancels; what the ratio adds beyond the plan is the point-to-point messages and the schedule's own
work.

    python benchmarks/pipeline.py memory
    python benchmarks/pipeline.py bubble --micro-batches 2,4,8
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "benchmarks" / "models" / "ft512.yaml"
LAYOUTS = {"memory": "{include: fsdp.yaml, name: pp2_fsdp, mesh: {pp: 2, fsdp: -1}}",
           "bubble": "{include: fsdp.yaml, name: pp2, mesh: {pp: 2, fsdp: 1}}",
           "single": "{include: fsdp.yaml, name: one, mesh: {fsdp: 1}}"}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(kind: str, rank: int, world: int, work: Path, seq: int, rows: int, steps: int, micro: int) -> dict:
    import torch
    import torch.distributed as dist
    import yaml

    from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)
    from q38.parallel.layout import Layout
    from q38.parallel.mesh import init_sharded, make_mesh, shard_batch
    from q38.pytree import tree_leaves
    from q38.train.core.state import state_from_params
    from q38.train.core.step import train_step
    from q38.train.core.step_config import TrainConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=rank, world_size=world)
    cfg, tc = ModelConfig.from_yaml(MODEL), TrainConfig(micro_batches=micro, aux_loss_scope="global_batch")
    mesh = make_mesh(Layout.from_dict(yaml.safe_load(LAYOUTS[kind])), world, model=cfg)
    state = state_from_params(init_sharded(cfg, mesh, seed=0), cfg, tc)
    shard = sum(getattr(t, "_local_tensor", t).numel() * getattr(t, "_local_tensor", t).element_size()
                for t in tree_leaves(state) if t.dim() > 0)
    g = torch.Generator().manual_seed(0)
    dp = world // mesh.pp
    batches = [torch.randint(0, cfg.vocab_size, (rows * dp, seq), generator=g) for _ in range(steps + 1)]
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    base = _status("VmRSS")
    times = []
    for ids in batches:
        t0 = time.perf_counter()
        state, m = train_step(state, shard_batch({"input_ids": ids, "labels": ids.clone()}, mesh, 1), mesh,
                              donate=True)
        float(m.loss)
        times.append(time.perf_counter() - t0)
    peak = _status("VmHWM")
    stage = mesh.pp_rank
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "stage": stage, "base": base, "peak": peak, "shard": shard,
            "seconds": min(times[1:]), "loss": float(m.loss)}


def run(kind: str, world: int, seq: int, rows: int, steps: int, micro: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO), MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="q38_pipeline_") as d:
        procs = [subprocess.Popen([sys.executable, __file__, kind, "--worker", "--rank", str(r), "--world", str(world),
                                   "--work", d, "--seq", str(seq), "--rows", str(rows), "--steps", str(steps),
                                   "--micro-batches", str(micro)], env=env, stdout=subprocess.PIPE, text=True)
                 for r in range(world)]
        outs = []
        for p in procs:
            out, _ = p.communicate()
            if p.returncode:
                raise SystemExit(f"pipeline benchmark: a rank failed (exit {p.returncode})")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def plan_stages(world: int, seq: int, rows: int, micro: int, kind: str):
    import yaml

    from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)
    from q38.parallel.budget import estimate
    from q38.parallel.hardware import Hardware
    from q38.parallel.layout import Layout

    b = estimate(ModelConfig.from_yaml(MODEL), Layout.from_dict(yaml.safe_load(LAYOUTS[kind])), world, seq_len=seq,
                 rows_per_rank=rows, micro_batches=micro, param_dtype="fp32", reduce_dtype="fp32",
                 adamw_impl="foreach", donated=True, hardware=Hardware.load("h100"))
    return b.pipeline


def plan_compute(world: int, seq: int, rows: int, micro: int, kind: str) -> float:
    """The plan's compute seconds of the step of layout ``kind`` (bubble included where it pipelines; the hardware
    profile only scales both the pipelined and the one-process figure)."""
    import yaml

    from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)
    from q38.parallel.budget import estimate
    from q38.parallel.hardware import Hardware
    from q38.parallel.layout import Layout

    b = estimate(ModelConfig.from_yaml(MODEL), Layout.from_dict(yaml.safe_load(LAYOUTS[kind])), world, seq_len=seq,
                 rows_per_rank=rows, micro_batches=micro, param_dtype="fp32", reduce_dtype="fp32",
                 adamw_impl="foreach", donated=True, hardware=Hardware.load("h100"))
    return b.compute_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("memory", "bubble", "single"))
    ap.add_argument("--world", type=int, default=None, help="ranks (memory: 4, bubble: 2)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rows", type=int, default=None, help="rows per data-parallel rank and step (default 2; bubble: 8)")
    ap.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up step")
    ap.add_argument("--micro-batches", default=None, help="memory: one count (default 2); bubble: a list (2,4,8)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--work", type=Path)
    a = ap.parse_args(argv)
    world = a.world or (4 if a.kind == "memory" else 2)
    rows = a.rows or (2 if a.kind == "memory" else 8)
    if a.worker:
        print(json.dumps(worker(a.kind, a.rank, world, a.work, a.seq, rows, a.steps, int(a.micro_batches))))
        return 0
    if a.kind == "memory":
        micro = int(a.micro_batches or 2)
        outs = run("memory", world, a.seq, rows, a.steps, micro)
        stages = plan_stages(world, a.seq, rows, micro, "memory")
        print(f"| rank | stage | measured peak (MiB) | plan (MiB) | measured / plan |  (ft512, pp2 x fsdp{world // 2}, "
              f"seq {a.seq}, {rows} rows, {micro} micro-batches, fp32, donated)")
        for o in outs:
            got = (o["peak"] - o["base"] + o["shard"]) / 2**20
            want = stages[o["stage"]].peak_bytes / 2**20
            print(f"| {o['rank']} | {o['stage']} | {got:,.1f} | {want:,.1f} | {got / want:.2f} |")
        return 0
    counts = [int(x) for x in (a.micro_batches or "2,4,8").split(",")]
    print(f"| micro-batches | one process (s) | pp2, 2 ranks (s) | measured pp2 / one | plan pp2 / one | "
          f"measured / plan |  (ft512, seq {a.seq}, {rows} rows, 1F1B, fp32, one thread a rank, best of {a.steps})")
    for m in counts:
        one = run("single", 1, a.seq, rows, a.steps, m)[0]["seconds"]
        pp = max(o["seconds"] for o in run("bubble", world, a.seq, rows, a.steps, m))
        planned = plan_compute(world, a.seq, rows, m, "bubble") / plan_compute(1, a.seq, rows, m, "single")
        print(f"| {m} | {one:.3f} | {pp:.3f} | {pp / one:.3f} | {planned:.3f} | {pp / one / planned:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
