"""The decoder layer (pre-norm, two residuals) used by every main layer and by each MTP depth."""

import attrs
from jaxtyping import Float
from torch import Tensor

from q38.config import ModelConfig
from q38.layers.attention import AttnParams, abstract_attention, attention_apply
from q38.layers.common import ParamInfo
from q38.layers.context import SeqInfo
from q38.layers.gdn import GDNParams, abstract_gdn, gdn_apply
from q38.layers.moe import ExpertDispatch, MoEParams, abstract_moe, moe_apply
from q38.layers.norm import rms_norm
from q38.pytree import pytree_node


@pytree_node
@attrs.frozen
class LayerParams:
    attn_norm: Tensor  # [d] input_layernorm (zero-centred)
    mixer: AttnParams | GDNParams  # full attention or Gated DeltaNet, by layer type
    mlp_norm: Tensor  # [d] post_attention_layernorm
    moe: MoEParams


def abstract_layer(cfg: ModelConfig, layer_type: str) -> LayerParams:
    mixer = abstract_attention(cfg) if layer_type == "full_attention" else abstract_gdn(cfg)
    d = cfg.hidden_size
    return LayerParams(
        attn_norm=ParamInfo((d,), "zeros", axes=("norm",)),
        mixer=mixer,
        mlp_norm=ParamInfo((d,), "zeros", axes=("norm",)),
        moe=abstract_moe(cfg),
    )


def layer_apply(
    p: LayerParams,
    x: Float[Tensor, "b s d"],
    cfg: ModelConfig,
    info: SeqInfo,
    dispatch: ExpertDispatch | None = None,
    router_bias: Float[Tensor, " e"] | None = None,
) -> tuple[Float[Tensor, "b s d"], Float[Tensor, "n e"]]:
    """``x + mixer(norm(x))``, then ``x + moe(norm(x))``; returns the router logits too. ``router_bias``: the MoE
    layer's expert-selection bias (aux-loss-free balancing), or None."""
    h = rms_norm(x, p.attn_norm, cfg.rms_norm_eps)
    if isinstance(p.mixer, AttnParams):
        h = attention_apply(p.mixer, h, cfg, info)
    else:
        h = gdn_apply(p.mixer, h, cfg, info)
    x = x + h
    y, router_logits = moe_apply(p.moe, rms_norm(x, p.mlp_norm, cfg.rms_norm_eps), cfg, dispatch, router_bias,
                                 info.kernels)
    return x + y, router_logits
