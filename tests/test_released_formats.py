"""The formats the released checkpoints ship in: block-FP8 read and write, fp32 leaves under the bf16 policy, export
in the source's dtypes, and one MTP layer serving every depth.

The FP8 references are written here from the format (docs/hf_checkpoints.md#block-fp8-checkpoints), not with
q38's code: ``_to_fp8_dir`` turns a bf16 Hugging Face directory into a block-FP8 one (routed experts per expert,
each projection quantized block by block in a Python loop, scales ``amax / 448``), and ``_dequantized_dir``
dequantizes it block by block into plain fp32 tensors under the same keys. q38 reading the FP8 directory must
give exactly what it reads from the dequantized one.
"""

import json
import math
import re
from pathlib import Path

import attrs
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from q38.hf_config import load_model_config
from q38.model_config import ModelConfig
from q38.hf import CheckpointError, fp8_dtypes, load_hf, save_hf
from q38.pytree import named_leaves, tree_map
from tests.test_hf_parity import CFG_A, CFG_NEXT, _random_params

E4M3_MAX = 448.0
# The projections a block-FP8 release quantizes (Linear weights of attention, GDN and the experts).
QUANTIZED = re.compile(
    r"(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_qkvz|in_proj_z|out_proj)"
    r"|mlp\.experts\.\d+\.(gate|up|down)_proj|mlp\.shared_expert\.(gate|up|down)_proj)\.weight$"
)


