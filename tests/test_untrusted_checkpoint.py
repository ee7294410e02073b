"""A checkpoint is data: loading one never runs code from it (issue 24). DCP's ``.metadata`` is a pickle; a crafted
one that would write a marker file (with ``manifest.json`` rewritten to match, as its author can) is refused on every
load path with one line, and the marker never appears. Checkpoints made by q38 and by plain
``torch.distributed.checkpoint.save`` still load."""

import pickle

import pytest
import torch

from q38.cli import main
from q38.train.io import checkpoint as ck
from tests.run_utils import run_dict, write_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).write_text('ran')",)


def _craft(ck_dir, marker):
    """Replace the checkpoint's ``.metadata`` by a pickle that runs code, and its manifest to match."""
    (ck_dir / ".metadata").write_bytes(pickle.dumps(_Payload(marker), protocol=4))
    ck.write_manifest(ck_dir)
    assert ck.verify_checkpoint(ck_dir) is None  # the integrity check alone cannot tell


@pytest.fixture
def crafted(tmp_path):
    """A finished 1-step run whose checkpoint carries the payload; returns (config path, checkpoint, marker)."""
    cfg = write_config(tmp_path / "run.yaml", run_dict(tmp_path / "out", steps=1))
    assert main(["train", str(cfg)]) == 0
    ck_dir = tmp_path / "out" / "checkpoints" / "step_000001"
    marker = tmp_path / "MARKER"
    _craft(ck_dir, marker)
    return tmp_path, ck_dir, marker


def _one_line_refusal(capsys, code, marker):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not marker.exists()
    assert len(err) == 1 and "builtins.exec" in err[0] and ".metadata" in err[0], err
    return err[0]


def test_automatic_resume_refuses_a_crafted_metadata(crafted, capsys):
    tmp, ck_dir, marker = crafted
    cfg = write_config(tmp / "more.yaml", run_dict(tmp / "out", steps=2))
    capsys.readouterr()
    _one_line_refusal(capsys, main(["train", str(cfg)]), marker)


def test_resume_from_refuses_a_crafted_metadata(crafted, capsys):
    tmp, ck_dir, marker = crafted
    cfg = write_config(tmp / "rf.yaml", run_dict(tmp / "other", steps=2, run={"resume_from": str(ck_dir)}))
    capsys.readouterr()
    _one_line_refusal(capsys, main(["train", str(cfg)]), marker)


def test_init_from_refuses_a_crafted_metadata(crafted, capsys):
    tmp, ck_dir, marker = crafted
    cfg = write_config(tmp / "init.yaml", run_dict(tmp / "ft", steps=1, init_from=str(ck_dir)))
    capsys.readouterr()
    _one_line_refusal(capsys, main(["train", str(cfg)]), marker)


def test_convert_refuses_a_crafted_metadata(crafted, capsys):
    tmp, ck_dir, marker = crafted
    capsys.readouterr()
    _one_line_refusal(capsys, main(["convert", "--to-hf", str(ck_dir), str(tmp / "hf")]), marker)
    assert not (tmp / "hf").exists()


def test_the_payload_does_run_under_plain_pickle(tmp_path):
    """The crafted file is a real attack: DCP's own reader (plain ``pickle.load``) runs it."""
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "ck"
    dcp.save({"a": torch.zeros(2)}, checkpoint_id=str(d), no_dist=True)
    marker = tmp_path / "MARKER"
    (d / ".metadata").write_bytes(pickle.dumps(_Payload(marker), protocol=4))
    with pytest.raises(BaseException):
        dcp.load({"a": torch.zeros(2)}, checkpoint_id=str(d), no_dist=True)
    assert marker.exists()


def test_a_plain_dcp_save_of_a_q38_state_loads(tmp_path, tiny_cfg):
    """A checkpoint written by ``torch.distributed.checkpoint.save`` itself (not q38's writer) passes the restricted
    reader: its metadata holds only DCP's own types."""
    import torch.distributed.checkpoint as dcp

    from q38.train.core.step_config import TrainConfig
    from q38.train.core.state import init_state

    state = init_state(tiny_cfg, TrainConfig(), seed=1)
    d = tmp_path / "plain"
    dcp.save(ck.state_dict_of(state), checkpoint_id=str(d), no_dist=True)
    target = ck.state_dict_of(init_state(tiny_cfg, TrainConfig(), seed=2))
    ck._dcp_load(target, d)
    assert all(torch.equal(target[k], v) for k, v in ck.state_dict_of(state).items())


def test_truncated_metadata_is_one_clear_error(tmp_path, tiny_cfg):
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "cut"
    dcp.save({"a": torch.zeros(2)}, checkpoint_id=str(d), no_dist=True)
    data = (d / ".metadata").read_bytes()
    (d / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(ck.CheckpointMismatch, match="unreadable checkpoint metadata"):
        ck.checkpoint_reader(d)
