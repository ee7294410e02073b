"""The prepared device script (benchmarks/gpu.sh) runs end to end before a device session spends time on it.

A session is lent a GPU by chance and for 15 minutes; a script that breaks there (a renamed flag, a benchmark that
no longer imports, a subprocess that loses the carried wheels) loses the whole measurement, and a part whose step
limits exceed one 10-minute call is cut off. Its CPU dry run takes every step of each part at toy sizes on CPU in
fp32 (measuring nothing) and skips, by name, the three that need CUDA."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu.sh"


def _gpu_sh(out: Path, mode: str | None, cwd: Path = REPO, part: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "Q38_GPU_SH"}
    if mode is not None:
        env["Q38_GPU_SH"] = mode
    # the test's interpreter first on PATH: the script calls python3
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    return subprocess.run(["bash", str(SCRIPT), str(out), *([part] if part else [])], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _limits(part: str) -> dict[str, int]:
    """Each ``step NAME LIMIT`` of the script's ``part`` block, with its limit in seconds."""
    import re

    text = SCRIPT.read_text()
    block = text.split(f"# ---- part {part} ")[1].split("# ---- part ")[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^\s*step (\S+) (\d+) ", block, re.MULTILINE)}


@pytest.mark.parametrize("part", ["calib", "checks"])
def test_each_part_fits_one_ten_minute_device_call(part):
    """The step limits of a part add up to at most 570 s: a part is one device call of at most 600 s, with 30 s for
    the start (the header says so)."""
    limits = _limits(part)
    assert len(limits) >= 7 and sum(limits.values()) <= 570, limits
    assert "add up to at most 570 s" in SCRIPT.read_text()


def test_the_calibration_part_measures_both_models_and_a_whole_step():
    steps = _limits("calib")
    assert {"efficiency", "efficiency_35b", "train_step", "plan_step", "plan_measured", "plan_35b_measured"} <= set(
        steps)


@pytest.mark.slow
@pytest.mark.parametrize("part", ["calib", "checks"])
def test_every_step_of_the_device_script_runs_in_its_cpu_dry_run(tmp_path, part):
    out = tmp_path / "out"
    proc = _gpu_sh(out, "cpu", part=part)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    failures = out / "failures.txt"
    assert not failures.exists(), failures.read_text() + proc.stdout[-6000:]
    # each step printed its table (a step whose benchmark printed nothing useful fails here)
    if part == "checks":
        skipped = (out / "skipped.txt").read_text().splitlines()
        assert [line.split()[1] for line in skipped] == ["gdn_kernel", "model_fla_gdn", "compile_block"]
        expect = {
            "kernels.txt": ["run: device cpu, dtype float32", "gdn.torch            auto"],
            "cuda_tests.txt": ["7 passed"],
            "loss.txt": ["chunked/unchunked", "compiled/unchunked", "| loss "],
            "model_torch_gdn.txt": ["ratio q38 / transformers", "q38, gdn_chunk_size 16", "GDN layer", "MoE layer"],
            "plan_step_recompute.txt": ["| step time (s)", "recompute True"],
            "bf16_train.txt": ["| step | cpu fp32 loss | cpu bf16 loss |", "| 1 | "],
        }
    else:
        assert not (out / "skipped.txt").exists()
        expect = {
            "kernels.txt": ["run: device cpu, dtype float32"],
            "train_step.txt": ["q38 train_step, gdn=torch", "refused: kernels.gdn: fla runs on cuda only",
                               "transformers fwd+bwd+AdamW"],
            "plan_step.txt": ["| step time (s)", "recompute False"],
            "attention.txt": ["variant", "sdpa-causal"],
            "efficiencies.jsonl": ['{"op": "attention", "impl": "sdpa", "layout": "packed"'],
            "efficiency.txt": ["TFLOP/s", "appended"],
            "efficiency_35b.txt": ["TFLOP/s", "appended"],
            "plan_measured.txt": ["compute per op on h200", "measured "],
            "plan_35b_measured.txt": ["compute per op on h100", "measured ", "range over the profile's"],
        }
    for name, needles in expect.items():
        text = (out / name).read_text()
        for needle in needles:
            assert needle in text, f"{name} lacks {needle!r}:\n{text[-2000:]}"
    if part == "checks":
        return
    # every measured line is one the plan reads (op, kernel and a TFLOP/s figure against the profile's peak)
    from q38.parallel.budget import Hardware
    from q38.parallel.efficiency import read_measured

    got = {(e.op, e.impl) for e in read_measured(out / "efficiencies.jsonl", Hardware.load("h200").peak)}
    assert {("matmul", "torch"), ("attention", "sdpa"), ("gdn", "torch"), ("loss", "torch")} <= got, got


def test_the_device_run_without_its_wheels_stops_at_once_and_says_how_to_fetch_them(tmp_path):
    proc = _gpu_sh(tmp_path / "out", None, cwd=tmp_path)  # no .whl/ here
    assert proc.returncode == 2
    assert "no wheels in .whl/" in proc.stderr and "bash benchmarks/gpu_wheels.sh" in proc.stderr


def test_an_unknown_mode_or_part_is_refused(tmp_path):
    proc = _gpu_sh(tmp_path / "out", "tpu")
    assert proc.returncode == 2 and "Q38_GPU_SH must be cuda" in proc.stderr
    proc = _gpu_sh(tmp_path / "out", "cpu", part="all")
    assert proc.returncode == 2 and "the part must be calib (the default) or checks, got 'all'" in proc.stderr