# ---- a block-FP8 writer and reader written from the format ------------------------------------------------------


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _per_expert(tensors: dict) -> dict:
    """Fused ``mlp.experts.gate_up_proj [e, 2f, d]`` / ``down_proj [e, d, f]`` → one key per expert and projection."""
    out = {}
    for k, t in tensors.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            f = t.shape[1] // 2
            for i in range(t.shape[0]):
                out[k.replace("gate_up_proj", f"{i}.gate_proj.weight")] = t[i, :f].clone()
                out[k.replace("gate_up_proj", f"{i}.up_proj.weight")] = t[i, f:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for i in range(t.shape[0]):
                out[k.replace("down_proj", f"{i}.down_proj.weight")] = t[i].clone()
        else:
            out[k] = t
    return out


def _quantize_loop(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block: ``scale = amax / 448`` (1 for an all-zero block), ``q = e4m3(w / scale)``."""
    bo, bi = block
    o, i = w.shape
    q = torch.empty(o, i, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(o / bo), math.ceil(i / bi), dtype=torch.float32)
    for r in range(s.shape[0]):
        for c in range(s.shape[1]):
            blk = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi].float()
            amax = blk.abs().max().item()
            scale = torch.tensor(amax / E4M3_MAX if amax > 0 else 1.0, dtype=torch.float32)
            s[r, c] = scale
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (blk / scale).clamp(-E4M3_MAX, E4M3_MAX).to(q.dtype)
    return q, s


def _dequantize_loop(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    bo, bi = block
    w = torch.empty(q.shape, dtype=torch.float32)
    for r in range(s.shape[0]):
        for c in range(s.shape[1]):
            w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi].float() * s[r, c]
    return w


def _to_fp8_dir(src: Path, out: Path, block=(128, 128), shards: int = 3) -> Path:
    """The block-FP8 form of the Hugging Face directory ``src``, as the released ``-FP8`` checkpoints store it."""
    tensors = _per_expert(_tensors(src))
    out.mkdir()
    written, not_converted = {}, []
    for k, t in tensors.items():
        if QUANTIZED.search(k):
            written[k], written[k + "_scale_inv"] = _quantize_loop(t, block)
        else:
            written[k] = t
            if t.ndim == 2 and k.endswith(".weight"):
                not_converted.append(k[: -len(".weight")])
    keys = sorted(written)
    weight_map = {}
    for j in range(shards):  # a sharded checkpoint: a weight and its scale may sit in different files
        name = f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: written[k].contiguous() for n, k in enumerate(keys) if n % shards == j}
        save_file(part, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": not_converted}
    (out / "config.json").write_text(json.dumps(config))
    return out


def _dequantized_dir(fp8: Path, out: Path) -> Path:
    """``fp8`` with every quantized weight replaced by its fp32 dequantization (block by block), scales dropped."""
    config = json.loads((fp8 / "config.json").read_text())
    block = config.pop("quantization_config")["weight_block_size"]
    tensors = _tensors(fp8)
    plain = {}
    for k, t in tensors.items():
        if k.endswith("_scale_inv"):
            continue
        plain[k] = _dequantize_loop(t, tensors[k + "_scale_inv"], block) if t.dtype == torch.float8_e4m3fn else t
    out.mkdir()
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def _bf16_dir(tmp_path: Path, cfg: ModelConfig, name: str = "bf16") -> Path:
    params = tree_map(lambda t: t.to(torch.bfloat16), _random_params(cfg, seed=5))
    return save_hf(tmp_path / name, cfg, params)


def _differ(a, b) -> list[str]:
    a, b = dict(named_leaves(a)), dict(named_leaves(b))
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


# ---- reading block-FP8 -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg,block", [(CFG_A, (128, 128)), (CFG_A, (16, 8)), (CFG_NEXT, (8, 16))],
                         ids=["qwen35-128x128", "qwen35-16x8", "next-8x16"])
def test_fp8_checkpoint_loads_as_its_independent_dequantization(tmp_path, cfg, block):
    """A block-FP8 directory in the released layout (per-expert experts, weight + weight_scale_inv split over files)
    loads equal, bit for bit, to the fp32 dequantization written by the loop above; the 16x8 / 8x16 blocks make
    whole and partial blocks in both dims. The quantized leaves differ from the bf16 source (the scales matter)."""
    fp8 = _to_fp8_dir(_bf16_dir(tmp_path, cfg), tmp_path / "fp8", block)
    ref = _dequantized_dir(fp8, tmp_path / "deq")
    _, got = load_hf(fp8, dtype=torch.float32)
    _, want = load_hf(ref, dtype=torch.float32)
    assert _differ(got, want) == []
    _, bf16 = load_hf(tmp_path / "bf16", dtype=torch.float32)
    changed = _differ(got, bf16)
    assert "layers.0.mixer.w_qkv" in changed and "layers.0.moe.we_gate_up" in changed
    assert not any(n.endswith(("A_log", "norm_w", "w_router", "embed")) for n in changed)


@pytest.mark.slow
def test_fp8_checkpoint_read_by_transformers_dequantized(tmp_path):
    """transformers' own FP8 loader (``FineGrainedFP8Config(dequantize=True)``, transformers 5.23 on CPU; it needs
    ``accelerate``) reads the directory to the weights of the loop's dequantization, and its logits equal q38's from
    the same FP8 directory (fp32, 1e-4). Blocks of 4x4: transformers' dequantizer takes whole blocks only (a weight
    whose dims are not multiples of the block is refused with "not divisible by scale grid"), so this test uses a
    block size that divides every dim; partial blocks are checked against the loop above."""
    from q38.model import logits

    fp8 = _to_fp8_dir(_bf16_dir(tmp_path, CFG_A), tmp_path / "fp8", (4, 4))
    ref = _fuse(_tensors(_dequantized_dir(fp8, tmp_path / "deq")))
    model = _hf_fp8_model(CFG_A, fp8)
    got = model.state_dict()
    both = [k for k in got if k in ref]
    assert len(both) == len(got), sorted(set(got) - set(ref))[:10]  # every transformers weight compared
    for k in both:
        assert torch.equal(got[k].float(), ref[k].float()), k
    ids = torch.randint(0, CFG_A.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    cfg, params = load_hf(fp8, dtype=torch.float32)
    with torch.no_grad():  # the unquantized weights keep the checkpoint's bf16 in transformers' model: fp32 here
        torch.testing.assert_close(model.float()(input_ids=ids).logits, logits(params, ids, cfg), rtol=1e-4,
                                   atol=1e-4)


def _fuse(tensors: dict) -> dict:
    out = dict(tensors)
    experts = {}
    for k in tensors:
        m = re.match(r"(.*mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", k)
        if m:
            experts.setdefault(m.group(1), set()).add(int(m.group(2)))
    for p, ids in experts.items():
        e = range(len(ids))
        out[p + ".gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}.{i}.gate_proj.weight"],
                                                           tensors[f"{p}.{i}.up_proj.weight"]]) for i in e])
        out[p + ".down_proj"] = torch.stack([tensors[f"{p}.{i}.down_proj.weight"] for i in e])
    return out


def _hf_fp8_model(cfg, path):
    """transformers' ``Qwen3_5MoeForCausalLM`` from a block-FP8 directory, dequantized by its FP8 quantizer."""
    from transformers import FineGrainedFP8Config

    from tests.test_hf_parity import _hf_classes

    _, model_cls = _hf_classes(cfg)
    return model_cls.from_pretrained(path, dtype=torch.float32,
                                     quantization_config=FineGrainedFP8Config(dequantize=True)).eval()


