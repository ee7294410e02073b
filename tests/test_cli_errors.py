"""Bad inputs end with one line on stderr naming the problem and the fix, exit code 2, and no traceback."""

import json

import pytest

from q38.cli import main
from q38.train.io import checkpoint as ck
from tests.run_utils import q38, run_dict, write_config


def _one_line_error(capsys, argv, *needles, code=2):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == code, err
    assert err.count("\n") == 0 and err.startswith(f"q38 {argv[0]}") and ": error: " in err, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.fixture
def cfg_file(tmp_path):
    """``cfg_file(**sections)`` → a run config YAML in tmp_path."""

    def make(name="run.yaml", **sections):
        return str(write_config(tmp_path / name, run_dict(tmp_path / "out", steps=2, **sections)))

    return make


# ---- real subprocesses --------------------------------------------------------------------------------------------


def test_unknown_config_key_subprocess(cfg_file):
    r = q38("train", cfg_file(), "--set", "run.stpes=5")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    err = r.stderr.strip()
    assert "\n" not in err
    assert err.startswith("q38 train: error: unknown key(s) in section 'run': 'stpes' (did you mean 'steps'?); "
                          "valid keys: steps, ")


def test_malformed_jsonl_subprocess(tmp_path, cfg_file):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n\n{"text": "broken\n')
    r = q38("train", cfg_file(data={"path": str(data)}))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert f"q38 train: error: {data}:3: malformed JSON" in r.stderr and "each line must be one JSON object" in r.stderr


# ---- in-process: every other bad input ----------------------------------------------------------------------------


def test_missing_files(capsys, tmp_path, cfg_file):
    _one_line_error(capsys, ["train", str(tmp_path / "nope.yaml")], "train config not found", "nope.yaml")
    _one_line_error(capsys, ["train", cfg_file(data={"path": str(tmp_path / "missing.jsonl")})],
                    f"data: {tmp_path / 'missing.jsonl'} not found", "expected a JSONL file")
    _one_line_error(capsys, ["train", cfg_file(init_from=str(tmp_path / "no_ckpt"))], "init_from", "not found")


def test_empty_dataset(capsys, tmp_path, cfg_file):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n\n")
    _one_line_error(capsys, ["train", cfg_file(data={"path": str(data)})], f"data: {data} contains no records")


def test_overlong_sample_refused_or_truncated(capsys, tmp_path, cfg_file):
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": "word " * n}) + "\n" for n in (3, 40, 2, 2, 2)))
    _one_line_error(capsys, ["train", cfg_file(data={"path": str(data), "overlong": "error"})],
                    f"({data}:2) has 201 tokens, longer than seq_len 32", "set `overlong: truncate`")
    assert main(["train", cfg_file(data={"path": str(data), "overlong": "truncate", "batch_size": 1},
                                   run={"steps": 1})]) == 0


def test_checkpoint_of_another_model(capsys, tmp_path, cfg_file):
    from q38.model_config import ModelConfig
    from q38.train.core.step_config import TrainConfig
    from q38.train.core.state import init_state

    other = ModelConfig.preset("tiny")  # 4 layers; the run config names a 2-layer model
    s = init_state(other, TrainConfig())
    ck.save_checkpoint(tmp_path / "out" / "checkpoints", s, {"step": 0, "model_config": other.to_dict()})
    _one_line_error(capsys, ["train", cfg_file()], "was made for another model config",
                    "layer_types: checkpoint", "num_hidden_layers: checkpoint 4, config 2",
                    "start a new run")


def test_unknown_keys_name_the_closest_valid_key(capsys, cfg_file):
    _one_line_error(capsys, ["train", cfg_file(), "--set", "train.lrr=0.1"],
                    "unknown train config key(s): 'lrr' (did you mean 'lr'?)")
    _one_line_error(capsys, ["train", cfg_file(), "--set", "data.seq_lenn=8"], "(did you mean 'seq_len'?)")
    _one_line_error(capsys, ["train", cfg_file(), "--set", "trian={}"], "unknown top-level key 'trian'",
                    "(did you mean 'train'?)")
    _one_line_error(capsys, ["train", cfg_file(), "--set", "run.steps=0"], "run.steps must be a positive integer")
    _one_line_error(capsys, ["train", "--set", "runsteps"], "--set expects SECTION.KEY=VALUE")


def test_layout_that_does_not_fit_the_world_size(capsys, monkeypatch, cfg_file):
    _one_line_error(capsys, ["train", cfg_file(), "--set", "layout=fsdp_ep"],
                    "needs a world size divisible by 2", "but WORLD_SIZE=1", "torchrun --nproc_per_node N")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    err = _one_line_error(capsys, ["train", cfg_file()], "layout 'single'", "has 1 ranks, but WORLD_SIZE=3",
                          "layout: single runs on one process")
    assert err.startswith("q38 train [rank 0]: error:")


def test_nan_loss_stops_with_the_step(capsys, cfg_file):
    _one_line_error(capsys, ["train", cfg_file(train={"lr": 1e30, "warmup_steps": 0}), "--set", "run.steps=3"],
                    "non-finite loss or gradient at step", "set nan_policy: skip")


def test_convert_and_init_hf_errors(capsys, tmp_path):
    _one_line_error(capsys, ["convert", "--to-hf", str(tmp_path), str(tmp_path / "hf")],
                    "holds no complete q38 checkpoint")
    _one_line_error(capsys, ["convert", "--from-hf", str(tmp_path), str(tmp_path / "ck")],
                    "is not a Hugging Face checkpoint directory (no config.json)")
    _one_line_error(capsys, ["convert", str(tmp_path), str(tmp_path / "x")], "one of the arguments --to-hf --from-hf")
    (tmp_path / "notes.txt").write_text("x")
    _one_line_error(capsys, ["init-hf", "--model", "tiny", str(tmp_path)], "exists and is not empty")
    _one_line_error(capsys, ["init-hf", "--model", "tinyy", str(tmp_path / "new")], "unknown model preset 'tinyy'")
    assert main(["frobnicate"]) == 2


def test_plan_checks_the_whole_train_file(capsys, tmp_path):
    """``q38 plan --train FILE`` refuses what ``q38 train FILE`` would refuse, not only the keys the plan reads."""
    bad = tmp_path / "run.yaml"
    bad.write_text("model: tiny\ntrain:\n  lr: 1.0e-3\n  warmpu_steps: 3\n")
    _one_line_error(capsys, ["plan", "--model", "tiny", "--layout", "single", "--world", "1", "--train", str(bad)],
                    "warmpu_steps", "warmup_steps")
    bad.write_text("model: tiny\nrun:\n  steps: ten\n")
    _one_line_error(capsys, ["plan", "--model", "tiny", "--layout", "single", "--world", "1", "--train", str(bad)],
                    "run.steps")


def test_a_closed_stdout_is_a_quiet_ending():
    """``q38 plan ... | head -1``: the reader has closed the pipe before q38 writes (here: before q38 has even started);
    q38 stops with SIGPIPE's status and no error line."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "q38.cli", "plan", "--model", "qwen3_8_2_4t", "--layout",
                          "qwen3_8_2_4t", "--world", "1024"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    p.stderr.close()
    assert p.wait(timeout=120) == 141, err
    assert err == ""
