"""Operator safety (issue 11): no command destroys a run, corrupt checkpoints are skipped with a note, a torn
metrics line is repaired, one run per out_dir, a failed save is one line and leaves the previous checkpoint usable."""

import errno
import json
import os

import pytest

from q38.cli import main
from q38.train.io import checkpoint as ck
from tests.run_utils import metrics, q38, run_dict, write_config


def _cfg(tmp_path, steps=2, name="run.yaml", **run):
    """Small runs (the machine running the suite may be shared): a checkpoint after every step."""
    return str(write_config(tmp_path / name, run_dict(tmp_path / "out", steps=steps, run={"save_every": 1, **run})))


def _snapshot(d):
    """{relative path: bytes} of every file under ``d``."""
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _steps(out):
    return [r["step"] for r in metrics(out)]


def _err_lines(capsys):
    return capsys.readouterr().err.strip().splitlines()


def test_manifest_lists_every_file_and_catches_each_kind_of_damage(tmp_path):
    assert main(["train", _cfg(tmp_path, steps=1)]) == 0
    d = tmp_path / "out" / "checkpoints" / "step_000001"
    man = json.loads((d / "manifest.json").read_text())["files"]
    on_disk = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(man) == on_disk and {"meta.json", ".metadata", "rng/rank_00000.pt"} <= on_disk
    assert all(man[f]["sha256"] for f in ("meta.json", ".metadata", "rng/rank_00000.pt"))
    assert ck.verify_checkpoint(d) is None
    shard = next(d.glob("*.distcp"))
    good = shard.read_bytes()
    shard.write_bytes(good[:-1])
    assert "bytes, the manifest says" in ck.verify_checkpoint(d)
    shard.write_bytes(good)
    meta = (d / "meta.json").read_text()
    (d / "meta.json").write_text(meta.replace('"step": 1', '"step": 7'))  # same size, other content
    assert "does not match its checksum" in ck.verify_checkpoint(d)
    (d / "meta.json").write_text(meta)
    assert ck.verify_checkpoint(d) is None


def test_convert_onto_its_own_run_is_refused_and_the_run_is_intact(tmp_path, capsys):
    assert main(["train", _cfg(tmp_path, steps=1)]) == 0
    out = tmp_path / "out"
    before = _snapshot(out)
    for dest, extra in ((out, []), (out, ["--overwrite"]), (out / "hf", ["--overwrite"]),
                        (out / "checkpoints", [])):
        capsys.readouterr()
        assert main(["convert", "--to-hf", str(out), str(dest), *extra]) == 2
        err = _err_lines(capsys)
        assert len(err) == 1 and "point OUT_DIR outside it (--overwrite does not change this)" in err[0], err
    assert _snapshot(out) == before
    # an existing non-empty OUT_DIR elsewhere: refused without --overwrite, replaced (atomically) with it
    other = tmp_path / "export"
    other.mkdir()
    (other / "old.txt").write_text("x")
    assert main(["convert", "--to-hf", str(out), str(other)]) == 2
    assert (other / "old.txt").read_text() == "x"
    assert main(["convert", "--to-hf", str(out), str(other), "--overwrite"]) == 0
    assert sorted(p.name for p in other.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                       "tokenizer.json", "tokenizer_config.json"]  # old.txt gone
    assert _snapshot(out) == before


