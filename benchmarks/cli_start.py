"""Start-up time of the ``q38`` command against ``import torch``, side by side.

    python benchmarks/cli_start.py [--repeat 7]

Runs, interleaved, ``--repeat`` times each, as fresh processes from this interpreter: ``python -c "import torch"``,
``q38 --help``, a usage error (``q38 generate`` with no source: exit 2) and ``python -c "pass"`` (the interpreter's
own start). Prints the median and the fastest wall time of each and their ratio to ``import torch`` (the
target: ``q38 --help`` under 0.3 x). The ``q38`` command is run as the console script runs it (``from q38.cli
import main``), with this checkout first on ``PYTHONPATH``.

What it assumes: the machine may be shared, so the medians move between runs; the fastest time of each is the
least disturbed, and both ratios are printed.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
Q38 = "import sys; from q38.cli import main; sys.exit(main())"
CASES = {
    "import torch": ["-c", "import torch"],
    "q38 --help": ["-c", Q38, "--help"],
    "q38 generate (usage error)": ["-c", Q38, "generate"],
    "python (empty)": ["-c", "pass"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    times: dict[str, list[float]] = {k: [] for k in CASES}
    for _ in range(a.repeat):
        for name, args in CASES.items():
            t = time.perf_counter()
            subprocess.run([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - t)
    base_med, base_min = statistics.median(times["import torch"]), min(times["import torch"])
    print(f"{'command':<28} {'median s':>9} {'fastest s':>10} {'median / torch':>15} {'fastest / torch':>16}")
    for name, ts in times.items():
        med, fast = statistics.median(ts), min(ts)
        print(f"{name:<28} {med:9.3f} {fast:10.3f} {med / base_med:15.3f} {fast / base_min:16.3f}")


if __name__ == "__main__":
    main()
