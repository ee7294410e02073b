"""Gated full attention: QK-norm, partial RoPE, GQA, sigmoid output gate (docs/model.md#gated-full-attention).

Extra dims: none beyond the legend (``h`` query heads, ``g`` kv heads, ``c`` head dim, ``t`` key positions).
"""

import attrs
import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from q38.config import ModelConfig
from q38.layers.common import ParamInfo
from q38.layers.context import SeqInfo
from q38.layers.norm import rms_norm
from q38.layers.rope import apply_rope, rope_cos_sin
from q38.pytree import pytree_node


@pytree_node
@attrs.frozen
class AttnParams:
    w_q: Tensor  # [2·h·c, d]: per head, c query rows then c gate rows
    w_k: Tensor  # [g·c, d]
    w_v: Tensor  # [g·c, d]
    w_o: Tensor  # [d, h·c]
    q_norm: Tensor  # [c] zero-centred
    k_norm: Tensor  # [c] zero-centred


def abstract_attention(cfg: ModelConfig) -> AttnParams:
    d, h, g, c, std = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.initializer_range
    return AttnParams(
        w_q=ParamInfo((2 * h * c, d), std=std, axes=("heads_q", "embed")),
        w_k=ParamInfo((g * c, d), std=std, axes=("kv", "embed")),
        w_v=ParamInfo((g * c, d), std=std, axes=("kv", "embed")),
        w_o=ParamInfo((d, h * c), std=std, axes=("attn_out", "attn_in")),
        q_norm=ParamInfo((c,), "zeros", axes=("norm",)),
        k_norm=ParamInfo((c,), "zeros", axes=("norm",)),
    )


def _attention_mask(info: SeqInfo, seq_idx_k: Tensor, doc_k: Tensor) -> Tensor:
    """Boolean ``[b, 1, s, t]``: key is not in the future and belongs to the query's document."""
    causal = seq_idx_k[:, None, :] <= info.seq_idx[:, :, None]
    same_doc = doc_k[:, None, :] == info.doc_ids[:, :, None]
    return (causal & same_doc)[:, None]


def attention_apply(p: AttnParams, x: Float[Tensor, "b s d"], cfg: ModelConfig, info: SeqInfo) -> Float[Tensor, "b s d"]:
    """``o_proj(attn(q, k, v) * sigmoid(gate))`` with causal, per-document masking."""
    h, g, c = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # Context parallel: the whole row's token indices and doc ids (for the mask), then its keys/values (identity on
    # one device); each exchange starts as soon as its input exists and is waited where it is used.
    comm = info.comm
    ids = None if (comm.is_local and not info.packed) else comm.all_gather_seq_async((info.seq_idx, info.doc_ids), 1)
    cos, sin = rope_cos_sin(info.positions, cfg.rotary_dim, cfg.rope_theta)
    k_bsgc = rms_norm(rearrange(F.linear(x, p.w_k), "b s (g c) -> b s g c", g=g), p.k_norm, cfg.rms_norm_eps)
    v_bsgc = rearrange(F.linear(x, p.w_v), "b s (g c) -> b s g c", g=g)
    kv = comm.all_gather_seq_async((apply_rope(k_bsgc, cos, sin), v_bsgc), 1)
    qg_bshc = rearrange(F.linear(x, p.w_q), "b s (h c2) -> b s h c2", h=h)
    q_bshc, gate_bshc = qg_bshc.chunk(2, dim=-1)  # one cat in backward, not two zero-filled slice grads
    q_bshc = apply_rope(rms_norm(q_bshc, p.q_norm, cfg.rms_norm_eps), cos, sin)
    mask = None if ids is None else _attention_mask(info, *ids.wait())
    k_btgc, v_btgc = kv.wait()

    q_bhsc = rearrange(q_bshc, "b s h c -> b h s c")
    k_bgtc, v_bgtc = rearrange(k_btgc, "b t g c -> b g t c"), rearrange(v_btgc, "b t g c -> b g t c")
    with info.region("attention"):
        o_bhsc = info.kernels.fn("attention")(q_bhsc, k_bgtc, v_bgtc, mask, c**-0.5)
    # sigmoid before the merge of (h c): the gate is a strided half of the projection, whose merge would copy it;
    # the sigmoid's output is contiguous, so the merge is a view
    o_bsd = rearrange(o_bhsc, "b h s c -> b s (h c)") * rearrange(torch.sigmoid(gate_bshc), "b s h c -> b s (h c)")
    return F.linear(o_bsd, p.w_o)


def _native_gqa(q_bhsc: Tensor, mask: Tensor | None) -> bool:
    """Whether SDPA takes the kv heads as they are (``enable_gqa``) instead of copies repeated to the query heads.

    Only where the kernel SDPA then picks handles grouped heads itself: the causal (mask-free) case on CPU (its flash
    kernel: fwd+bwd 0.9x of the repeated copies at 8 query / 2 kv heads, and no ``[b, h, t, c]`` copies or their
    summed gradients) and on CUDA in 16-bit (flash). Elsewhere (an explicit mask, fp32 on CUDA: memory-efficient
    attention, NPU) ``enable_gqa`` could fall back to the O(s²)-memory math kernel, so the kv heads are repeated."""
    dev, dt = q_bhsc.device.type, q_bhsc.dtype
    return mask is None and (dev == "cpu" or (dev == "cuda" and dt in (torch.float16, torch.bfloat16)))


def _repeat_kv(k_bgtc: Tensor, v_bgtc: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """The kv heads repeated to the query heads (query head ``i`` reads kv head ``i // r``)."""
    return k_bgtc.repeat_interleave(r, dim=1), v_bgtc.repeat_interleave(r, dim=1)


def sdpa_attention(
    q_bhsc: Tensor, k_bgtc: Tensor, v_bgtc: Tensor, mask: Tensor | None, scale: float
) -> Tensor:
    """``kernels.attention: sdpa``: ``F.scaled_dot_product_attention`` of ``h`` query heads over ``g`` kv heads,
    causal when ``mask`` is None, else under the boolean ``mask`` ``[b, 1, s, t]``."""
    r = q_bhsc.shape[1] // k_bgtc.shape[1]
    if r > 1 and _native_gqa(q_bhsc, mask):
        return F.scaled_dot_product_attention(q_bhsc, k_bgtc, v_bgtc, is_causal=True, scale=scale, enable_gqa=True)
    k_bhtc, v_bhtc = _repeat_kv(k_bgtc, v_bgtc, r)
    if mask is None:
        return F.scaled_dot_product_attention(q_bhsc, k_bhtc, v_bhtc, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q_bhsc, k_bhtc, v_bhtc, attn_mask=mask, scale=scale)


def eager_attention(
    q_bhsc: Tensor, k_bgtc: Tensor, v_bgtc: Tensor, mask: Tensor | None, scale: float
) -> Tensor:
    """``kernels.attention: eager``: explicit fp32 ``softmax(QKᵀ · scale)V`` (the reference), same contract as
    ``sdpa_attention``."""
    k_bhtc, v_bhtc = _repeat_kv(k_bgtc, v_bgtc, q_bhsc.shape[1] // k_bgtc.shape[1])
    scores = torch.einsum("bhsc,bhtc->bhst", q_bhsc.float(), k_bhtc.float()) * scale
    if mask is None:
        s, t = scores.shape[-2:]
        mask = torch.ones(s, t, dtype=torch.bool, device=q_bhsc.device).tril()[None, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhst,bhtc->bhsc", scores.softmax(-1), v_bhtc.float()).to(q_bhsc.dtype)
