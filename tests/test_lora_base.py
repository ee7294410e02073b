"""The base of a LoRA run (q38.train.io.peft, docs/checkpoints.md#the-base-of-a-lora-run): read-only to every q38
command, known by the bytes of its weights whatever world size computed the reference, checked at resume and by both
exports, which name the tensor that changed; the merged export of an FP8-at-load base merges onto the values the run
trained on (or the stored ones); ``init-hf --dtype fp8`` writes only block-aligned checkpoints.

Independent references: the base directory's bytes hashed before and after each refused command; each tensor's
digest recomputed from the bytes the ``safetensors`` library returns; the single-process reference against two gloo
ranks; the merged weights against the run's own FP8 base (``fp8_base``) plus a naive ``B @ A``. The models differ
from the ``tiny`` preset in every dimension, except where a LoRA merge needs the adapters q38 builds on tiny shapes
(the merge-onto test).
"""

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch

from q38.cli import main
from q38.hf import load_hf, save_hf
from q38.lora import PeftConfig
from q38.model import init_params
from q38.model_config import ConfigError, ModelConfig
from q38.pytree import named_leaves
from q38.train.io import peft as peft_io
from tests.test_peft_export import CFG, _lora_params, _refused, _write_lora_checkpoint

# every dimension unlike tiny's (hidden, heads, head dims, GDN heads, experts, top-k, expert widths, vocab, layers)
OTHER = ModelConfig.preset("tiny").replace(
    vocab_size=400, hidden_size=96, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
    num_attention_heads=6, num_key_value_heads=3, head_dim=8, linear_num_key_heads=3, linear_num_value_heads=6,
    linear_key_head_dim=8, linear_value_head_dim=12, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
    shared_expert_intermediate_size=40)
PEFT = PeftConfig(rank=2, alpha=4, targets=["w_q", "we_down"])


def _tree_digest(d) -> dict:
    """Every file under ``d`` (relative name -> SHA-256 of its bytes), symlinks as their target."""
    out = {}
    for root, dirs, files in os.walk(d):
        for f in files + [x for x in dirs if os.path.islink(os.path.join(root, x))]:
            p = os.path.join(root, f)
            rel = os.path.relpath(p, d)
            out[rel] = os.readlink(p) if os.path.islink(p) else hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def _header(f):
    """``(data start, header)`` of a safetensors file, parsed here (not by q38)."""
    raw = Path(f).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return 8 + n, json.loads(raw[8:8 + n])


def _flip_one_tensor(d, part="q_proj"):
    """Flip every bit of the first 16 bytes of the first tensor whose key holds ``part``, keeping the header and the
    file size: returns its key."""
    f = sorted(d.glob("*.safetensors"))[0]
    start, header = _header(f)
    key = sorted(k for k in header if part in k)[0]
    a = start + header[key]["data_offsets"][0]
    data = bytearray(f.read_bytes())
    data[a:a + 16] = bytes(b ^ 0xFF for b in data[a:a + 16])
    f.write_bytes(bytes(data))
    return key


def _lora_run(tmp_path, cfg=OTHER, peft=PEFT):
    base = tmp_path / "bases" / "base"
    save_hf(base, cfg, init_params(cfg, seed=0))
    run = tmp_path / "run"
    _write_lora_checkpoint(run, _lora_params(init_params(cfg, seed=0), peft), peft, init_from=base, cfg=cfg)
    return base, run


# ---- read-only ------------------------------------------------------------------------------------------------------


MODELS = {"tiny": CFG, "other": OTHER}  # tiny: on which the old exports ran to the end (and replaced the base)