def test_truncated_newest_shard_resumes_from_the_previous_checkpoint(tmp_path, capsys):
    cfg = _cfg(tmp_path)
    assert main(["train", cfg]) == 0
    root = tmp_path / "out" / "checkpoints"
    assert [p.name for _, p in ck.step_dirs(root)] == ["step_000001", "step_000002"]
    shard = next((root / "step_000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    capsys.readouterr()
    assert main(["train", cfg]) == 0
    cap = capsys.readouterr()
    notes = [line for line in cap.err.splitlines() if "skipped checkpoint" in line]
    assert len(notes) == 1 and "step_000002" in notes[0] and "the manifest says" in notes[0], cap.err
    assert f"resumed from {root / 'step_000001'} (step 1)" in cap.out
    assert _steps(tmp_path / "out") == [1, 2]  # step 2 re-run after the broken save
    assert ck.verify_checkpoint(root / "step_000002") is None  # re-saved over the broken one


def test_torn_metrics_line_is_cut_with_a_note_and_the_run_resumes(tmp_path, capsys):
    cfg = _cfg(tmp_path, steps=1)
    assert main(["train", cfg]) == 0
    m = tmp_path / "out" / "metrics.jsonl"
    text = m.read_text()
    m.write_text(text + text.splitlines()[0][:37])  # a partial record, as left by a full disk
    capsys.readouterr()
    assert main(["train", cfg, "--set", "run.steps=2"]) == 0
    err = capsys.readouterr().err
    assert f"{m}:2: cut off a torn last line" in err, err
    recs = metrics(tmp_path / "out")
    assert [r["step"] for r in recs] == [1, 2]
    assert m.read_text().startswith(text)  # the whole records before the torn line are kept as they were


def test_two_concurrent_runs_the_second_refuses_and_the_first_finishes(tmp_path, capsys):
    from q38.train.run.trainer import RunConfig, train

    cfg = _cfg(tmp_path, steps=3, save_every=0)
    second = {}

    def on_step(rec):
        if rec["step"] == 2:  # the first run holds the lock: start a second run on the same out_dir
            second["rc"] = main(["train", cfg])
            second["err"] = capsys.readouterr().err

    train(RunConfig.from_yaml(cfg), on_step=on_step)
    assert second["rc"] == 2
    err = second["err"].strip()
    assert "\n" not in err and "is in use by another q38 train run" in err and f"pid {os.getpid()}" in err, err
    assert _steps(tmp_path / "out") == [1, 2, 3]
    assert not (tmp_path / "out" / ".q38.lock.holder").exists()  # released at the end


@pytest.mark.slow
def test_two_concurrent_runs_as_processes(tmp_path):
    """Two real processes: the second, started while the first runs, refuses naming the first's PID. The first is
    given far more steps than it can run meanwhile (a short run can finish before the second process has imported
    torch) and is stopped with SIGTERM once the second has answered."""
    import signal
    import subprocess
    import sys
    import time

    cfg = _cfg(tmp_path, steps=100_000, save_every=10)
    holder = tmp_path / "out" / ".q38.lock.holder"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    first = subprocess.Popen([sys.executable, "-m", "q38.cli", "train", cfg], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not holder.exists() and time.time() < deadline:
        time.sleep(0.05)
    r = q38("train", cfg)
    assert first.poll() is None, "the first run ended before the second one started: the test proves nothing"
    first.send_signal(signal.SIGTERM)  # a graceful stop: checkpoint, then exit 0
    _, err1 = first.communicate(timeout=300)
    assert first.returncode == 0, err1
    assert r.returncode == 2 and f"pid {first.pid}" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    steps = _steps(tmp_path / "out")
    assert steps and steps == list(range(1, len(steps) + 1))  # the first run's metrics, untouched by the second


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path, capsys):
    cfg = _cfg(tmp_path, steps=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".q38.lock").write_text("")
    (out / ".q38.lock.holder").write_text("deadhost pid 99999 since 2026-01-01T00:00:00\n")  # no flock held
    assert main(["train", cfg]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "took over the lock" in line]
    assert len(notes) == 1 and "left by deadhost pid 99999" in notes[0], notes
    assert _steps(out) == [1]


def test_disk_full_during_a_save_is_one_line_and_the_previous_checkpoint_resumes(tmp_path, capsys, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    cfg = _cfg(tmp_path)
    real_write, real_save = fs._write_item, ck.save_checkpoint
    calls = {"saves": 0, "items": 0}

    def counting_save(*a, **k):
        calls["saves"] += 1
        calls["items"] = 0
        return real_save(*a, **k)

    def filling_up(*a, **k):  # the second save (step 2) runs out of space after a few tensors
        calls["items"] += 1
        if calls["saves"] >= 2 and calls["items"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*a, **k)

    monkeypatch.setattr(fs, "_write_item", filling_up)
    monkeypatch.setattr(ck, "save_checkpoint", counting_save)
    capsys.readouterr()
    assert main(["train", cfg]) == 2
    err = _err_lines(capsys)
    root = tmp_path / "out" / "checkpoints"
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "saving the checkpoint of step 2" in err[0] and "No space left on device" in err[0], err
    assert f"the previous checkpoint {root / 'step_000001'} is intact" in err[0], err
    assert [p.name for p in root.iterdir() if p.name.startswith("step_")] == ["step_000001"]  # no leftovers
    assert ck.verify_checkpoint(root / "step_000001") is None
    monkeypatch.undo()
    assert main(["train", cfg]) == 0  # the same command resumes from step 1
    assert f"resumed from {root / 'step_000001'} (step 1)" in capsys.readouterr().out
    assert _steps(tmp_path / "out") == [1, 2]


def test_none_verifying_changes_nothing(tmp_path, capsys):
    cfg = _cfg(tmp_path)
    assert main(["train", cfg]) == 0
    out = tmp_path / "out"
    for d in (out / "checkpoints").glob("step_*"):
        os.remove(d / "meta.json")
    before = _snapshot(out)
    capsys.readouterr()
    assert main(["train", cfg, "--set", "run.steps=3"]) == 2
    assert "none verifies" in capsys.readouterr().err
    assert _snapshot(out) == before  # metrics.jsonl and the checkpoints untouched


def test_ctrl_c_during_a_save_is_one_line_and_the_previous_checkpoint_resumes(tmp_path, capsys, monkeypatch):
    """A second Ctrl-C while the checkpoint is being written (KeyboardInterrupt inside DCP's writer)."""
    import torch.distributed.checkpoint.filesystem as fs

    cfg = _cfg(tmp_path)
    real_write, real_save = fs._write_item, ck.save_checkpoint
    calls = {"saves": 0}

    def counting_save(*a, **k):
        calls["saves"] += 1
        return real_save(*a, **k)

    def interrupted(*a, **k):
        if calls["saves"] >= 2:
            raise KeyboardInterrupt
        return real_write(*a, **k)

    monkeypatch.setattr(fs, "_write_item", interrupted)
    monkeypatch.setattr(ck, "save_checkpoint", counting_save)
    capsys.readouterr()
    assert main(["train", cfg]) == 130
    err = _err_lines(capsys)
    assert err == ["q38 train: interrupted (an unfinished checkpoint save is discarded; the previous one is intact)"]
    root = tmp_path / "out" / "checkpoints"
    assert [p.name for p in root.iterdir() if p.name.startswith("step_")] == ["step_000001"]
    monkeypatch.undo()
    assert main(["train", cfg]) == 0
    assert _steps(tmp_path / "out") == [1, 2]
