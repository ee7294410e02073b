"""Asynchronous checkpoints (``run.async_save``, ``checkpoint.AsyncSave``): the same checkpoints and losses as
synchronous saves; the staged copy is what is written; a failed background write stops the run with one line; kill
-9 at any moment of a background write (2 processes, repeated) resumes from a complete checkpoint with the losses of
an uninterrupted run."""

import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from q38.train.io import checkpoint as ck
from q38.train.run.safety import SaveError
from tests.run_utils import REPO, losses, metrics, run_config, run_dict, write_config


def _tensors(path):
    from q38.train.io.checkpoint import _dcp_load, saved_tensors

    sd = {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in saved_tensors(path).items()}
    _dcp_load(sd, path, collective=False)
    return sd


def test_async_saves_write_what_sync_saves_write(tmp_path):
    from q38.train.run.trainer import train

    sync = train(run_config(tmp_path / "sync", steps=4, run={"save_every": 2, "keep_last": 0}))
    both = train(run_config(tmp_path / "async", steps=4, run={"save_every": 2, "keep_last": 0, "async_save": True}))
    assert losses(both) == losses(sync)
    for step in (2, 4):
        a = tmp_path / "async" / "checkpoints" / ck.step_dir_name(step)
        s = tmp_path / "sync" / "checkpoints" / ck.step_dir_name(step)
        assert ck.verify_checkpoint(a) is None
        ta, ts = _tensors(a), _tensors(s)
        assert ta.keys() == ts.keys() and all(torch.equal(ta[k], ts[k]) for k in ts)
        assert ck.read_meta(a)["data"] == ck.read_meta(s)["data"]
    assert ck.latest_checkpoint(tmp_path / "async" / "checkpoints").name == ck.step_dir_name(4)


def test_the_staged_copy_is_what_is_written(tmp_path):
    """Changing the state after AsyncSave returns (as the next steps do) does not change the checkpoint."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(3)}
    save = ck.AsyncSave(tmp_path, state, {"step": 3})
    state["w"].add_(100.0)  # in place, while (or before) the background write runs
    path = save.finish()
    got = _tensors(path)
    assert torch.equal(got["w"], torch.arange(6.0).reshape(2, 3))
    assert ck.verify_checkpoint(path) is None and ck.latest_checkpoint(tmp_path) == path


def test_a_failed_background_write_stops_the_run_with_one_line(tmp_path, monkeypatch):
    from q38.train.run.trainer import train

    real = ck.AsyncSave.__init__

    def failing(self, root, state, meta, **kw):
        real(self, root, state, meta, **kw)
        if int(meta["step"]) == 4:  # the second background save fails in its writer thread
            self.future.result()
            self.future = concurrent.futures.Future()
            self.future.set_exception(OSError(28, "No space left on device"))

    monkeypatch.setattr(ck.AsyncSave, "__init__", failing)
    out = tmp_path / "run"
    with pytest.raises(SaveError, match=r"saving the checkpoint of step 4 to .* failed \(.*No space left on device"
                                        r".*\); the previous checkpoint .*step_000002 is intact"):
        train(run_config(out, steps=8, run={"save_every": 2, "async_save": True}))
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4, 5]  # reported on the step after it was started
    assert ck.latest_checkpoint(out / "checkpoints").name == "step_000002"
    assert not (out / "checkpoints" / "step_000004").exists()


DRIVER = """
import sys, time
import torch.distributed.checkpoint.filesystem as fs
_write = fs._write_files_from_queue
def slow(*a, **k):
    time.sleep(0.25)  # a slow disk: each background write takes a while, so a kill lands inside one
    return _write(*a, **k)
fs._write_files_from_queue = slow
from q38.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("train,layout", [
    ({}, "fsdp"),
    pytest.param({"master_dtype": "bfloat16_remainder", "param_dtype": "bfloat16"}, "fsdp", marks=pytest.mark.slow),
    pytest.param({"micro_batches": 2}, "{include: fsdp.yaml, name: pp2, mesh: {pp: 2, fsdp: 1}}",
                 marks=pytest.mark.slow)],
    ids=["fp32-masters", "bf16-remainder-masters", "pp2"])
def test_kill_9_during_background_writes_resumes_from_a_complete_checkpoint(tmp_path, train, layout):
    """2 torchrun processes saving every step in the background; kill -9 of the whole process group at a random
    moment, twice; each relaunch resumes from the newest complete checkpoint, and the final losses equal a run that
    never stopped (with fp32 masters, with bf16 + remainder masters: both halves staged and resumed, and on a
    pipelined layout: pp 2, each stage writing its own layers)."""
    steps = 12
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    (tmp_path / "driver.py").write_text(DRIVER)
    if layout.startswith("{"):
        (tmp_path / "layout.yaml").write_text(layout)
        layout = str(tmp_path / "layout.yaml")

    def cmd(out, **run):
        cfg = write_config(tmp_path / f"{out.name}.yaml", run_dict(out, steps=steps, layout=layout, run=run,
                                                                   train=train))
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(tmp_path / "driver.py"), "train", str(cfg)]

    ref = subprocess.run(cmd(tmp_path / "ref"), capture_output=True, text=True, cwd=REPO, env=env, timeout=300,
                         check=False)
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "cut"
    rng = random.Random(0)
    for attempt in range(2):
        before = len(metrics(out)) if (out / "metrics.jsonl").exists() else 0
        proc = subprocess.Popen(cmd(out, save_every=1, async_save=True), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, cwd=REPO, env=env, start_new_session=True)
        try:
            t0 = time.time()
            # two new steps logged and a complete checkpoint on disk (on a loaded machine the first background
            # save can still be writing after two steps: a kill then leaves nothing to resume, which is not the case
            # this test is about)
            while (not (out / "metrics.jsonl").exists() or len(metrics(out)) < before + 2
                   or ck.latest_checkpoint(out / "checkpoints") is None) and time.time() - t0 < 240:
                assert proc.poll() is None, "the run ended before it could be killed"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.5))  # somewhere inside a background write (each takes >= 0.25 s)
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            proc.wait()
        latest = ck.latest_checkpoint(out / "checkpoints")
        assert latest is not None and ck.verify_checkpoint(latest) is None
        # a leftover .tmp- directory is a torn write (it fails verification), or a complete one killed in the
        # publish window (between its manifest and its rename, or a re-saved step's old copy moved aside): never
        # older than the checkpoint resumed from, and never what the next run resumes (that is `latest`)
        step = int(latest.name.split("_")[1])
        for n in (p.name for p in (out / "checkpoints").iterdir() if ".tmp-" in p.name):
            if ck.verify_checkpoint(out / "checkpoints" / n) is None:
                assert int(n.split(".tmp-")[0].split("_")[1]) >= step, (n, latest.name)
    final = subprocess.run(cmd(out, save_every=1, async_save=True), capture_output=True, text=True, cwd=REPO,
                           env=env, timeout=300, check=False)
    assert final.returncode == 0, final.stderr
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(tmp_path / "ref")]
