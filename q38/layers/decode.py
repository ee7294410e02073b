"""One-token steps of the token mixers, for decoding (docs/evaluate.md#how-decoding-works): each is a pure function
of (params, one token's input, the layer's cache) returning (output, new cache), with the same math as the layer's
sequence form (``gdn_apply``, ``attention_apply``) run on the prefix.

* Gated DeltaNet: the causal conv keeps its last ``K - 1`` inputs (``conv``), the gated delta rule its state
  ``S [h a p]`` (``ssm``): ``S ← exp(g)·S``, ``S ← S + k (β (v − Sᵀk))ᵀ``, ``o = Sᵀq`` with L2-normalised ``q``
  (scaled by ``a^-½``) and ``k`` — the recurrent form of the rule whose chunked form ``gdn.py`` trains with.
* Gated attention: the RoPE'd keys and the values of every earlier token (``k``, ``v``) and which of them are real
  (``valid``: a row of a batch may skip steps, e.g. the left padding of a shorter prompt).

Extra dims: ``t`` cached positions, ``ch`` conv channels, ``w1`` = conv kernel − 1, ``a``/``p`` key/value state dims.
"""

import attrs
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from q38.layers.attention import AttnParams
from q38.layers.gdn import GDNParams, l2norm
from q38.layers.norm import gated_rms_norm, rms_norm
from q38.layers.rope import apply_rope, rope_cos_sin
from q38.model_config import ModelConfig
from q38.pytree import pytree_node


@pytree_node
@attrs.frozen
class GDNCache:
    """A GDN layer's decode state: the last ``K - 1`` conv inputs (oldest first) and the recurrent state (fp32)."""

    conv: Tensor  # [b, K - 1, conv_dim]
    ssm: Tensor  # [b, nv, dk, dv] fp32


@pytree_node
@attrs.frozen
class KVCache:
    """An attention layer's decode state: RoPE'd keys and values of the cached positions, and which are real."""

    k: Tensor  # [b, t, g, c]
    v: Tensor  # [b, t, g, c]
    valid: Tensor  # [b, t] bool


def empty_gdn_cache(cfg: ModelConfig, batch: int, dtype: torch.dtype, device=None) -> GDNCache:
    """The state before a document's first token: zero conv inputs (the conv never reads another document) and S = 0."""
    kw = cfg.linear_conv_kernel_dim
    return GDNCache(
        conv=torch.zeros(batch, kw - 1, cfg.linear_conv_dim, dtype=dtype, device=device),
        ssm=torch.zeros(batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                        dtype=torch.float32, device=device),
    )


def empty_kv_cache(cfg: ModelConfig, batch: int, dtype: torch.dtype, device=None) -> KVCache:
    g, c = cfg.num_key_value_heads, cfg.head_dim
    return KVCache(k=torch.zeros(batch, 0, g, c, dtype=dtype, device=device),
                   v=torch.zeros(batch, 0, g, c, dtype=dtype, device=device),
                   valid=torch.zeros(batch, 0, dtype=torch.bool, device=device))


def gated_delta_rule_step(
    q: Float[Tensor, "b h a"], k: Float[Tensor, "b h a"], v: Float[Tensor, "b h p"], g: Float[Tensor, "b h"],
    beta: Float[Tensor, "b h"], state: Float[Tensor, "b h a p"],
) -> tuple[Float[Tensor, "b h p"], Float[Tensor, "b h a p"]]:
    """One token of the gated delta rule (fp32; ``q``, ``k`` already L2-normalised, ``q`` scaled):
    ``S' = exp(g)·S + k ⊗ β(v − (exp(g)·S)ᵀk)``, ``o = S'ᵀq`` (docs/model.md#the-gated-delta-rule)."""
    s = state * g.exp()[..., None, None]
    delta = (v - torch.einsum("bhap,bha->bhp", s, k)) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhap,bha->bhp", s, q), s