def test_fp8_bad_inputs_are_one_clear_error(tmp_path):
    fp8 = _to_fp8_dir(_bf16_dir(tmp_path, CFG_A), tmp_path / "fp8", (16, 8))
    config = json.loads((fp8 / "config.json").read_text())

    def variant(name, edit_config=None, drop=None, replace=None):
        d = tmp_path / name
        d.mkdir()
        index = json.loads((fp8 / "model.safetensors.index.json").read_text())
        for f in fp8.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as fh:
                part = {k: fh.get_tensor(k) for k in fh.keys() if k != drop}
            if replace is not None and replace[0] in part:
                part[replace[0]] = replace[1]
            save_file(part, str(d / f.name), metadata={"format": "pt"})
        index["weight_map"].pop(drop, None)
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        c = json.loads(json.dumps(config))
        if edit_config:
            edit_config(c)
        (d / "config.json").write_text(json.dumps(c))
        return d

    key = "model.layers.0.linear_attn.in_proj_qkv.weight"
    cases = {
        "no_scale": (variant("a", drop=key + "_scale_inv"), "block scales are missing"),
        "no_config": (variant("b", edit_config=lambda c: c.pop("quantization_config")), "no quantization_config"),
        "bad_scale": (variant("c", replace=(key + "_scale_inv", torch.ones(2, 2))), "one scale per 16x8 block"),
        "method": (variant("d", edit_config=lambda c: c["quantization_config"].update(quant_method="awq")),
                   "quant_method 'awq'"),
        "per_tensor": (variant("e", edit_config=lambda c: c["quantization_config"].pop("weight_block_size")),
                       "block-wise FP8 only"),
    }
    for name, (d, words) in cases.items():
        with pytest.raises(CheckpointError, match=re.escape(words)):
            load_hf(d)


# ---- writing block-FP8 -----------------------------------------------------------------------------------------------


