"""LoRA step cost, side by side in one run on the same model and data: a full fine-tune step, a LoRA step with the
adapters beside their frozen weights (the run path, ``q38.lora.compute_form``: ``x·Wᵀ + s·(x·Aᵀ)·Bᵀ``, no weight
gradient of the base) and a LoRA step with the adapters merged into their weights after each gather (``base +
s·B@A``, the form q38 ran before; reachable here only, by swapping the step's gather hook for
``q38.lora.merge_adapters``).

    python benchmarks/lora.py [--hidden 512] [--layers 4] [--experts 16] [--top-k 4] [--seq 512] [--batch 1]
                              [--rank 16] [--steps 3] [--dtype float32]
                              [--layer-types full_attention|default] [--threads 1] [--memory-world 4] [--skip-speed]

Speed: the median of ``--steps`` timed steps of each form, interleaved (one step of each in turn, after one warm-up
each), in this process; printed as wall seconds and CPU seconds of the process (``time.process_time``: all its
threads; the fair measure on a shared machine, where wall time also counts other processes' turns), each with its
ratio to the full fine-tune step. Memory: for each LoRA form,
``--memory-world`` fresh processes (gloo, layout ``fsdp``, spawned; rendezvous through a file), each rank reading its
resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` after building its state) after
one LoRA step; printed per rank as the
step's peak over that baseline (MiB), the largest rank's, and unmerged / merged. Never asserted in tests.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import q38  # noqa: E402
import q38.train.core.step as step_mod  # noqa: E402
from q38.lora import PeftConfig, add_adapters, compute_form, merge_adapters  # noqa: E402
from q38.model import init_params  # noqa: E402
from q38.train.core.state import state_from_params  # noqa: E402
from q38.train.core.step import train_step  # noqa: E402
from q38.train.core.step_config import TrainConfig  # noqa: E402

FORMS = {"unmerged": compute_form, "merged": merge_adapters}


def model_config(args) -> q38.ModelConfig:
    return q38.ModelConfig(
        model_type="qwen3_5_moe", vocab_size=8192, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.hidden // 2,
        shared_expert_intermediate_size=args.hidden // 2, mtp_num_layers=0,
        layer_types=None if args.layer_types == "default" else (args.layer_types,) * args.layers,
    )


def _batch(cfg, args, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def _states(cfg, args):
    tc = TrainConfig(param_dtype=args.dtype, lr=1e-4)
    params = init_params(cfg, seed=0)
    peft = PeftConfig(rank=args.rank, alpha=2.0 * args.rank)
    full = state_from_params(params, cfg, tc)
    lora = state_from_params(add_adapters(params, peft, seed=0, base_dtype=tc.compute_dtype), cfg, tc, peft=peft)
    return full, lora


def _step(state, batch, form=None):
    if form is not None:
        step_mod.compute_form = FORMS[form]
    try:
        t, c = time.perf_counter(), time.process_time()
        train_step(state, batch)
        return time.perf_counter() - t, time.process_time() - c
    finally:
        step_mod.compute_form = compute_form


def speed(args):
    cfg = model_config(args)
    full, lora = _states(cfg, args)
    batch = _batch(cfg, args)
    runs = {"full fine-tune": (full, None), "LoRA unmerged": (lora, "unmerged"), "LoRA merged": (lora, "merged")}
    times = {k: [] for k in runs}
    for k, (s, form) in runs.items():
        _step(s, batch, form)  # warm-up
    for _ in range(args.steps):
        for k, (s, form) in runs.items():
            times[k].append(_step(s, batch, form))
    med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    print(f"speed: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers ({args.layer_types}), {cfg.num_experts} experts top-"
          f"{cfg.num_experts_per_tok} (width {cfg.moe_intermediate_size}), {args.batch} x {args.seq} tokens, rank "
          f"{args.rank}, {args.dtype}, {torch.get_num_threads()} threads, median of {args.steps}")
    print(f"{'step':<16} {'s/step':>8} {'/ full':>7} {'CPU s':>8} {'/ full':>7}")
    for k, v in med.items():
        c, c0 = cpu[k], cpu["full fine-tune"]
        print(f"{k:<16} {v:8.3f} {v / med['full fine-tune']:7.2f} {c:8.3f} {c / c0:7.2f}")
    return med


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _memory_rank(rank, world, init_file, args, form, out):
    import torch.distributed as dist

    from q38.parallel.layout import Layout
    from q38.parallel.mesh import make_mesh, shard, shard_batch

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = model_config(args)
    mesh = make_mesh(Layout.preset("fsdp").with_mesh(fsdp=world), world)
    _, lora = _states(cfg, args)
    state = shard(lora, mesh)
    del lora
    batch = shard_batch(_batch(cfg, _WorldArgs(args, world)), mesh, 0)
    step_mod.compute_form = FORMS[form]
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
    base = _status("VmHWM")
    train_step(state, batch, mesh)
    peak = _status("VmHWM")
    Path(out).joinpath(f"{form}.{rank}").write_text(str(peak - base))
    dist.barrier()
    dist.destroy_process_group()


class _WorldArgs:
    """``args`` with one row per rank."""

    def __init__(self, args, world):
        self.seq, self.batch = args.seq, world


def memory(args):
    import torch.multiprocessing as mp

    world = args.memory_world
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for form in FORMS:
            init = os.path.join(tmp, f"rdzv.{form}")
            env = dict(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
            os.environ.update(env)
            mp.start_processes(_memory_rank, args=(world, init, args, form, tmp), nprocs=world,
                               start_method="spawn")
            res[form] = [int(Path(tmp, f"{form}.{r}").read_text()) for r in range(world)]
    mib = lambda b: b / 2**20  # noqa: E731
    print(f"memory: one LoRA step on {world} gloo ranks (layout fsdp, one row of {args.seq} tokens a rank), peak "
          "resident set (VmHWM) over the rank's resident set before the step, MiB")
    for form, v in res.items():
        print(f"{form:<9} " + " ".join(f"{mib(x):8.1f}" for x in v) + f"   max {mib(max(v)):8.1f}")
    print(f"unmerged / merged (max rank): {max(res['unmerged']) / max(res['merged']):.2f}")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layer-types", default="full_attention",
                    help="every layer's kind (default full_attention: a model whose matmuls dominate; the CPU's torch "
                         "GDN core does not), or 'default' for the 3:1 GDN / attention mix")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--memory-world", type=int, default=4)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.skip_speed:
        speed(args)
    if not args.skip_memory and args.memory_world > 0:
        memory(args)


if __name__ == "__main__":
    main()
