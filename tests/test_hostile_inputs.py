"""Hostile inputs other than checkpoints (issue 40): Hugging Face dataset directories, Arrow / CSV / JSON-array /
Parquet files, safetensors indexes, JSON of every kind, model configs, LoRA ranks, block-FP8 scales, Megatron
corpora and run seeds, as an attacker or a careless operator would give them.

Every case ends in one line and exit 2, and: a name that leads out of its input (``..``, an absolute path, a symlink
out) opens nothing outside (the outside file's atime is watched); a corrupt Arrow batch is refused before a byte of
it is read (the real CLI, in a subprocess: it used to die of SIGBUS); an oversized record, rank or model is refused
before it is allocated (the forked child's peak RSS, ``wait4``'s ``ru_maxrss``, stays far below what materialising
it takes); deep JSON is refused by its nesting bound, never a ``RecursionError``.
"""

import json
import os
import struct
import time
from pathlib import Path

import pytest
import torch

from q38.cli import main
from q38.model_config import ModelConfig
from tests.run_utils import q38, run_dict, write_config
from tests.test_bad_inputs import _assert_one_line
from tests.test_hostile_checkpoints import in_child

pa = pytest.importorskip("pyarrow")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# a small model whose every dimension differs from the tiny preset's
CFG = ModelConfig.preset("tiny").replace(
    vocab_size=300, hidden_size=48, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
    num_attention_heads=6, num_key_value_heads=2, head_dim=8, linear_num_key_heads=3, linear_num_value_heads=6,
    linear_key_head_dim=8, linear_value_head_dim=12, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
    shared_expert_intermediate_size=20, mtp_num_layers=0)
RECORD = 64 << 20  # an oversized record: 4x the 16 MiB bound
RSS_BOUND = 300 << 20  # peak RSS growth of a refusing child; materialising a RECORD record takes over 1 GB


# ---- helpers --------------------------------------------------------------------------------------------------------


class Watched:
    """Files outside an input: whether anything read them (their atime, set three days back so a relatime mount
    updates it on the next read; not checked where the filesystem keeps no atime) or changed them."""

    def __init__(self, *paths: Path) -> None:
        self.paths = [p for path in paths for p in ([path] if path.is_file() else sorted(path.rglob("*")))
                      if p.is_file()]
        old = time.time() - 3 * 86400
        for p in self.paths:
            os.utime(p, (old, old))
        self.stat = {p: os.stat(p) for p in self.paths}
        probe = self.paths[0].with_name(".atime-probe")
        probe.write_bytes(b"x")
        os.utime(probe, (old, old))
        a = os.stat(probe).st_atime_ns
        probe.read_bytes()
        self.atime_works = os.stat(probe).st_atime_ns != a
        probe.unlink()

    def untouched(self) -> list[str]:
        """The watched files that were read or changed (empty: none)."""
        bad = []
        for p, st in self.stat.items():
            now = os.stat(p)
            if now.st_mtime_ns != st.st_mtime_ns or (self.atime_works and now.st_atime_ns != st.st_atime_ns):
                bad.append(str(p))
        return bad


def _arrow(path: Path, texts: list[str]) -> Path:
    """An Arrow IPC stream of one ``text`` column (the format of a ``save_to_disk`` data file)."""
    table = pa.table({"text": pa.array(texts, pa.large_string() if sum(map(len, texts)) > 1 << 30 else pa.string())})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return path


def _dataset(d: Path, texts: list[str], files=None) -> Path:
    """A ``save_to_disk`` directory: its Arrow file and ``state.json`` (``files``: the names it lists)."""
    d.mkdir(parents=True, exist_ok=True)
    _arrow(d / "data-00000-of-00001.arrow", texts)
    names = files if files is not None else ["data-00000-of-00001.arrow"]
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (d / "dataset_info.json").write_text("{}")
    return d


def _hf_dir(tmp: Path, name: str = "hf") -> Path:
    """A Hugging Face directory of ``CFG`` (one ``model.safetensors``)."""
    from q38.hf import save_hf
    from q38.model import init_params

    return save_hf(tmp / name, CFG, init_params(CFG, seed=3))


