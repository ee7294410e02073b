"""Exporting a LoRA run (q38.train.io.peft_export): the adapters in the Hugging Face PEFT format and the merged model.

The independent references are the ``peft`` library and ``transformers``: ``peft`` loads q38's exported adapter onto
transformers' ``Qwen3_5MoeForCausalLM`` of the same base checkpoint and gives the logits q38 computes with the LoRA
parameters (fp32, within 1e-4), routed experts included; an adapter whose expert entries are dropped misses them by
far more; the merged export loads in transformers with the same logits. Bad requests are one line, exit 2, and write
nothing.

Tiny fp32 models on CPU. The adapters' ``B`` is drawn nonzero (a trained adapter's is; at B = 0 every adapter is the
identity and the comparison would prove nothing), large enough that each adapted projection moves the logits by far
more than the tolerance.
"""

import json

import pytest
import torch

from q38.cli import main
from q38.hf import load_hf, save_hf
from q38.layers.common import leaf_generator
from q38.lora import TARGETS, PeftConfig, add_adapters, is_adapted, merged_params
from q38.model import init_params, logits
from q38.model_config import ModelConfig
from q38.pytree import named_leaves, tree_map_with_path
from q38.train.core.state import state_from_params
from q38.train.core.step_config import TrainConfig
from q38.train.io.checkpoint import write_checkpoint
from q38.train.io.hf_io import import_hf, init_source_format
from q38.train.io.peft import base_reference

LOGIT_TOL = 1e-4
# 3 GDN + 1 attention layers, 8 experts top-2, one MTP layer (the base HF directory has mtp.*; transformers skips it)
CFG = ModelConfig.preset("tiny").replace(initializer_range=0.08)


def _base_params(cfg=CFG, seed=0):
    """``init_params`` with every 1-D leaf perturbed (norms, dt_bias, A_log: none is a constant)."""
    g = torch.Generator().manual_seed(seed + 1)
    return tree_map_with_path(lambda p, t: t + 0.3 * torch.randn(t.shape, generator=g) if t is not None and
                              t.ndim == 1 else t, init_params(cfg, seed=seed))


def _lora_params(base, peft, seed=0):
    """Adapters per ``peft`` on ``base``, with ``B`` drawn nonzero (std 0.05, per path)."""
    p = add_adapters(base, peft, seed=seed)

    def perturb(path, t):
        if not path.endswith(("lora_b", "shared_b")):
            return t
        return torch.randn(t.shape, generator=leaf_generator(7, path)) * 0.05

    return tree_map_with_path(perturb, p)


def _write_lora_checkpoint(path, params, peft, *, init_from=None, seed=0, cfg=CFG, train=None):
    """A LoRA checkpoint as the trainer writes it: adapters (+ moments, step), ``meta.json`` with the LoRA setting
    and the base reference (``q38.train.io.peft.base_reference``)."""
    tc = TrainConfig(**(train or {}))
    state = state_from_params(params, cfg, tc, peft=peft)
    meta = {"step": 3, "model_config": cfg.to_dict(), "train_config": tc.to_dict(), "param_dtype": "float32",
            "source_format": init_source_format(init_from),
            "peft": dict(peft.to_dict(), base=base_reference(None if init_from is None else str(init_from), seed))}
    return write_checkpoint(path / "checkpoints" / "step_000003", state, meta)


def _ids(cfg=CFG, b=2, s=70, seed=0):
    return torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _peft_logits(base_dir, adapter_dir, ids):
    from peft import PeftModel

    model = PeftModel.from_pretrained(_hf_model(base_dir), str(adapter_dir)).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits, model


