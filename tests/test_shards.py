"""Token shards: prepare-data round trip against the on-the-fly path, re-runs and interruptions, the mixture sampler
(weights, epochs, data-parallel invariance, resume), held-out eval loss against a hand computation, every bad input,
and training from shards resumed mid-epoch (1 and 2 processes, dp 2 -> dp 1)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from q38.cli import main
from q38.train.io import checkpoint as ck
from q38.train.data.loader import IGNORE_INDEX, DataError, load_documents
from q38.train.data.tokenizer import ByteTokenizer
from q38.train.data import shards
from q38.train.data.prepare import prepare_data
from q38.train.data.shards import (
    MIX_BLOCK,
    EvalRows,
    MixtureIterator,
    RowSource,
    ShardRows,
    block_counts,
    feistel_permute,
    parse_mixture,
)
from q38.train.run.trainer import RunConfig, train
from tests.run_utils import REPO, losses, metrics, run_dict, write_config

BYTE = ByteTokenizer()
CORPUS = REPO / "q38" / "train" / "data" / "corpus"
CHAT = CORPUS / "chat_example.jsonl"
QUIET = dict(progress=False, log=lambda s: None)


def prep(inputs, out, **kw):
    return prepare_data([str(i) for i in inputs], out, **{**QUIET, **kw})


@pytest.fixture(scope="module")
def tiny_shards(tmp_path_factory):
    """builtin:tiny + the chat example, cut into several shards, tokenized by 2 worker processes."""
    out = tmp_path_factory.mktemp("shards") / "tiny"
    prep(["builtin:tiny", CHAT], out, workers=2, chunk_bytes=20_000)
    return out


# ---- prepare-data ---------------------------------------------------------------------------------------------------


def test_round_trip_matches_the_on_the_fly_path(tiny_shards):
    man = json.loads((tiny_shards / "manifest.json").read_text())
    assert len(man["shards"]) > 4 and man["token_dtype"] == "uint16" and man["tokenizer"]["vocab_size"] == 261
    want = load_documents("builtin:tiny", BYTE)[0] + load_documents(CHAT, BYTE)[0]
    src = ShardRows(tiny_shards, 48, tokenizer=BYTE, vocab_size=261)
    got = src.documents()
    assert len(got) == len(want) == man["num_docs"]
    assert got == [(list(i), list(lab)) for i, lab in want]  # tokens, document boundaries and chat loss masks
    assert any(IGNORE_INDEX in lab for _, lab in got)  # the chat records are really masked
    assert man["num_tokens"] == sum(len(i) for i, _ in want)
    assert man["num_targets"] == sum(sum(x != IGNORE_INDEX for x in lab) for _, lab in want)
    for s in man["shards"]:  # manifest checksums are those of the files
        for kind, f in s["files"].items():
            from q38.train.data.shards import sha256_file

            assert sha256_file(tiny_shards / f"{s['name']}.{kind}") == f["sha256"]
    # rows: the shard's token stream cut into seq_len pieces, documents numbered from 0 along each row
    L = 48
    s0 = man["shards"][0]
    n0 = s0["tokens"] // L
    stream = [t for i, _ in got[:s0["docs"]] for t in i]
    labels = [t for _, lab in got[:s0["docs"]] for t in lab]
    docs = [d for d, (i, _) in enumerate(got[:s0["docs"]]) for _ in i]
    rows = src.rows(np.array([0, 1, n0 - 1]))
    for r, k in enumerate([0, 1, n0 - 1]):
        sl = slice(k * L, (k + 1) * L)
        assert rows["input_ids"][r].tolist() == stream[sl] and rows["labels"][r].tolist() == labels[sl]
        assert rows["doc_ids"][r].tolist() == [d - docs[sl][0] for d in docs[sl]]
    assert len(src) == sum(s["tokens"] // L for s in man["shards"])


def test_rerun_does_nothing_and_a_change_rebuilds(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"text": f"document {i} " * 5}) + "\n" for i in range(50)))
    out = tmp_path / "out"
    first = prep([a], out, chunk_bytes=1000, workers=1)
    assert "skipped" not in first
    stamp = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    assert prep([a], out)["skipped"] is True  # unchanged: nothing rewritten
    os.utime(a, ns=(1, 1))  # touched, same content: still nothing to do (the sha256 decides)
    assert prep([a], out)["skipped"] is True
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir() if f.name != "manifest.json"} == \
        {k: v for k, v in stamp.items() if k != "manifest.json"}
    a.write_text(json.dumps({"text": "one short document"}) + "\n")  # changed: rebuilt, stale shards removed
    m = prep([a], out, chunk_bytes=1000)
    assert "skipped" not in m and len(m["shards"]) == 1
    assert sorted(f.name for f in out.iterdir()) == ["manifest.json", "shard_000000.docs", "shard_000000.tokens"]
    assert ShardRows(out, 4).documents() == [(BYTE.encode("one short document") + [BYTE.eos_id],) * 2]


def test_interrupted_preparation_leaves_no_manifest(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))
    out = tmp_path / "out"
    prep([good], out)
    bad = tmp_path / "z_bad.jsonl"  # the failure comes after the first file's shards were written
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + "{not json\n")
    with pytest.raises(DataError, match=r"z_bad\.jsonl:2: malformed JSON"):
        prep([good, bad], out, workers=1)
    assert not (out / "manifest.json").exists()  # the old manifest went before the first new shard was written
    assert not [f for f in out.iterdir() if ".tmp-" in f.name]
    with pytest.raises(DataError, match=r"has no manifest\.json \(not prepared, or its preparation was interrupted\)"):
        ShardRows(out, 8)
    prep([good], out)  # a re-run completes it
    assert ShardRows(out, 8).manifest["num_docs"] == 40


def test_prepare_cli_and_parquet_error(tmp_path, capsys, monkeypatch):
    assert main(["prepare-data", str(CHAT), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    assert "q38 prepare-data: wrote" in capsys.readouterr().out
    pq = tmp_path / "x.parquet"
    pq.write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    assert main(["prepare-data", str(pq), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "reading Parquet needs pyarrow (pip install pyarrow)" in err


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    recs = [json.loads(x) for x in CHAT.read_text().splitlines() if x.strip()]
    recs += [{"text": "plain text"}]
    table = pa.Table.from_pylist([{"text": r.get("text"), "messages": r.get("messages")} for r in recs])
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    prep([tmp_path / "d.parquet"], tmp_path / "o")
    from q38.train.data.loader import encode_record

    assert ShardRows(tmp_path / "o", 8).documents() == [encode_record(r, BYTE) for r in recs]


# ---- sampler ------------------------------------------------------------------------------------------------------


def test_feistel_is_a_permutation():
    for n in (1, 2, 3, 7, 64, 1000, 4099):
        p = feistel_permute(np.arange(n), n, key=12345)
        assert sorted(p.tolist()) == list(range(n)), n
    a, b = feistel_permute(np.arange(100), 100, 1), feistel_permute(np.arange(100), 100, 2)
    assert a.tolist() != b.tolist() and a.tolist() != list(range(100))


class FakeRows(RowSource):
    """Row ``k`` of source ``i``: every token is ``i * 10000 + k`` (so a batch says where each row came from)."""

    def __init__(self, i: int, n: int, seq_len: int = 4) -> None:
        self.i, self.n, self.seq_len, self.name = i, n, seq_len, f"fake{i}"

    def __len__(self) -> int:
        return self.n

    def rows(self, idx):
        self.reads = getattr(self, "reads", 0) + len(idx)
        v = torch.as_tensor(np.asarray(idx) + self.i * 10000).view(-1, 1).expand(-1, self.seq_len)
        return {"input_ids": v.clone(), "labels": v.clone(), "doc_ids": torch.zeros_like(v)}


def _ids(batch):
    return batch["input_ids"][:, 0].tolist()


def test_mixture_draws_each_source_at_its_weight():
    weights = [0.2, 0.5, 0.3]
    srcs = [FakeRows(0, 1000), FakeRows(1, 50), FakeRows(2, 7)]
    it = MixtureIterator(srcs, weights, 64, seed=3)
    n = 4 * MIX_BLOCK
    src, row = it.sample_sources(np.arange(n))
    frac = np.bincount(src, minlength=3) / n
    # Each block of MIX_BLOCK samples holds the largest-remainder integer shares, so over whole blocks every
    # fraction is within 1 / MIX_BLOCK of its weight.
    assert np.abs(frac - weights).max() <= 1 / MIX_BLOCK
    assert (np.bincount(src, minlength=3) == 4 * block_counts(weights)).all()
    # within any 2000-sample window (a hypergeometric draw from a block): within 0.05 of the weight
    f2 = np.bincount(src[5000:7000], minlength=3) / 2000
    assert np.abs(f2 - weights).max() < 0.05
    # every source's samples walk through all of its rows once per epoch, in a new order each epoch
    for i, s in enumerate(srcs):
        r = row[src == i]
        epochs = [r[e * len(s):(e + 1) * len(s)] for e in range(len(r) // len(s))]
        assert len(epochs) >= 2
        for e in epochs:
            assert sorted(e.tolist()) == list(range(len(s)))
        assert epochs[0].tolist() != epochs[1].tolist()


def test_sample_order_is_a_function_of_seed_and_step_and_keeps_the_global_order_across_dp():
    srcs = [FakeRows(0, 300), FakeRows(1, 200)]
    one = MixtureIterator(srcs, [1, 3], 8, seed=7)
    ref = [_ids(next(one)) for _ in range(10)]  # 10 steps of the global batch of 8
    two = [MixtureIterator(srcs, [1, 3], 4, dp_rank=r, dp_size=2, seed=7) for r in range(2)]
    for s in range(10):
        before = sum(getattr(x, "reads", 0) for x in srcs)
        mine = _ids(next(two[0]))
        assert sum(x.reads for x in srcs) - before == 4  # a rank reads only its own rows
        assert mine + _ids(next(two[1])) == ref[s]
    assert _ids(two[0].global_batch(5)) == ref[5]
    # resume from a dp 2 checkpoint at step 4 with dp 1: the same global order
    state = two[0].state_dict()
    assert state == {"consumed_samples": 80}
    fresh = MixtureIterator(srcs, [1, 3], 8, seed=7)
    two_again = MixtureIterator(srcs, [1, 3], 4, dp_rank=1, dp_size=2, seed=7)
    two_again.load_state_dict({"consumed_samples": 32})
    fresh.load_state_dict({"consumed_samples": 32})
    assert _ids(next(fresh)) == ref[4] and _ids(next(two_again)) == ref[4][4:]
    assert _ids(MixtureIterator(srcs, [1, 3], 8, seed=8).global_batch(0)) != ref[0]  # the seed matters
    # another global batch size continues the same sample stream
    small = MixtureIterator(srcs, [1, 3], 2, seed=7)
    small.load_state_dict({"consumed_samples": 36})
    assert _ids(next(small)) + _ids(next(small)) == ref[4][4:]
    with pytest.raises(DataError, match="not from prepared shards"):
        fresh.load_state_dict({"epoch": 0, "index": 3})


def test_parse_mixture():
    assert parse_mixture("a") == [("a", 1.0)]
    assert parse_mixture([{"path": "a", "weight": 0.3}, {"path": "b", "weight": "0.7"}]) == [("a", 0.3), ("b", 0.7)]
    for bad, msg in [([{"path": "a", "weight": "x"}], "not a number"), ([{"path": "a", "weight": -1}], ">= 0"),
                     ([{"path": "a", "weight": 0}, {"path": "b", "weight": 0.0}], "sum to 0"),
                     ([{"path": "a"}], "list of {path"), ([], "list of {path")]:
        with pytest.raises(DataError, match=msg):
            parse_mixture(bad)


def test_eval_rows_cover_the_split_once():
    srcs = [FakeRows(0, 10), FakeRows(1, 7)]
    ev = EvalRows(srcs, 2, dp_size=2)
    assert ev.num_batches == 5  # ceil(17 / 4): the last batch holds 1 row and 3 padding rows
    batches = [ev.global_batch(k) for k in range(ev.num_batches)]
    seen = [x for b in batches for x, d in zip(_ids(b), b["doc_ids"][:, 0].tolist()) if d >= 0]
    assert len(seen) == 17 and set(seen) == {*range(10), *range(10000, 10007)}
    last = ev.global_batch(4)
    assert (last["doc_ids"][1:] == -1).all() and (last["labels"][1:] == -100).all() and (last["doc_ids"][0] >= 0).all()
    ranks = [EvalRows(srcs, 2, dp_rank=r, dp_size=2, max_batches=2) for r in range(2)]
    assert ranks[0].num_batches == 2
    assert _ids(ranks[0].batch(1)) + _ids(ranks[1].batch(1)) == _ids(ev.global_batch(1))
    small = EvalRows(srcs, 20, dp_size=2)  # fewer rows than one global batch of 40: one padded batch
    assert small.num_batches == 1 and int((small.global_batch(0)["doc_ids"][:, 0] >= 0).sum()) == 17
    with pytest.raises(DataError, match="no rows"):
        EvalRows([FakeRows(0, 0)], 2)


# ---- training from shards -------------------------------------------------------------------------------------------


def shard_run(out, data, steps=6, **sections):
    d = run_dict(out, steps=steps, **sections)
    d["data"] = {**d["data"], **data}
    return d


def _sigterm_at(step):
    def hook(rec):
        if rec["step"] == step:
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def test_resume_mid_epoch_from_shards_is_exact(tmp_path, tiny_shards):
    data = {"path": [{"path": str(tiny_shards), "weight": 1}, {"path": "builtin:tiny", "weight": 0.5}]}
    full = train(RunConfig.from_dict(shard_run(tmp_path / "full", data, steps=4)))
    out = tmp_path / "cut"
    a = train(RunConfig.from_dict(shard_run(out, data, steps=4)), on_step=_sigterm_at(2))
    assert ck.read_meta(out / "checkpoints" / "step_000002")["data"]["iterator"] == {"consumed_samples": 4}
    b = train(RunConfig.from_dict(shard_run(out, data, steps=4)))
    assert [r["step"] for r in b] == [3, 4]
    assert losses(a + b) == losses(full)  # exact
    assert [r["mtp_1"] for r in a + b] == [r["mtp_1"] for r in full]


def test_eval_loss_equals_a_hand_computed_mean(tmp_path):
    """The eval set: 6 rows of 24 tokens from a prepared directory. Hand computation: the model's forward on each
    row (doc ids by hand), CE of every same-document next token (and, for MTP, the token after it) by a loop."""
    from q38.model import forward, head_weight

    texts = [f"eval doc {i} " + "xyz" * i for i in range(7)]
    jl = tmp_path / "eval.jsonl"
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prep([jl], tmp_path / "ev")
    L, n_rows = 24, 6
    stream = [t for x in texts for t in BYTE.encode(x) + [BYTE.eos_id]]
    docs = [d for d, x in enumerate(texts) for _ in range(len(BYTE.encode(x)) + 1)]
    assert len(stream) // L == n_rows  # every row of the set is evaluated (batch 2: 3 global batches)
    out = tmp_path / "run"
    recs = train(RunConfig.from_dict(shard_run(out, {"eval_path": str(tmp_path / "ev"), "seq_len": L}, steps=1,
                                               run={"eval_every": 1})))
    assert [("eval_loss" in r) for r in recs] == [True] and recs[-1]["eval_tokens"] > 0
    cfg, params, _ = ck.load_params(out)
    w = head_weight(params)
    tot = {0: 0.0, 1: 0.0}
    cnt = {0: 0, 1: 0}
    with torch.no_grad():
        for k in range(n_rows):
            ids = stream[k * L:(k + 1) * L]
            dk = [d - docs[k * L] for d in docs[k * L:(k + 1) * L]]
            mtp_in = [ids[t + 1] if t + 1 < L and dk[t + 1] == dk[t] else 0 for t in range(L)]
            o = forward(params, torch.tensor([ids]), cfg, doc_ids=torch.tensor([dk]),
                        mtp_input_ids=(torch.tensor([mtp_in]),))
            for depth, h in ((0, o.hidden[0]), (1, o.mtp_hidden[0][0])):
                logits = (h.double() @ w.double().T).log_softmax(-1)
                for t in range(L):
                    u = t + 1 + depth
                    if u < L and all(dk[v] == dk[t] for v in range(t, u + 1)):
                        tot[depth] -= float(logits[t, ids[u]])
                        cnt[depth] += 1
    assert recs[-1]["eval_tokens"] == cnt[0]
    assert recs[-1]["eval_loss"] == pytest.approx(tot[0] / cnt[0], rel=1e-5)
    assert recs[-1]["eval_mtp_1"] == pytest.approx(tot[1] / cnt[1], rel=1e-5)
    assert metrics(out)[-1]["eval_loss"] == recs[-1]["eval_loss"]


def test_eval_split_of_a_jsonl_path_and_the_console_line(tmp_path, capsys):
    recs = train(RunConfig.from_dict(shard_run(tmp_path / "r", {"eval_split": 0.02}, steps=2,
                                               run={"eval_batches": 2})))
    assert "eval_loss" not in recs[0] and recs[1]["eval_loss"] > 0  # eval_every 0: after the last step only
    assert recs[1]["eval_tokens"] > 0
    assert "| eval loss " in capsys.readouterr().out


def test_the_eval_is_bounded_by_default_and_shows_its_progress(tmp_path, monkeypatch):
    """``run.eval_batches`` defaults to a bounded eval (EVAL_BATCHES global batches of the shuffled split), 0 walks
    the whole split; an eval longer than PROGRESS_AFTER_S shows a bar counting its batches."""
    import io
    import sys

    from q38.model_config import ModelConfig
    from q38.model import init_params
    from q38.train.run import evaluate
    from q38.train.core.step_config import TrainConfig
    from q38.train.run.run_config import EVAL_BATCHES, RunOptions
    from q38.train.data.shards import PackedRows
    from q38.train.data.sources import TrainData
    from q38.train.core.state import state_from_params
    from tests.run_utils import small_model_dict

    assert RunOptions().eval_batches == EVAL_BATCHES == 16
    data = TrainData("builtin:tiny", BYTE, seq_len=16, vocab_size=384, eval_split=0.9)
    bounded = data.iterators(1, dp_rank=0, dp_size=1, seed=0, shuffle=True, eval_batches=RunOptions().eval_batches)[1]
    whole = data.iterators(1, dp_rank=0, dp_size=1, seed=0, shuffle=True, eval_batches=0)[1]
    assert len(bounded) == 16 < len(whole) == whole.total
    assert isinstance(data.eval[0].base, PackedRows)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    cfg = ModelConfig.from_dict(small_model_dict())
    state = state_from_params(init_params(cfg, seed=0), cfg, TrainConfig(loss_chunk_size=64))
    ev = data.iterators(1, dp_rank=0, dp_size=1, seed=0, shuffle=True, eval_batches=3)[1]
    monkeypatch.setattr(evaluate, "PROGRESS_AFTER_S", 0.0)
    for progress, shown in ((True, True), (False, False)):
        monkeypatch.setattr(sys, "stdout", Terminal())
        out = evaluate.eval_losses(state, ev, progress=progress)
        # the bar with its total (how often tqdm redraws, and so whether "3/3" is drawn before the bar is cleared,
        # depends on the machine's speed)
        assert ("eval:" in sys.stdout.getvalue() and "/3 [" in sys.stdout.getvalue()) is shown
        assert out["eval_tokens"] > 0
    assert evaluate.eval_losses(state, ev) == evaluate.eval_losses(state, (ev.batch(k) for k in range(3)))


def test_default_config_prints_an_eval_loss():
    cfg = RunConfig.from_yaml()  # specs/train/tiny.yaml, what `q38 train` runs
    assert cfg.data.eval_split > 0 and cfg.run.eval_every > 0 and cfg.run.steps % cfg.run.eval_every == 0


# ---- bad input: one stderr line naming the file and the fix, exit 2, before any step ---------------------------------


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _expect_error(tmp_path, capsys, data, pattern, **sections):
    cfg = write_config(tmp_path / "bad.yaml", shard_run(tmp_path / "badrun", data, steps=2, **sections))
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("q38 train: error: "), err
    assert __import__("re").search(pattern, err), err
    assert not (tmp_path / "badrun" / "metrics.jsonl").exists()  # no step ran
    return err


def test_bad_shard_inputs(tmp_path, capsys, tiny_shards):
    d = _copy(tiny_shards, tmp_path / "trunc")
    tok = d / "shard_000002.tokens"
    tok.write_bytes(tok.read_bytes()[:-6])
    _expect_error(tmp_path, capsys, {"path": str(d)},
                  rf"shard file {tok} has \d+ bytes but .*manifest\.json says .*re-run `q38 prepare-data")

    d = _copy(tiny_shards, tmp_path / "missing")
    (d / "shard_000001.docs").unlink()
    _expect_error(tmp_path, capsys, {"path": str(d)}, rf"shard file {d / 'shard_000001.docs'} .* is missing")

    d = _copy(tiny_shards, tmp_path / "vocab")
    man = json.loads((d / "manifest.json").read_text())
    man["shards"][3]["max_token_id"] = 400  # the model's vocab_size is 384
    (d / "manifest.json").write_text(json.dumps(man))
    _expect_error(tmp_path, capsys, {"path": str(d)},
                  rf"{d / 'shard_000003.tokens'} holds token id 400 >= the model's vocab_size 384")

    empty = tmp_path / "empty"  # (not tmp_path itself: the run writes under tmp_path, and a run never writes into its data)
    empty.mkdir()
    _expect_error(tmp_path, capsys, {"path": str(empty)}, rf"{empty} has no manifest\.json")


def test_bad_token_in_a_shard_is_caught_when_the_shard_is_first_read(tmp_path, tiny_shards, monkeypatch):
    """The manifest's max_token_id is not trusted: the first read of a shard checks all of its tokens, so a row
    without the bad token is refused as well, and the line names the shard file and the row. The file is read in
    chunks of ID_CHUNK tokens (bounded memory): at 16, the bad token lies in the third, and its position is still
    counted from the start of the shard."""
    monkeypatch.setattr(shards, "ID_CHUNK", 16)
    d = _copy(tiny_shards, tmp_path / "tampered")
    arr = np.fromfile(d / "shard_000000.tokens", dtype=np.uint16)
    arr[37] = 999
    arr.tofile(d / "shard_000000.tokens")
    src = ShardRows(d, 16, vocab_size=384)
    src.rows(np.array([src.cum_rows[1]]))  # another shard reads fine
    for row in (0, 2, 5):
        with pytest.raises(DataError, match=r"shard_000000\.tokens holds token id 999 >= the model's vocab_size 384 "
                                            r"at token 37 \(row 2 of the shard at seq_len 16\)"):
            src.rows(np.array([row]))
    assert len(ShardRows(d, 16).rows(np.array([2]))["input_ids"]) == 1  # without a vocab_size: not checked


def test_tokenizer_mismatch(tmp_path, capsys, tiny_shards):
    from tests.test_data import _train_hf_tokenizer

    hf = _train_hf_tokenizer(tmp_path / "tok", config={"eos_token": "<|endoftext|>"})
    _expect_error(tmp_path, capsys, {"path": str(tiny_shards), "tokenizer": str(hf)},
                  rf"{tiny_shards / 'manifest.json'} was prepared with tokenizer 'byte' .* but the run uses "
                  rf"'{hf}'.*set data\.tokenizer")


def test_bad_weights(tmp_path, capsys, tiny_shards):
    for weights, pattern in [(["x", 1], r"data\.path\[0\]\.weight 'x' is not a number"),
                             ([0, 0], r"data\.path weights sum to 0"), ([-1, 2], r"must be a finite number >= 0")]:
        data = {"path": [{"path": str(tiny_shards), "weight": weights[0]}, {"path": "builtin:tiny",
                                                                            "weight": weights[1]}]}
        _expect_error(tmp_path, capsys, data, pattern)


def test_no_trainable_tokens(tmp_path, capsys):
    jl = tmp_path / "users_only.jsonl"
    jl.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "hello there " * 10}]}) + "\n"
                          for _ in range(20)))
    with pytest.raises(DataError, match="hold 20 documents but no trainable target under --train-on assistant"):
        prep([jl], tmp_path / "nt", workers=2, chunk_bytes=500)  # several shards, none with a target
    assert not (tmp_path / "nt").exists()  # the refused preparation removed the directory it made
    m = prep([jl], tmp_path / "all", train_on="all")  # every token a target: accepted
    assert m["num_targets"] == m["num_tokens"] and m["train_on"] == "all"
    man = json.loads((tmp_path / "all" / "manifest.json").read_text())
    man["num_targets"] = 0  # a directory whose manifest counts no target (e.g. prepared by an older q38)
    (tmp_path / "all" / "manifest.json").write_text(json.dumps(man))
    _expect_error(tmp_path, capsys, {"path": str(tmp_path / "all"), "train_on": "all"},
                  rf"{tmp_path / 'all'} has no trainable tokens .*--train-on all")
    _expect_error(tmp_path, capsys, {"path": str(jl)}, rf"{jl} has no trainable tokens \(every token is masked "
                  r"under data\.train_on: assistant.*set data\.train_on: all")


def test_train_on_is_prepared_into_the_shards(tmp_path, capsys):
    """``--train-on`` picks the chat targets stored in the shards; a run must use the same data.train_on."""
    m = prep([CHAT], tmp_path / "last", train_on="last_assistant")
    assert ShardRows(tmp_path / "last", 8).documents() == [
        (i, lab) for i, lab in load_documents(CHAT, BYTE, train_on="last_assistant")[0]]
    assert prep([CHAT], tmp_path / "last", train_on="last_assistant")["skipped"] is True
    assert "skipped" not in prep([CHAT], tmp_path / "last")  # another train_on: prepared again
    assert m["num_targets"] < json.loads((tmp_path / "last" / "manifest.json").read_text())["num_targets"]
    _expect_error(tmp_path, capsys, {"path": str(tmp_path / "last"), "train_on": "last_assistant"},
                  r"was prepared with --train-on assistant but data\.train_on is last_assistant")


def test_eval_settings_errors(tmp_path, capsys):
    _expect_error(tmp_path, capsys, {}, r"run\.eval_every is 5 but there is no eval data; set data\.eval_split",
                  run={"eval_every": 5})
    _expect_error(tmp_path, capsys, {"eval_split": 1.5}, r"data\.eval_split must be a fraction in \[0, 1\)")


# ---- multi-process --------------------------------------------------------------------------------------------------


def _two_rank_shard_run(rank, world, out, shards, steps, stop_at):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        hook = _sigterm_at(stop_at) if (stop_at and rank == 0) else None
        d = shard_run(out, {"path": shards, "eval_path": shards}, steps=steps, layout="fsdp",
                      run={"eval_every": 2, "eval_batches": 1})
        return [(r["loss"], r.get("eval_loss")) for r in train(RunConfig.from_dict(d), on_step=hook)]
    finally:
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(k, None)


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_from_shards_resume_and_dp2_to_dp1(tmp_path, tiny_shards):
    from tests.dist_utils import run_distributed

    full = run_distributed(_two_rank_shard_run, 2, str(tmp_path / "full"), str(tiny_shards), 4, 0)
    assert full[0] == full[1] and len(full[0]) == 4 and full[0][1][1] is not None
    a = run_distributed(_two_rank_shard_run, 2, str(tmp_path / "cut"), str(tiny_shards), 4, 2)
    b = run_distributed(_two_rank_shard_run, 2, str(tmp_path / "cut"), str(tiny_shards), 4, 0)
    assert a[0] + b[0] == full[0]  # exact, eval losses included
    # dp 2 -> dp 1 with the same global batch (2 ranks x 2 rows = 1 rank x 4 rows): the same samples, so the same
    # losses up to the order of the floating-point sums over ranks
    cut2 = tmp_path / "cut2"
    run_distributed(_two_rank_shard_run, 2, str(cut2), str(tiny_shards), 4, 2)
    d = shard_run(cut2, {"path": str(tiny_shards), "batch_size": 4, "eval_path": str(tiny_shards)}, steps=4,
                  run={"eval_every": 2, "eval_batches": 1})
    one = train(RunConfig.from_dict(d))
    assert [r["step"] for r in one] == [3, 4]
    for r, (loss, ev) in zip(one, full[0][2:]):
        assert r["loss"] == pytest.approx(loss, rel=1e-5)
        if ev is not None:
            assert r["eval_loss"] == pytest.approx(ev, rel=1e-5)