def gdn_decode(
    p: GDNParams, x: Float[Tensor, "b d"], cache: GDNCache, cfg: ModelConfig
) -> tuple[Float[Tensor, "b d"], GDNCache]:
    """``gdn_apply`` for one token per row, given the row's ``GDNCache``; returns the output and the new cache."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    b = x.shape[0]
    mixed = F.linear(x, p.w_qkv)  # [b ch]
    window = torch.cat([cache.conv, mixed[:, None]], dim=1)  # [b K ch]: tap j reads window[:, j]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # the conv accumulates as causal_conv1d does
    w, win = p.conv_w.to(acc), window.to(acc)
    conv = win[:, -1] * w[:, -1]  # the taps summed in causal_conv1d's order: the token's own, then the oldest first
    for j in range(w.shape[1] - 1):
        conv = conv + win[:, j] * w[:, j]
    conv = conv.to(x.dtype)
    qkv = F.silu(conv)
    q, k, v = torch.split(qkv, [cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim], dim=-1)
    z = F.linear(x, p.w_z).view(b, nv, dv)
    beta = torch.sigmoid(F.linear(x, p.w_b)).float()
    g = -p.A_log.float().exp() * F.softplus(F.linear(x, p.w_a).float() + p.dt_bias)
    r = nv // nk  # value head i reads key head i // r
    q = (l2norm(q.float().view(b, nk, dk)) * dk**-0.5).repeat_interleave(r, dim=1)
    k = l2norm(k.float().view(b, nk, dk)).repeat_interleave(r, dim=1)
    o, ssm = gated_delta_rule_step(q, k, v.float().view(b, nv, dv), g, beta, cache.ssm)
    o = gated_rms_norm(o.to(x.dtype), z, p.norm_w, cfg.rms_norm_eps)
    return F.linear(o.reshape(b, nv * dv), p.w_out), GDNCache(conv=window[:, 1:], ssm=ssm)


def attention_decode(
    p: AttnParams, x: Float[Tensor, "b d"], cache: KVCache, pos: Int[Tensor, " b"], active: Bool[Tensor, " b"],
    cfg: ModelConfig,
) -> tuple[Float[Tensor, "b d"], KVCache]:
    """``attention_apply`` for one token per row at position ``pos`` (RoPE) over the row's cached keys: the new key
    and value are appended (marked real where ``active``), then the token attends to every real cached key."""
    h, g, c = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    b = x.shape[0]
    cos, sin = rope_cos_sin(pos[:, None], cfg.rotary_dim, cfg.rope_theta)  # [b 1 r]
    q, gate = F.linear(x, p.w_q).view(b, 1, h, 2 * c).chunk(2, dim=-1)
    q = apply_rope(rms_norm(q, p.q_norm, cfg.rms_norm_eps), cos, sin)[:, 0]  # [b h c]
    k = apply_rope(rms_norm(F.linear(x, p.w_k).view(b, 1, g, c), p.k_norm, cfg.rms_norm_eps), cos, sin)
    v = F.linear(x, p.w_v).view(b, 1, g, c)
    on = active[:, None, None, None]  # a skipped step stores zeros: a hidden key's value then adds 0, never NaN
    new = KVCache(k=torch.cat([cache.k, torch.where(on, k, 0.0)], 1),
                  v=torch.cat([cache.v, torch.where(on, v, 0.0)], 1),
                  valid=torch.cat([cache.valid, active[:, None]], 1))
    r = h // g  # query head i reads kv head i // r
    keys, values = (t.repeat_interleave(r, dim=2).transpose(1, 2) for t in (new.k, new.v))  # [b h t c]
    sees = new.valid.clone()
    sees[:, -1] = True  # a skipped step's token sees itself (its output is discarded; it only has to be finite)
    # the attention training's reference runs (SDPA under a boolean mask), for one query per row
    o = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=sees[:, None, None, :], scale=c**-0.5)
    o = o[:, :, 0]
    o = o * torch.sigmoid(gate[:, 0])
    return F.linear(o.reshape(b, h * c), p.w_o), new