def test_fp8_export_round_trip_and_same_layout_as_an_fp8_source(tmp_path):
    """q38's FP8 export of fp32 weights imports back within e4m3 rounding of each block (half a step of the 3-bit
    mantissa, or of the subnormal step); an FP8 source imported into a q38 checkpoint and exported again
    (``convert --to-hf`` default: the source's format) writes the same keys, dtypes and scale shapes, its
    ``quantization_config`` keeps the block size and lists what the source left unquantized, and it loads to the
    same weights (re-quantizing a dequantized block gives back its values)."""
    from q38.train.io.hf_io import export_checkpoint, import_hf

    params = _random_params(CFG_A, seed=7)
    out = save_hf(tmp_path / "q38fp8", CFG_A, params, dtypes=fp8_dtypes(lambda q: torch.float32))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert "lm_head" in cfg["quantization_config"]["modules_to_not_convert"]
    _, back = load_hf(out, dtype=torch.float32)
    for name, w in named_leaves(params):
        got = dict(named_leaves(back))[name]
        if name.endswith(("w_qkv", "w_z", "w_out", "w_q", "w_k", "w_v", "w_o", "we_gate_up", "we_down", "ws_gate",
                          "ws_up", "ws_down")):
            w2 = w.reshape(-1, w.shape[-1])  # one block per expert matrix at these sizes (< 128)
            per_matrix = w.reshape(-1, *w.shape[-2:]).abs().amax(dim=(1, 2)) / E4M3_MAX
            step = per_matrix.repeat_interleave(w.shape[-2]).unsqueeze(1)
            bound = torch.maximum(w2.abs() * 2.0**-4, step * 2.0**-10)
            err = (got.reshape(w2.shape) - w2).abs()
            assert bool((err <= bound * (1 + 1e-6)).all()), (name, (err / bound).max().item())
            assert err.max() > 0, name  # really quantized
        else:
            assert torch.equal(got, w), name

    src = _to_fp8_dir(_bf16_dir(tmp_path, CFG_A), tmp_path / "fp8", (16, 8), shards=1)
    import_hf(src, tmp_path / "ck")
    export_checkpoint(tmp_path / "ck", tmp_path / "again", dtype="source")
    a, b = _headers(src), _headers(tmp_path / "again")
    assert a == b
    qa = json.loads((src / "config.json").read_text())["quantization_config"]
    qb = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert qb["weight_block_size"] == [16, 8] and set(qa["modules_to_not_convert"]) <= set(qb["modules_to_not_convert"])
    assert _differ(load_hf(src, dtype=torch.float32)[1], load_hf(tmp_path / "again", dtype=torch.float32)[1]) == []


def _headers(d: Path) -> dict:
    out = {}
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


# ---- source dtypes ------------------------------------------------------------------------------------------------


def test_export_writes_each_tensor_in_the_source_dtype(tmp_path):
    """A bf16 checkpoint that keeps A_log and the GDN norm in fp32 (as released Qwen3.5 checkpoints do) goes through
    a q38 checkpoint (fp32 masters) and comes out with every key in its source dtype; the import keeps the fp32
    leaves unrounded."""
    from q38.train.io.hf_io import export_checkpoint, import_hf, source_fp32_params

    fp32 = ("A_log", "norm_w")
    params = _random_params(CFG_A, seed=2)
    src = save_hf(tmp_path / "src", CFG_A, params,
                  dtypes=lambda q: torch.float32 if q.endswith(fp32) else torch.bfloat16)
    _, meta = import_hf(src, tmp_path / "ck")
    assert source_fp32_params(meta["source_format"]) == ("layers.*.mixer.A_log", "layers.*.mixer.norm_w")
    export_checkpoint(tmp_path / "ck", tmp_path / "out", dtype="source")
    assert _headers(src) == _headers(tmp_path / "out")
    _, back = load_hf(tmp_path / "out")
    a_log = back.layers[0].mixer.A_log
    assert a_log.dtype == torch.float32 and torch.equal(a_log, params.layers[0].mixer.A_log)


# ---- fp32 leaves under the bf16 policy ----------------------------------------------------------------------------


def test_bf16_policy_gathers_fp32_params_in_fp32():
    from q38.parallel.local import LocalRuntime
    from q38.train.core.step_config import TrainConfig

    tc = TrainConfig(param_dtype="bfloat16")
    params = _random_params(CFG_A)
    rt = LocalRuntime(tc.torch_param_dtype, tc.compute_dtype)
    rt.bind(params)
    layer = rt.gather(params.layers[0])
    assert layer.mixer.A_log.dtype == torch.float32 and layer.mixer.norm_w.dtype == torch.float32
    assert layer.mixer.w_qkv.dtype == torch.bfloat16 and layer.mixer.dt_bias.dtype == torch.bfloat16
    assert torch.equal(layer.mixer.A_log, params.layers[0].mixer.A_log)


