"""Profiling on demand (``run.profile``, ``q38.train.run.profile``): one Chrome trace per rank with q38's phase names;
an out-of-memory step writes the allocator's snapshot and ends with one line."""

import json
import os
import subprocess
import sys

import pytest
import torch

from q38.model_config import ConfigError
from tests.run_utils import REPO, run_config, run_dict, write_config

PHASES = ("q38.forward_backward", "q38.optimizer", "q38.linear_attention", "q38.full_attention", "q38.moe",
          "q38.loss", "q38.gather", "q38.reduce_scatter", "q38.dispatch", "q38.experts", "q38.combine")


@pytest.mark.dist
def test_a_profiled_run_writes_one_trace_per_rank_with_q38s_phases(tmp_path):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", run_dict(out, steps=4, layout="fsdp_ep",
                                                       run={"profile": {"start": 2, "steps": 2}}))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "q38.cli", "train", str(cfg)], capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "profile of steps 2-3 written to" in p.stdout
    for rank in (0, 1):
        trace = json.loads((out / "profile" / f"trace_rank{rank}_steps2-3.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert set(PHASES) <= names, set(PHASES) - names
        steps = [e for e in trace["traceEvents"] if e.get("name") == "q38.optimizer"]
        assert len(steps) == 2  # the two recorded steps, not more
    assert sorted(f.name for f in (out / "profile").iterdir()) == ["trace_rank0_steps2-3.json",
                                                                  "trace_rank1_steps2-3.json"]


def test_an_out_of_memory_step_writes_the_snapshot_and_ends_with_one_line(tmp_path, monkeypatch, capsys):
    import q38.train.run.profile as prof
    import q38.train.core.step as step_mod
    from q38.cli import main

    real = step_mod.train_step

    def oom_at_2(state, batch, mesh, **kw):
        if int(state.step) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 139 GiB total)\n"
                                         "more detail on a second line")
        return real(state, batch, mesh, **kw)

    written = []

    def writer(path):
        written.append(path)
        path.write_bytes(b"snapshot")

    monkeypatch.setattr(step_mod, "train_step", oom_at_2)
    monkeypatch.setattr(prof, "snapshot_writer", lambda device: writer)  # as on a CUDA device
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", run_dict(out, steps=3))
    assert main(["train", str(cfg)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1
    snap = out / "profile" / "oom_rank0_step2.pickle"
    assert err[0].startswith("q38 train: error: step 2 ran out of device memory on rank 0 (CUDA out of memory. "
                             "Tried to allocate 2.00 GiB (GPU 0; 139 GiB total)); the allocator's snapshot is in "
                             f"{snap}")
    assert written == [snap] and snap.read_bytes() == b"snapshot"


def test_bad_profile_settings_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"run.profile.start must be an integer >= 1, got 0"):
        run_config(tmp_path, run={"profile": {"start": 0}})
    with pytest.raises(ConfigError, match=r"unknown key"):
        run_config(tmp_path, run={"profile": {"begin": 2}})