PER_EXPERT = PeftConfig(rank=4, alpha=8, experts="per_expert")
EVERY_TARGET = PeftConfig(rank=4, alpha=8, experts="per_expert", targets=TARGETS)  # the router too


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A Hugging Face base directory, a LoRA checkpoint over it (every target q38 has, the router included; per-expert
    experts), and the logits q38 computes with the LoRA parameters."""
    d = tmp_path_factory.mktemp("lora")
    base = _base_params()
    save_hf(d / "hf-base", CFG, base)
    params = _lora_params(base, EVERY_TARGET)
    _write_lora_checkpoint(d / "run", params, EVERY_TARGET, init_from=d / "hf-base")
    ids = _ids()
    with torch.no_grad():
        ours = logits(merged_params(params), ids, CFG)
        plain = logits(base, ids, CFG)
    assert (ours - plain).abs().max() > 1000 * LOGIT_TOL  # the adapters matter
    return {"dir": d, "params": params, "ids": ids, "logits": ours}


def test_peft_loads_the_adapter_with_q38s_logits(lora_run):
    """``peft`` reads q38's adapter onto transformers' model of the same base: q38's logits within 1e-4 (fp32); the
    expert adapters are PEFT's own ``target_parameters`` wrappers, whose delta per expert is q38's."""
    d = lora_run["dir"]
    assert main(["convert", "--to-peft", str(d / "run"), str(d / "adapter")]) == 0
    cfg = json.loads((d / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert cfg["base_model_name_or_path"] == str(d / "hf-base")
    assert cfg["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"]
    assert sorted(cfg["target_modules"]) == sorted(
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "linear_attn.in_proj_qkv",
         "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a", "linear_attn.out_proj",
         "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"])
    got, model = _peft_logits(d / "hf-base", d / "adapter", lora_run["ids"])
    assert got.std() > 0.5
    diff = (got - lora_run["logits"]).abs().max().item()
    print(f"PEFT adapter on transformers vs q38 with LoRA: max |Δ logits| = {diff:.2e}")
    assert diff <= LOGIT_TOL
    # PEFT's expert wrappers: their delta per expert is q38's scale · B_k @ A_k (gate_up innermost, down outermost)
    from q38.lora import delta

    experts = model.base_model.model.model.layers[0].mlp.experts
    ours = dict(named_leaves(lora_run["params"], is_leaf=is_adapted))
    for wrapper, leaf in ((experts, "we_down"), (experts.base_layer, "we_gate_up")):
        assert wrapper.parameter_name == leaf.removeprefix("we_").replace("down", "down_proj").replace(
            "gate_up", "gate_up_proj")
        want = delta(ours[f"layers.0.moe.{leaf}"])
        assert torch.allclose(wrapper.get_delta_weight("default"), want, atol=1e-6, rtol=0)


def test_adapter_without_its_experts_misses_q38s_logits(lora_run):
    """The failure the export guards against (routed experts silently skipped, as adapters built on nn.Linear alone
    come out): the same adapter with its expert entries dropped misses q38's logits by far more than the
    tolerance."""
    from safetensors.torch import load_file, save_file

    d = lora_run["dir"]
    if not (d / "adapter").exists():
        assert main(["convert", "--to-peft", str(d / "run"), str(d / "adapter")]) == 0
    cut = d / "adapter-no-experts"
    cut.mkdir()
    cfg = json.loads((d / "adapter" / "adapter_config.json").read_text())
    cfg["target_parameters"] = ["mlp.gate.weight"]  # the router stays: only the experts are skipped
    (cut / "adapter_config.json").write_text(json.dumps(cfg))
    sd = load_file(d / "adapter" / "adapter_model.safetensors")
    kept = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    assert 0 < len(kept) < len(sd)
    save_file(kept, cut / "adapter_model.safetensors", metadata={"format": "pt"})
    got, _ = _peft_logits(d / "hf-base", cut, lora_run["ids"])
    diff = (got - lora_run["logits"]).abs().max().item()
    print(f"adapter without experts: max |Δ logits| = {diff:.2e}")
    assert diff > 100 * LOGIT_TOL


def test_merged_export_loads_in_transformers_with_q38s_logits(lora_run):
    d = lora_run["dir"]
    assert main(["convert", "--to-hf", str(d / "run"), str(d / "merged"), "--max-shard-bytes", "200000"]) == 0
    assert (d / "merged" / "model.safetensors.index.json").is_file()  # sharded like any export
    model = _hf_model(d / "merged")
    with torch.no_grad():
        got = model(input_ids=lora_run["ids"]).logits
    diff = (got - lora_run["logits"]).abs().max().item()
    print(f"merged export in transformers vs q38 with LoRA: max |Δ logits| = {diff:.2e}")
    assert diff <= LOGIT_TOL
    # every tensor is the merged parameter q38 computes with (the MTP layer too, which transformers skips)
    _, params = load_hf(d / "merged")
    want = dict(named_leaves(merged_params(lora_run["params"])))
    for n, t in named_leaves(params):
        assert torch.equal(t, want[n]), n


@pytest.mark.parametrize("base_kind", ["seed", "q38_checkpoint"])
def test_merged_export_from_each_kind_of_base(tmp_path, base_kind):
    """The base a LoRA checkpoint names may be the seed's init or a q38 checkpoint (a Hugging Face directory: above);
    the merged export equals ``merged_params`` of the run's parameters bit for bit, shared-expert adapters and MTP
    adapters included."""
    peft = PeftConfig(rank=2, alpha=4, experts="shared", mtp=True)
    if base_kind == "seed":
        base, init_from = init_params(CFG, seed=5), None
    else:
        base = _base_params()
        save_hf(tmp_path / "hf-base", CFG, base)
        import_hf(tmp_path / "hf-base", tmp_path / "base-ck")
        init_from = tmp_path / "base-ck"
    params = _lora_params(base, peft)
    _write_lora_checkpoint(tmp_path / "run", params, peft, init_from=init_from, seed=5)
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    _, got = load_hf(tmp_path / "merged")
    want = dict(named_leaves(merged_params(params)))
    for n, t in named_leaves(got):
        assert torch.equal(t, want[n]), n



def _dtypes(d):
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: fh.get_slice(k).get_dtype() for k in fh.keys()})
    return out


@pytest.mark.parametrize("form", ["bf16_with_fp32_A_log", "fp8"])
def test_merged_export_keeps_the_base_checkpoint_dtypes(tmp_path, form):
    """The merged model is written in the dtypes of the Hugging Face base, tensor by tensor: bf16 weights with the
    fp32 ``A_log`` of the released BF16 checkpoints, or block-FP8 again (same keys, scales and layout) for an FP8
    base. Values: the fp32 merge cast to each dtype (bf16: exactly; FP8: within its quantization)."""
    from q38.fp8 import default_quantized
    from q38.hf import fp8_dtypes

    base = _base_params()
    keep = lambda q: torch.float32 if q.endswith("A_log") else torch.bfloat16  # noqa: E731
    dtypes = keep if form != "fp8" else fp8_dtypes(keep)
    save_hf(tmp_path / "hf-base", CFG, base, dtypes=dtypes)
    _, stored = load_hf(tmp_path / "hf-base")  # the base as the run reads it (FP8 dequantized)
    peft = PeftConfig(rank=2, alpha=4)
    params = _lora_params(tree_map_with_path(lambda p, t: t.float(), stored), peft)
    _write_lora_checkpoint(tmp_path / "run", params, peft, init_from=tmp_path / "hf-base")
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    assert _dtypes(tmp_path / "merged") == _dtypes(tmp_path / "hf-base")
    _, got = load_hf(tmp_path / "merged")
    want = dict(named_leaves(merged_params(params)))
    base_of = dict(named_leaves(stored))
    for n, t in named_leaves(got):
        w = want[n].to(t.dtype)
        if form == "fp8" and default_quantized(n):
            err = (t - w).abs().max()
            assert err <= 0.07 * w.abs().max(), n  # e4m3: 3 mantissa bits
            if peft.adapts(n):  # the delta is there, well above FP8's rounding
                assert err < 0.5 * (t - base_of[n]).abs().max(), n
        else:
            assert torch.equal(t, w), n

def _refused(capsys, argv, *needles):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.count("\n") == 0 and ": error: " in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def test_bad_requests_are_one_line_and_write_nothing(tmp_path, capsys):
    base = init_params(CFG, seed=0)
    runs = {}
    for name, peft in {"shared": PeftConfig(rank=2, alpha=4, experts="shared"),
                       "mtp": PeftConfig(rank=2, alpha=4, mtp=True, targets=["w_q"]),
                       "plain": PeftConfig(rank=2, alpha=4, targets=["w_q", "we_down"])}.items():
        runs[name] = tmp_path / name
        _write_lora_checkpoint(runs[name], _lora_params(base, peft), peft)
    full = tmp_path / "full"
    write_checkpoint(full / "checkpoints" / "step_000001", state_from_params(base, CFG, TrainConfig()),
                     {"step": 1, "model_config": CFG.to_dict(), "train_config": TrainConfig().to_dict()})
    save_hf(tmp_path / "other-base", CFG, init_params(CFG, seed=9))
    out = tmp_path / "out"
    cases = [
        (["--to-peft", str(runs["shared"]), str(out)], ["layers.0.moe.we_gate_up", "peft.experts: shared",
                                                        "--to-hf"]),
        (["--to-peft", str(runs["mtp"]), str(out)], ["mtp.layers.0.mixer.w_q", "MTP", "--to-hf"]),
        (["--to-peft", str(full), str(out)], ["not a LoRA checkpoint", "--to-hf"]),
        (["--to-peft", str(runs["plain"]), str(out), "--dtype", "fp8"], ["--dtype fp8"]),
        (["--to-hf", str(runs["plain"]), str(out), "--base", str(tmp_path / "other-base")], ["drawn from seed"]),
        (["--to-hf", str(full), str(out), "--base", str(tmp_path / "other-base")], ["not a LoRA checkpoint"]),
    ]
    for argv, needles in cases:
        _refused(capsys, ["convert", *argv], *needles)
        assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir()), argv


def test_merged_export_refuses_another_base(tmp_path, capsys):
    """The base is checked against the hash the checkpoint recorded (of the base's safetensors index or headers: it
    tells another checkpoint layout, here another dtype, not other values in the same layout): another base is
    refused before anything is written; ``--base`` points at a base that moved."""
    base = _base_params()
    save_hf(tmp_path / "hf-base", CFG, base)
    peft = PeftConfig(rank=2, alpha=4, targets=["w_q", "we_gate_up"])
    params = _lora_params(base, peft)
    _write_lora_checkpoint(tmp_path / "run", params, peft, init_from=tmp_path / "hf-base")
    save_hf(tmp_path / "other", CFG, init_params(CFG, seed=9, dtype=torch.bfloat16))
    out = tmp_path / "out"
    _refused(capsys, ["convert", "--to-hf", str(tmp_path / "run"), str(out), "--base", str(tmp_path / "other")],
             "is not the base the adapters", "--base")
    _refused(capsys, ["convert", "--to-peft", str(tmp_path / "run"), str(out), "--base", str(tmp_path / "other")],
             "is not the base the adapters")
    (tmp_path / "hf-base").rename(tmp_path / "moved")
    _refused(capsys, ["convert", "--to-hf", str(tmp_path / "run"), str(out)], "is not there", "--base")
    assert not out.exists()
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(out), "--base", str(tmp_path / "moved")]) == 0
    _, got = load_hf(out)
    want = dict(named_leaves(merged_params(params)))
    assert all(torch.equal(t, want[n]) for n, t in named_leaves(got))



def _export_rank(rank, world, ck, out, kind):
    from q38.train.io.peft_export import export_merged, export_peft

    if kind == "merged":
        export_merged(ck, out, max_shard_bytes=100_000)
    else:
        export_peft(ck, out)


@pytest.mark.slow  # ~5-10 s: two forked gloo ranks (the split itself is export_checkpoint's, tested by default)
@pytest.mark.dist
def test_exports_on_two_ranks_write_the_same_bytes(tmp_path):
    """Under a process group each rank writes its share of the merged model's files (rank 0 the one PEFT file): the
    bytes equal one process's export, and no temporary directory is left."""
    import hashlib

    from q38.train.io.peft_export import export_merged, export_peft
    from tests.dist_utils import run_distributed

    params = _lora_params(init_params(CFG, seed=3), PER_EXPERT)
    _write_lora_checkpoint(tmp_path / "run", params, PER_EXPERT, seed=3)
    ck = tmp_path / "run" / "checkpoints" / "step_000003"
    export_merged(ck, tmp_path / "one", max_shard_bytes=100_000)
    export_peft(ck, tmp_path / "one-peft")
    run_distributed(_export_rank, 2, str(ck), str(tmp_path / "two"), "merged")
    run_distributed(_export_rank, 2, str(ck), str(tmp_path / "two-peft"), "peft")

    def digest(d):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    assert len(list((tmp_path / "one").glob("*.safetensors"))) > 2  # several files: the split is exercised
    assert digest(tmp_path / "two") == digest(tmp_path / "one")
    assert digest(tmp_path / "two-peft") == digest(tmp_path / "one-peft")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