def test_gdn_on_a_long_packed_row_tracks_fp32_closer_with_fp32_a_log():
    """One GDN layer over a 4096-token packed row (documents of 2500, 1000 and 596 tokens), tiny heads, decays slow
    enough to carry state over many tokens (``A_log`` in [-3, -2.5]): the bf16 policy's output (input and every other
    leaf bf16) is closer to the fp32 layer with ``A_log`` gathered in fp32 (``train.fp32_params``' default) than with
    ``A_log`` rounded to bf16. Errors: relative RMS over the row; the third number is the error of rounding ``A_log``
    alone in an otherwise fp32 layer (what the fp32 gather removes). Measured on CPU: 0.00877 (fp32 A_log), 0.00912
    (bf16 A_log), 0.0021 (A_log alone)."""
    from q38.layers.context import seq_info
    from q38.layers.gdn import gdn_apply
    from q38.model import init_params
    from q38.parallel.local import LocalRuntime
    from q38.train.core.step_config import TrainConfig

    cfg = ModelConfig.preset("tiny").replace(hidden_size=32, linear_num_key_heads=1, linear_num_value_heads=2,
                                             linear_key_head_dim=8, linear_value_head_dim=8)
    p = init_params(cfg, seed=0).layers[cfg.layer_types.index("linear_attention")].mixer
    g = torch.Generator().manual_seed(0)
    p = attrs.evolve(p, A_log=-3.0 + 0.5 * torch.rand(p.A_log.shape, generator=g))
    s = 4096
    doc = torch.tensor([[0] * 2500 + [1] * 1000 + [2] * 596])
    x = torch.randn(1, s, cfg.hidden_size, generator=g)
    info = seq_info(doc, 1, s, "cpu")
    rel = lambda y, ref: ((y.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    with torch.no_grad():
        ref = gdn_apply(p, x, cfg, info).double()
        errs = {}
        for name, keep in (("A_log fp32", ("*A_log",)), ("A_log bf16", ())):
            tc = TrainConfig(param_dtype="bfloat16", fp32_params=keep)
            rt = LocalRuntime(tc.torch_param_dtype, tc.compute_dtype)
            rt.bind(p)
            errs[name] = rel(gdn_apply(rt.gather(p), x.to(torch.bfloat16), cfg, info), ref)
        rounded = attrs.evolve(p, A_log=p.A_log.to(torch.bfloat16).float())
        errs["A_log alone bf16"] = rel(gdn_apply(rounded, x, cfg, info), ref)
    print(f"relative RMS error against the fp32 layer over {s} tokens: {errs}")
    assert errs["A_log fp32"] * 1.01 < errs["A_log bf16"]
    assert errs["A_log alone bf16"] > 1e-3


# ---- one MTP layer for every depth ------------------------------------------------------------------------------

SHARED = CFG_A.replace(mtp_num_layers=3, mtp_shared_layer=True)


def _mtp_by_hand(params, ids, cfg):
    """The MTP hiddens computed depth by depth: the main model without MTP, then for each depth d the tokens
    shifted left by d (0 past the end), ``fc([norm_emb(embed) | norm_hidden(h)])``, MTP layer 0, ``mtp.norm``."""
    from q38.layers.block import layer_apply
    from q38.layers.context import seq_info
    from q38.layers.norm import rms_norm
    from q38.model import forward

    base = cfg.replace(mtp_num_layers=0, mtp_shared_layer=False)
    info = seq_info(None, *ids.shape, "cpu")
    h_prev = forward(attrs.evolve(params, mtp=None), ids, base).hidden
    mp, eps, outs = params.mtp, cfg.rms_norm_eps, []
    for d in range(1, cfg.mtp_num_layers + 1):
        ids_d = torch.zeros_like(ids)
        ids_d[:, :-d] = ids[:, d:]
        e = params.embed[ids_d]
        h = torch.cat([rms_norm(e, mp.norm_emb, eps), rms_norm(h_prev, mp.norm_hidden, eps)], -1) @ mp.fc.T
        h, _ = layer_apply(mp.layers[0], h, cfg, info)
        h_prev = rms_norm(h, mp.norm, eps)
        outs.append(h_prev)
    return outs


def test_shared_mtp_layer_equals_the_depth_by_depth_loop_and_tied_copies():
    """``mtp_shared_layer``: one MTP layer, run at depths 1..3, gives the hand loop's hiddens; a one-layer-per-depth
    model whose three layers are copies of it gives the same outputs, and the shared layer's gradient is the sum of
    the copies' gradients (every depth contributes: each depth alone gives it a non-zero gradient)."""
    from q38.model import forward

    params = _random_params(SHARED, seed=4)
    assert len(params.mtp.layers) == 1
    ids = torch.randint(0, SHARED.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = forward(params, ids, SHARED).mtp_hidden
        want = _mtp_by_hand(params, ids, SHARED)
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))

    probes = [torch.randn(h.shape, generator=torch.Generator().manual_seed(d)) for d, h in enumerate(got)]
    layer = [t.requires_grad_() for t in torch.utils._pytree.tree_leaves(params.mtp.layers[0])]
    out = forward(params, ids, SHARED).mtp_hidden
    per_depth = [torch.autograd.grad((h * w).sum(), layer, retain_graph=True, allow_unused=True)
                 for h, w in zip(out, probes)]
    total = torch.autograd.grad(sum((h * w).sum() for h, w in zip(out, probes)), layer, allow_unused=True)
    for d, g in enumerate(per_depth, start=1):
        assert any(x is not None and x.abs().sum() > 0 for x in g), f"depth {d} gave the shared layer no gradient"

    untied = SHARED.replace(mtp_shared_layer=False)
    copies = [tree_map(lambda t: t.detach().clone().requires_grad_(), params.mtp.layers[0]) for _ in range(3)]
    p3 = attrs.evolve(params, mtp=attrs.evolve(params.mtp, layers=copies))
    out3 = forward(p3, ids, untied).mtp_hidden
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(out3, out))
    leaves3 = [torch.utils._pytree.tree_leaves(c) for c in copies]
    g3 = torch.autograd.grad(sum((h * w).sum() for h, w in zip(out3, probes)), [t for ls in leaves3 for t in ls],
                             allow_unused=True)
    n = len(layer)
    for i in range(n):
        parts = [g3[j * n + i] for j in range(3) if g3[j * n + i] is not None]
        if total[i] is None:
            assert not parts
            continue
        torch.testing.assert_close(total[i], sum(parts), rtol=1e-5, atol=1e-6)


