"""The data-wait share of a step, with and without the background prefetch (``data.prefetch``).

    python benchmarks/data_wait.py [--steps 40]

Trains the embedded default run (the tiny model, 8 rows of 256 tokens per step, CPU) for ``--steps`` steps on the
shipped corpus (``builtin:tiny``: packed in memory at start) and on the same corpus prepared as token shards
(``q38 prepare-data``: memory-mapped reads), each with ``data.prefetch: 0`` (the batch is read inside the step) and
``1`` (read on a thread while the previous step runs). It prints, from one run side by side, the share of
wall time the loop waits for data (``time_data`` over ``time_data + step_time``, summed over the steps after the
first two) and the median wait per step.

What it assumes: one process on this machine's CPU; the prefetch thread shares the cores with the step, so a
reader that needs much CPU would slow the step instead of vanishing (the table shows both columns).
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(data_path: str, prefetch: int, steps: int, out: Path) -> tuple[float, float, float]:
    from q38.train.run.run_config import DEFAULT_CONFIG, RunConfig
    from q38.train.run.trainer import train

    cfg = RunConfig.from_yaml(DEFAULT_CONFIG, {"data.path": data_path, "data.prefetch": prefetch,
                                               "run.steps": steps, "run.out_dir": str(out), "run.progress": False,
                                               "run.eval_every": 0, "run.log_every": 10_000})
    recs = train(cfg)[2:]
    wait = sum(r["time_data"] for r in recs)
    step = sum(r["step_time"] for r in recs)
    return wait / (wait + step), statistics.median(r["time_data"] for r in recs), step / len(recs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    from q38.train.data.prepare import prepare_data

    tmp = Path(tempfile.mkdtemp(prefix="q38-data-wait-"))
    shards = tmp / "shards"
    prepare_data(["builtin:tiny"], shards, workers=1, progress=False, log=lambda s: None)
    print(f"{'data':24}{'prefetch':>9}{'wait share':>12}{'median wait (ms)':>18}{'step (s)':>10}")
    for name, path in (("builtin:tiny (in memory)", "builtin:tiny"), ("prepared shards", str(shards))):
        for prefetch in (0, 1):
            share, med, step = run(path, prefetch, a.steps, tmp / f"{len(list(tmp.iterdir()))}")
            print(f"{name:24}{prefetch:>9}{100 * share:>11.2f}%{1000 * med:>18.3f}{step:>10.3f}")


if __name__ == "__main__":
    main()
