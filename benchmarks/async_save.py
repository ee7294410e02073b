"""Step time while a checkpoint is saved: synchronous saves vs ``run.async_save`` (``checkpoint.AsyncSave``).

    python benchmarks/async_save.py [--steps-between 4] [--dir DIR]

One process, the 164M-parameter model of ``benchmarks/checkpoint_io.py`` (1.83 GiB of fp32 parameters and AdamW
moments to write), 2 rows of 64 tokens per step. It runs plain steps (the baseline), then a step followed by a
synchronous save, then a step followed by an ``AsyncSave`` and the steps that run while its write is in flight, and
prints, side by side from this one run: the seconds a save holds training up (sync: the whole write; async: the
staging copy), the time a step takes while the background write runs, and each over the baseline step.

What it assumes: one CPU process, so the background writer thread competes with the step for the same cores and
memory bandwidth (on an accelerator the step runs on the device and the write costs it less); the disk is the
machine's temporary directory. The machine is shared, so seconds are indicative; the ratios are from one run.
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.checkpoint_io import model_config  # noqa: E402
from q38.train.io import checkpoint as ck  # noqa: E402
from q38.train.core.step_config import TrainConfig  # noqa: E402
from q38.train.core.state import init_state  # noqa: E402
from q38.train.core.step import train_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps-between", type=int, default=4, help="baseline steps before each save")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    a = ap.parse_args()
    cfg = model_config()
    tc = TrainConfig(lr=1e-4, warmup_steps=0, loss_chunk_size=64)
    state = init_state(cfg, tc, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    root = Path(a.dir or tempfile.mkdtemp(prefix="q38-async-"))

    def step():
        nonlocal state
        t0 = time.perf_counter()
        state, _ = train_step(state, batch)
        return time.perf_counter() - t0

    step()  # warm-up
    base = statistics.median(step() for _ in range(a.steps_between))
    t_sync_step = step()
    t0 = time.perf_counter()
    ck.save_checkpoint(root / "sync", state, {"step": int(state.step)})
    t_sync_save = time.perf_counter() - t0
    for _ in range(a.steps_between):
        step()
    t_async_step = step()
    t0 = time.perf_counter()
    pending = ck.AsyncSave(root / "async", state, {"step": int(state.step)})
    t_stage = time.perf_counter() - t0
    during = []
    t_write0 = time.perf_counter()
    while pending.running():
        during.append(step())
    t_write = time.perf_counter() - t_write0
    t0 = time.perf_counter()
    pending.finish()
    t_publish = time.perf_counter() - t0
    nbytes = sum(p.stat().st_size for p in (root / "async").rglob("*") if p.is_file())
    print(f"model: {nbytes / 2**30:.2f} GiB per checkpoint on disk; baseline step {base:.3f} s (median of "
          f"{a.steps_between})")
    print(f"{'':34}{'sync':>10}{'async':>10}")
    print(f"{'step that saves, step itself (s)':34}{t_sync_step:>10.3f}{t_async_step:>10.3f}")
    print(f"{'training held up by the save (s)':34}{t_sync_save:>10.3f}{t_stage + t_publish:>10.3f}"
          f"   async: staging {t_stage:.3f} + publish {t_publish:.3f}")
    print(f"{'  over the baseline step':34}{t_sync_save / base:>9.2f}x{(t_stage + t_publish) / base:>9.2f}x")
    if during:
        d = statistics.median(during)
        print(f"{'steps during the background write':34}{'-':>10}{len(during):>10}   write took {t_write:.2f} s")
        print(f"{'  median step time (s)':34}{'-':>10}{d:>10.3f}   {d / base:.2f}x the baseline")
    else:
        print("the background write finished before a step could run (no step ran during it)")
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
