"""Hugging Face ``config.json`` ⇄ ``ModelConfig``: reading a released config (any of the family's field names) and
writing the one q38 exports; ``load_model_config`` takes a preset name, a q38 YAML or a Hugging Face config."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import q38.layers.kinds  # noqa: F401 (the layer-kind table registers itself: a ModelConfig checks layer_types on it)
from q38.errors import ConfigError
from q38.model_config import MODEL_FAMILIES, MTP_DEPTH_FIELDS, ModelConfig, _default_layer_types, model_family


def read_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face ``config.json`` as a dict (a path, a checkpoint directory, or the parsed mapping)."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    # the file checks of q38's checkpoint reader (a leaf module; imported here, not at the top, to keep this module
    # light): bounded, no FIFO, a symlink only to a Hugging Face cache blob, nested at most MAX_JSON_DEPTH deep
    from q38.files import check_config_bounds, inside, load_json

    p = Path(path_or_dict)
    if p.is_dir():
        if not (p / "config.json").exists() and not (p / "config.json").is_symlink():
            raise ConfigError(f"Hugging Face config not found: {p / 'config.json'}")
        p = inside(p, "config.json", f"Hugging Face config {p / 'config.json'}", follow=True)
    elif not p.exists():
        raise ConfigError(f"Hugging Face config not found: {p}")
    raw = load_json(p, str(p), follow=True)
    if isinstance(raw, dict):
        check_config_bounds(raw, str(p))  # every size and count bounded before a shape is computed from it
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object of config keys, got {type(raw).__name__}")
    return raw


def hf_model_type(raw: Mapping[str, Any]) -> str:
    """The q38 model type of a HF config: its ``model_type`` (a known family), or the q38 family ``save_hf``
    recorded in ``q38_model_type`` (e.g. qwen3_8_moe saved as qwen3_5_moe_text) when their checkpoint layouts
    agree."""
    top_type = raw.get("model_type")
    if top_type is None:
        raise ConfigError(f"config has no model_type; known model types: {', '.join(sorted(MODEL_FAMILIES))}")
    layout = model_family(top_type).checkpoint_layout
    q38_type = raw.get("q38_model_type")
    if q38_type in MODEL_FAMILIES and MODEL_FAMILIES[q38_type].checkpoint_layout == layout:
        return q38_type
    return top_type


def _hf_mtp_depth(text: Mapping[str, Any], raw: Mapping[str, Any]) -> int:
    """The MTP depth: whichever of the family's field names is present (text config first, then the top level)."""
    for src in (text, raw):
        for k in MTP_DEPTH_FIELDS:
            if src.get(k) is not None:
                return int(src[k])
    return 0


