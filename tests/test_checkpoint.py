"""Checkpoints: round trip, atomicity under a crash during the write, keep-last pruning, model-config refusal."""

import subprocess
import sys
import textwrap

import pytest
import torch

from q38.model_config import ModelConfig
from q38.pytree import named_leaves
from q38.train.io import checkpoint as ck
from q38.train.core.step_config import TrainConfig
from q38.train.core.state import init_state
from tests.run_utils import REPO, small_model_dict


def _cfg(**kw):
    return ModelConfig.from_dict(dict(small_model_dict(), **kw))


def _state(seed=0, step=0, cfg=None):
    s = init_state(cfg or _cfg(), TrainConfig(), seed=seed)
    import attrs

    return attrs.evolve(s, step=torch.tensor(step, dtype=torch.int64))


def _meta(state, **kw):
    return dict({"step": int(state.step), "model_config": state.model_config.to_dict(),
                 "train_config": state.train_config.to_dict(), "param_dtype": "float32",
                 "data": {"iterator": {"epoch": 0, "index": int(state.step)}}}, **kw)


def _assert_same(a, b):
    la, lb = named_leaves(a), named_leaves(b)
    assert [n for n, _ in la] == [n for n, _ in lb]
    for (n, x), (_, y) in zip(la, lb):
        assert torch.equal(x, y), n


def test_round_trip_meta_rng_and_latest(tmp_path):
    root = tmp_path / "checkpoints"
    s = _state(seed=1, step=7)
    torch.manual_seed(123)
    path = ck.save_checkpoint(root, s, _meta(s, layout="single"))
    expected_draw = torch.rand(3)
    assert path == root / "step_000007" and (root / "latest").read_text().strip() == "step_000007"
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "manifest.json", "meta.json", "rng"]
    torch.manual_seed(999)
    loaded, meta = ck.load_checkpoint(ck.latest_checkpoint(root), _state(seed=2))
    _assert_same(loaded, s)
    assert int(loaded.step) == 7 and meta["layout"] == "single" and meta["format"] == ck.FORMAT
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG state of the save is restored
    cfg, params, _ = ck.load_params(tmp_path / "checkpoints")  # params only, from the checkpoints dir
    assert cfg == s.model_config
    _assert_same(params, s.params)


def test_refuses_another_model_config(tmp_path):
    s = _state()
    ck.save_checkpoint(tmp_path, s, _meta(s))
    other = _state(cfg=_cfg(hidden_size=32, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8))
    with pytest.raises(ck.CheckpointMismatch, match=r"another model config \(head_dim: checkpoint 16, config 8; "
                                                    r"hidden_size: checkpoint 64, config 32"):
        ck.load_checkpoint(tmp_path / "step_000000", other)


def test_keep_last_deletes_only_checkpoint_dirs(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step_000001_notes").mkdir()  # look-alikes survive
    (root / "step_000002.txt").write_text("x")
    (root / "step_000003.tmp-123").mkdir()  # leftover of an interrupted save: removed
    s = _state()
    for step in (1, 2, 3, 4):
        import attrs

        s = attrs.evolve(s, step=torch.tensor(step))
        ck.save_checkpoint(root, s, _meta(s), keep_last=2)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_000001_notes", "step_000002.txt", "step_000003", "step_000004"]
    assert [st for st, _ in ck.list_checkpoints(root)] == [3, 4]
    assert ck.prune(root, 0) == []  # keep_last 0 keeps everything


def test_resave_same_step_replaces(tmp_path):
    s = _state(seed=0, step=3)
    ck.save_checkpoint(tmp_path, s, _meta(s))
    s2 = _state(seed=5, step=3)
    ck.save_checkpoint(tmp_path, s2, _meta(s2))
    loaded, _ = ck.load_checkpoint(tmp_path / "step_000003", _state())
    _assert_same(loaded, s2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000003"]


def test_exception_during_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    good = _state(seed=0, step=2)
    ck.save_checkpoint(root, good, _meta(good))

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "_write_json", boom)  # fails after the DCP shards are written
    bad = _state(seed=1, step=4)
    with pytest.raises(OSError, match="No space left"):
        ck.save_checkpoint(root, bad, _meta(bad))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]  # tmp dir cleaned up
    loaded, meta = ck.load_checkpoint(ck.latest_checkpoint(root), _state(seed=3))
    _assert_same(loaded, good)


def test_process_killed_during_write_keeps_previous_checkpoint(tmp_path):
    """A real crash: the saving process dies (os._exit) in the middle of the DCP write of step 4."""
    root = tmp_path / "checkpoints"
    script = textwrap.dedent(f"""
        import os, sys, torch, attrs
        sys.path.insert(0, {str(REPO)!r})
        from tests.test_checkpoint import _state, _meta
        from q38.train.io import checkpoint as ck
        s = _state(seed=0, step=2)
        ck.save_checkpoint({str(root)!r}, s, _meta(s))
        real = ck._dcp_save
        def dying(sd, path):
            half = dict(list(sd.items())[: len(sd) // 2])
            real(half, path)          # some shards reach the disk ...
            os._exit(137)             # ... then the process dies, as under SIGKILL or a node failure
        ck._dcp_save = dying
        s4 = _state(seed=1, step=4)
        ck.save_checkpoint({str(root)!r}, s4, _meta(s4))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 137, r.stderr
    names = sorted(p.name for p in root.iterdir())
    assert names[:2] == ["latest", "step_000002"] and len(names) == 3 and names[2].startswith("step_000004.tmp-")
    assert (root / "latest").read_text().strip() == "step_000002"
    assert ck.latest_checkpoint(root) == root / "step_000002"
    loaded, _ = ck.load_checkpoint(root / "step_000002", _state(seed=3))
    _assert_same(loaded, _state(seed=0, step=2))
    s6 = _state(seed=2, step=6)
    ck.save_checkpoint(root, s6, _meta(s6))  # the next save removes the leftover
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000006"]


def test_resolve_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ck.resolve_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="holds no complete q38 checkpoint"):
        ck.resolve_checkpoint(tmp_path)
