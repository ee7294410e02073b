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


# ---- several tokens per row at once: prefill and speculative verification -----------------------------------------


@pytree_node
@attrs.frozen
class GDNSteps:
    """What ``gdn_extend`` leaves for keeping only a prefix of its tokens (``gdn_keep``): the conv inputs (the
    cache's ``K - 1``, then the ``n`` new tokens') and the recurrent state after each of ``0..n`` new tokens."""

    window: Tensor  # [b, K - 1 + n, conv_dim]
    states: Tensor  # [b, n + 1, nv, dk, dv] fp32


def _take_window(window: Tensor, keep: Tensor, kw: int) -> Tensor:
    """Each row's ``K - 1`` conv inputs after ``keep[r]`` new tokens: ``window[r, keep[r] : keep[r] + K - 1]``."""
    idx = keep[:, None] + torch.arange(kw - 1, device=window.device)
    return torch.gather(window, 1, idx[..., None].expand(-1, -1, window.shape[-1]))


def gdn_extend(
    p: GDNParams, x: Float[Tensor, "b n d"], cache: GDNCache, lengths: Int[Tensor, " b"], cfg: ModelConfig, *,
    stepwise: bool = False,
) -> tuple[Float[Tensor, "b n d"], GDNCache, GDNSteps | None]:
    """``gdn_apply`` over ``n`` new tokens per row continuing the row's ``GDNCache`` (row ``r``'s first
    ``lengths[r]`` columns are real, the rest padding whose outputs are meaningless). Returns the outputs, the cache
    after each row's real tokens and, with ``stepwise``, the ``GDNSteps`` to keep a shorter prefix (``gdn_keep``).

    The conv continues from the cache's inputs (its halo); the padding's gates are set to ``β = 0, g = 0``, which
    leaves the state unchanged, so the final state is the state after the last real token. The gated delta rule
    runs its chunked form (``gated_delta_rule_chunked``, from the cache's state) or, ``stepwise``, its recurrent form
    a token at a time keeping every intermediate state (a short verification pass)."""
    from q38.layers.gdn import causal_conv1d, gated_delta_rule_chunked

    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    b, n, _ = x.shape
    kw = cfg.linear_conv_kernel_dim
    real = torch.arange(n, device=x.device)[None] < lengths[:, None]  # [b n]
    mixed = F.linear(x, p.w_qkv)  # [b n ch]
    qkv = F.silu(causal_conv1d(mixed, p.conv_w, None, halo=cache.conv))
    q, k, v = torch.split(qkv, [cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim], dim=-1)
    z = F.linear(x, p.w_z).view(b, n, nv, dv)
    beta = torch.sigmoid(F.linear(x, p.w_b)).float() * real[..., None]
    g = -p.A_log.float().exp() * F.softplus(F.linear(x, p.w_a).float() + p.dt_bias) * real[..., None]
    q, k, v = q.view(b, n, nk, dk), k.view(b, n, nk, dk), v.view(b, n, nv, dv)
    window = torch.cat([cache.conv, mixed], dim=1)
    steps = None
    if stepwise:
        r = nv // nk
        qs = (l2norm(q.float()) * dk**-0.5).repeat_interleave(r, dim=2)
        ks = l2norm(k.float()).repeat_interleave(r, dim=2)
        s, outs, states = cache.ssm, [], [cache.ssm]
        for t in range(n):
            o_t, s = gated_delta_rule_step(qs[:, t], ks[:, t], v[:, t].float(), g[:, t], beta[:, t], s)
            outs.append(o_t)
            states.append(s)
        o = torch.stack(outs, dim=1).to(x.dtype)
        steps = GDNSteps(window=window, states=torch.stack(states, dim=1))
        final = s
    else:
        o, final = gated_delta_rule_chunked(q, k, v, g, beta, None, cache.ssm)
    o = gated_rms_norm(o.to(x.dtype), z, p.norm_w, cfg.rms_norm_eps)
    y = F.linear(o.reshape(b, n, nv * dv), p.w_out)
    return y, GDNCache(conv=_take_window(window, lengths, kw), ssm=final), steps


def gdn_keep(steps: GDNSteps, keep: Int[Tensor, " b"], kw: int) -> GDNCache:
    """The cache after each row's first ``keep[r]`` tokens of a stepwise ``gdn_extend`` (0: the cache before it)."""
    idx = keep.view(-1, *([1] * (steps.states.dim() - 1))).expand(-1, 1, *steps.states.shape[2:])
    return GDNCache(conv=_take_window(steps.window, keep, kw), ssm=torch.gather(steps.states, 1, idx)[:, 0])


def attention_extend(
    p: AttnParams, x: Float[Tensor, "b n d"], cache: KVCache, positions: Int[Tensor, "b n"],
    active: Bool[Tensor, "b n"], cfg: ModelConfig,
) -> tuple[Float[Tensor, "b n d"], KVCache]:
    """``attention_apply`` for ``n`` new tokens per row at RoPE ``positions`` over the row's cached keys: the new keys
    and values are appended (real where ``active``), and new token ``j`` attends to every real cached key and to the
    real new tokens ``j' <= j`` (an inactive token's output is meaningless)."""
    h, g, c = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    b, n, _ = x.shape
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)  # [b n r]
    q, gate = F.linear(x, p.w_q).view(b, n, h, 2 * c).chunk(2, dim=-1)
    q = apply_rope(rms_norm(q, p.q_norm, cfg.rms_norm_eps), cos, sin)  # [b n h c]
    k = apply_rope(rms_norm(F.linear(x, p.w_k).view(b, n, g, c), p.k_norm, cfg.rms_norm_eps), cos, sin)
    v = F.linear(x, p.w_v).view(b, n, g, c)
    on = active[..., None, None]
    new = KVCache(k=torch.cat([cache.k, torch.where(on, k, 0.0)], 1),
                  v=torch.cat([cache.v, torch.where(on, v, 0.0)], 1),
                  valid=torch.cat([cache.valid, active], 1))
    r = h // g
    keys, values = (t.repeat_interleave(r, dim=2).transpose(1, 2) for t in (new.k, new.v))  # [b h t c]
    j = torch.arange(n, device=x.device)
    causal = (j[None, :] <= j[:, None])[None] & active[:, None, :]  # [b n n]: query j sees new key j'
    causal = causal | torch.eye(n, dtype=torch.bool, device=x.device)[None]  # every query sees itself (finite)
    sees = torch.cat([cache.valid[:, None, :].expand(b, n, -1), causal], dim=2)  # [b n t]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=sees[:, None], scale=c**-0.5)
    o = o.transpose(1, 2) * torch.sigmoid(gate)  # [b n h c]
    return F.linear(o.reshape(b, n, h * c), p.w_o), new


def kv_keep(cache: KVCache, new: int, keep: Int[Tensor, " b"]) -> KVCache:
    """``cache`` (its last ``new`` slots appended by one ``attention_extend``) with only each row's first ``keep[r]``
    of them real; trailing slots no row holds are dropped."""
    t0 = cache.valid.shape[1] - new
    j = torch.arange(new, device=keep.device)[None]
    valid = torch.cat([cache.valid[:, :t0], cache.valid[:, t0:] & (j < keep[:, None])], 1)
    held = valid.any(0).nonzero()
    end = int(held.max()) + 1 if held.numel() else 0
    on = valid[:, :end, None, None]
    return KVCache(k=torch.where(on, cache.k[:, :end], 0.0), v=torch.where(on, cache.v[:, :end], 0.0),
                   valid=valid[:, :end])