def _hf_rope(text: Mapping[str, Any], raw: Mapping[str, Any]) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` from ``rope_parameters`` or the flat keys; only default RoPE."""
    rope = dict(text.get("rope_parameters") or raw.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", None):
        raise ConfigError(f"rope_type {rope_type!r} is not supported by q38 (only 'default' RoPE)")
    theta = rope.get("rope_theta", text.get("rope_theta", 10_000.0))
    return float(theta), float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))


def load_model_config(name_or_path: str | os.PathLike, *, kernels_out: dict | None = None) -> ModelConfig:
    """A preset name, a q38 YAML file, a HF ``config.json`` or a HF checkpoint directory."""
    p = Path(name_or_path)
    if p.is_dir() or p.suffix == ".json":
        return config_from_hf(p)
    if p.suffix in (".yaml", ".yml"):
        return ModelConfig.from_yaml(p, kernels_out=kernels_out)
    return ModelConfig.preset(str(name_or_path))


def config_from_hf(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> ModelConfig:
    """Read a Hugging Face ``config.json`` (a path, a checkpoint directory, or the parsed dict). A key that is
    missing or of the wrong type is one ``ConfigError`` naming the file and the key."""
    where = "config" if isinstance(path_or_dict, Mapping) else str(
        Path(path_or_dict) / "config.json" if Path(path_or_dict).is_dir() else path_or_dict)
    try:
        return _config_from_hf(path_or_dict)
    except KeyError as e:
        raise ConfigError(f"{where}: required key {e.args[0]!r} is missing (not a config.json of a "
                          "supported model)") from None
    except (TypeError, AttributeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: a value has the wrong type or form ({' '.join(str(e).split())}); "
                          "fix the file") from None


def _config_from_hf(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> ModelConfig:
    raw = read_hf_config(path_or_dict)
    model_type = hf_model_type(raw)
    text = dict(raw.get("text_config") or raw)
    rope_theta, prf = _hf_rope(text, raw)
    if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step", 1)) != 1:
        raise ConfigError(
            "dense (non-MoE) decoder layers (mlp_only_layers / decoder_sparse_step != 1) are not implemented "
            "in q38; every released checkpoint of this family is all-MoE"
        )
    num_layers = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types") or _default_layer_types(
        num_layers, int(text.get("full_attention_interval", 4))
    )
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    kw = dict(
        model_type=model_type,
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        num_hidden_layers=num_layers,
        layer_types=tuple(layer_types),
        num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text["num_key_value_heads"],
        head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
        rope_theta=rope_theta,
        partial_rotary_factor=prf,
        linear_num_key_heads=text["linear_num_key_heads"],
        linear_num_value_heads=text["linear_num_value_heads"],
        linear_key_head_dim=text["linear_key_head_dim"],
        linear_value_head_dim=text["linear_value_head_dim"],
        linear_conv_kernel_dim=text["linear_conv_kernel_dim"],
        num_experts=text["num_experts"],
        num_experts_per_tok=text["num_experts_per_tok"],
        moe_intermediate_size=text["moe_intermediate_size"],
        shared_expert_intermediate_size=text["shared_expert_intermediate_size"],
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        router_aux_loss_coef=float(text.get("router_aux_loss_coef", 0.001)),
        mtp_num_layers=(int(raw["q38_mtp_depth"]) if raw.get("q38_mtp_shared_layer") and "q38_mtp_depth" in raw
                        else _hf_mtp_depth(text, raw)),
        mtp_shared_layer=bool(raw.get("q38_mtp_shared_layer", False)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        initializer_range=float(text.get("initializer_range", 0.02)),
        max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
        hidden_act=text.get("hidden_act", "silu"),
        attention_bias=bool(text.get("attention_bias", False)),
        bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_id=eos,
        pad_token_id=text.get("pad_token_id", raw.get("pad_token_id")),
    )
    return ModelConfig(**kw)


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` for ``Qwen3_5MoeForCausalLM`` (model type ``qwen3_5_moe_text``) or Qwen3-Next."""
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        layer_types=list(cfg.layer_types),
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        max_position_embeddings=cfg.max_position_embeddings,
        hidden_act=cfg.hidden_act,
        attention_bias=False,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
    )
    extra = {}
    if cfg.mtp_shared_layer:  # the checkpoint holds one MTP layer; q38 runs it at every depth
        extra = dict(q38_mtp_shared_layer=True, q38_mtp_depth=cfg.mtp_num_layers)
    if cfg.family.checkpoint_layout == "qwen3_next":
        return dict(
            common,
            **extra,
            model_type="qwen3_next",
            architectures=["Qwen3NextForCausalLM"],
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            intermediate_size=cfg.moe_intermediate_size,
            num_nextn_predict_layers=cfg.mtp_layers_stored,
        )
    if not cfg.norm_topk_prob:
        raise ConfigError("the Qwen3.5-MoE layout always renormalises top-k weights; norm_topk_prob must be True")
    return dict(
        common,
        **extra,
        model_type="qwen3_5_moe_text",
        architectures=["Qwen3_5MoeForCausalLM"],
        mtp_num_hidden_layers=cfg.mtp_layers_stored,
        q38_model_type=cfg.model_type,
    )
