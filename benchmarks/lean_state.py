"""Lean optimizer state against the fp32 state: 300-step runs of the embedded default run (``specs/train/tiny.yaml``:
the tiny model on the shipped corpus) and of a two-layer hybrid (``benchmarks/models/hybrid2.yaml``: one GDN, one
full-attention layer), once per lean option (``OPTIONS``: moment dtype, gradient dtype, bf16 + remainder masters
beside the fp32-master run computing in bf16), at ``--rows`` rows of 128 tokens a step (all runs at once, one
process and one thread each). Prints, per model and option, the training loss at steps 1, 50, 100, 200, 300 (mean
of the 10 steps ending there, so one batch's noise does not decide) and the final eval loss, and each option's
difference from the fp32 run. Every run is ``q38 train`` in a fresh process.

    python benchmarks/lean_state.py                # both models, every option, 300 steps, 4 rows
    python benchmarks/lean_state.py --steps 50 --models tiny
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {"tiny": "tiny", "hybrid2": str(REPO / "benchmarks" / "models" / "hybrid2.yaml")}
# option name -> train settings (the first is the baseline)
OPTIONS = {"float32": {}, "bfloat16": {"train.moment_dtype": "bfloat16"}, "int8": {"train.moment_dtype": "int8"},
           "int8+bf16grads": {"train.moment_dtype": "int8", "train.reduce_dtype": "bfloat16"},
           # bf16 + remainder masters need bf16 compute: beside them the fp32-master run computing in bf16
           "bf16compute": {"train.param_dtype": "bfloat16"},
           "bf16compute+remainder": {"train.param_dtype": "bfloat16", "train.master_dtype": "bfloat16_remainder"}}
MARKS = (1, 50, 100, 200, 300)


def start(model: str, moment: str, steps: int, rows: int, out: Path, seed: int = 0) -> subprocess.Popen:
    sets = {"model": MODELS[model], **OPTIONS[moment], "run.steps": steps, "train.total_steps": steps,
            "data.batch_size": rows, "run.out_dir": str(out), "run.eval_every": steps, "run.save_every": 0,
            "run.progress": False, "run.seed": seed}
    cmd = [sys.executable, "-m", "q38.cli", "train", str(REPO / "specs" / "train" / "tiny.yaml")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)  # one thread a run: they run side by side


def result(out: Path, steps: int) -> dict:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    loss = {r["step"]: r["loss"] for r in recs}
    marks = {m: sum(loss[s] for s in range(max(1, m - 9), m + 1)) / len(range(max(1, m - 9), m + 1))
             for m in MARKS if m <= steps}
    ev = [r["eval_loss"] for r in recs if "eval_loss" in r]
    return {"marks": marks, "eval": ev[-1] if ev else float("nan")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--rows", type=int, default=4, help="data.batch_size (the default run's is 8)")
    ap.add_argument("--seed", type=int, default=0, help="run.seed (another seed: the fp32 run's own spread)")
    a = ap.parse_args(argv)
    marks = [m for m in MARKS if m <= a.steps]
    print(f"| model | option | {' | '.join(f'loss@{m}' for m in marks)} | eval loss | Δ final vs fp32 |")
    print("|---|---|" + "---|" * (len(marks) + 2))
    runs = [(m, o) for m in a.models.split(",") for o in a.options.split(",")]
    with tempfile.TemporaryDirectory(prefix="q38_lean_") as d:
        procs = {r: start(*r, a.steps, a.rows, Path(d) / "_".join(r), a.seed) for r in runs}  # all at once
        for r, p in procs.items():
            if p.wait():
                raise SystemExit(f"lean_state: the run {r} failed (exit {p.returncode})")
        base = {}
        for model, opt in runs:
            r = result(Path(d) / f"{model}_{opt}", a.steps)
            final = r["marks"][marks[-1]]
            base.setdefault(model, final)
            cells = " | ".join(f"{r['marks'][m]:.4f}" for m in marks)
            print(f"| {model} | {opt} | {cells} | {r['eval']:.4f} | {final - base[model]:+.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
