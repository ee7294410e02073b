"""prepare-data inputs in the shapes users bring: ShareGPT / Alpaca / OpenAI-style chat records (converted to
q38's messages), Hugging Face ``save_to_disk`` directories, Arrow, CSV and JSON-array files."""

from __future__ import annotations

import csv
import json
import re
import sys

import numpy as np
import pytest

from q38.cli import main
from q38.train.data import readers
from q38.train.data.loader import DataError, encode_record, validate_record
from q38.train.data.formats import to_record
from q38.train.data.prepare import prepare_data
from q38.train.data.shards import ShardRows
from q38.train.data.sources import TrainData
from q38.train.data.tokenizer import ByteTokenizer, load_tokenizer
from q38.train.run.trainer import RunConfig, train
from tests.run_utils import run_dict
from tests.test_chat import PLAIN_TEMPLATE, WEATHER_TOOL, _make_tokenizer_dir

QUIET = dict(progress=False, log=lambda s: None, workers=1)
BYTE = ByteTokenizer()

WEATHER_SCHEMA = WEATHER_TOOL["function"]  # the bare schema ShareGPT files carry

# (name, record in its own shape, the same conversation written as q38 messages)
SAME = [
    ("sharegpt", {"system": "Be brief.", "conversations": [
        {"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."},
        {"from": "human", "value": "Another?"}, {"from": "gpt", "value": "Green."}]},
     {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                   {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
                   {"role": "assistant", "content": "Green."}]}),
    ("sharegpt_tools", {"tools": json.dumps([WEATHER_SCHEMA]), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "{\"temp\": 18}"},
        {"from": "gpt", "value": "It is 18 degrees."}]},
     {"tools": [WEATHER_TOOL], "messages": [
         {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "{\"temp\": 18}"},
         {"role": "assistant", "content": "It is 18 degrees."}]}),
    ("alpaca", {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5", "system": "You add.",
                "history": [["Add 1 and 1.", "2"]]},
     {"messages": [{"role": "system", "content": "You add."}, {"role": "user", "content": "Add 1 and 1."},
                   {"role": "assistant", "content": "2"}, {"role": "user", "content": "Add the numbers.\n2 and 3"},
                   {"role": "assistant", "content": "5"}]}),
    ("alpaca_no_input", {"instruction": "Say hi.", "input": "", "output": "Hi."},
     {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]}),
    ("openai", {"tools": [WEATHER_TOOL], "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Use "}, {"type": "text", "text": "tools."}]},
        {"role": "user", "content": "Weather in Oslo?", "name": None},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"},
        {"role": "assistant", "content": "Cold: 3 degrees.", "audio": None}]},
     {"tools": [WEATHER_TOOL], "messages": [
         {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"},
         {"role": "assistant", "content": "Cold: 3 degrees."}]}),
]


@pytest.fixture(scope="module")
def tmpl_tok(tmp_path_factory):
    d = _make_tokenizer_dir(tmp_path_factory.mktemp("fmt_tok") / "plain", PLAIN_TEMPLATE)
    from transformers import AutoTokenizer

    return load_tokenizer(str(d)), AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("name,record,messages", SAME, ids=[s[0] for s in SAME])
def test_converted_records_tokenize_as_the_same_conversation_written_as_messages(name, record, messages, tmpl_tok):
    ours, hf = tmpl_tok
    converted = to_record(record, "auto", "x.jsonl:1")
    validate_record(converted, "x.jsonl:1")
    got = encode_record(converted, ours)
    want = encode_record(messages, ours)
    assert got == want
    ref = hf.apply_chat_template(messages["messages"], tools=messages.get("tools"), tokenize=True, return_dict=True)
    assert got[0] == list(ref["input_ids"])  # and both are what transformers renders
    assert to_record(record, name.split("_")[0] if name != "openai" else "messages", "w") == converted