@pytest.mark.parametrize("model", list(MODELS))
def test_no_command_writes_into_a_runs_base(tmp_path, capsys, model):
    """``q38 convert --to-hf RUN BASE --overwrite`` (BASE the run's own base) used to exit 0 and replace the base's
    weights. Every export into the base, a directory holding it, a directory inside it, the base through a symlink or
    given as ``--base``, and a run whose ``run.out_dir`` is the base or inside it: one line, exit 2, and the base's
    bytes unchanged."""
    from q38.train.run.trainer import train
    from tests.run_utils import run_config

    base, run = _lora_run(tmp_path, MODELS[model])
    (tmp_path / "link").symlink_to(base)
    before = _tree_digest(tmp_path / "bases")
    for argv in (["--to-hf", run, base, "--overwrite"], ["--to-peft", run, base, "--overwrite"],
                 ["--to-hf", run, base / "merged"], ["--to-hf", run, tmp_path / "bases", "--overwrite"],
                 ["--to-hf", run, tmp_path / "link", "--overwrite"],
                 ["--to-hf", run, base, "--base", tmp_path / "link", "--overwrite"]):
        _refused(capsys, ["convert", *map(str, argv)], "base (", "--overwrite does not change this")
        assert _tree_digest(tmp_path / "bases") == before, argv
    for out in (base, base / "runs" / "lora"):
        cfg = run_config(out, steps=1, model=str(base), init_from=str(base), peft={"rank": 2, "alpha": 4})
        with pytest.raises(ConfigError, match="run.out_dir .* is the run's base"):
            train(cfg)
        assert _tree_digest(tmp_path / "bases") == before, out


def test_a_run_never_reads_what_it_writes(tmp_path):
    """A data file that lies where the run writes (its checkpoints directory) is refused before anything is made."""
    from q38.train.run.trainer import train
    from tests.run_utils import run_config

    data = tmp_path / "run" / "checkpoints" / "data.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text('{"text": "hello"}\n')
    with pytest.raises(ConfigError, match="lies in .*checkpoints, which the run writes"):
        train(run_config(tmp_path / "run", steps=1, data={"path": str(data)}))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints"]


# ---- the reference --------------------------------------------------------------------------------------------------


def _naive_reference(d, chunk: int) -> dict:
    """Each tensor's digest from the bytes ``safetensors`` returns: SHA-256 of ``"<dtype> <shape>\\n"`` and the
    SHA-256 of each ``chunk``-byte piece."""
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        _, header = _header(f)
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                raw = fh.get_tensor(k).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                h = hashlib.sha256(f"{header[k]['dtype']} {header[k]['shape']}\n".encode())
                for a in range(0, len(raw), chunk):
                    h.update(hashlib.sha256(raw[a:a + chunk]).digest())
                out[k] = h.hexdigest()[:peft_io.SHORT]
    return out


def test_reference_covers_every_weight_byte_and_not_the_files(tmp_path, monkeypatch):
    """The reference is each tensor's bytes (as recomputed here from what safetensors reads); the same weights split
    into other files give the same reference; one flipped weight (headers kept) gives another, naming that tensor."""
    monkeypatch.setattr(peft_io, "CHUNK_BYTES", 4096)  # several pieces per tensor
    params = init_params(OTHER, seed=0)
    save_hf(tmp_path / "one", OTHER, params)
    save_hf(tmp_path / "split", OTHER, params, max_shard_bytes=200_000)
    assert len(list((tmp_path / "split").glob("*.safetensors"))) > 3
    ref = peft_io.base_reference(str(tmp_path / "one"), 0)
    assert ref["tensors"] == _naive_reference(tmp_path / "one", 4096)
    assert peft_io.base_reference(str(tmp_path / "split"), 0)["sha256"] == ref["sha256"]
    key = _flip_one_tensor(tmp_path / "one")
    changed = peft_io.base_reference(str(tmp_path / "one"), 0)
    assert changed["sha256"] != ref["sha256"]
    assert peft_io.base_difference(ref, changed) == (f"tensor {key} differs", None)


def _reference_rank(rank, world, d):
    from q38.train.io import peft as p

    p.CHUNK_BYTES = 4096
    hashed = []
    inner = p._hash_chunks

    def counting(chunks):
        hashed.extend(b - a for _, a, b in chunks)
        return inner(chunks)

    p._hash_chunks = counting
    return {"ref": p.base_reference(d, 0), "bytes": sum(hashed)}


