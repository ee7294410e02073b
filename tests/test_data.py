"""Data pipeline: tokenizers, ChatML masking, packing, JSONL errors, deterministic DP loader, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from q38.train.data.loader import (
    IGNORE_INDEX,
    BatchIterator,
    DataError,
    PackedDataset,
    build_dataset,
    encode_record,
    encode_text,
    pack_documents,
    read_jsonl,
)
from q38.train.data.chat import encode_chat, render_chat_prompt
from q38.train.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

BYTE = ByteTokenizer()
CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant", "content": "6, héhé."},
    ]
}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def doc(n: int, start: int = 0) -> tuple[list[int], list[int]]:
    ids = list(range(start, start + n))
    return ids, list(ids)


# ------------------------------------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_round_trip_and_specials():
    tok = BYTE
    assert tok.vocab_size == 261
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (256, 257, 258)
    assert (tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")) == (259, 260)
    text = "Hello, wörld! 你好 🙂\n\ttabs"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode("<|im_end|>") == list(b"<|im_end|>")  # text never turns into specials
    assert tok.decode([257] + tok.encode("hi") + [258, 256]) == "<|bos|>hi<|eos|><|pad|>"
    assert tok.decode([0xFF, 300]) == "\ufffd\ufffd"  # invalid utf-8 and ids beyond the vocab
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_load_tokenizer_missing_path(tmp_path):
    missing = tmp_path / "no_such_tokenizer"
    with pytest.raises(DataError) as e:
        load_tokenizer(str(missing))
    msg = str(e.value)
    assert str(missing) in msg and "tokenizer.json" in msg and '"byte"' in msg
    with pytest.raises(DataError, match="without tokenizer.json"):
        load_tokenizer(tmp_path)
    assert issubclass(DataError, ValueError)


def _train_hf_tokenizer(directory: Path, *, chat_tokens: bool = True, config: dict | None = None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<|pad|>", "<|endoftext|>"] + (["<|im_start|>", "<|im_end|>"] if chat_tokens else [])
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"] + specials)
    corpus = ["the cat sat on the mat", "what is two plus two", "two plus two is four", "system user assistant",
              "be brief", "hello world"]
    tok.train_from_iterator(corpus, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_hf_tokenizer(tmp_path):
    d = _train_hf_tokenizer(tmp_path / "tok", config={"eos_token": {"content": "<|endoftext|>"},
                                                      "pad_token": "<|pad|>", "bos_token": None})
    tok = load_tokenizer(str(d))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == tok.token_to_id("<|endoftext|>") and tok.pad_id == tok.token_to_id("<|pad|>")
    assert tok.bos_id is None
    assert tok.vocab_size >= 10
    ids = tok.encode("two plus two is four")
    assert len(ids) == 5 and tok.decode(ids) == "two plus two is four"

    # plain text: all targets, eos last
    t_ids, t_labels = encode_text("the cat sat", tok)
    assert t_ids[-1] == tok.eos_id and t_labels == t_ids

    # chat: targets are exactly the assistant content + <|im_end|>
    msgs = [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}]
    c_ids, c_labels = encode_chat(msgs, tok)
    targets = [label for label in c_labels if label != IGNORE_INDEX]
    assert targets == tok.encode("four") + [tok.token_to_id("<|im_end|>")]
    assert c_ids.count(tok.token_to_id("<|im_start|>")) == 2

    # eos/pad fallbacks without tokenizer_config.json
    d2 = _train_hf_tokenizer(tmp_path / "tok2", chat_tokens=False)
    tok2 = HFTokenizer(d2)
    assert tok2.eos_id == tok2.token_to_id("<|endoftext|>") == tok2.pad_id
    with pytest.raises(DataError, match=r"<\|im_start\|>"):
        encode_chat(msgs, tok2)

    # a config naming a token that is not in the vocabulary
    d3 = _train_hf_tokenizer(tmp_path / "tok3", config={"eos_token": "</s>"})
    with pytest.raises(DataError, match="not in the vocabulary"):
        HFTokenizer(d3)


def test_hf_tokenizer_chat_file_error_names_line(tmp_path):
    d = _train_hf_tokenizer(tmp_path / "tok", chat_tokens=False)
    f = write_lines(tmp_path / "chat.jsonl", [json.dumps({"text": "hello world"}), json.dumps(CHAT)])
    with pytest.raises(DataError, match=rf"{f.name}:2: .*<\|im_start\|>"):
        build_dataset(f, load_tokenizer(d), 16)


# ------------------------------------------------------------------------------------------------ records


def test_text_record_all_targets_with_eos():
    ids, labels = encode_record({"text": "abc"}, BYTE)
    assert ids == [97, 98, 99, BYTE.eos_id] and labels == ids


def test_chat_masking_byte():
    ids, labels = encode_chat(CHAT["messages"], BYTE)
    assert len(ids) == len(labels)
    rendered = BYTE.decode(ids)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT["messages"])
    assert rendered == expected
    # labels equal input ids where set (not pre-shifted)
    assert all(label == i for i, label in zip(ids, labels) if label != IGNORE_INDEX)
    # the labelled tokens, decoded per contiguous span, are exactly the assistant answers + <|im_end|>
    spans, cur = [], []
    for label in labels:
        if label == IGNORE_INDEX:
            if cur:
                spans.append(cur)
                cur = []
        else:
            cur.append(label)
    if cur:
        spans.append(cur)
    assert [BYTE.decode(s) for s in spans] == ["4.<|im_end|>", "6, héhé.<|im_end|>"]
    prompt = render_chat_prompt(CHAT["messages"][:2], BYTE)
    assert BYTE.decode(prompt).endswith("<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------------------ JSONL errors


def test_read_jsonl_ok_and_blank_lines(tmp_path):
    f = write_lines(tmp_path / "d.jsonl", [json.dumps({"text": "a", "id": 3}), "", json.dumps(CHAT)])
    records = list(read_jsonl(f))
    assert records[0]["text"] == "a" and records[1] == CHAT


@pytest.mark.parametrize(
    "lines, line, pattern",
    [
        (['{"text": "ok"}', '{"text": "broken"'], 2, "malformed JSON"),
        (['{"text": "ok"}', "", '{"prompt": "x", "completion": "y"}'], 3,
         r"neither plain text nor chat \(keys: 'prompt', 'completion'\); expected \{\"text\": str\} or "
         r"\{\"messages\""),
        (['{"text": 5}'], 1, r"\"text\" must be a string, got int"),
        (['["text"]'], 1, "expected a JSON object"),
        (['{"messages": "hi"}'], 1, "non-empty list"),
        (['{"messages": [{"role": "bot", "content": "x"}]}'], 1, r"messages\[0\]\.role is 'bot'; expected one of"),
        (['{"messages": [{"role": "user", "content": 1}]}'], 1, r"messages\[0\]\.content must be a string"),
        (['{"text": "a", "messages": []}'], 1, "both"),
    ],
)
def test_read_jsonl_errors_name_file_and_line(tmp_path, lines, line, pattern):
    f = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match=rf"bad\.jsonl:{line}: .*{pattern}"):
        list(read_jsonl(f))
    with pytest.raises(DataError, match=rf"bad\.jsonl:{line}:"):
        build_dataset(f, BYTE, 32)


def test_empty_and_missing_files(tmp_path):
    empty = write_lines(tmp_path / "empty.jsonl", ["", "   "])
    with pytest.raises(DataError, match=r"empty\.jsonl contains no records"):
        list(read_jsonl(empty))
    with pytest.raises(DataError, match=r"empty\.jsonl contains no records"):
        build_dataset(empty, BYTE, 32)
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=r"nope\.jsonl not found"):
        read_jsonl(missing)  # eager: no iteration needed
    with pytest.raises(DataError, match=r"nope\.jsonl not found"):
        build_dataset(str(missing), BYTE, 32)
    with pytest.raises(DataError, match="unknown built-in corpus 'builtin:nope'; available: .*builtin:tiny"):
        build_dataset("builtin:nope", BYTE, 32)


# ------------------------------------------------------------------------------------------------ packing


def test_packing_boundaries():
    docs = [doc(3, 10), doc(4, 20), doc(2, 30), doc(6, 40), doc(8, 50), doc(1, 60)]
    docs[1][1][0] = IGNORE_INDEX  # a masked position survives packing
    rows = pack_documents(docs, 8, pad_id=0)
    assert [r.doc_ids for r in rows] == [
        [0, 0, 0, 1, 1, 1, 1, -1],
        [0, 0, 1, 1, 1, 1, 1, 1],
        [0] * 8,
        [0, -1, -1, -1, -1, -1, -1, -1],
    ]
    assert rows[0].input_ids == [10, 11, 12, 20, 21, 22, 23, 0]
    assert rows[0].labels == [10, 11, 12, IGNORE_INDEX, 21, 22, 23, IGNORE_INDEX]
    assert rows[3].input_ids == [60] + [0] * 7 and rows[3].labels == [60] + [IGNORE_INDEX] * 7
    # every document lies whole inside one row
    for ids, _ in docs:
        assert sum(all(t in r.input_ids for t in ids) for r in rows) == 1
    for r in rows:
        assert len(r.input_ids) == len(r.labels) == len(r.doc_ids) == 8
        d = [x for x in r.doc_ids if x >= 0]
        assert d == sorted(d) and d[0] == 0  # ids restart per row, increase along it
        assert all(x == -1 for x in r.doc_ids[len(d):])  # padding only at the tail


def test_packing_overlong_modes():
    docs = [doc(3, 0), doc(11, 100), doc(1, 200)]
    rows = pack_documents(docs, 4, pad_id=9, overlong="truncate")
    assert [r.input_ids for r in rows] == [[0, 1, 2, 9], [100, 101, 102, 103], [200, 9, 9, 9]]

    with pytest.raises(DataError) as e:
        pack_documents(docs, 4, pad_id=9, overlong="error", sources=["a:1", "a:2", "a:3"])
    msg = str(e.value)
    assert "sample 1 (a:2) has 11 tokens" in msg and "seq_len 4" in msg and "`overlong: truncate`" in msg

    rows = pack_documents(docs, 4, pad_id=9, overlong="split")
    assert [r.input_ids for r in rows] == [
        [0, 1, 2, 9], [100, 101, 102, 103], [104, 105, 106, 107], [108, 109, 110, 200]]
    assert rows[3].doc_ids == [0, 0, 0, 1]  # the split tail is its own document, packed with the next one
    assert rows[3].labels == [108, 109, 110, 200]

    with pytest.raises(DataError, match="overlong is 'drop'"):
        pack_documents(docs, 4, pad_id=9, overlong="drop")
    assert pack_documents([doc(4)], 4, pad_id=9)[0].doc_ids == [0] * 4  # exactly seq_len is not overlong


def test_build_dataset_overlong_error_names_line(tmp_path):
    f = write_lines(tmp_path / "d.jsonl", [json.dumps({"text": "short"}), json.dumps({"text": "x" * 50})])
    with pytest.raises(DataError, match=r"sample 1 \(.*d\.jsonl:2\) has 51 tokens.*`overlong: truncate`"):
        build_dataset(f, BYTE, 16, overlong="error")
    # 6 tokens; then 51 = 16 + 16 + 16 + 3 in pieces that each start a row
    assert build_dataset(f, BYTE, 16, overlong="split").doc_ids.tolist() == (
        [[0] * 6 + [-1] * 10, [0] * 16, [0] * 16, [0] * 16, [0] * 3 + [-1] * 13])
    assert len(build_dataset(f, BYTE, 16)) == 2


def test_builtin_tiny_corpus():
    ds = build_dataset("builtin:tiny", BYTE, 512)
    assert 150_000 < ds.num_tokens < 400_000
    assert len(ds) > 300 and ds.seq_len == 512
    assert ds.input_ids.dtype == ds.labels.dtype == ds.doc_ids.dtype == torch.int64
    assert int(ds.input_ids.max()) < BYTE.vocab_size
    pad = ds.doc_ids == -1
    assert (ds.input_ids[pad] == BYTE.pad_id).all() and (ds.labels[pad] == IGNORE_INDEX).all()
    chat = build_dataset("builtin:chat_example", BYTE, 256)
    assert 0 < chat.num_targets < chat.num_tokens


# ------------------------------------------------------------------------------------------------ loader


def _dataset(n_rows: int, seq_len: int = 4) -> PackedDataset:
    # row k holds tokens k*seq_len ... so rows are identifiable
    return PackedDataset(pack_documents([doc(seq_len, k * seq_len) for k in range(n_rows)], seq_len, pad_id=0))


def test_batches_shape_and_dtype():
    it = BatchIterator(_dataset(10), 3, seed=1)
    b = next(it)
    assert set(b) == {"input_ids", "labels", "doc_ids"}
    for v in b.values():
        assert v.shape == (3, 4) and v.dtype == torch.int64
    assert it.steps_per_epoch == 3


def test_dp_sharding_union_is_global_batch():
    ds, bs, dp, seed = _dataset(37), 2, 3, 7
    ref = BatchIterator(ds, bs * dp, seed=seed)  # one rank with the whole global batch
    ranks = [BatchIterator(ds, bs, dp_rank=r, dp_size=dp, seed=seed) for r in range(dp)]
    for _ in range(15):  # crosses several epoch boundaries (6 global batches per epoch)
        want = next(ref)["input_ids"]
        parts = [next(it)["input_ids"] for it in ranks]
        assert torch.equal(torch.cat(parts), want)
        assert len({tuple(p[:, 0].tolist()) for p in parts}) == dp  # ranks get different rows
    # each epoch is a permutation: no row repeats within an epoch
    it = BatchIterator(ds, 6, seed=seed)
    firsts = torch.cat([next(it)["input_ids"][:, 0] for _ in range(it.steps_per_epoch)])
    assert len(set(firsts.tolist())) == len(firsts)
    # epochs differ; seeds differ; no shuffle is in order
    assert not torch.equal(it.global_rows(0), it.global_rows(it.steps_per_epoch))
    assert not torch.equal(BatchIterator(ds, 6, seed=8).global_rows(0), it.global_rows(0))
    assert BatchIterator(ds, 6, shuffle=False).global_rows(1).tolist() == list(range(6, 12))


def test_resume_from_state_dict():
    ds = _dataset(23)
    kw = dict(dp_rank=1, dp_size=2, seed=3)
    a = BatchIterator(ds, 2, **kw)
    for _ in range(9):  # 5 global batches per epoch: into epoch 1
        next(a)
    state = a.state_dict()
    assert state == {"epoch": 1, "index": 4}
    expected = [next(a) for _ in range(8)]
    b = BatchIterator(ds, 2, **kw)
    b.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    for want in expected:
        got = next(b)
        for k in want:
            assert torch.equal(got[k], want[k])
    with pytest.raises(DataError, match="index=7 does not fit"):
        b.load_state_dict({"epoch": 0, "index": 7})
    with pytest.raises(DataError, match="lacks index"):
        b.load_state_dict({"epoch": 0})


def test_too_few_rows_for_global_batch():
    with pytest.raises(DataError) as e:
        BatchIterator(_dataset(5), 2, dp_rank=0, dp_size=4)
    msg = str(e.value)
    assert "5 packed rows" in msg and "needs 8" in msg and "reduce batch_size or seq_len, or add data" in msg
    with pytest.raises(DataError, match="dp_rank"):
        BatchIterator(_dataset(5), 1, dp_rank=2, dp_size=2)
