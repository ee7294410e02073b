"""Experiment trackers (``run.trackers``): wandb and SwanLab in offline mode record the same scalars as
``metrics.jsonl``; a resumed run continues the same tracker run; bad tracker settings are one line.

The offline files are read back with the readers the libraries ship (W&B's LevelDB-style log through SwanLab's
converter reader and W&B's protobufs; SwanLab's own store reader and protobufs), so the check is what a
``wandb sync`` / ``swanlab sync`` would upload, not what q38 meant to send."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from q38.model_config import ConfigError
from tests.run_utils import metrics, run_config

HAVE_WANDB = importlib.util.find_spec("wandb") is not None
HAVE_SWANLAB = importlib.util.find_spec("swanlab") is not None
needs_wandb = pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (pip install 'q38[trackers]')")
needs_swanlab = pytest.mark.skipif(not HAVE_SWANLAB, reason="swanlab is not installed (pip install 'q38[trackers]')")


def _expected(out) -> dict[tuple[str, int], float]:
    """Every number of metrics.jsonl under its tracker name (train/<key>, eval/<key>)."""
    want = {}
    for rec in metrics(out):
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                want[(f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}", rec["step"])] = float(v)
    return want


def _wandb_records(run_file: Path) -> tuple[str, dict[tuple[str, int], float]]:
    from swanlab.converter.wb.wbdatastore import WBDataStoreReader
    from wandb.proto import wandb_internal_pb2 as pb

    run_id, got = None, {}
    ds = WBDataStoreReader()
    ds.open(run_file)
    try:
        while (data := ds.scan()) is not None:
            rec = pb.Record()
            rec.ParseFromString(data)
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_id = rec.run.run_id
            elif kind == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                step = int(items.pop("_step"))
                got.update({(k, step): float(v) for k, v in items.items() if not k.startswith("_")})
    finally:
        ds.close()
    return run_id, got


def _swanlab_records(run_file: Path) -> tuple[str, dict[tuple[str, int], float]]:
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    run_id, got = None, {}
    reader = DataStoreReader()
    reader.open(run_file)
    try:
        for data in reader:
            rec = Record()
            rec.ParseFromString(data)
            kind = rec.WhichOneof("record_type")
            if kind == "start":
                run_id = rec.start.id
            elif kind == "scalar":
                got[(rec.scalar.key, int(rec.scalar.step))] = float(rec.scalar.value.number)
    finally:
        reader.close()
    return run_id, got


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    bad = {k: (got[k], want[k]) for k in want if abs(got[k] - want[k]) > 1e-6 * max(1.0, abs(want[k]))}
    assert bad == {}


@needs_wandb
@needs_swanlab  # the W&B log is read with SwanLab's reader of it
def test_wandb_offline_records_what_metrics_jsonl_holds_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    from q38.train.io.checkpoint import read_meta, resolve_checkpoint
    from q38.train.run.trainer import train

    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    run = {"trackers": ["wandb"], "tracker_mode": "offline"}
    train(run_config(out, steps=2, run=run))
    train(run_config(out, steps=4, run=run))  # resumes from step 2
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # one per process, one wandb run
    (id1, got1), (id2, got2) = (_wandb_records(f) for f in files)
    kept = read_meta(resolve_checkpoint(out))["trackers"]["wandb"]
    assert id1 == id2 == kept
    _assert_same({**got1, **got2}, _expected(out))
    assert {s for _, s in got2} == {3, 4}


@needs_swanlab
def test_swanlab_offline_records_what_metrics_jsonl_holds_and_a_resume_continues_its_run(tmp_path):
    from q38.train.io.checkpoint import read_meta, resolve_checkpoint
    from q38.train.run.trainer import train

    out = tmp_path / "run"
    run = {"trackers": ["swanlab"], "tracker_mode": "offline"}
    train(run_config(out, steps=2, run=run))
    train(run_config(out, steps=4, run=run))
    files = sorted((out / "swanlog").glob("run-*/run-*.swanlab"))
    assert len(files) == 2
    (id1, got1), (id2, got2) = (_swanlab_records(f) for f in files)
    assert id1 == id2 == read_meta(resolve_checkpoint(out))["trackers"]["swanlab"]
    _assert_same({**got1, **got2}, _expected(out))
    assert {s for _, s in got2} == {3, 4}


def test_the_offline_readers_can_fail(tmp_path):
    """A record that differs from metrics.jsonl is seen (so the comparisons above could fail)."""
    want = {("train/loss", 1): 2.0, ("train/aux", 1): 0.1}
    with pytest.raises(AssertionError):
        _assert_same({("train/loss", 1): 2.0, ("train/aux", 1): 0.2}, want)
    with pytest.raises(AssertionError):
        _assert_same({("train/loss", 1): 2.0}, want)


def test_an_unknown_tracker_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"run.trackers: unknown tracker\(s\) \['mlflow'\]; choose from jsonl, "
                                          r"tensorboard, wandb, swanlab"):
        run_config(tmp_path, run={"trackers": ["mlflow"]})
    with pytest.raises(ConfigError, match="run.tracker_mode must be one of online, offline, got 'cloud'"):
        run_config(tmp_path, run={"tracker_mode": "cloud"})


@pytest.mark.parametrize("name", ["wandb", "swanlab"])
def test_a_tracker_without_its_package_names_the_extra(tmp_path, monkeypatch, name):
    from q38.train.run.trainer import train

    monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=rf"run.trackers names {name}, but the {name} package is not installed; "
                                          r"install it with pip install 'q38\[trackers\]'"):
        train(run_config(tmp_path / "run", steps=1, run={"trackers": [name], "tracker_mode": "offline"}))
    assert list((tmp_path / "run").glob("checkpoints/step_*")) == []  # stopped before the first step


def test_only_rank_0_opens_trackers(tmp_path):
    from q38.train.run.launch import check_run
    from q38.train.run.trainer import RunLog

    cfg = run_config(tmp_path, run={"trackers": ["wandb", "swanlab"], "tracker_mode": "offline"})
    log = RunLog(cfg, 0, lead=False, plan=check_run(cfg, 1, "cpu"))
    assert log.trackers == {} and log.run_ids() == {}
    log.close()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="tensorboard is not installed (pip install 'q38[trackers]')")
def test_tensorboard_records_what_metrics_jsonl_holds(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from q38.train.run.trainer import train

    out = tmp_path / "run"
    train(run_config(out, steps=3, run={"trackers": ["tensorboard"]}))
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    got = {(tag, ev.step): float(ev.value) for tag in acc.Tags()["scalars"] for ev in acc.Scalars(tag)}
    _assert_same(got, _expected(out))