def test_shared_mtp_in_hf_files_counts_and_the_train_step(tmp_path):
    """The HF form holds ``mtp.layers.0`` only and reloads as the same shared model; a released checkpoint's one MTP
    layer loads shared at any depth; the parameter count has one MTP layer; a train step has one term per depth."""
    from q38.model import count_params
    from q38.train.core.step_config import TrainConfig
    from q38.train.core.state import state_from_params
    from q38.train.core.step import loss_and_grads

    params = _random_params(SHARED, seed=1)
    out = save_hf(tmp_path / "shared", SHARED, params)
    mtp_keys = {k.split(".")[2] for k in _headers(out) if k.startswith("mtp.layers.")}
    assert mtp_keys == {"0"}
    cfg, back = load_hf(out)
    assert cfg == SHARED and _differ(back, params) == []

    one = save_hf(tmp_path / "one", CFG_A, _random_params(CFG_A, seed=1))  # mtp_num_layers 1
    cfg, p = load_hf(one, mtp_num_layers=3, mtp_shared_layer=True)
    assert cfg.mtp_num_layers == 3 and cfg.mtp_shared_layer and len(p.mtp.layers) == 1

    assert count_params(SHARED).mtp_total == count_params(CFG_A).mtp_total
    assert count_params(SHARED).mtp_total < count_params(SHARED.replace(mtp_shared_layer=False)).mtp_total

    ids = torch.randint(0, SHARED.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    r = loss_and_grads(state_from_params(params, SHARED, TrainConfig()), {"input_ids": ids, "labels": ids.clone()})
    assert {"mtp_1", "mtp_2", "mtp_3"} <= set(r.terms)


def test_cli_fp8_init_import_export(tmp_path):
    """``q38 init-hf --dtype fp8`` writes a block-FP8 directory (projections e4m3 with scales, A_log and the GDN norm
    fp32, the rest bf16); ``convert --from-hf`` then ``--to-hf`` (no --dtype: the source's format) gives the same
    keys, dtypes and scale shapes, and ``--to-hf --dtype bfloat16`` a plain bf16 directory."""
    from q38.cli import main

    src, ck = tmp_path / "hf", tmp_path / "ck"
    assert main(["init-hf", "--model", "tiny_fp8", "--dtype", "fp8", str(src)]) == 0  # tiny: refused (blocks misaligned)
    h = _headers(src)
    assert h["model.layers.0.linear_attn.in_proj_qkv.weight"][0] == "F8_E4M3"
    assert h["model.layers.0.linear_attn.A_log"][0] == "F32" and h["model.embed_tokens.weight"][0] == "BF16"
    assert "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv" in h
    assert main(["convert", "--from-hf", str(src), str(ck)]) == 0
    assert main(["convert", "--to-hf", str(ck), str(tmp_path / "again")]) == 0
    assert _headers(tmp_path / "again") == h
    assert main(["convert", "--to-hf", str(ck), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert {dt for dt, _ in _headers(tmp_path / "bf16").values()} == {"BF16"}
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())


@pytest.mark.slow  # a training run: ~20 s alone, a minute on a loaded machine
def test_a_run_from_an_fp8_checkpoint_exports_fp8_and_keeps_source_fp32_leaves(tmp_path):
    """``init_from`` a block-FP8 directory that also stores dt_bias and the shared-expert gate in fp32: the run (bf16
    policy) adds the vector kind dt_bias to ``train.fp32_params`` (A_log and the GDN norm are there by default; the
    gate is a matrix: computed in bf16, exported in fp32), records the source format in its checkpoint, and
    ``run.save_hf`` writes the source's keys, dtypes and scale shapes."""
    from q38.train.io.checkpoint import read_meta, resolve_checkpoint
    from q38.train.run.trainer import RunConfig, train
    from tests.run_utils import run_dict

    cfg = load_model_config("tiny")
    fp32 = ("A_log", "norm_w", "dt_bias", "w_shared_gate")
    keep = lambda q: torch.float32 if q.endswith(fp32) else torch.bfloat16  # noqa: E731
    src = save_hf(tmp_path / "hf", cfg, _random_params(cfg), dtypes=fp8_dtypes(keep))
    d = run_dict(tmp_path / "run", steps=1, train={"param_dtype": "bfloat16"}, run={"save_hf": True})
    d["model"], d["init_from"] = str(src), str(src)
    train(RunConfig.from_dict(d))
    meta = read_meta(resolve_checkpoint(tmp_path / "run"))
    assert meta["train_config"]["fp32_params"] == ["*.mixer.A_log", "*.mixer.norm_w", "layers.*.mixer.dt_bias"]
    assert meta["source_format"]["fp8"]["weight_block_size"] == [128, 128]
    (hf_out,) = (tmp_path / "run" / "hf").iterdir()
    assert _headers(hf_out) == _headers(src)