BAD = [
    ({"conversations": [{"from": "bot", "value": "x"}]}, "auto", r"conversations\[0\]\.from is 'bot'"),
    ({"conversations": [{"from": "human", "value": 3}]}, "auto", r"conversations\[0\]\.value must be a string"),
    ({"conversations": []}, "auto", r"\"conversations\" must be a non-empty list"),
    ({"conversations": [{"from": "function_call", "value": "{not json"}]}, "auto",
     r"conversations\[0\]\.value of a function_call turn must be a JSON call"),
    ({"instruction": "a", "output": 5}, "auto", r"\"output\" must be a string"),
    ({"instruction": "a", "output": "b", "history": [["q"]]}, "auto", r"history\[0\] must be a \[query, reply\]"),
    ({"instruction": "a", "output": "b"}, "sharegpt", r"\"conversations\" must be a non-empty list"),
    ({"text": "a"}, "alpaca", r"\"instruction\" must be a string"),
    ({"text": "a"}, "messages", r"record has no \"messages\""),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "auto",
     r"messages\[0\]\.content\[0\] is a 'image_url' part"),
    ({"prompt": "a"}, "auto", r"record is neither plain text nor chat"),
]


@pytest.mark.parametrize("record,fmt,pattern", BAD)
def test_a_malformed_record_gets_one_line_naming_file_line_and_field(tmp_path, capsys, record, fmt, pattern):
    f = tmp_path / "data.jsonl"
    f.write_text(json.dumps({"text": "fine"}) + "\n\n" + json.dumps(record) + "\n")
    if fmt != "auto":  # under a named format the first record must fit it too: put the bad one first
        f.write_text(json.dumps(record) + "\n")
    assert main(["prepare-data", str(f), "--out", str(tmp_path / "out"), "--format", fmt, "--workers", "1",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    line = 3 if fmt == "auto" else 1
    assert err.count("\n") == 0 and err.startswith(f"q38 prepare-data: error: {f}:{line}: "), err
    assert re.search(pattern, err), err
    assert not (tmp_path / "out").exists()  # nothing written


def test_json_array_files_stream_one_record_at_a_time(tmp_path, monkeypatch):
    recs = [{"instruction": f"q{i} " + "é" * (i % 7), "input": "", "output": f"a{i}", "n": [1.5, i]}
            for i in range(50)]
    f = tmp_path / "alpaca.json"
    f.write_text(json.dumps(recs, indent=2))
    monkeypatch.setattr(readers, "JSON_BLOCK", 7)  # records straddle every block border
    got = [r for _, r in readers.json_array_records({"file": str(f)})]
    assert got == json.loads(f.read_text())
    f.write_text(json.dumps(recs)[:-40])
    with pytest.raises(DataError, match=rf"{f}: record 4\d: malformed JSON|{f}: the JSON array ends early"):
        list(readers.json_array_records({"file": str(f)}))


def test_without_pyarrow_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    f = tmp_path / "d.csv"
    f.write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"reading CSV files needs pyarrow, which the hf-data extra installs: pip "
                                        r"install 'q38\[hf-data\]'"):
        prepare_data([str(f)], tmp_path / "out", **QUIET)


def _docs(path, seq_len=16):
    return ShardRows(path, seq_len, tokenizer=BYTE, vocab_size=384).documents()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A DatasetDict and a Dataset saved by Hugging Face ``datasets``, a ShareGPT JSONL, an Alpaca JSON array and
    CSV, each prepared through the CLI."""
    datasets = pytest.importorskip("datasets", reason="the hf-data extra (datasets) is part of the test extra")
    tmp_path = tmp_path_factory.mktemp("formats")
    chat = [{"conversations": [{"from": "human", "value": f"Question {i}?"},
                               {"from": "gpt", "value": f"Answer {i} " + "la " * (i % 9)}]} for i in range(60)]
    text = [{"text": f"document {i}: " + "word " * (i % 13)} for i in range(80)]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(text),
                               "test": datasets.Dataset.from_list(text[:5])})
    dd.save_to_disk(str(tmp_path / "hf_dict"))
    datasets.Dataset.from_list(chat).save_to_disk(str(tmp_path / "hf_chat"))
    (tmp_path / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    alpaca = [{"instruction": f"Repeat {i}.", "input": "" if i % 2 else "twice", "output": f"{i} {i}"}
              for i in range(60)]
    (tmp_path / "alpaca.json").write_text(json.dumps(alpaca, indent=1))  # a JSON array, as Alpaca ships
    with open(tmp_path / "alpaca.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["instruction", "input", "output"])
        w.writeheader()
        w.writerows(alpaca)
    out = {k: tmp_path / f"out_{k}" for k in ("dict", "chat", "sharegpt", "alpaca", "csv")}
    quiet = ["--no-progress", "--workers", "1"]
    assert main(["prepare-data", str(tmp_path / "hf_dict"), "--out", str(out["dict"]), *quiet]) == 0
    assert main(["prepare-data", str(tmp_path / "hf_chat"), "--out", str(out["chat"]), *quiet]) == 0
    assert main(["prepare-data", str(tmp_path / "sharegpt.jsonl"), "--out", str(out["sharegpt"]), "--format",
                 "sharegpt", *quiet]) == 0
    assert main(["prepare-data", str(tmp_path / "alpaca.json"), "--out", str(out["alpaca"]), *quiet]) == 0
    assert main(["prepare-data", str(tmp_path / "alpaca.csv"), "--out", str(out["csv"]), "--format", "alpaca",
                 *quiet]) == 0
    return {"dir": tmp_path, "out": out, "chat": chat, "text": text, "alpaca": alpaca}


def test_hf_dataset_dirs_sharegpt_alpaca_and_csv_prepare_to_their_records(prepared, capsys):
    out, text, chat, alpaca, tmp_path = (prepared[k] for k in ("out", "text", "chat", "alpaca", "dir"))
    # the records, tokenized one by one, are the prepared documents
    assert _docs(out["dict"]) == [encode_record(r, BYTE) for r in text]  # the default split: train
    want_chat = [encode_record(to_record(r, "sharegpt", "-"), BYTE) for r in chat]
    assert _docs(out["chat"]) == want_chat and _docs(out["sharegpt"]) == want_chat
    want_alpaca = [encode_record(to_record(r, "alpaca", "-"), BYTE) for r in alpaca]
    assert _docs(out["alpaca"]) == want_alpaca and _docs(out["csv"]) == want_alpaca

    assert main(["prepare-data", str(tmp_path / "hf_dict"), "--split", "test", "--out", str(tmp_path / "t"),
                 "--no-progress", "--workers", "1"]) == 0
    assert _docs(tmp_path / "t") == [encode_record(r, BYTE) for r in text[:5]]
    capsys.readouterr()
    assert main(["prepare-data", str(tmp_path / "hf_dict"), "--split", "dev", "--out", str(tmp_path / "u")]) == 2
    assert f"{tmp_path / 'hf_dict'} has no split 'dev'; its splits: train, test" in capsys.readouterr().err
    assert main(["prepare-data", str(tmp_path / "hf_chat"), "--split", "dev", "--out", str(tmp_path / "u")]) == 2
    assert "is a single Dataset (no dataset_dict.json); drop --split" in capsys.readouterr().err
    assert not (tmp_path / "u").exists()


@pytest.mark.slow  # a 3-step run: ~25 s on 2 busy cores
def test_a_run_trains_on_a_hf_dir_a_sharegpt_and_an_alpaca_file(prepared, tmp_path):
    out = prepared["out"]
    d = run_dict(tmp_path / "run", steps=3)
    d["data"] = {**d["data"], "batch_size": 4,
                 "path": [{"path": str(out[k]), "weight": 1} for k in ("dict", "sharegpt", "alpaca")]}
    cfg = RunConfig.from_dict(d)
    recs = train(cfg)
    assert [r["step"] for r in recs] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in recs)
    it, _ = TrainData(d["data"]["path"], BYTE, seq_len=32, vocab_size=384).iterators(
        4, dp_rank=0, dp_size=1, seed=cfg.run.seed, shuffle=True)
    assert set(it.sample_sources(np.arange(12))[0].tolist()) == {0, 1, 2}  # the run's 12 samples


def test_a_sharegpt_jsonl_as_data_path_tokenizes_like_its_prepared_directory(tmp_path):
    """On-the-fly JSONL reading converts the chat formats too: the same documents as prepare-data's."""
    from q38.train.data.loader import load_documents

    rec = SAME[0][1]
    alp = SAME[2][1]
    f = tmp_path / "mixed.jsonl"
    f.write_text(json.dumps(rec) + "\n" + json.dumps(alp) + "\n" + json.dumps({"text": "plain"}) + "\n")
    prepare_data([str(f)], tmp_path / "out", **QUIET)
    assert load_documents(f, BYTE)[0] == ShardRows(tmp_path / "out", 8).documents()
    assert load_documents(f, BYTE)[0][:2] == [encode_record(SAME[0][2], BYTE), encode_record(SAME[2][2], BYTE)]