@pytest.mark.slow  # ~40 s: a LoRA run of 3 steps through the trainer, then both exports through the CLI
def test_trained_lora_run_exports_end_to_end(tmp_path):
    """A real LoRA run (the trainer, ``init_from`` a Hugging Face directory, every default target) exported with
    ``q38 convert --to-peft`` and ``--to-hf``: ``peft`` on transformers and the merged model in transformers both give
    the logits q38 computes with the checkpoint's adapters (loaded as a resume loads them)."""
    from q38.train.io.checkpoint import latest_checkpoint, load_checkpoint
    from q38.train.io.peft import lora_state
    from q38.train.run.trainer import train
    from tests.run_utils import run_config, small_model_dict

    cfg = ModelConfig.from_dict(small_model_dict())
    base = _base_params(cfg)
    save_hf(tmp_path / "hf-base", cfg, base)
    rc = run_config(tmp_path / "run", steps=3, init_from=str(tmp_path / "hf-base"), peft={"rank": 4, "alpha": 16},
                    train={"lr": 5e-2, "warmup_steps": 0})
    train(rc)
    ck = latest_checkpoint(tmp_path / "run" / "checkpoints")
    state = lora_state(base, rc.model, rc.train, rc.peft, seed=rc.run.seed, empty=True)
    state, _ = load_checkpoint(ck, state)
    ids = _ids(cfg)
    with torch.no_grad():
        ours = logits(merged_params(state.params), ids, cfg)
        assert (ours - logits(base, ids, cfg)).abs().max() > 100 * LOGIT_TOL  # the run moved the model
    assert main(["convert", "--to-peft", str(tmp_path / "run"), str(tmp_path / "adapter")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    got, _ = _peft_logits(tmp_path / "hf-base", tmp_path / "adapter", ids)
    assert (got - ours).abs().max() <= LOGIT_TOL
    with torch.no_grad():
        merged = _hf_model(tmp_path / "merged")(input_ids=ids).logits
    assert (merged - ours).abs().max() <= LOGIT_TOL
