"""``run.keep_best`` keeps the checkpoint of the best evaluation in ``out_dir/best`` (the same tensors as the regular
checkpoint of that step), survives a resume, and ``run.early_stop_patience`` ends a run whose evaluations stop
improving; bad settings are one line. On a model unlike tiny in every dimension."""

import json
from pathlib import Path

import pytest
import torch

from q38.model_config import ConfigError
from q38.train.io import checkpoint as ck
from q38.train.run.trainer import train
from tests.run_utils import metrics, run_config
from tests.test_donate import CFG

MODEL = CFG.replace(vocab_size=288).to_dict()  # the byte tokenizer's 261 tokens (still unlike tiny's 384)
DATA = {"eval_split": 0.05, "seq_len": 32, "batch_size": 2}
# a constant, high LR: the evaluations go down, then up at step 6 (measured: 4.27, 3.89, 4.50)
TRAIN = {"lr": 0.1, "schedule": "constant", "warmup_steps": 1, "total_steps": 8, "loss_chunk_size": 16}


def _run(out: Path, steps: int, **run):
    return train(run_config(out, steps=steps, model=MODEL, data=DATA, train=TRAIN,
                            run={"eval_every": 2, "eval_batches": 2, **run}))


def _evals(out: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in metrics(out) if "eval_loss" in r}


def _params(path: Path) -> dict[str, torch.Tensor]:
    from q38.pytree import named_leaves

    return dict(named_leaves(ck.load_params(path)[1]))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    _run(out, 6, keep_best="eval_loss", save_every=2, keep_last=0)
    return out


def test_the_best_evaluation_is_kept(whole):
    evals = _evals(whole)
    best_step = min(evals, key=evals.get)
    assert sorted(evals) == [2, 4, 6]
    assert best_step != 6, f"the test's premise: the last evaluation is not the best ({evals})"
    kept = ck.list_checkpoints(whole / "best")
    assert [s for s, _ in kept] == [best_step]  # only the best, not the latest
    meta = json.loads((kept[0][1] / "meta.json").read_text())
    assert meta["best"]["value"] == pytest.approx(evals[best_step], abs=1e-6) and meta["best"]["step"] == best_step
    a, b = _params(kept[0][1]), _params(whole / "checkpoints" / ck.step_dir_name(best_step))
    last = _params(whole / "checkpoints" / ck.step_dir_name(6))
    assert a and sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], last[k]) for k in a)


@pytest.mark.slow  # two more short runs
def test_a_resumed_run_keeps_the_same_best(whole, tmp_path):
    _run(tmp_path, 4, keep_best=True, save_every=2)
    _run(tmp_path, 6, keep_best=True, save_every=2)
    assert _evals(tmp_path) == pytest.approx(_evals(whole), abs=1e-6)
    assert [s for s, _ in ck.list_checkpoints(tmp_path / "best")] == [s for s, _ in
                                                                       ck.list_checkpoints(whole / "best")]


def test_early_stopping_ends_the_run_and_a_rerun_trains_nothing(tmp_path, capsys):
    # min_delta 100: no evaluation improves enough after the first, so the run stops after 2 more (steps 4 and 6)
    recs = _run(tmp_path, 20, keep_best="eval_loss", early_stop_patience=2, early_stop_min_delta=100.0)
    assert recs[-1]["step"] == 6
    out = capsys.readouterr().out
    assert "early stop at step 6" in out and "best" in out
    evals = _evals(tmp_path)  # the best checkpoint is the best evaluation, improved by any amount (step 4)
    assert [s for s, _ in ck.list_checkpoints(tmp_path / "best")] == [min(evals, key=evals.get)]
    assert ck.list_checkpoints(tmp_path / "checkpoints")[-1][0] == 6
    assert _run(tmp_path, 20, keep_best="eval_loss", early_stop_patience=2, early_stop_min_delta=100.0) == []
    assert "stopped early at step 6" in capsys.readouterr().out


@pytest.mark.parametrize("run, says", [
    ({"keep_best": "eval_bogus"}, "run.keep_best must be null, true (eval_loss) or an evaluation metric"),
    ({"keep_best": "eval_loss", "eval_every": 0}, "run.eval_every is 0"),
    ({"early_stop_patience": 3}, "run.keep_best is not set"),
    ({"keep_best": "eval_loss", "early_stop_min_delta": -1}, "run.early_stop_min_delta must be a number >= 0"),
    ({"keep_best": "eval_mtp_3"}, "the model has 1 MTP depth(s)"),
    ({"keep_best": "eval_accept_len_2"}, "the model has 1 MTP depth(s)"),
    ({"keep_best": "eval_accept_0"}, "run.keep_best must be null, true (eval_loss) or an evaluation metric"),
])
def test_bad_settings_are_one_line(tmp_path, run, says):
    with pytest.raises(ConfigError) as e:
        _run(tmp_path, 2, **{"eval_every": 2, **run})
    assert says in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("metric, values, news", [
    ("eval_loss", [3.0, 2.0, 2.5], [True, True, False]),  # lower is better
    ("eval_accuracy", [0.2, 0.5, 0.4], [True, True, False]),  # higher is better
    ("eval_accept_1", [0.3, 0.6, 0.61], [True, True, True]),  # the MTP head's acceptance: higher is better
    ("eval_accept_len_1", [1.4, 1.3, float("nan")], [True, False, False]),  # non-finite: never the best
])
def test_which_evaluation_is_the_best(metric, values, news, tmp_path):
    """The watched metric's direction: losses shrink, accuracy and acceptance grow."""
    from q38.train.run.trainer import _Best

    cfg = run_config(tmp_path, model=MODEL, data=DATA, run={"eval_every": 1, "keep_best": metric})
    b = _Best.resumed(cfg, None)
    assert [b.update({metric: v}, step, cfg) for step, v in enumerate(values, start=1)] == news
    assert b.step == max(i for i, new in enumerate(news, start=1) if new)