@pytest.mark.dist
def test_reference_is_the_same_on_one_and_two_ranks(tmp_path, monkeypatch):
    """Two gloo ranks compute the single-process reference, each hashing about half of the bytes."""
    from tests.dist_utils import run_distributed

    monkeypatch.setattr(peft_io, "CHUNK_BYTES", 4096)
    save_hf(tmp_path / "base", OTHER, init_params(OTHER, seed=1))
    one = peft_io.base_reference(str(tmp_path / "base"), 0)
    got = run_distributed(_reference_rank, 2, str(tmp_path / "base"))
    assert [g["ref"] for g in got] == [one, one]
    total = sum(g["bytes"] for g in got)
    assert total == sum(b - a for _, (_, a, b, _, _) in peft_io._hf_tensors(tmp_path / "base").items())
    assert all(0.4 < g["bytes"] / total < 0.6 for g in got), [g["bytes"] for g in got]


# ---- a changed base -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_both_exports_refuse_a_changed_base_naming_the_tensor(tmp_path, capsys, model):
    """One weight of the base changed in place (headers kept): ``--to-hf`` and ``--to-peft`` (which used not to
    check the base at all without ``--base``) refuse, naming it, and write nothing."""
    base, run = _lora_run(tmp_path, MODELS[model])
    key = _flip_one_tensor(base)
    out = tmp_path / "out"
    for flag in ("--to-hf", "--to-peft"):
        _refused(capsys, ["convert", flag, str(run), str(out)], f"tensor {key} differs", "not the base")
        assert not out.exists()


@pytest.mark.slow  # ~15 s: a LoRA run of one step through the trainer
def test_resume_refuses_a_changed_base_naming_the_tensor(tmp_path):
    """A LoRA run on a Hugging Face base resumes on it unchanged; after one weight changed in place (headers kept)
    the resume is refused, naming it."""
    from q38.train.io.checkpoint import read_meta
    from q38.train.io.peft import BaseMismatch
    from q38.train.run.trainer import train
    from tests.run_utils import run_config, small_model_dict

    cfg = ModelConfig.from_dict(small_model_dict(), source="test")
    save_hf(tmp_path / "base", cfg, init_params(cfg, seed=0))
    peft = {"rank": 2, "alpha": 4}
    kw = dict(model=str(tmp_path / "base"), init_from=str(tmp_path / "base"), peft=peft)
    train(run_config(tmp_path / "run", steps=1, **kw))
    meta = read_meta(tmp_path / "run" / "checkpoints" / "step_000001")
    assert meta["peft"]["base"]["format"] == peft_io.REFERENCE_FORMAT
    assert [r["step"] for r in train(run_config(tmp_path / "run", steps=2, **kw))] == [2]
    key = _flip_one_tensor(tmp_path / "base")
    with pytest.raises(BaseMismatch, match=f"tensor {key} differs"):
        train(run_config(tmp_path / "run", steps=3, **kw))


def test_a_header_only_reference_is_checked_as_before_with_a_note(tmp_path, capsys):
    """A checkpoint written before the weights were hashed recorded the hash of its base's safetensors headers (here
    recomputed by hand): exported with a note saying the weights could not be compared; refused when the headers
    differ."""
    base, run = _lora_run(tmp_path)
    ck = run / "checkpoints" / "step_000003"
    meta = json.loads((ck / "meta.json").read_text())
    f = base / "model.safetensors"
    start, _ = _header(f)
    legacy = hashlib.sha256(f.name.encode() + f.read_bytes()[8:start]).hexdigest()
    meta["peft"]["base"] = {"init_from": str(base), "sha256": legacy}
    (ck / "meta.json").write_text(json.dumps(meta))
    from q38.train.io.checkpoint import write_manifest  # meta.json is covered by the manifest

    write_manifest(ck)
    assert main(["convert", "--to-peft", str(run), str(tmp_path / "a")]) == 0
    assert "cannot be compared" in capsys.readouterr().err
    save_hf(base, OTHER, init_params(OTHER, seed=0, dtype=torch.bfloat16))  # other headers
    _refused(capsys, ["convert", "--to-peft", str(run), str(tmp_path / "b")], "index or headers differ")


# ---- the merged export of an FP8-at-load base ----------------------------------------------------------------------


