"""q38 ↔ Hugging Face parity: checkpoints written by ``q38.save_hf`` run in transformers' models with the same logits,
CE loss and aux loss; checkpoints written by transformers load into q38 with the same logits; round trips are exact;
malformed checkpoints fail with one ``CheckpointError`` naming every problem.

Everything is tiny fp32 on CPU. Weights use std 0.08-0.1 (not 0.02) and random norm weights, so a wrong row order, a
missing ``1 + w`` or a swapped gate/up moves the logits by far more than the 1e-4 tolerance (checked: each q→HF test
also shows that a mislaid tensor moves the logits by > 100x the tolerance). Larger stds make these deep random stacks
amplify fp32 rounding (the chunked GDN differs from HF's at ~1e-6 relative) past 1e-4 without any layout error.
"""

import json

import attrs
import pytest
import torch
import torch.nn.functional as F

import q38
from q38.hf_config import hf_config_dict
from q38.model_config import ModelConfig
from q38.hf import CheckpointError, load_hf, save_hf
from q38.pytree import named_leaves, tree_map_with_path

LOGIT_TOL = 1e-4
LOSS_TOL = 1e-5

# Qwen3.5 layout, 5 layers with the default 3:1 pattern (5 % 4 != 0), value heads = 2 × key heads, top-2 of 8.
CFG_A = ModelConfig(
    model_type="qwen3_5_moe", vocab_size=160, hidden_size=48, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0, partial_rotary_factor=0.5,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=20,
    mtp_num_layers=1, initializer_range=0.08, max_position_embeddings=4096,
)
# Custom layer types, value heads = 4 × key heads, top-1 of 4, tied embeddings, the qwen3_8_moe family name.
CFG_B = ModelConfig(
    model_type="qwen3_8_moe", vocab_size=256, hidden_size=32, num_hidden_layers=3,
    layer_types=("full_attention", "linear_attention", "full_attention"),
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=1_000_000.0, partial_rotary_factor=0.25,
    linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    mtp_num_layers=1, tie_word_embeddings=True, initializer_range=0.1, max_position_embeddings=4096,
)
# Qwen3-Next layout (grouped qkvz / ba, per-expert experts), no top-k renormalisation, top-3 of 6.
CFG_NEXT = ModelConfig(
    model_type="qwen3_next", vocab_size=200, hidden_size=40, num_hidden_layers=3,
    layer_types=("linear_attention", "full_attention", "linear_attention"),
    num_attention_heads=4, num_key_value_heads=1, head_dim=8, rope_theta=10_000.0, partial_rotary_factor=0.5,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    norm_topk_prob=False, mtp_num_layers=1, initializer_range=0.1, max_position_embeddings=4096,
)
CONFIGS = {"qwen35_5layers": CFG_A, "qwen35_custom_tied_top1": CFG_B, "qwen3_next": CFG_NEXT}