def _sharded(hf: Path, names: list[str], weights: Path) -> None:
    """Give ``hf`` an index naming the tensors of ``weights`` in ``len(names)`` runs, run ``i`` in file
    ``names[i]``."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as fh:
        keys = list(fh.keys())
    n = -(-len(keys) // len(names))
    weight_map = {k: names[i // n] for i, k in enumerate(keys)}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _prepare(inp, out) -> list[str]:
    return ["prepare-data", str(inp), "--out", str(out), "--no-progress", "--workers", "1"]


def _deep(n: int) -> str:
    return "[" * n + "]" * n


# ---- paths stay inside their input ---------------------------------------------------------------------------------


def _split_out(t: Path, how: str):
    victim = _dataset(t / "victim_ds", ["a secret record"])
    d = t / "dd"
    d.mkdir()
    split = "../victim_ds" if how == "dotdot" else str(victim)
    (d / "dataset_dict.json").write_text(json.dumps({"splits": [split]}))
    return _prepare(d, t / "o"), ["not a plain directory name", "refused"], [victim]


def _data_file_out(t: Path, how: str):
    victim = _arrow(t / "victim.arrow", ["a secret record"])
    d = _dataset(t / "ds", ["x"], files=["../victim.arrow" if how == "dotdot" else "linked.arrow"])
    if how == "symlink":
        (d / "linked.arrow").symlink_to(victim)
    needle = "leaves its directory" if how == "dotdot" else "symbolic link to"
    return _prepare(d, t / "o"), [needle, "refused"], [victim]


def _dir_input_symlink_out(t: Path):
    victim = t / "victim.jsonl"
    victim.write_text(json.dumps({"text": "a secret record"}) + "\n")
    d = t / "in"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"text": "mine"}) + "\n")
    (d / "b.jsonl").symlink_to(victim)
    return _prepare(d, t / "o"), ["'b.jsonl' is a symbolic link to", "refused"], [victim]


def _index_out(t: Path, how: str):
    """A sharded checkpoint with one shard inside and one named outside (``../``, an absolute path, or a symlink
    that leads out)."""
    import shutil

    hf = _hf_dir(t)
    outside = t / "outside"
    outside.mkdir()
    victim = outside / "model.safetensors"
    shutil.copy(hf / "model.safetensors", victim)
    (hf / "model.safetensors").rename(hf / "model-00001-of-00002.safetensors")
    if how == "symlink":
        (hf / "model-00002-of-00002.safetensors").symlink_to(victim)
        second, needle = "model-00002-of-00002.safetensors", "symbolic link to"
    else:
        second, needle = "../outside/model.safetensors" if how == "dotdot" else str(victim), "leaves its directory"
    _sharded(hf, ["model-00001-of-00002.safetensors", second], victim)
    return ["convert", "--from-hf", str(hf), str(t / "ck")], [needle, "refused"], [victim]


PATH_CASES = {
    "split-dotdot": lambda t: _split_out(t, "dotdot"),
    "split-absolute": lambda t: _split_out(t, "absolute"),
    "data-file-dotdot": lambda t: _data_file_out(t, "dotdot"),
    "data-file-symlink-out": lambda t: _data_file_out(t, "symlink"),
    "dir-input-symlink-out": _dir_input_symlink_out,
    "index-shard-dotdot": lambda t: _index_out(t, "dotdot"),
    "index-shard-absolute": lambda t: _index_out(t, "absolute"),
    "index-shard-symlink-out": lambda t: _index_out(t, "symlink"),
}


@pytest.mark.parametrize("name", list(PATH_CASES))
def test_a_path_out_of_its_input_is_refused_and_nothing_outside_is_opened(name, tmp_path, capsys):
    argv, needles, outside = PATH_CASES[name](tmp_path)
    watched = Watched(*outside)
    capsys.readouterr()
    rc = main(argv)
    _assert_one_line(rc, capsys.readouterr().err, argv[0], needles)
    assert watched.untouched() == [], "a file outside the input was opened"
    assert not (tmp_path / "o").exists() and not (tmp_path / "ck").exists()


def test_a_hub_cache_snapshot_links_into_its_own_blobs(tmp_path):
    """The Hugging Face hub cache layout (``models--org--name/snapshots/REV/FILE`` linking to ``../../blobs/HASH``)
    is read: a symlink into the repository's own blobs stays inside the input."""
    hf = _hf_dir(tmp_path)
    repo = tmp_path / "models--q38--small"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in hf.iterdir():
        blob = repo / "blobs" / f"{hash(f.name) & 0xFFFFFF:06x}"
        f.rename(blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    assert main(["convert", "--from-hf", str(snap), str(tmp_path / "ck")]) == 0


# ---- Arrow validated before use ------------------------------------------------------------------------------------


def test_corrupt_arrow_offsets_are_one_line_not_a_crash(tmp_path):
    """String offsets past the data buffer: refused by pyarrow's full validation before any row is read (the
    unchecked reader died of SIGBUS, exit 135, or read past the buffer)."""
    f = _arrow(tmp_path / "bad.arrow", ["hello", "world"])
    data = bytearray(f.read_bytes())
    offsets = struct.pack("<3i", 0, 5, 10)
    at = data.find(offsets)
    assert at > 0 and data.find(offsets, at + 1) < 0
    data[at + 8:at + 12] = struct.pack("<i", 0x7FFF0000)  # the last offset: 2 GB past a 10-byte buffer
    f.write_bytes(bytes(data))
    r = q38(*_prepare(f, tmp_path / "o"), timeout=300)
    _assert_one_line(r.returncode, r.stderr, "prepare-data", ["bad.arrow: record batch 0 is corrupt", "offset"])


# ---- records, ranks and models bounded before they are allocated ---------------------------------------------------


def _big_arrow(t: Path):
    return _prepare(_arrow(t / "big.arrow", ["a short record", "x" * RECORD]), t / "o"), ["big.arrow: row 1"]


def _big_json_array(t: Path):
    f = t / "big.json"
    with open(f, "w") as fh:
        fh.write('[{"text": "a short record"}, {"text": "' + "x" * RECORD + '"}]')
    return _prepare(f, t / "o"), ["big.json: record 1"]


def _big_csv(t: Path):
    f = t / "big.csv"
    with open(f, "w") as fh:
        fh.write("instruction,output\nhi,there\n" + "x" * RECORD + ",y\n")
    return _prepare(f, t / "o"), ["big.csv: row"]


def _big_parquet(t: Path):
    import pyarrow.parquet as pq

    f = t / "big.parquet"
    pq.write_table(pa.table({"text": ["a short record", "x" * RECORD]}), f, compression="zstd")
    return _prepare(f, t / "o"), ["big.parquet: row group 0 row 1"]


def _huge_rank(t: Path):
    cfg = write_config(t / "run.yaml", run_dict(t / "run", steps=1, model=CFG.to_dict(),
                                                peft={"rank": 1_000_000}))
    return ["train", str(cfg)], ["peft.rank 1000000 exceeds the limit 48"]


def _model_yaml(t: Path, **sizes) -> Path:
    import yaml

    f = t / "model.yaml"
    f.write_text(yaml.safe_dump(dict(CFG.replace(layer_types=None).to_dict(), layer_types=None, **sizes)))
    return f


def _huge_model(t: Path):
    m = _model_yaml(t, vocab_size=1 << 24, hidden_size=1 << 20)  # each size within the bound, the whole not
    return ["init-hf", "--model", str(m), str(t / "o")], ["parameters", "GiB", "more than the", "can still allocate"]


def _huge_model_run(t: Path):
    m = _model_yaml(t, vocab_size=1 << 24, hidden_size=1 << 20)
    cfg = write_config(t / "run.yaml", dict(run_dict(t / "run", steps=1), model=str(m)))
    return ["train", str(cfg)], ["run.device cpu: the model has", "GiB", "run.memory_check: false"]


def _many_layers(t: Path):
    m = _model_yaml(t, num_hidden_layers=10**9)
    return ["init-hf", "--model", str(m), str(t / "o")], ["num_hidden_layers = 1000000000 exceeds the limit 4,096"]


SIZE_CASES = {"arrow-record": _big_arrow, "json-array-record": _big_json_array, "csv-record": _big_csv,
              "parquet-record": _big_parquet, "peft-rank": _huge_rank, "model-size": _huge_model,
              "model-size-train": _huge_model_run, "model-layers": _many_layers}


@pytest.mark.parametrize("name", list(SIZE_CASES))
def test_an_oversized_input_is_refused_before_it_is_allocated(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv, needles = SIZE_CASES[name](tmp_path)
    r = in_child(lambda: main(argv), tmp_path, timeout=240)
    assert r["code"] == 2 and len(r["lines"]) == 1, r
    assert r["lines"][0].startswith(f"q38 {argv[0]}: error: ") and "Traceback" not in r["lines"][0]
    for n in needles:
        assert n in r["lines"][0], (n, r["lines"][0])
    if name.endswith("record"):
        assert "more than the limit of 16,777,216 bytes" in r["lines"][0] and "--max-line-mb" in r["lines"][0]
    assert r["grew"] < RSS_BOUND, f"peak RSS grew by {r['grew'] >> 20} MiB"


def test_records_at_the_bound_are_read(tmp_path):
    """The per-record bound refuses only what exceeds it: each source with a record just under a 1 MiB bound
    prepares to the shards the same records prepare to from JSON Lines."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    text = "y" * ((1 << 20) - 4096)
    recs = [{"instruction": "short", "output": text}, {"instruction": text, "output": "short"}]
    table = pa.Table.from_pylist(recs)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pa.OSFile(str(tmp_path / "a.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (tmp_path / "a.json").write_text(json.dumps(recs))
    pq.write_table(table, tmp_path / "a.parquet")
    pcsv.write_csv(table, tmp_path / "a.csv")
    want = None
    for f in ("a.jsonl", "a.arrow", "a.json", "a.parquet", "a.csv"):
        assert main(_prepare(tmp_path / f, tmp_path / f"o_{f}") + ["--max-line-mb", "1"]) == 0
        shard = tmp_path / f"o_{f}" / "shard_000000.tokens"
        m = json.loads((tmp_path / f"o_{f}" / "manifest.json").read_text())
        got = (m["num_docs"], m["num_tokens"], shard.read_bytes())
        assert got[0] == 2 and got[1] > 2 * len(text), f
        want = want or got
        assert got == want, f


# ---- JSON nesting bounded ------------------------------------------------------------------------------------------


def _deep_config(t: Path, n: int):
    hf = _hf_dir(t)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(cfg)[:-1] + f', "x": {_deep(n)}}}')
    return ["convert", "--from-hf", str(hf), str(t / "ck")], ["config.json"]


def _deep_index(t: Path, n: int):
    hf = _hf_dir(t)
    (hf / "model.safetensors.index.json").write_text(f'{{"weight_map": {{}}, "metadata": {_deep(n)}}}')
    return ["convert", "--from-hf", str(hf), str(t / "ck")], ["model.safetensors.index.json"]


def _deep_dataset_dict(t: Path, n: int):
    d = t / "dd"
    d.mkdir()
    (d / "dataset_dict.json").write_text(f'{{"splits": {_deep(n)}}}')
    return _prepare(d, t / "o"), ["dataset_dict.json"]


def _deep_state(t: Path, n: int):
    d = _dataset(t / "ds", ["x"])
    (d / "state.json").write_text(f'{{"_data_files": [], "x": {_deep(n)}}}')
    return _prepare(d, t / "o"), ["state.json"]


def _deep_jsonl(t: Path, n: int):
    (t / "d.jsonl").write_text(f'{{"text": "a", "meta": {_deep(n)}}}\n')
    return _prepare(t / "d.jsonl", t / "o"), ["d.jsonl:1"]


def _deep_json_array(t: Path, n: int):
    (t / "d.json").write_text(f'[{{"text": "a"}}, {{"text": "b", "meta": {_deep(n)}}}]')
    return _prepare(t / "d.json", t / "o"), ["d.json: record 1"]


def _deep_tools(t: Path, n: int):
    rec = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}], "tools": _deep(n)}
    (t / "d.jsonl").write_text(json.dumps(rec) + "\n")
    return _prepare(t / "d.jsonl", t / "o"), ["d.jsonl:1", "JSON inside a string"]


def _deep_tokenizer(t: Path, n: int):
    d = t / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text(f'{{"model": {_deep(n)}}}')
    (d / "tokenizer_config.json").write_text("{}")
    (t / "d.jsonl").write_text('{"text": "a"}\n')
    return _prepare(t / "d.jsonl", t / "o") + ["--tokenizer", str(d)], ["tokenizer.json"]


DEEP_CASES = {"config.json": _deep_config, "index.json": _deep_index, "dataset_dict.json": _deep_dataset_dict,
              "state.json": _deep_state, "jsonl-record": _deep_jsonl, "json-array-record": _deep_json_array,
              "tools-string": _deep_tools, "tokenizer.json": _deep_tokenizer}


@pytest.mark.parametrize("depth", [150, 20_000])  # over the bound; over Python's recursion limit
@pytest.mark.parametrize("name", list(DEEP_CASES))
def test_deeply_nested_json_is_one_line(name, depth, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv, needles = DEEP_CASES[name](tmp_path, depth)
    capsys.readouterr()
    rc = main(argv)
    _assert_one_line(rc, capsys.readouterr().err, argv[0], [*needles, "nested too deeply"])


def test_json_depth_bound_against_a_parser():
    """``json_depth_over`` agrees with the depth of what ``json.loads`` builds, strings with brackets and escapes
    included."""
    from q38.files import json_depth_over

    def depth(x) -> int:
        if isinstance(x, dict):
            return 1 + max(map(depth, x.values()), default=0)
        if isinstance(x, list):
            return 1 + max(map(depth, x), default=0)
        return 0

    docs = [{"a": [1, {"b": "]]]}}[[[\\\"{{"}], "c": [[[[]]]]}, [[["[", "\\\\"]]], "x", {"k": {"k": {"k": {}}}}]
    for doc in docs:
        text = json.dumps(doc)
        d = depth(json.loads(text))
        for limit in range(max(d - 2, 0), d + 2):
            assert json_depth_over(text, limit) == (d > limit), (text, limit)
            assert json_depth_over(text.encode(), limit) == (d > limit), (text, limit)


# ---- FP8 scales, and unclean endings -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_non_finite_or_non_positive_fp8_scale_is_refused(bad, tmp_path, capsys):
    """A block-FP8 checkpoint whose one ``weight_scale_inv`` block is NaN / Inf / 0 / negative: ``convert
    --from-hf`` names the tensor and the block (it used to convert the weights to NaN or zeros silently)."""
    from safetensors.torch import load_file, save_file

    from q38.fp8 import Fp8Format
    from q38.hf import fp8_dtypes, save_hf
    from q38.model import init_params

    hf = save_hf(tmp_path / "fp8", CFG, init_params(CFG, seed=4), fp8=Fp8Format(block=(16, 8)),
                 dtypes=fp8_dtypes(lambda q: torch.float32))
    files = sorted(hf.glob("*.safetensors"))
    key = next(k for f in files for k in load_file(f) if k.endswith("self_attn.q_proj.weight_scale_inv"))
    for f in files:
        t = load_file(f)
        if key in t:
            t[key][1, 2] = bad
            save_file(t, f, metadata={"format": "pt"})
    capsys.readouterr()
    rc = main(["convert", "--from-hf", str(hf), str(tmp_path / "ck")])
    _assert_one_line(rc, capsys.readouterr().err, "convert",
                     [key, "at block [1, 2]", "not a finite positive number"])
    assert not (tmp_path / "ck").exists()


def test_the_metadata_readers_refusal_names_the_opcode(tmp_path):
    """A ``.metadata`` with an opcode DCP never writes: the reader's own refusal (it raised ``AttributeError:
    _file`` instead, a message about q38's internals)."""
    import pickle

    from q38.files import UnsafeCheckpoint
    from q38.train.io.untrusted import unpickle_metadata

    f = tmp_path / ".metadata"
    f.write_bytes(b"\x80\x04" + pickle.NONE + pickle.PERSID + b"x\n" + pickle.STOP)
    with pytest.raises(UnsafeCheckpoint, match=r"pickle opcode b'P' at byte 3 is not one DCP metadata uses"):
        unpickle_metadata(f)


@pytest.mark.parametrize("which", ["bin", "idx"])
def test_a_fifo_as_a_megatron_file_is_named(which, tmp_path, capsys):
    prefix = str(tmp_path / "corpus")
    for ext in ("bin", "idx"):  # the other file regular (its content is never reached)
        Path(f"{prefix}.{ext}").write_bytes(b"MMIDIDX\x00\x00" if ext == "idx" else b"")
    os.unlink(f"{prefix}.{which}")
    os.mkfifo(f"{prefix}.{which}")
    cfg = write_config(tmp_path / "run.yaml", run_dict(tmp_path / "run", steps=1, data={"path": prefix}))
    capsys.readouterr()
    rc = main(["train", str(cfg)])
    _assert_one_line(rc, capsys.readouterr().err, "train", [f"corpus.{which} is a FIFO, not a regular file"])


def test_a_fifo_as_the_jsonl_data_path_is_named(tmp_path, capsys):
    """A FIFO as ``data.path``: named as a FIFO, never opened (it said "not found")."""
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    cfg = write_config(tmp_path / "run.yaml", run_dict(tmp_path / "run", steps=1, data={"path": str(fifo)}))
    capsys.readouterr()
    rc = main(["train", str(cfg)])
    _assert_one_line(rc, capsys.readouterr().err, "train", [f"{fifo} is a FIFO; expected a JSONL file"])


@pytest.mark.parametrize("seed", [-1, 1 << 63])
def test_a_seed_outside_64_bits_is_refused(seed, tmp_path, capsys):
    cfg = write_config(tmp_path / "run.yaml", run_dict(tmp_path / "run", steps=1))
    rc = main(["train", str(cfg), "--set", f"run.seed={seed}"])
    _assert_one_line(rc, capsys.readouterr().err, "train", [f"run.seed must be an integer from 0 to {(1 << 63) - 1}",
                                                             str(seed)])


@pytest.mark.parametrize("key", ["path", "eval_path"])
def test_a_data_path_that_is_a_symlink_loop_is_named(key, tmp_path, capsys):
    """``data.path`` (or ``eval_path``) a symlink to itself: one line naming it (was an internal "Symlink loop")."""
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop.name)
    cfg = write_config(tmp_path / "run.yaml", run_dict(tmp_path / "run", steps=1, data={key: str(loop)}))
    capsys.readouterr()
    rc = main(["train", str(cfg)])
    _assert_one_line(rc, capsys.readouterr().err, "train", [f"{loop} cannot be resolved", "loop of links"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("backend", ["nccl", "hccl"])
def test_an_accelerator_backend_on_a_cpu_process_is_refused(backend, tmp_path, capsys):
    """``run.backend: nccl`` on a CPU-only process was accepted (a CPU tensor in an NCCL collective fails later)."""
    cfg = write_config(tmp_path / "run.yaml", run_dict(tmp_path / "run", steps=1, run={"backend": backend,
                                                                                        "device": "cpu"}))
    rc = main(["train", str(cfg)])
    _assert_one_line(rc, capsys.readouterr().err, "train", [f"run.backend is {backend} but this process runs on cpu"])
    assert not (tmp_path / "run").exists()
