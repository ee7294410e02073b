"""Hang diagnosis (``run.step_timeout_s``, ``q38.train.run.watchdog``): a step that overruns writes every rank's stacks
and ends the run with one line naming the rank that holds it up; ``run.timeout_s`` bounds every collective."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from q38.train.io import checkpoint as ck
from q38.train.run.watchdog import StepWatchdog, summary, where
from tests.run_utils import REPO, run_dict, write_config


def test_an_overrunning_step_dumps_the_stacks_and_says_where_it_is(tmp_path, capfd):
    exited = threading.Event()
    dog = StepWatchdog(0.3, tmp_path, rank=0, world=1, exit=lambda code: exited.set())
    try:
        with dog.step(7):
            assert exited.wait(10)  # the main thread "hangs" here, in this test function
    finally:
        dog.close()
    dump = (tmp_path / "hangs" / "step_7_rank0.txt").read_text()
    assert "step 7 ran past run.step_timeout_s=0.3 s" in dump
    assert "test_an_overrunning_step_dumps_the_stacks_and_says_where_it_is" in dump  # the main thread's stack
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("q38 train [rank 0]: error: step 7 ran past run.step_timeout_s=0.3 s: rank 0 is busy "
                             "in test_watchdog.py:")
    assert f"stacks in {tmp_path / 'hangs'}" in err[0]


def test_a_step_within_the_timeout_leaves_nothing(tmp_path):
    dog = StepWatchdog(2.0, tmp_path, rank=0, world=1, exit=lambda code: pytest.fail("fired"))
    for n in range(3):
        with dog.step(n):
            time.sleep(0.01)
    time.sleep(0.1)
    dog.close()
    assert not (tmp_path / "hangs").exists()


def test_the_verdicts_name_the_busy_and_the_silent_ranks():
    line = summary(4, 5.0, {0: "waiting in all_reduce (distributed_c10d.py:1)", 1: "busy in x.py:3 (f)", 2: None,
                          3: "waiting in barrier (distributed_c10d.py:9)"}, 4)
    assert line == ("step 4 ran past run.step_timeout_s=5 s: rank 1 is busy in x.py:3 (f); rank(s) 2 did not answer "
                    "(stopped, dead or hung outside Python); rank(s) 0, 3 wait in a collective")


def test_where_tells_a_collective_from_compute():
    import torch.distributed.distributed_c10d as c10d

    code = compile("def f(): return sys._getframe()", c10d.__file__, "exec")
    ns = {"sys": sys}
    exec(code, ns)
    assert where(ns["f"]())[0] is True  # a frame in torch/distributed: waiting
    assert where(sys._getframe())[0] is False


DRIVER = """
import os, sys, time
import q38.train.core.step as S
_step = S.train_step
def slow(state, batch, mesh, **kw):
    if int(state.step) == 2 and os.environ.get("RANK") == "1":
        time.sleep(120)  # rank 1 stalls in step 3
    return _step(state, batch, mesh, **kw)
S.train_step = slow
from q38.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.dist
def test_a_rank_that_stalls_is_named_on_every_rank(tmp_path):
    """2 gloo ranks under torchrun; rank 1 sleeps in step 3. Within the step timeout (plus the answer window) both
    ranks stop, each with one error line naming rank 1 as busy in the driver's sleep and rank 0 as waiting in a
    collective; every rank wrote its stacks; the checkpoint of step 2 is intact."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", run_dict(out, steps=6, layout="fsdp",
                                                       run={"save_every": 2, "step_timeout_s": 4}))
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "driver.py"), "train", str(cfg)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=240,
                       start_new_session=True)
    assert p.returncode != 0 and time.time() - t0 < 200
    lines = [ln for ln in p.stderr.splitlines() if "error: step 3 ran past run.step_timeout_s=4 s" in ln]
    assert len(lines) == 2, p.stderr
    for ln in lines:
        assert "rank 1 is busy in driver.py:" in ln and "(slow)" in ln
        assert "rank(s) 0 wait in a collective" in ln
    for r in (0, 1):
        assert (out / "hangs" / f"step_3_rank{r}.txt").is_file()
    assert "time.sleep" in (out / "hangs" / "step_3_rank1.txt").read_text() or \
        "slow" in (out / "hangs" / "step_3_rank1.txt").read_text()
    latest = ck.latest_checkpoint(out / "checkpoints")
    assert latest is not None and latest.name == "step_000002" and ck.verify_checkpoint(latest) is None


def test_bad_timeouts_are_one_line(tmp_path):
    from q38.model_config import ConfigError
    from tests.run_utils import run_config

    with pytest.raises(ConfigError, match=r"run.timeout_s must be a positive number of seconds, got 0"):
        run_config(tmp_path, run={"timeout_s": 0})
    with pytest.raises(ConfigError, match=r"run.step_timeout_s must be auto, a positive number of seconds, or 0 / null "
                       r"\(off\), got -1"):
        run_config(tmp_path, run={"step_timeout_s": -1})
    with pytest.raises(ConfigError, match=r"run.step_timeout_floor_s must be a positive number of seconds, got 0"):
        run_config(tmp_path, run={"step_timeout_floor_s": 0})
    assert run_config(tmp_path).run.step_timeout_s == "auto"
    assert run_config(tmp_path, run={"step_timeout_s": 0}).run.step_timeout_s == 0


def _stop_rank_1(tmp_path, run: dict, wait_s: float) -> tuple[str, float]:
    """A 2-rank gloo run under torchrun with ``run`` settings; rank 1 is stopped (SIGSTOP) after step 2. The log and
    the seconds until rank 0 printed its error line (at most ``wait_s``)."""
    import signal

    from tests.test_trainer import _children, _wait_for_step

    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", run_dict(out, steps=400, layout="fsdp", run=run))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "q38.cli", "train", str(cfg)], stdout=log, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=env, start_new_session=True)
    try:
        _wait_for_step(out, 2, proc, timeout=240)
        workers = sorted(_children(proc.pid))
        assert len(workers) == 2
        rank1 = next(w for w in workers if b"RANK=1" in Path(f"/proc/{w}/environ").read_bytes().split(b"\0"))
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.time()
        while time.time() - t0 < wait_s and "q38 train [rank 0]: error:" not in (tmp_path / "log.txt").read_text():
            time.sleep(0.2)
        waited = time.time() - t0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    return (tmp_path / "log.txt").read_text(), waited


@pytest.mark.slow
@pytest.mark.dist
def test_run_timeout_s_bounds_a_collective_wait(tmp_path):
    """2 gloo ranks; rank 1 is stopped (SIGSTOP) mid-run. With run.timeout_s: 5 rank 0's next collective fails
    within seconds, with one error line, instead of waiting torch's 30 minutes."""
    text, waited = _stop_rank_1(tmp_path, {"timeout_s": 5}, 60)
    lines = [ln for ln in text.splitlines() if ln.startswith("q38 train [rank 0]: error:")]
    assert len(lines) == 1, text[-3000:]
    assert waited < 40  # the 5 s timeout, plus the step in flight
    assert "run.timeout_s" in lines[0] and "internal error" not in text


