"""The tiny run under the bf16 policy on an accelerator next to the fp32 run on CPU: losses side by side.

    python benchmarks/bf16_train.py --device cuda --steps 50 --out OUT_DIR

Runs ``q38 train`` (the embedded tiny config) twice with the same data and seed: on CPU with ``param_dtype:
float32`` and on ``--device`` with ``param_dtype: bfloat16`` (fp32 master weights and moments, fp32 reductions).
Prints every ``--every``-th step's losses, the absolute gap, and the largest gap after warmup. Never asserted.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(out: Path, device: str, dtype: str, steps: int) -> list[float]:
    cmd = [sys.executable, "-m", "q38.cli", "train", "--set", f"run.steps={steps}", "--set", f"run.device={device}",
           "--set", f"train.param_dtype={dtype}", "--set", f"run.out_dir={out}", "--set", "run.progress=false",
           "--set", "run.log_every=10", "--set", "run.resume=false"]
    # the repo first, then what the caller had (on the device: /tmp/site with the carried wheels, cattrs among them)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    subprocess.run(cmd, check=True, cwd=REPO, env=env)
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--out", default="runs/bf16_train")
    a = ap.parse_args()
    out = Path(a.out)
    fp32 = run(out / "cpu_fp32", "cpu", "float32", a.steps)
    bf16 = run(out / f"{a.device}_bf16", a.device, "bfloat16", a.steps)
    print(f"tiny, {a.steps} steps: CPU fp32 vs {a.device} bf16 policy (fp32 masters, bf16 compute, fp32 reductions)")
    print(f"| step | cpu fp32 loss | {a.device} bf16 loss | |gap| |")
    print("|---:|---:|---:|---:|")
    for i, (x, y) in enumerate(zip(fp32, bf16), start=1):
        if i % a.every == 0 or i == 1:
            print(f"| {i} | {x:.4f} | {y:.4f} | {abs(x - y):.4f} |")
    gaps = [abs(x - y) for x, y in zip(fp32, bf16)][20:]
    if gaps:
        print(f"max |gap| after step 20: {max(gaps):.4f}; final losses {fp32[-1]:.4f} vs {bf16[-1]:.4f}")


if __name__ == "__main__":
    main()