# ---- helpers ---------------------------------------------------------------------------------------------------------
def _random_params(cfg: ModelConfig, seed: int = 0):
    """``init_params`` with every 1-D leaf (norm weights, dt_bias, A_log) perturbed, so none is a constant."""
    params = q38.init_params(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return tree_map_with_path(
        lambda p, t: t + 0.3 * torch.randn(t.shape, generator=g) if t is not None and t.ndim == 1 else t, params
    )


def _tokens(cfg: ModelConfig, b: int = 2, s: int = 70, seed: int = 0) -> torch.Tensor:
    """``s`` > 64 so the GDN chunked path crosses a chunk boundary."""
    return torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


def _hf_classes(cfg: ModelConfig):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    if cfg.family.checkpoint_layout == "qwen3_next":
        return Qwen3NextConfig, Qwen3NextForCausalLM
    return Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM


def _hf_from_pretrained(cfg: ModelConfig, path):
    _, model_cls = _hf_classes(cfg)
    return model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _aux_reference(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """HF's ``load_balancing_loss_func`` without a mask: ``E · Σ_e f_e · P̄_e`` over all layers' tokens pooled."""
    probs = torch.cat([torch.softmax(rl.float(), dim=-1) for rl in router_logits])
    counts = F.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).float().sum(1)  # [n, e]
    return num_experts * (counts.mean(0) * probs.mean(0)).sum()


def _ce_shifted(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF ``ForCausalLMLoss``: position t predicts label t + 1; -100 ignored; mean over valid targets."""
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def _assert_close_logits(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    assert a.std() > 0.5 and b.std() > 0.5, "logits nearly constant: the comparison would not exercise the model"
    diff = (a - b).abs().max().item()
    assert diff <= LOGIT_TOL, f"max |Δ logits| = {diff:.3e}"
    return diff


def _assert_same_params(a, b) -> None:
    la = {k: v for k, v in named_leaves(a) if v is not None}
    lb = {k: v for k, v in named_leaves(b) if v is not None}
    assert (a.lm_head is None) == (b.lm_head is None) and (a.mtp is None) == (b.mtp is None)
    assert la.keys() == lb.keys()
    for k in la:
        assert la[k].dtype == lb[k].dtype and la[k].shape == lb[k].shape, k
        assert torch.equal(la[k], lb[k]), k


def _hf_random_model(cfg: ModelConfig, *, seed: int = 0, mtp_field: int | None = None):
    """A transformers model for ``cfg`` with every parameter redrawn from N(0, std) (gated GDN norm: 1 + N(0, std));
    std is the config's ``initializer_range`` for matrices and 0.3 for vectors (zero-centred norms, dt_bias, A_log)."""
    config_cls, model_cls = _hf_classes(cfg)
    d = {k: v for k, v in hf_config_dict(cfg).items() if k not in ("model_type", "architectures", "q38_model_type")}
    if mtp_field is not None:
        d["mtp_num_hidden_layers" if "mtp_num_hidden_layers" in d else "num_nextn_predict_layers"] = mtp_field
    model = model_cls(config_cls(**d)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.3 if p.ndim == 1 else cfg.initializer_range) * torch.randn(p.shape, generator=g))
            if name.endswith("linear_attn.norm.weight"):
                p.add_(1.0)
    return model


# ---- (i) q38 → HF ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_q38_to_hf_logits_and_losses(name, tmp_path):
    cfg = CONFIGS[name]
    params = _random_params(cfg)
    # CFG_B goes through a sharded checkpoint (fused experts split across files) into transformers.
    max_shard = 40_000 if name == "qwen35_custom_tied_top1" else q38.hf.DEFAULT_MAX_SHARD_BYTES
    save_hf(tmp_path / "ckpt", cfg, params, max_shard_bytes=max_shard)
    if name == "qwen35_custom_tied_top1":
        assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    hf = _hf_from_pretrained(cfg, tmp_path / "ckpt")

    ids = _tokens(cfg)
    labels = ids.clone()
    labels[0, :5] = -100
    with torch.no_grad():
        out = hf(input_ids=ids, labels=labels, output_router_logits=True)
        ours = q38.forward(params, ids, cfg)
        ours_logits = F.linear(ours.hidden, q38.head_weight(params))
    diff = _assert_close_logits(ours_logits, out.logits)
    print(f"{name}: q38→HF max |Δ logits| = {diff:.2e}")

    # the tolerance discriminates layout errors: value heads reversed in w_z, gate/up swapped in one layer
    gdn_i = cfg.layer_types.index("linear_attention")
    lp = params.layers[gdn_i]
    f = cfg.moe_intermediate_size
    z_rev = lp.mixer.w_z.reshape(cfg.linear_num_value_heads, -1, cfg.hidden_size).flip(0).reshape_as(lp.mixer.w_z)
    gu_swap = torch.cat([lp.moe.we_gate_up[:, f:], lp.moe.we_gate_up[:, :f]], dim=1)
    for bad_layer in (
        attrs.evolve(lp, mixer=attrs.evolve(lp.mixer, w_z=z_rev)),
        attrs.evolve(lp, moe=attrs.evolve(lp.moe, we_gate_up=gu_swap)),
    ):
        layers = list(params.layers)
        layers[gdn_i] = bad_layer
        with torch.no_grad():
            wrong = q38.logits(attrs.evolve(params, layers=layers), ids, cfg)
        assert (wrong - out.logits).abs().max() > 100 * LOGIT_TOL

    aux = _aux_reference(ours.router_logits[: cfg.num_hidden_layers], cfg.num_experts, cfg.num_experts_per_tok)
    assert abs(out.aux_loss.item() - aux.item()) <= LOSS_TOL
    ce = _ce_shifted(ours_logits, labels)
    assert abs(out.loss.item() - (ce + cfg.router_aux_loss_coef * aux).item()) <= LOSS_TOL
    # our local aux formula is HF's own function (guards the reference against drift)
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    main_logits = tuple(ours.router_logits[: cfg.num_hidden_layers])
    hf_fn = load_balancing_loss_func(main_logits, cfg.num_experts, cfg.num_experts_per_tok)
    assert abs(hf_fn.item() - aux.item()) <= LOSS_TOL


# ---- (ii)/(iii) HF → q38 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen35_5layers", "qwen35_custom_tied_top1", "qwen3_next"])
def test_hf_to_q38_logits(name, tmp_path):
    cfg = CONFIGS[name]
    hf = _hf_random_model(cfg, mtp_field=1)
    hf.save_pretrained(tmp_path / "hf")
    keys = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert keys["model_type"] in ("qwen3_5_moe_text", "qwen3_next")

    # transformers drops MTP on save while the config still says 1: a clear error, then an explicit opt-out.
    with pytest.raises(CheckpointError) as ei:
        load_hf(tmp_path / "hf")
    msg = str(ei.value)
    assert str(tmp_path / "hf") in msg and "missing keys" in msg and "mtp.fc.weight" in msg
    assert "mtp_num_layers=0" in msg

    cfg2, params = load_hf(tmp_path / "hf", mtp_num_layers=0)
    assert params.mtp is None and cfg2.mtp_num_layers == 0
    assert cfg2.layer_types == cfg.layer_types and cfg2.tie_word_embeddings == cfg.tie_word_embeddings
    ids = _tokens(cfg, seed=1)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        ours = q38.logits(params, ids, cfg2)
    diff = _assert_close_logits(ours, ref)
    print(f"{name}: HF→q38 max |Δ logits| = {diff:.2e}")


def test_hf_checkpoint_without_mtp_in_config_loads(tmp_path):
    hf = _hf_random_model(CFG_A, mtp_field=0)
    hf.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf(tmp_path / "hf")
    assert cfg.mtp_num_layers == 0 and params.mtp is None


# ---- (iv) round trips, other layouts, sharding, errors ---------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_bit_identical(name, tmp_path):
    cfg = CONFIGS[name]
    params = _random_params(cfg, seed=3)
    save_hf(tmp_path / "ckpt", cfg, params)
    cfg2, params2 = load_hf(tmp_path / "ckpt")
    assert cfg2 == cfg
    assert params2.mtp is not None
    _assert_same_params(params, params2)


def _qwen35_reference_state_dict(cfg: ModelConfig, params, prefix: str, main_fused: bool, mtp_fused: bool) -> dict:
    """The Qwen3.5 layout written out by hand (independent of q38.hf's tables), ``mtp.*`` at the top level; the hub
    checkpoints have fused main-layer experts and per-expert MTP experts."""
    sd = {f"{prefix}embed_tokens.weight": params.embed, f"{prefix}norm.weight": params.final_norm}
    if params.lm_head is not None:
        sd["lm_head.weight"] = params.lm_head
    f = cfg.moe_intermediate_size

    def layer(hp, lp, per_expert):
        sd[hp + "input_layernorm.weight"] = lp.attn_norm
        sd[hp + "post_attention_layernorm.weight"] = lp.mlp_norm
        m = lp.mixer
        if hasattr(m, "w_q"):
            attn = dict(q_proj=m.w_q, k_proj=m.w_k, v_proj=m.w_v, o_proj=m.w_o, q_norm=m.q_norm, k_norm=m.k_norm)
            for n, t in attn.items():
                sd[f"{hp}self_attn.{n}.weight"] = t
        else:
            la = hp + "linear_attn."
            sd[la + "in_proj_qkv.weight"], sd[la + "in_proj_z.weight"] = m.w_qkv, m.w_z
            sd[la + "in_proj_b.weight"], sd[la + "in_proj_a.weight"] = m.w_b, m.w_a
            sd[la + "conv1d.weight"] = m.conv_w[:, None, :]
            sd[la + "dt_bias"], sd[la + "A_log"], sd[la + "norm.weight"] = m.dt_bias, m.A_log, m.norm_w
            sd[la + "out_proj.weight"] = m.w_out
        moe = lp.moe
        sd[hp + "mlp.gate.weight"] = moe.w_router
        sd[hp + "mlp.shared_expert.gate_proj.weight"] = moe.ws_gate
        sd[hp + "mlp.shared_expert.up_proj.weight"] = moe.ws_up
        sd[hp + "mlp.shared_expert.down_proj.weight"] = moe.ws_down
        sd[hp + "mlp.shared_expert_gate.weight"] = moe.w_shared_gate
        if per_expert:
            for e in range(cfg.num_experts):
                sd[f"{hp}mlp.experts.{e}.gate_proj.weight"] = moe.we_gate_up[e, :f]
                sd[f"{hp}mlp.experts.{e}.up_proj.weight"] = moe.we_gate_up[e, f:]
                sd[f"{hp}mlp.experts.{e}.down_proj.weight"] = moe.we_down[e]
        else:
            sd[hp + "mlp.experts.gate_up_proj"] = moe.we_gate_up
            sd[hp + "mlp.experts.down_proj"] = moe.we_down

    for i, lp in enumerate(params.layers):
        layer(f"{prefix}layers.{i}.", lp, per_expert=not main_fused)
    mtp = params.mtp
    sd["mtp.fc.weight"] = mtp.fc
    sd["mtp.pre_fc_norm_embedding.weight"] = mtp.norm_emb
    sd["mtp.pre_fc_norm_hidden.weight"] = mtp.norm_hidden
    sd["mtp.norm.weight"] = mtp.norm
    for j, lp in enumerate(mtp.layers):
        layer(f"mtp.layers.{j}.", lp, per_expert=not mtp_fused)
    return {k: v.contiguous() for k, v in sd.items()}


@pytest.mark.parametrize("main_fused,mtp_fused", [(True, False), (False, True)], ids=["hub", "swapped"])
def test_multimodal_prefix_checkpoint_loads(main_fused, mtp_fused, tmp_path):
    """``model.language_model.`` prefix (model_type qwen3_5_moe, nested text_config), fused or per-expert experts in
    the main layers and in MTP, a vision tower key to ignore, split over two shards with an index."""
    from safetensors.torch import save_file

    cfg = CFG_A
    params = _random_params(cfg, seed=5)
    sd = _qwen35_reference_state_dict(cfg, params, "model.language_model.", main_fused, mtp_fused)
    sd["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, 2)
    keys = sorted(sd)
    half = len(keys) // 2
    d = tmp_path / "mm"
    d.mkdir()
    weight_map = {}
    for n, part in enumerate((keys[:half], keys[half:])):
        fn = f"model-{n + 1:05d}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, str(d / fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = {k: v for k, v in hf_config_dict(cfg).items() if k not in ("architectures", "q38_model_type")}
    text["model_type"] = "qwen3_5_moe_text"
    config = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
              "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (d / "config.json").write_text(json.dumps(config))

    cfg2, params2 = load_hf(d)
    assert cfg2 == cfg
    _assert_same_params(params, params2)


def test_bf16_round_trip_and_dtype_cast(tmp_path):
    cfg = CFG_NEXT
    params = _random_params(cfg, seed=9)
    bf16 = tree_map_with_path(lambda p, t: None if t is None else t.to(torch.bfloat16), params)
    save_hf(tmp_path / "bf16", cfg, bf16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    _assert_same_params(bf16, load_hf(tmp_path / "bf16")[1])
    _, up = load_hf(tmp_path / "bf16", dtype=torch.float32)
    assert all(t.dtype == torch.float32 for _, t in named_leaves(up) if t is not None)
    _assert_same_params(bf16, tree_map_with_path(lambda p, t: None if t is None else t.to(torch.bfloat16), up))
    save_hf(tmp_path / "fp32", cfg, params)
    _, cast = load_hf(tmp_path / "fp32", dtype=torch.bfloat16)
    _assert_same_params(bf16, cast)


def test_sharded_save_and_load(tmp_path):
    cfg = CFG_NEXT
    params = _random_params(cfg, seed=7)
    save_hf(tmp_path / "ckpt", cfg, params, max_shard_bytes=30_000)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors" not in files and "model.safetensors.index.json" in files
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    _, params2 = load_hf(tmp_path / "ckpt")
    _assert_same_params(params, params2)


def test_save_is_atomic_and_replaces(tmp_path):
    cfg = CFG_B
    target = tmp_path / "ckpt"
    save_hf(target, cfg, _random_params(cfg, seed=1))
    (target / "stale.txt").write_text("old")
    p2 = _random_params(cfg, seed=2)
    save_hf(target, cfg, p2, max_shard_bytes=40_000)
    assert not (target / "stale.txt").exists() and not (target / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary or old directories left
    _assert_same_params(p2, load_hf(target)[1])

    class Sub(torch.Tensor):
        pass

    bad = attrs.evolve(p2, embed=p2.embed.as_subclass(Sub))
    with pytest.raises(TypeError, match="gather"):
        save_hf(tmp_path / "other", cfg, bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _rewrite(src, dst, edit):
    """Copy a single-file checkpoint, editing its state dict."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_checkpoint_errors(tmp_path):
    cfg = CFG_A
    src = tmp_path / "ok"
    save_hf(src, cfg, _random_params(cfg))

    _rewrite(src, tmp_path / "missing", lambda sd: sd.pop("model.layers.3.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError) as ei:
        load_hf(tmp_path / "missing")
    msg = str(ei.value)
    assert str(tmp_path / "missing") in msg
    assert "missing keys (1)" in msg and "model.layers.3.self_attn.k_norm.weight" in msg
    assert "unexpected" not in msg and "shape" not in msg

    _rewrite(src, tmp_path / "unexpected", lambda sd: sd.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected keys \(1\):\n    model\.layers\.0\.extra\.weight"):
        load_hf(tmp_path / "unexpected")

    def wrong_shape(sd):
        sd["model.layers.0.linear_attn.in_proj_z.weight"] = torch.zeros(7, 48)
        sd["mtp.layers.0.mlp.experts.2.down_proj.weight"] = torch.zeros(48, 25)

    _rewrite(src, tmp_path / "shape", wrong_shape)
    with pytest.raises(CheckpointError) as ei:
        load_hf(tmp_path / "shape")
    msg = str(ei.value)
    assert "shape mismatches (2)" in msg
    assert "model.layers.0.linear_attn.in_proj_z.weight: checkpoint [7, 48], expected [48, 48]" in msg
    assert "mtp.layers.0.mlp.experts.2.down_proj.weight: checkpoint [48, 25], expected [48, 24]" in msg

    def many(sd):  # all three kinds at once, with more than the listed limit of missing keys
        for k in [k for k in sd if k.startswith(("model.layers.1.", "model.layers.2."))]:
            del sd[k]
        sd["model.layers.9.input_layernorm.weight"] = torch.zeros(48)
        sd["model.norm.weight"] = torch.zeros(47)

    _rewrite(src, tmp_path / "many", many)
    with pytest.raises(CheckpointError) as ei:
        load_hf(tmp_path / "many")
    msg = str(ei.value)
    assert "missing keys (36)" in msg and "    ... and 16 more" in msg
    assert "unexpected keys (1)" in msg and "shape mismatches (1)" in msg

    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text((src / "config.json").read_text())
        load_hf(tmp_path / "empty")


# ---- (v) training gradients and the aux loss with padding, against transformers ----------------------------------
# Per tensor, against transformers in fp64 (the exact gradient to ~1e-12): max |Δ grad| / max |grad| of q38 (fp32) within
# the larger of GRAD_RTOL and twice transformers' own fp32 error. The A_log gradients are sums of many cancelling
# products: transformers' fp32 run is up to 9.3e-5 from its fp64 one there (measured), so no fixed fp32 bound
# near 1e-4 separates rounding from a bug for them; everything else is within 4.4e-5.
GRAD_RTOL = 1e-4


def test_training_gradients_and_real_token_aux_match_transformers(tmp_path):
    """q38's training objective (main CE + coef · aux, ``aux_loss_tokens: real``) on a right-padded batch against
    transformers' ``loss`` with its ``attention_mask`` (``load_balancing_loss_func`` over non-padding tokens): the
    aux value, the loss, and the gradient of every parameter. The HF gradients are written in the HF layout and read
    back by ``load_hf``, so every q38 leaf is compared with its own HF tensor(s)."""
    from safetensors.torch import save_file

    from q38.train.core.step_config import TrainConfig
    from q38.train.core.state import state_from_params
    from q38.train.core.step import loss_and_grads

    cfg = CFG_A.replace(mtp_num_layers=0, router_aux_loss_coef=0.5)  # a large coef: the aux gradient matters
    params = _random_params(cfg, seed=11)
    save_hf(tmp_path / "ckpt", cfg, params)
    hf = _hf_from_pretrained(cfg, tmp_path / "ckpt")
    ids = _tokens(cfg, seed=4)
    mask = torch.ones_like(ids)
    mask[1, -12:] = 0  # right padding
    labels = ids.clone()
    labels[0, :9] = -100  # a prompt: routed and balanced (real tokens) but not a target
    labels[mask == 0] = -100
    out = hf(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    out.loss.backward()
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    with torch.no_grad():
        ref_aux = load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok, mask)
    assert abs(out.aux_loss.item() - ref_aux.item()) <= LOSS_TOL

    tc = TrainConfig(loss_chunk_size=16, aux_loss_tokens="real")
    r = loss_and_grads(state_from_params(params, cfg, tc), {"input_ids": ids, "labels": labels, "attention_mask": mask})
    assert abs(float(r.aux_loss) - ref_aux.item()) <= LOSS_TOL
    assert abs(float(r.objective) - out.loss.item()) <= LOSS_TOL
    # labelled tokens only is a different number here (the prompt is routed but unlabelled)
    r_lab = loss_and_grads(state_from_params(params, cfg, tc.replace(aux_loss_tokens="labelled")),
                           {"input_ids": ids, "labels": labels, "attention_mask": mask})
    assert abs(float(r_lab.aux_loss) - ref_aux.item()) > 100 * LOSS_TOL

    # the exact gradients: transformers in fp64 (its eager experts: grouped_mm has no fp64)
    _, model_cls = _hf_classes(cfg)
    hf64 = model_cls.from_pretrained(tmp_path / "ckpt", dtype=torch.float32, attn_implementation="eager",
                                     experts_implementation="eager").eval().double()
    hf64(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True).loss.backward()

    def hf_grads(model, name):
        grads = {n: p.grad.detach().float().contiguous() for n, p in model.named_parameters() if p.grad is not None}
        (tmp_path / name).mkdir()
        save_file(grads, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text((tmp_path / "ckpt" / "config.json").read_text())
        return dict(named_leaves(load_hf(tmp_path / name)[1]))

    ref32, ref64 = hf_grads(hf, "grads32"), hf_grads(hf64, "grads64")
    ours = dict(zip([n for n, _ in named_leaves(params)], r.grads))
    assert ref64.keys() == ours.keys()
    worst = 0.0
    for name, g in ref64.items():
        scale = float(g.abs().max())
        assert scale > 0, f"{name}: zero HF gradient (the comparison would not test it)"
        rel = float((ours[name] - g).abs().max()) / scale
        rel_hf = float((ref32[name] - g).abs().max()) / scale
        worst = max(worst, rel)
        assert rel <= max(GRAD_RTOL, 2 * rel_hf), f"{name}: max |Δ grad| / max |grad| = {rel:.2e} (HF fp32: {rel_hf:.2e})"
    print(f"\nq38 vs transformers fp64 gradients: {len(ref64)} tensors, worst max|Δ|/max|g| = {worst:.2e}")