def test_merged_export_onto_the_trained_fp8_values_or_the_original(tmp_path, capsys):
    """A ``peft.base_dtype: fp8`` run over an fp32 base trained on the base's 128 x 128 block-FP8 quantization:
    ``--merge-onto trained`` (the default) writes those values (``fp8_base``, the run's own base, dequantized) plus
    ``scale · B @ A``; ``--merge-onto original`` the stored base plus the same; the line printed says which."""
    from q38.fp8 import Fp8Weight

    peft = PeftConfig(rank=2, alpha=4, targets=["w_q", "we_gate_up", "w_router"], base_dtype="fp8")
    base_params = init_params(CFG, seed=0)
    save_hf(tmp_path / "base", CFG, base_params)
    params = _lora_params(base_params, peft)
    _write_lora_checkpoint(tmp_path / "run", params, peft, init_from=tmp_path / "base")
    held = dict(named_leaves(peft_io.fp8_base(CFG, str(tmp_path / "base"), seed=0, dtype=torch.float32),
                             is_leaf=lambda x: isinstance(x, Fp8Weight)))
    leaves = dict(named_leaves(params))
    stored = dict(named_leaves(base_params))

    def delta(w):
        a, b = leaves[f"{w}.lora_a"], leaves[f"{w}.lora_b"]
        return peft.scale * torch.einsum("...or,...ri->...oi", b, a)

    got = {}
    for onto in ("trained", "original"):
        out = tmp_path / onto
        assert main(["convert", "--to-hf", str(tmp_path / "run"), str(out), "--dtype", "float32",
                     "--merge-onto", onto]) == 0
        line = capsys.readouterr().out
        assert ("the values the run trained on" in line) == (onto == "trained"), line
        got[onto] = dict(named_leaves(load_hf(out)[1]))
    adapted = sorted({n.removesuffix(".lora_a") for n in leaves if n.endswith(".lora_a")})
    assert {"layers.3.mixer.w_q", "layers.1.moe.we_gate_up", "layers.2.moe.w_router"} <= set(adapted)
    for w in adapted:
        trained = held[w].dequantize() if isinstance(held[w], Fp8Weight) else held[w]
        torch.testing.assert_close(got["trained"][w], trained + delta(w), rtol=0, atol=1e-6)
        torch.testing.assert_close(got["original"][w], stored[w] + delta(w), rtol=0, atol=1e-6)
    w = "layers.1.moe.we_gate_up"
    assert (got["trained"][w] - got["original"][w]).abs().max() > 1e-4  # the quantization shows
    w = "layers.2.moe.w_router"  # not held in FP8: the same either way
    assert torch.equal(got["trained"][w], got["original"][w])


# ---- a toy block-FP8 checkpoint -------------------------------------------------------------------------------------


def test_init_hf_fp8_writes_only_block_aligned_checkpoints(tmp_path, capsys):
    """``init-hf --model tiny --dtype fp8`` (widths of 16-64) is refused in one line pointing to ``tiny_fp8``;
    that preset (shaped unlike tiny, widths multiples of 128) is written and an FP8 base keeps its stored bits."""
    from safetensors import safe_open

    from q38.fp8 import Fp8Weight

    _refused(capsys, ["init-hf", "--model", "tiny", "--dtype", "fp8", str(tmp_path / "t")], "hidden_size = 64",
             "tiny_fp8")
    assert not (tmp_path / "t").exists()
    assert main(["init-hf", "--model", "tiny_fp8", "--dtype", "fp8", str(tmp_path / "f")]) == 0
    cfg = ModelConfig.preset("tiny_fp8")
    tiny = ModelConfig.preset("tiny")
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
              "linear_num_value_heads", "linear_key_head_dim", "num_experts", "moe_intermediate_size"):
        assert getattr(cfg, k) != getattr(tiny, k), k
    held = dict(named_leaves(peft_io.fp8_base(cfg, str(tmp_path / "f"), seed=0, dtype=torch.float32),
                             is_leaf=lambda x: isinstance(x, Fp8Weight)))
    with safe_open(str(tmp_path / "f" / "model.safetensors"), framework="pt") as fh:
        stored = fh.get_tensor("model.layers.1.self_attn.o_proj.weight").view(torch.uint8)
    assert torch.equal(held["layers.1.mixer.w_o"].bits, stored)
