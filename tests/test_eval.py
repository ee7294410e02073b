"""``q38 eval``: a checkpoint's evaluation equals the terms training logged for the same data and parameters (full and
LoRA, one process and 2 gloo ranks); eval batches have their own size and a held-out file smaller than one batch is
evaluated (padded), in training's periodic eval too."""

import json
import os

import pytest

from tests.run_utils import metrics, q38, run_config, run_dict, write_config

SEQ = 32


def _model() -> dict:
    """The decode tests' model (every dimension unlike the tiny preset), its vocab covering the byte tokenizer."""
    from tests.test_decode import CFG

    return dict(CFG.to_dict(), vocab_size=300)


def _rows_file(path, n: int, seed: int = 0):
    """``n`` text records of ``SEQ - 1`` characters: each packs into exactly one row of ``SEQ`` tokens (its eos
    included), so a global batch of ``n`` rows is the whole file, every step."""
    import random

    rnd = random.Random(seed)
    words = "the cat sat on a mat while dogs ran far away from home".split()
    lines = []
    for _ in range(n):
        s = ""
        while len(s) < SEQ - 1:
            s += rnd.choice(words) + " "
        lines.append(json.dumps({"text": s[: SEQ - 1]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _train_two_steps(out, data, **kw):
    """Two steps on ``data`` (one global batch), a checkpoint after each; returns the logged records."""
    from q38.train.run.trainer import train

    cfg = run_config(out, steps=2, model=_model(), data={"path": str(data), "seq_len": SEQ, "shuffle": False},
                     run={"save_every": 1, "keep_last": 0}, **kw)
    return train(cfg)


def _assert_matches(rec: dict, logged: dict):
    """The eval of the step-1 checkpoint against the terms step 2 logged (computed with the step-1 parameters)."""
    assert rec["step"] == 1
    assert rec["eval_loss"] == pytest.approx(logged["loss"], rel=1e-6, abs=1e-7)
    assert rec["eval_mtp_1"] == pytest.approx(logged["mtp_1"], rel=1e-6, abs=1e-7)
    assert rec["eval_aux"] == pytest.approx(logged["aux"], rel=1e-6, abs=1e-9)
    assert rec["eval_tokens"] == logged["tokens"]
    assert 0 <= rec["eval_accuracy"] <= 1


@pytest.mark.parametrize("peft", [None, pytest.param({"rank": 4, "alpha": 8, "mtp": True}, marks=pytest.mark.slow)],
                         ids=["full", "lora"])  # LoRA in the default suite: the 2-rank test
def test_eval_equals_the_logged_loss(tmp_path, peft):
    from q38.train.run.inference import evaluate

    data = _rows_file(tmp_path / "rows.jsonl", 2)
    recs = _train_two_steps(tmp_path / "run", data, **({"peft": peft} if peft else {}))
    ck = tmp_path / "run" / "checkpoints" / "step_000001"
    rec = evaluate(str(ck), str(data), batch_size=2, progress=False)
    _assert_matches(rec, recs[1])
    # another eval batch size: the LM terms are token-weighted over the whole set, so they do not change
    one = evaluate(str(ck), str(data), batch_size=1, progress=False)
    assert one["eval_loss"] == pytest.approx(rec["eval_loss"], rel=1e-6) and one["eval_batches"] == 2
    # the step-2 checkpoint is another model: its loss differs (the comparison can fail)
    later = evaluate(str(tmp_path / "run"), str(data), batch_size=2, progress=False)
    assert later["step"] == 2 and abs(later["eval_loss"] - rec["eval_loss"]) > 1e-4


def _two_rank_eval(rank, world, out, data, peft):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        from q38.train.run.inference import evaluate
        from q38.train.run.trainer import train

        cfg = run_config(out, steps=2, layout="fsdp", model=_model(),
                         data={"path": data, "seq_len": SEQ, "shuffle": False},
                         run={"save_every": 1, "keep_last": 0}, **({"peft": peft} if peft else {}))
        recs = train(cfg)
        import torch.distributed as dist

        dist.barrier()
        return recs, evaluate(os.path.join(out, "checkpoints", "step_000001"), data, batch_size=2, progress=False)
    finally:
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(k, None)


@pytest.mark.dist
@pytest.mark.parametrize("peft", [None, {"rank": 4, "alpha": 8}], ids=["full", "lora"])
def test_eval_on_two_ranks_equals_the_logged_loss(tmp_path, peft):
    from q38.train.run.inference import evaluate
    from tests.dist_utils import run_distributed

    data = _rows_file(tmp_path / "rows.jsonl", 4)  # fsdp on 2 ranks, 2 rows each: one global batch of 4
    (recs0, ev0), (_, ev1) = run_distributed(_two_rank_eval, 2, str(tmp_path / "run"), str(data), peft)
    assert ev0 == ev1
    _assert_matches(ev0, recs0[1])
    # the same checkpoint on one process (resharded), one batch of 4 rows: the same terms
    one = evaluate(str(tmp_path / "run" / "checkpoints" / "step_000001"), str(data), batch_size=4, progress=False)
    for k in ("eval_loss", "eval_mtp_1", "eval_aux", "eval_accuracy", "eval_accept_1", "eval_accept_1_0_1k",
              "eval_accept_len_1"):
        assert one[k] == pytest.approx(ev0[k], rel=1e-6, abs=1e-9), k


@pytest.mark.slow
def test_small_held_out_chat_file_evaluates_at_batch_size_8(tmp_path):
    """6 held-out chat records at batch_size 8: training's periodic eval takes them (one padded batch), and so does
    ``q38 eval`` of the checkpoint, through the CLI."""
    chats = [{"messages": [{"role": "user", "content": f"question {i}?"},
                           {"role": "assistant", "content": f"answer number {i}."}]} for i in range(6)]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(c) + "\n" for c in chats))
    d = run_dict(tmp_path / "run", steps=2, model=_model(),
                 data={"batch_size": 8, "seq_len": 64, "eval_path": str(held)}, run={"eval_every": 1})
    cfg = write_config(tmp_path / "run.yaml", d)
    r = q38("train", cfg, timeout=600)
    assert r.returncode == 0, r.stderr
    logged = [m for m in metrics(tmp_path / "run") if "eval_loss" in m]
    assert len(logged) == 2 and logged[-1]["eval_tokens"] > 0
    r = q38("eval", tmp_path / "run", "--data", held, "--batch-size", "8", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["eval_batches"] == 1 and rec["step"] == 2
    assert rec["eval_loss"] == pytest.approx(logged[-1]["eval_loss"], rel=1e-6)
    assert rec["eval_tokens"] == logged[-1]["eval_tokens"]
    # a separate eval batch size in training: 3 rows per batch, 2 batches, the same token-weighted loss
    d2 = run_dict(tmp_path / "run2", steps=2, model=_model(),
                  data={"batch_size": 8, "seq_len": 64, "eval_path": str(held), "eval_batch_size": 3},
                  run={"eval_every": 1})
    from q38.train.run.run_config import RunConfig
    from q38.train.run.trainer import train

    recs = train(RunConfig.from_dict(d2))
    assert recs[-1]["eval_loss"] == pytest.approx(logged[-1]["eval_loss"], rel=1e-6)


def test_eval_cli_errors(tmp_path):
    r = q38("eval", tmp_path / "nope", "--data", "builtin:tiny")
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    r = q38("eval", tmp_path, "--data", tmp_path / "missing.jsonl")
    assert r.returncode == 2 and "--data" in r.stderr and "Traceback" not in r.stderr
    r = q38("train", "--set", "data.eval_batch_size=0", "--set", f"run.out_dir={tmp_path / 'x'}")
    assert r.returncode == 2 and "data.eval_batch_size must be a positive integer" in r.stderr
