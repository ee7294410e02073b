"""The training run: kill-and-resume gives the uninterrupted losses (1 process, 2 gloo ranks, a real SIGTERM to a
real process, torchrun), metrics, throughput, NaN handling, shipped configs, convert / export."""

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch

from q38.model_config import ModelConfig
from q38.train.io import checkpoint as ck
from q38.train.run.metrics import PROGRESS_LEGEND
from q38.train.run.trainer import (
    RunConfig,
    Throughput,
    check_run,
    format_metrics,
    known_peak_flops,
    train,
)
from tests.run_utils import REPO, losses, metrics, run_config, run_dict, write_config

STEPS = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of STEPS steps."""
    out = tmp_path_factory.mktemp("ref")
    return train(run_config(out, steps=STEPS))


def _sigterm_at(step):
    def hook(rec):
        if rec["step"] == step:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal; the handler only sets a flag

    return hook


def test_sigterm_then_resume_gives_the_uninterrupted_losses(tmp_path, reference, capsys):
    out = tmp_path / "run"
    opts = {"save_every": 2, "keep_last": 2}
    first = train(run_config(out, steps=STEPS, run=opts), on_step=_sigterm_at(3))
    said = capsys.readouterr().out
    assert [r["step"] for r in first] == [1, 2, 3]
    assert f"stopped by SIGTERM at step 3; checkpoint saved to {out / 'checkpoints' / 'step_000003'}" in said
    assert [s for s, _ in ck.list_checkpoints(out / "checkpoints")] == [2, 3]  # save_every 2, and the signal
    meta = ck.read_meta(out / "checkpoints" / "step_000003")
    assert meta["data"]["iterator"] == {"epoch": 0, "index": 3} and meta["step"] == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored

    second = train(run_config(out, steps=STEPS, run=opts))
    assert [r["step"] for r in second] == [4, 5, 6]
    assert [s for s, _ in ck.list_checkpoints(out / "checkpoints")] == [4, 6]  # keep_last 2
    assert losses(first + second) == losses(reference)  # exact
    for key in ("mtp_1", "aux", "grad_norm", "lr"):
        assert [r[key] for r in first + second] == [r[key] for r in reference], key
    assert [r["step"] for r in metrics(out)] == list(range(1, STEPS + 1))
    printed = capsys.readouterr().out
    assert "resumed from" in printed and PROGRESS_LEGEND in printed
    assert "malloc" not in printed  # no internal noise in the run's output
    # once done, running it again trains nothing
    assert train(run_config(out, steps=STEPS)) == []


def test_metrics_records_and_console_line(reference):
    r = reference[-1]
    for key in ("step", "loss", "mtp_1", "aux", "grad_norm", "lr", "step_time", "tokens_per_s", "mfu", "tokens",
                "skipped", "router_max_mean", "router_idle", "router_max_mean_0", "router_idle_0"):
        assert key in r, key
    assert r["router_max_mean"] >= 1.0 and r["router_max_mean"] == max(v for k, v in r.items()
                                                                        if k.startswith("router_max_mean_"))
    assert r["mfu"] is None  # CPU: no known peak
    assert reference[0]["tokens_per_s"] is None and reference[2]["tokens_per_s"] > 0  # 2 warm-up steps skipped
    assert reference[-1]["loss"] < reference[0]["loss"]
    window = Throughput(0, 1.0, None)
    window.update(6, 100, 0.5)
    line = format_metrics(6, r, window, 0.5)
    assert line.startswith("step 6 | loss ") and "| mtp_1 " in line and "| aux " in line
    assert "| step 6: 0.50 s/step, tok/s 200" in line
    assert f"| load {r['router_max_mean']:.2f}x idle {r['router_idle']} |" in line
    # every field's label is explained by the legend printed at the top of a run
    labels = {re.sub(r"^mtp_\d+$", "mtp_<d>", w.rstrip(",;:")) for part in line.split(" | ")[1:] for w in part.split()
              if not any(c.isdigit() for c in w.replace("mtp_", "")) and w != "n/a"}
    missing = {w for w in labels if w not in PROGRESS_LEGEND.replace(",", " ").replace(";", " ").split()}
    assert not missing, f"progress-line labels not in PROGRESS_LEGEND: {sorted(missing)}"


def test_throughput_skips_warmup_and_never_divides_by_zero():
    t = Throughput(warmup=2, flops_per_token=10.0, peak_flops=1000.0, devices=2)
    assert t.tokens_per_s is None and t.mfu is None
    t.update(101, 50, 1.0)  # counted from this process's first step (a resumed run has its own warm-up)
    t.update(102, 50, 1.0)
    assert t.tokens_per_s is None
    t.update(103, 100, 0.0)  # zero time: ignored
    assert t.tokens_per_s is None
    t.update(104, 100, 2.0)
    assert t.tokens_per_s == 50.0 and t.mfu == pytest.approx(50 * 10 / 2000)
    assert Throughput(0, 1.0, None).mfu is None
    assert known_peak_flops("cpu", "bfloat16") is None


def test_nan_skip_reports_the_step(tmp_path, capsys):
    """nan_policy: skip keeps going and reports each skipped step (the stop policy: test_cli_errors)."""
    recs = train(run_config(tmp_path / "b", steps=3, train={"lr": 1e30, "warmup_steps": 0, "nan_policy": "skip"}))
    skipped = [r["step"] for r in recs if r["skipped"]]
    assert skipped and len(recs) == 3
    assert f"step {skipped[0]}: non-finite loss or gradient" in capsys.readouterr().out


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    out = tmp_path / "run"
    train(run_config(out, steps=1))
    other = dict(run_dict(out, steps=2))
    other["model"] = dict(other["model"], num_experts=4)
    with pytest.raises(ck.CheckpointMismatch, match=r"made for another model config \(num_experts: checkpoint 8, "
                                                    r"config 4\)"):
        train(RunConfig.from_dict(other))
    with pytest.raises(Exception, match="run.resume is false"):
        train(run_config(out, steps=2, run={"resume": False}))


# ---- shipped configs ------------------------------------------------------------------------------------------------

SHIPPED_WORLD = {"tiny": 1, "qwen3_8_2_4t": 1024}  # the world size each shipped train config is documented for


@pytest.mark.parametrize("path", sorted((REPO / "specs" / "train").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_train_configs(path):
    cfg = RunConfig.from_yaml(path)
    assert path.stem in SHIPPED_WORLD, f"add {path.stem} with its world size to SHIPPED_WORLD"
    assert cfg.model == ModelConfig.preset(cfg.model_source)  # the model it names is the model it trains
    plan = check_run(cfg, SHIPPED_WORLD[path.stem])
    if path.stem == "qwen3_8_2_4t":
        assert cfg.layout == "qwen3_8_2_4t" and plan.mesh_sizes == {"fsdp": 16, "ep": 32, "cp": 2}
        t = cfg.train
        assert t.recompute and t.enable_ep_balance and (t.loss_chunk_size or t.dynamic_chunk_loss)
        assert cfg.model.mtp_num_layers == 1 and (t.param_dtype, t.reduce_dtype) == ("bfloat16", "float32")
    if path.stem == "tiny":
        assert cfg.run.save_every == 0 and cfg.run.steps >= 100  # the default run saves at the end only


def test_scripts_are_strict_bash():
    scripts = sorted((REPO / "scripts").glob("*.sh"))
    assert scripts
    for s in scripts:
        text = s.read_text()
        assert "set -euo pipefail" in text, s
        assert "rm " not in text and "rmdir" not in text, s  # scripts never delete anything
        subprocess.run(["bash", "-n", str(s)], check=True)


# ---- convert / export -----------------------------------------------------------------------------------------------


def test_convert_round_trip_and_init_from(tmp_path, reference):
    from q38.cli import main
    from q38.hf import load_hf

    out = tmp_path / "run"
    train(run_config(out, steps=2))
    assert main(["convert", "--to-hf", str(out), str(tmp_path / "hf")]) == 0
    cfg, params = load_hf(tmp_path / "hf")
    _, trained, meta = ck.load_params(out)
    # the export names the run's tokenizer ids (the byte tokenizer's <|pad|>, <|bos|>, <|eos|>); the rest is the model
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (256, 257, 258)
    ids = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
    assert attrs.evolve(cfg, **ids) == RunConfig.from_dict(run_dict(out)).model and meta["step"] == 2
    for (n, a), (_, b) in zip(ck.named_leaves(params), ck.named_leaves(trained)):
        assert torch.equal(a, b), n
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "init")]) == 0
    # a new run from the imported checkpoint and, equivalently, from the HF directory itself
    firsts = []
    for src in ("init", "hf"):
        d = run_dict(tmp_path / f"ft_{src}", steps=1)
        d["init_from"] = str(tmp_path / src)
        del d["model"]  # the model is init_from's
        firsts.append(train(RunConfig.from_dict(d))[0]["loss"])
    assert firsts[0] == firsts[1] != reference[0]["loss"]  # the trained weights, not a fresh init
    d = run_dict(tmp_path / "ft_bad", steps=1)
    d["init_from"] = str(tmp_path / "hf")
    d["model"] = "tiny"  # 4 layers, the checkpoint has 2
    with pytest.raises(ck.CheckpointMismatch, match="init_from .* holds another model than the config names"):
        train(RunConfig.from_dict(d))


# ---- multi-process ----------------------------------------------------------------------------------------------------


def _two_rank_run(rank, world, out, stop_at):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        hook = _sigterm_at(stop_at) if (stop_at and rank == 0) else None  # only rank 0 gets the signal
        recs = train(run_config(out, steps=4, layout="fsdp"), on_step=hook)
        return losses(recs)
    finally:
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(k, None)


@pytest.mark.dist
def test_two_ranks_sigterm_and_resume(tmp_path, reference):
    from tests.dist_utils import run_distributed

    full = run_distributed(_two_rank_run, 2, str(tmp_path / "full"), 0)
    assert full[0] == full[1] and len(full[0]) == 4
    # fsdp over 2 ranks, batch_size rows per rank: a different global batch than the 1-process reference
    a = run_distributed(_two_rank_run, 2, str(tmp_path / "cut"), 2)
    assert a[0] == a[1] and len(a[0]) == 2  # both ranks stop at the step rank 0 was signalled in
    b = run_distributed(_two_rank_run, 2, str(tmp_path / "cut"), 0)
    assert a[0] + b[0] == full[0]
    assert [r["loss"] for r in metrics(tmp_path / "cut")] == full[0]


def _wait_for_step(out: Path, step: int, proc, timeout=120.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        p = out / "metrics.jsonl"
        if p.is_file() and len([x for x in p.read_text().splitlines() if x.strip()]) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.communicate()}")
        time.sleep(0.02)
    raise AssertionError("timeout waiting for metrics")


DRIVER = """
import os, sys, time
import q38.train.run.trainer as T
_train = T.train
PAUSE = float(os.environ.get("Q38_TEST_STEP_PAUSE", "0.4"))  # slow steps: time to signal
T.train = lambda cfg, on_step=None: _train(cfg, on_step=lambda rec: time.sleep(PAUSE))
from q38.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_real_sigterm_to_the_cli_process_then_resume(tmp_path, reference):
    """`q38 train` in a subprocess receives SIGTERM from outside; it saves, prints one line, exits 0."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", run_dict(out, steps=STEPS))
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, str(driver), "train", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        _wait_for_step(out, 2, proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    k = len(metrics(out))
    assert 2 <= k < STEPS and f"stopped by SIGTERM at step {k}; checkpoint saved to" in stdout
    resumed = train(RunConfig.from_yaml(cfg))
    assert [r["step"] for r in resumed] == list(range(k + 1, STEPS + 1))
    assert [m["loss"] for m in metrics(out)] == losses(reference)


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_two_processes_sigterm_and_resume(tmp_path):
    """`torchrun --nproc_per_node 2`: SIGTERM to the whole process group, then resume; same losses as a run
    that never stopped."""

    def torchrun(out, *, stop_at=None):
        cfg = write_config(tmp_path / f"{out.name}.yaml", run_dict(out, steps=STEPS, layout="fsdp"))
        driver = tmp_path / "driver.py"
        driver.write_text(DRIVER)
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(driver), "train", str(cfg)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                                start_new_session=True)
        try:
            if stop_at:
                _wait_for_step(out, stop_at, proc, timeout=240)
                os.killpg(proc.pid, signal.SIGTERM)  # agent and workers, as a scheduler's pre-emption does
            so, se = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        return proc.returncode, so, se

    rc, so, se = torchrun(tmp_path / "full")
    assert rc == 0, se
    full = [m["loss"] for m in metrics(tmp_path / "full")]
    _, so, se = torchrun(tmp_path / "cut", stop_at=2)  # torchrun's agent itself exits 1 on SIGTERM; the workers 0
    assert "stopped by SIGTERM at step" in so, se
    k = len(metrics(tmp_path / "cut"))
    assert ck.latest_checkpoint(tmp_path / "cut" / "checkpoints").name == f"step_{k:06d}"
    rc, so, se = torchrun(tmp_path / "cut")
    assert rc == 0, se
    assert [m["loss"] for m in metrics(tmp_path / "cut")] == full
    assert json.loads((tmp_path / "cut" / "checkpoints" / f"step_{STEPS:06d}" / "meta.json").read_text())[
        "world_size"] == 2


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(p.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.dist
def test_workers_do_not_outlive_a_killed_torchrun_agent(tmp_path):
    """kill -9 of the torchrun agent alone: both workers are gone within seconds (parent-death signal), the newest
    complete checkpoint is intact, and the same command relaunched (without the test's pause) resumes and
    finishes."""
    out = tmp_path / "run"
    # 1 s per step: without the parent-death signal the workers would still be training at the check (10 steps
    # after step 2 are left, the check waits 5 s); the relaunch runs at full speed.
    steps = 12
    cfg = write_config(tmp_path / "run.yaml", run_dict(out, steps=steps, layout="fsdp", run={"save_every": 1}))
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["Q38_TEST_STEP_PAUSE"] = "1.0"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(driver),
           "train", str(cfg)]
    log = open(tmp_path / "first.log", "w")  # not a pipe: the workers inherit it and would keep it open
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
                            start_new_session=True)
    workers: list[int] = []
    try:
        _wait_for_step(out, 2, proc, timeout=240)
        workers = _children(proc.pid)
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)  # the agent only
        proc.wait()
        t0 = time.time()
        while any(_alive(w) for w in workers) and time.time() - t0 < 5:
            time.sleep(0.05)
        assert not any(_alive(w) for w in workers), "a worker outlived its torchrun agent"
    finally:
        log.close()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    latest = ck.latest_checkpoint(out / "checkpoints")
    assert latest is not None and ck.verify_checkpoint(latest) is None
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**env, "Q38_TEST_STEP_PAUSE": "0"},
                           timeout=240)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {latest}" in again.stdout
    assert [m["step"] for m in metrics(out)] == list(range(1, steps + 1))