@pytest.mark.slow
@pytest.mark.dist
def test_a_stopped_rank_ends_the_run_by_default(tmp_path):
    """Default settings but a small floor of the automatic step bound (the default floor, 300 s, is too long for a
    test): rank 1 is stopped after step 2, and rank 0 ends the run within the bound derived from the measured steps
    (10 x the slowest, here a few seconds each) + the 5 s answer window, naming rank 1. Before the automatic bound
    the watchdog was off by default and rank 0 waited run.timeout_s (30 min) without a word."""
    text, waited = _stop_rank_1(tmp_path, {"step_timeout_floor_s": 3}, 150)
    lines = [ln for ln in text.splitlines() if ln.startswith("q38 train [rank 0]: error:")]
    assert len(lines) == 1, text[-3000:]
    assert "ran past run.step_timeout_s=auto (" in lines[0], lines[0]
    assert "rank(s) 1 did not answer (stopped, dead or hung outside Python)" in lines[0], lines[0]
    assert waited < 150 and "internal error" not in text
    bound = float(lines[0].split("run.step_timeout_s=auto (")[1].split(" s)")[0])
    assert 3 <= bound < 100, bound  # derived from the measured steps, not the 1800 s of the first step


def test_the_automatic_bound_follows_the_measured_steps(tmp_path):
    """``auto``: run.timeout_s (first_s) before any step, then max(floor, 10 x the slowest of the recent steps);
    each bound armed is handed to on_bound (the collective timeout)."""
    bounds = []
    dog = StepWatchdog("auto", tmp_path, rank=0, world=1, exit=lambda code: pytest.fail("fired"), floor_s=0.5,
                       first_s=7.0, on_bound=bounds.append)
    try:
        assert dog.bound() == 7.0
        with dog.step(1):
            time.sleep(0.02)
        assert dog.bound() == 0.5  # 10 x ~0.02 s is below the floor
        with dog.step(2):
            time.sleep(0.1)
        assert 1.0 <= dog.bound() < 5.0
        with dog.phase(2, "checkpoint save", "run.timeout_s", 9.0):
            time.sleep(0.01)  # a phase has its own bound and does not count as a step
        assert 1.0 <= dog.bound() < 5.0
    finally:
        dog.close()
    assert bounds == [7.0, 0.5, 9.0]
    off = StepWatchdog(0, tmp_path, rank=0, world=1, on_bound=bounds.append)
    with off.step(1):
        pass
    off.close()
    assert off.bound() is None and len(bounds) == 3


def _lowered(rank, world):
    import torch
    import torch.distributed as dist

    from q38.train.run.launch import CollectiveTimeout

    saver = dist.new_group(backend="gloo")  # as the trainer's background-save group: left at its timeout
    set_timeout = CollectiveTimeout(100.0, skip=(saver,))

    def timeout_of(g):
        return g._get_backend(torch.device("cpu")).options._timeout

    set_timeout(1.0)  # a step bound of 1 s + the margin (2 s in this test)
    seen = [timeout_of(dist.group.WORLD), timeout_of(saver)]
    waited = None
    if rank == 0:  # rank 1 never joins: the all-reduce fails after the lowered timeout, not after 100 s
        t0 = time.time()
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1))
        waited = time.time() - t0
    else:
        time.sleep(8)
    set_timeout(500.0)  # never above run.timeout_s
    seen.append(timeout_of(dist.group.WORLD))
    return seen, waited


@pytest.mark.dist
def test_the_collective_timeout_follows_the_step_bound(monkeypatch):
    """``CollectiveTimeout`` (the watchdog's on_bound in the trainer) lowers every process group's collective timeout
    to the step bound + the margin, never above run.timeout_s, and leaves the skipped group alone: a collective a
    rank never joins fails after that, not after run.timeout_s."""
    import datetime

    from q38.train.run import launch
    from tests.dist_utils import run_distributed

    monkeypatch.setattr(launch, "COLLECTIVE_MARGIN_S", 1.0)  # the forked ranks inherit it
    (seen0, waited), (seen1, _) = run_distributed(_lowered, 2)
    for seen in (seen0, seen1):
        assert seen[0] == datetime.timedelta(seconds=2) and seen[2] == datetime.timedelta(seconds=100)
        assert seen[1] == datetime.timedelta(minutes=30)  # torch's default for a new gloo group, untouched
    assert waited < 7, waited
