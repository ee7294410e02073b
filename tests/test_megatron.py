"""Megatron indexed corpora as a data source, against Megatron-Core's own ``IndexedDatasetBuilder`` (the writer)
and ``IndexedDataset`` (the reader), loaded from the pinned megatron-core wheel (tests/megatron_ref.py)."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from q38.cli import main
from q38.train.io import checkpoint as ck
from q38.train.data.loader import DataError
from q38.train.data.megatron import MegatronRows
from q38.train.data.prepare import prepare_data
from q38.train.data.shards import ShardRows
from q38.train.data.sources import TrainData
from q38.train.data.tokenizer import ByteTokenizer
from q38.train.run.trainer import RunConfig, train
from tests import megatron_ref
from tests.run_utils import losses, run_dict, write_config

BYTE = ByteTokenizer()


@pytest.fixture(scope="module")
def mcore():
    try:
        return megatron_ref.load()
    except RuntimeError as e:
        pytest.skip(f"Megatron-Core reference unavailable: {e}")


def _documents(seed: int, n: int, vocab: int) -> list[list[list[int]]]:
    """``n`` documents of 1-3 sequences (as sentence splitting makes), some sequences empty."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, vocab, size=int(rng.integers(0, 40))).tolist() for _ in range(int(rng.integers(1, 4)))]
            for _ in range(n)]


def _reference(mcore, prefix):
    """Megatron-Core's reading: the token stream and each document's tokens."""
    ref = mcore.IndexedDataset(str(prefix))
    seqs = [np.asarray(ref[i], dtype=np.int64) for i in range(len(ref))]
    di = ref.document_indices
    docs = [np.concatenate([np.zeros(0, np.int64)] + seqs[di[d]:di[d + 1]]) for d in range(len(di) - 1)]
    return np.concatenate(seqs), docs


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 65_000), (np.int32, 248_320)])
def test_reads_token_for_token_what_megatron_core_reads(tmp_path, mcore, dtype, vocab):
    prefix = tmp_path / "corpus_text_document"
    megatron_ref.write_corpus(prefix, _documents(1, 300, vocab), dtype)
    stream, ref_docs = _reference(mcore, prefix)
    src = MegatronRows(str(prefix), 32, vocab_size=vocab)
    assert src.index.dtype == np.dtype(dtype) and src.index.num_tokens == len(stream)
    got = src.documents()
    assert [ids for ids, _ in got] == [d.tolist() for d in ref_docs]
    assert all(ids == labels for ids, labels in got)  # every token is a target
    rows = src.rows(np.arange(len(src)))
    n = len(src) * 32
    assert np.array_equal(rows["input_ids"].numpy().reshape(-1), stream[:n])
    # doc ids: each row's pieces numbered 0, 1, ... at the reference's document borders
    starts = np.cumsum([0] + [len(d) for d in ref_docs])
    for r in range(len(src)):
        pos = np.arange(r * 32, (r + 1) * 32)
        d = np.searchsorted(starts, pos, side="right") - 1
        assert rows["doc_ids"][r].tolist() == (d - d[0]).tolist()


def test_rows_equal_those_of_a_prepared_directory_of_the_same_documents(tmp_path, mcore):
    """The packing is q38's own: a Megatron corpus of a prepared directory's documents gives the same rows."""
    out = tmp_path / "prepared"
    prepare_data(["builtin:tiny"], out, progress=False, log=lambda s: None, workers=1)
    shards = ShardRows(out, 24, tokenizer=BYTE, vocab_size=384)
    assert len(shards.shards) == 1
    docs = shards.documents()
    megatron_ref.write_corpus(tmp_path / "m", [[ids] for ids, _ in docs], np.uint16)
    meg = MegatronRows(str(tmp_path / "m"), 24, tokenizer=BYTE, vocab_size=384)
    assert len(meg) == len(shards)
    a, b = shards.rows(np.arange(len(shards))), meg.rows(np.arange(len(meg)))
    for k in ("input_ids", "labels", "doc_ids"):
        assert a[k].equal(b[k]), k


