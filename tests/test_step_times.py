"""Where a step's time goes: data wait, forward + backward, optimizer and save seconds in every record; the next
batch read on a background thread (``data.prefetch``) without changing a batch or a checkpoint's data position; each
rank's step time gathered, and the slowest rank named when it is more than 20 % slower than the median."""

import os
import subprocess
import sys

import pytest

from q38.train.io import checkpoint as ck
from q38.train.data.prefetch import Prefetch
from tests.run_utils import REPO, losses, metrics, run_config, run_dict, write_config


def test_prefetch_hands_out_the_loaders_batches_and_positions(tmp_path):
    import torch

    from q38.train.data.sources import TrainData
    from q38.train.data.tokenizer import ByteTokenizer

    data = TrainData("builtin:tiny", ByteTokenizer(), seq_len=32, vocab_size=512)
    plain, _ = data.iterators(2, dp_rank=0, dp_size=1, seed=3, shuffle=True)
    ahead = Prefetch(data.iterators(2, dp_rank=0, dp_size=1, seed=3, shuffle=True)[0], depth=3)
    try:
        for _ in range(5):
            a, b = next(plain), next(ahead)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            assert ahead.state_dict() == plain.state_dict()  # not the position the thread read ahead to
    finally:
        ahead.close()
    again = Prefetch(data.iterators(2, dp_rank=0, dp_size=1, seed=3, shuffle=True)[0])
    again.load_state_dict(plain.state_dict())
    try:
        got, want = next(again), next(plain)
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        again.close()


def test_a_run_reads_ahead_without_changing_its_losses_or_checkpoints(tmp_path):
    from q38.train.run.trainer import train

    a = train(run_config(tmp_path / "a", steps=4, data={"prefetch": 0}, run={"save_every": 2}))
    b = train(run_config(tmp_path / "b", steps=4, data={"prefetch": 2}, run={"save_every": 2}))
    assert losses(a) == losses(b)
    for step in (2, 4):
        name = ck.step_dir_name(step)
        assert ck.read_meta(tmp_path / "a" / "checkpoints" / name)["data"] == \
            ck.read_meta(tmp_path / "b" / "checkpoints" / name)["data"]


def test_every_record_says_where_the_steps_time_went(tmp_path):
    from q38.train.run.trainer import train

    train(run_config(tmp_path / "r", steps=4, run={"save_every": 2}))
    recs = metrics(tmp_path / "r")
    for r in recs:
        assert r["time_data"] >= 0 and r["time_forward_backward"] > 0 and r["time_optimizer"] > 0
        assert abs(r["time_forward_backward"] + r["time_optimizer"] - r["step_time"]) < 1e-6
        assert r["slowest_rank"] == 0 and r["busy_max"] == r["busy_median"] and r["time_comm_wait"] == 0
    assert recs[0]["time_save"] == 0 and recs[1]["time_save"] == 0
    assert recs[2]["time_save"] > 0  # the save after step 2, reported with step 3


DRIVER = """
import os, sys, time
import q38.train.core.step as S
_step = S.train_step
def slow(state, batch, mesh, **kw):
    if os.environ.get("RANK") == "1":
        time.sleep(1.0)  # rank 1 is a straggler
    return _step(state, batch, mesh, **kw)
S.train_step = slow
from q38.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.dist
def test_the_progress_line_names_a_slow_rank(tmp_path):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", run_dict(out, steps=3, layout="fsdp"))
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(tmp_path / "driver.py"), "train", str(cfg)], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("step ")]
    assert lines and all("slowest rank 1: busy " in ln for ln in lines), p.stdout
    recs = metrics(out)  # rank 0's: it waited for rank 1 in the step's collectives
    assert all(r["slowest_rank"] == 1 and r["busy_max"] > 1.2 * r["busy_median"] and r["time_comm_wait"] > 0.8
               for r in recs)