def test_a_mixture_of_megatron_corpora_draws_the_reference_rows(tmp_path, mcore):
    """Two corpora (uint16 and int32) mixed by weight with an eval split: every row a batch holds is the
    reference's token stream at that source's row."""
    streams = []
    paths = []
    for i, dtype in enumerate((np.uint16, np.int32)):
        p = tmp_path / f"c{i}"
        megatron_ref.write_corpus(p, _documents(10 + i, 200, 261), dtype)
        streams.append(_reference(mcore, p)[0])
        paths.append({"path": str(p), "weight": 1 + 2 * i})
    data = TrainData(paths, BYTE, seq_len=16, vocab_size=384, eval_split=0.1)
    train_it, ev = data.iterators(4, dp_rank=0, dp_size=1, seed=3, shuffle=True)
    for step in range(5):
        batch = train_it.global_batch(step)
        src, row = train_it.sample_sources(np.arange(step * 4, step * 4 + 4))
        for j in range(4):
            want = streams[src[j]][row[j] * 16:(row[j] + 1) * 16]
            assert batch["input_ids"][j].tolist() == want.tolist()
            assert row[j] < len(data.train[src[j]])  # never an eval row
    held = [len(streams[i]) // 16 - len(data.train[i]) for i in range(2)]
    assert all(h > 0 for h in held) and sum(len(e) for e in data.eval) == sum(held)
    assert ev is not None and len(ev) >= 1


def _corpus(tmp_path, name="corpus", vocab=261, n=120, dtype=np.uint16):
    p = tmp_path / name
    megatron_ref.write_corpus(p, _documents(7, n, vocab), dtype)
    return p


@pytest.mark.slow  # three short runs: ~70 s on 2 busy cores
def test_training_on_a_megatron_corpus_resumes_exactly(tmp_path, mcore):
    import os
    import signal

    prefix = _corpus(tmp_path, n=400)
    data = {"path": str(prefix), "eval_split": 0.05}

    def cfg(out):
        d = run_dict(out, steps=4)
        d["data"] = {**d["data"], **data}
        return RunConfig.from_dict(d)

    def stop_at_2(rec):
        if rec["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    full = train(cfg(tmp_path / "full"))
    a = train(cfg(tmp_path / "cut"), on_step=stop_at_2)
    assert ck.read_meta(tmp_path / "cut" / "checkpoints" / "step_000002")["data"]["iterator"] == \
        {"consumed_samples": 4}
    b = train(cfg(tmp_path / "cut"))
    assert [r["step"] for r in b] == [3, 4]
    assert losses(a + b) == losses(full)


def _expect_error(tmp_path, capsys, path, pattern):
    d = run_dict(tmp_path / "badrun", steps=2)
    d["data"] = {**d["data"], "path": str(path)}
    assert main(["train", str(write_config(tmp_path / "bad.yaml", d))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("q38 train: error: "), err
    assert re.search(pattern, err), err
    run = tmp_path / "badrun"  # nothing written: no metrics, no checkpoint (the run's empty directories only)
    assert not (run / "metrics.jsonl").exists() and not any((run / "checkpoints").glob("*"))


def _patch_idx(idx, offset, fmt, value):
    b = bytearray(idx.read_bytes())
    struct.pack_into(fmt, b, offset, value)
    idx.write_bytes(bytes(b))


def test_bad_megatron_inputs_stop_the_run_with_one_line(tmp_path, capsys, mcore):
    ok = _corpus(tmp_path)
    seqs = struct.unpack_from("<Q", ok.with_suffix(".idx").read_bytes(), 18)[0]

    p = _corpus(tmp_path, "past")  # the last sequence's pointer runs past the .bin
    _patch_idx(p.with_suffix(".idx"), 34 + 4 * seqs + 8 * (seqs - 1), "<q", 10 ** 9)
    _expect_error(tmp_path, capsys, p, rf"{p}\.idx: sequence {seqs - 1} ends at byte 10000000\d\d, past the end of "
                                       rf"{p}\.bin \(\d+ bytes\)")

    p = _corpus(tmp_path, "trunc")
    b = p.with_suffix(".bin")
    b.write_bytes(b.read_bytes()[:-10])
    _expect_error(tmp_path, capsys, p, rf"{p}\.idx: sequence \d+ ends at byte \d+, past the end of {b} .*truncated")

    p = _corpus(tmp_path, "dtype")
    _patch_idx(p.with_suffix(".idx"), 17, "<B", 9)
    _expect_error(tmp_path, capsys, p, rf"{p}\.idx has token dtype code 9, not one of Megatron's")

    p = _corpus(tmp_path, "vocab", vocab=300)  # ids up to 299, the byte tokenizer has 261
    _expect_error(tmp_path, capsys, p, rf"{p}\.bin holds token id 2\d\d >= the tokenizer's vocab_size 261 .*"
                                       rf"set data\.tokenizer to the one it was made with")

    p = _corpus(tmp_path, "nobin")
    p.with_suffix(".bin").unlink()
    _expect_error(tmp_path, capsys, p, rf"Megatron corpus {p}: {p}\.bin not found")

    _expect_error(tmp_path, capsys, f"{tmp_path / 'none'}.idx", rf"{tmp_path / 'none'}\.idx not found")


def test_a_corpus_with_sequence_modes_and_a_bin_of_another_index(tmp_path, mcore):
    p = _corpus(tmp_path, "modes")
    idx = p.with_suffix(".idx")
    seqs = struct.unpack_from("<Q", idx.read_bytes(), 18)[0]
    idx.write_bytes(idx.read_bytes() + bytes(seqs))  # a multimodal index: one int8 mode per sequence (ignored)
    assert len(MegatronRows(str(p), 16, vocab_size=384)) > 0
    other = _corpus(tmp_path, "other", n=121)
    p.with_suffix(".bin").write_bytes(other.with_suffix(".bin").read_bytes())
    with pytest.raises(DataError, match=r"does not belong to this index|past the end of"):
        MegatronRows(str(p), 16)


def _open_on_ranks(rank, world, prefix):
    from q38.train.data import megatron

    ix = megatron.MegatronIndex(str(prefix))
    part = ix.max_token(rank, world)
    try:
        MegatronRows(str(prefix), 16, tokenizer=BYTE)
        return part, None
    except DataError as e:
        return part, str(e)


@pytest.mark.dist
def test_the_token_id_scan_is_split_over_the_ranks(tmp_path, mcore, monkeypatch):
    """Each of 2 gloo ranks reads half of the .bin's chunks; a bad id in the second half stops both ranks with the same
    line (its first position), as the one-process scan does."""
    from q38.train.data import megatron
    from tests.dist_utils import run_distributed

    monkeypatch.setattr(megatron, "CHUNK", 64)  # forked ranks inherit it: a 400-document corpus is many chunks
    prefix = _corpus(tmp_path, n=400)
    ix = megatron.MegatronIndex(str(prefix))
    assert ix.num_tokens > 8 * 64
    ok = run_distributed(_open_on_ranks, 2, prefix)
    assert [e for _, e in ok] == [None, None]
    whole = ix.max_token()
    assert max(p[1] for p, _ in ok) == whole[1] and ok[0][0] != ok[1][0]  # two different halves, one answer
    tokens = np.memmap(prefix.with_suffix(".bin"), dtype=ix.dtype, mode="r+")
    at = 64 * 5 + 3  # in chunk 5: rank 1's half (chunks 1, 3, 5, ...)
    tokens[at] = 300
    tokens[64 * 7 + 1] = 300  # a later occurrence: the line names the first
    tokens.flush()
    del tokens
    bad = run_distributed(_open_on_ranks, 2, prefix)
    assert bad[0][0][1] < 300 <= bad[1][0][1]  # only rank 1 read it
    assert bad[0][1] == bad[1][1] and f"holds token id 300 >= the tokenizer's vocab_size 261 (at token {at})" in bad[0][1]
    with pytest.raises(DataError, match=f"at token {at}\\)"):
        MegatronRows(str(prefix), 16, tokenizer=BYTE)  # one process: the same line
