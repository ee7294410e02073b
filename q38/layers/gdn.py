"""Gated DeltaNet linear attention (docs/model.md#gated-deltanet): causal depthwise conv + SiLU, L2-normalised q/k,
fp32 beta/decay gates, the gated delta rule (chunked, C = 64; a token-by-token recurrent reference), gated RMSNorm.

Packed rows: the conv taps, the intra-chunk matrices and the carried state are masked by document, so a row holding
several documents gives exactly the outputs of the documents run one by one.

Extra dims: ``u`` = position inside a chunk, ``j`` = chunk index, ``a``/``p`` = key/value state dims.
"""

import dataclasses
import math
from typing import Optional

import attrs
import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from q38.model_config import ModelConfig
from q38.layers.common import ParamInfo, linear
from q38.layers.context import SeqHandle, SeqInfo
from q38.layers.norm import gated_rms_norm
from q38.pytree import pytree_node


@pytree_node
@attrs.frozen
class GDNParams:
    w_qkv: Tensor  # [2·key_dim + value_dim, d]; rows [q all heads | k all heads | v all heads]
    w_z: Tensor  # [value_dim, d]
    w_b: Tensor  # [nv, d]
    w_a: Tensor  # [nv, d]
    conv_w: Tensor  # [conv_dim, kernel] depthwise
    dt_bias: Tensor  # [nv]
    A_log: Tensor  # [nv]
    norm_w: Tensor  # [dv] gated RMSNorm weight (plain, init ones)
    w_out: Tensor  # [d, value_dim]


def abstract_gdn(cfg: ModelConfig) -> GDNParams:
    d, std = cfg.hidden_size, cfg.initializer_range
    nv = cfg.linear_num_value_heads
    return GDNParams(
        w_qkv=ParamInfo((cfg.linear_conv_dim, d), std=std, axes=("gdn_qkv", "embed")),
        w_z=ParamInfo((cfg.linear_value_dim, d), std=std, axes=("gdn_v", "embed")),
        w_b=ParamInfo((nv, d), std=std, axes=("gdn_heads", "gdn_gate_in"), fsdp_dim=1),  # skinny
        w_a=ParamInfo((nv, d), std=std, axes=("gdn_heads", "gdn_gate_in"), fsdp_dim=1),  # skinny
        conv_w=ParamInfo((cfg.linear_conv_dim, cfg.linear_conv_kernel_dim), std=std, axes=("gdn_qkv", "conv_window")),
        dt_bias=ParamInfo((nv,), "ones", axes=("bias",)),
        A_log=ParamInfo((nv,), "a_log", axes=("bias",)),
        norm_w=ParamInfo((cfg.linear_value_head_dim,), "ones", axes=("norm",)),
        w_out=ParamInfo((d, cfg.linear_value_dim), std=std, axes=("gdn_out", "gdn_in")),
    )


def _l2_factor(x: Tensor, eps: float = 1e-6) -> Tensor:
    """The L2 norm's per-row factor ``1 / sqrt(‖x‖² + eps)`` (``[..., 1]``)."""
    return torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def l2norm(x: Tensor, eps: float = 1e-6, scale: float = 1.0) -> Tensor:
    """``scale · x / sqrt(‖x‖² + eps)`` (the scale applied to the per-row factor: one pass over ``x``)."""
    return x * (_l2_factor(x, eps) * scale)


# ---- causal depthwise conv ------------------------------------------------------------------------------


def causal_conv1d(
    x: Float[Tensor, "b s ch"],
    w: Float[Tensor, "ch w"],
    doc_ids: Int[Tensor, "b s"] | None = None,
    halo: Float[Tensor, "b w1 ch"] | None = None,
    halo_doc: Int[Tensor, "b w1"] | None = None,
) -> Float[Tensor, "b s ch"]:
    """``y[t] = Σ_j w[:, j] · x[t - K + 1 + j]`` over taps in the same document as ``t`` (no activation).

    ``halo`` holds the ``K - 1`` inputs before this chunk of the sequence (context parallel); zeros otherwise.
    """
    b, s, ch = x.shape
    kw = w.shape[1]
    keep = None
    if doc_ids is not None:
        if halo_doc is None:
            halo_doc = torch.full((b, kw - 1), -2, dtype=doc_ids.dtype, device=doc_ids.device)
        dp = torch.cat([halo_doc, doc_ids], dim=1)
        # keep[:, t, j]: tap j of position t reads the same document (the last tap, t itself, always does)
        keep = torch.stack([dp[:, j : j + s] == doc_ids for j in range(kw - 1)], dim=-1).float()
    return _CausalConv.apply(x, w, halo, keep)


def _wide(t: Tensor) -> Tensor:
    """``t`` in the conv's accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return t if t.dtype == torch.float64 else t.float()


def _taps(kw: int, s: int):
    """``(j, sh, n)`` for every tap but the last: tap ``j`` reads ``x[t - sh]`` for ``t ≥ sh`` and ``halo[t + j]``
    for the first ``n = min(sh, s)`` positions."""
    return [(j, kw - 1 - j, min(kw - 1 - j, s)) for j in range(kw - 1)]


class _CausalConv(torch.autograd.Function):
    """``y[t] = Σ_j w[:, j] · xp[t + j] (· keep[t, j])`` for ``xp = [halo; x]`` (``halo`` None: zeros), without
    forming ``xp``: one fused multiply-add per tap into one output buffer on the contiguous ``[b, s, ch]`` layout,
    and a backward that accumulates every tap's input gradient into one buffer and reuses one product buffer for the
    weight gradients (on CPU every fresh activation-sized buffer costs page faults). With SiLU, forward+backward
    takes a fraction of the time of ``F.conv1d`` on CPU (``benchmarks/cpu_effects.py``): that one's ``[b, ch, s]``
    layout costs a transpose copy in and leaves a strided output, over which SiLU and its backward ran several times
    slower; autograd through the taps would allocate a zero-filled ``slice_backward`` buffer per tap, then sum
    them."""

    @staticmethod
    def forward(ctx, x, w, halo, keep):
        ctx.save_for_backward(x, w, halo, keep)
        kw, s = w.shape[1], x.shape[1]
        # the taps accumulate in fp32 whatever the input dtype (as a conv kernel does), rounded once at the end
        xf, wf, hf = (None if t is None else _wide(t) for t in (x, w, halo))
        y = xf * wf[:, kw - 1]
        for j, sh, n in _taps(kw, s):
            if sh < s:
                tap = xf[:, : s - sh] if keep is None else xf[:, : s - sh] * keep[:, sh:, j, None]
                y[:, sh:].addcmul_(tap, wf[:, j])
            if hf is not None:
                tap = hf[:, j : j + n] if keep is None else hf[:, j : j + n] * keep[:, :n, j, None]
                y[:, :n].addcmul_(tap, wf[:, j])
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, halo, keep = ctx.saved_tensors
        kw, s = w.shape[1], x.shape[1]
        xf, wf, hf = (None if t is None else _wide(t) for t in (x, w, halo))
        dy = _wide(dy).contiguous()
        buf = torch.empty_like(dy)  # x ⊙ dy products of the weight gradients, one tap at a time
        dx = dy * wf[:, kw - 1]
        dw = torch.empty_like(wf)
        dw[:, kw - 1] = torch.mul(xf, dy, out=buf).sum((0, 1))
        dhalo = None if hf is None else torch.zeros_like(hf)
        g = dy if keep is None else torch.empty_like(dy)
        for j, sh, n in _taps(kw, s):
            if keep is not None:
                torch.mul(dy, keep[..., j, None], out=g)
            dw_j = xf.new_zeros(wf.shape[0])
            if sh < s:
                dx[:, : s - sh].addcmul_(g[:, sh:], wf[:, j])
                # a contiguous prefix of the buffer: a reduction over a strided view runs many times slower
                prod = buf.view(-1)[: dy[:, sh:].numel()].view_as(dy[:, sh:])
                dw_j += torch.mul(xf[:, : s - sh], g[:, sh:], out=prod).sum((0, 1))
            if hf is not None:
                dhalo[:, j : j + n].addcmul_(g[:, :n], wf[:, j])
                dw_j += (hf[:, j : j + n] * g[:, :n]).sum((0, 1))
            dw[:, j] = dw_j
        return dx.to(x.dtype), dw.to(w.dtype), (None if dhalo is None else dhalo.to(halo.dtype)), None


@dataclasses.dataclass(frozen=True)
class ConvHalo:
    """The started CP exchanges of the conv halo: the previous rank's last ``K - 1`` conv inputs and doc ids
    (``+ 2``, so rank 0's zeros read as no document). A frozen dataclass: torch.compile cannot trace building a
    frozen attrs instance."""

    x: SeqHandle
    doc: SeqHandle


def start_doc_halo(kw: int, info: SeqInfo) -> SeqHandle | None:
    """Start the doc-id half of the conv halo (None on one device): it needs only ``info``, so it is issued at the
    start of the layer."""
    return None if info.comm.is_local else info.comm.prev_tail_async((info.doc_ids + 2,), kw - 1, 1)


def start_conv_halo(x: Tensor, kw: int, info: SeqInfo, doc: SeqHandle | None) -> ConvHalo | None:
    """Start the conv-input half of the halo of ``x`` ``[b s ch]`` as soon as ``x`` exists (None on one device)."""
    return None if doc is None else ConvHalo(info.comm.prev_tail_async((x,), kw - 1, 1), doc)


def conv_torch(x: Tensor, w: Tensor, info: SeqInfo, halo: ConvHalo | None = None) -> Tensor:
    """``kernels.causal_conv1d: torch``: ``causal_conv1d`` with the document mask (packed rows or CP) and the CP halo
    (the previous rank's last ``K - 1`` inputs and doc ids, started by the layer: ``start_conv_halo``)."""
    if halo is None:
        return causal_conv1d(x, w, info.doc_ids if info.packed else None)
    (prev_x,), (prev_doc,) = halo.x.wait(), halo.doc.wait()
    return causal_conv1d(x, w, info.doc_ids, prev_x, prev_doc - 2)  # zeros from rank 0 → doc -2


def conv_cuda(x: Tensor, w: Tensor, info: SeqInfo, halo: ConvHalo | None = None) -> Tensor:
    """``kernels.causal_conv1d: cuda``: the causal-conv1d package's kernel (one document per row, no CP: ``halo`` is
    always None)."""
    from causal_conv1d import causal_conv1d_fn  # type: ignore

    return causal_conv1d_fn(x.transpose(1, 2), w, None, activation=None).transpose(1, 2)


# ---- the gated delta rule -------------------------------------------------------------------------------


def _prep(q, k, v, g, beta):
    """[b s h c] → fp32 [b h s c] with L2-normalised q/k and q scaled by dk^-0.5 (as FLA / HF)."""
    q, k, v = (rearrange(t, "b s h c -> b h s c").float() for t in (q, k, v))
    g, beta = (rearrange(t, "b s h -> b h s").float() for t in (g, beta))
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    return q, k, v, g, beta


def gated_delta_rule_recurrent(
    q: Float[Tensor, "b s h a"],
    k: Float[Tensor, "b s h a"],
    v: Float[Tensor, "b s h p"],
    g: Float[Tensor, "b s h"],
    beta: Float[Tensor, "b s h"],
    doc_ids: Int[Tensor, "b s"] | None = None,
    initial_state: Float[Tensor, "b h a p"] | None = None,
) -> tuple[Float[Tensor, "b s h p"], Float[Tensor, "b h a p"]]:
    """Token-by-token reference (docs/model.md#the-gated-delta-rule); the state resets where the document changes."""
    dtype = v.dtype
    q, k, v, g, beta = _prep(q, k, v, g, beta)
    b, h, s, a = k.shape
    S = torch.zeros(b, h, a, v.shape[-1], dtype=torch.float32, device=v.device)
    if initial_state is not None:
        S = initial_state.float()
    outs = []
    for t in range(s):
        if doc_ids is not None and t > 0:
            keep = (doc_ids[:, t] == doc_ids[:, t - 1]).float()[:, None, None, None]
            S = S * keep
        S = S * g[:, :, t].exp()[..., None, None]
        kv_mem = torch.einsum("bhap,bha->bhp", S, k[:, :, t])
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        S = S + torch.einsum("bha,bhp->bhap", k[:, :, t], delta)
        outs.append(torch.einsum("bhap,bha->bhp", S, q[:, :, t]))
    o = torch.stack(outs, dim=2)
    return rearrange(o, "b h s p -> b s h p").to(dtype), S


GDN_BACKWARDS = ("custom", "autograd")  # the torch core's backward: its own (docs/gdn_backward.md), or autograd


def gated_delta_rule_chunked(
    q: Float[Tensor, "b s hk a"],
    k: Float[Tensor, "b s hk a"],
    v: Float[Tensor, "b s h p"],
    g: Float[Tensor, "b s h"],
    beta: Float[Tensor, "b s h"],
    doc_ids: Int[Tensor, "b s"] | None = None,
    initial_state: Float[Tensor, "b h a p"] | None = None,
    chunk_size: int = 64,
    backward: str = "custom",
) -> tuple[Float[Tensor, "b s h p"], Float[Tensor, "b h a p"]]:
    """Chunked (WY/UT) gated delta rule in fp32 (docs/model.md#the-chunked-form), document-masked.

    ``initial_state`` belongs to the document of the first token (``doc_ids[:, 0]``). Returns the outputs and the
    state after the last token (for the document the row ends in). ``q`` / ``k`` may have fewer heads than ``v``
    (``h / hk`` value heads per key head, value head ``i`` reading key head ``i // (h / hk)``): the custom function
    normalises and saves them per key head and expands them inside.

    ``backward="custom"`` (default) runs the core as ``_ChunkGatedDeltaRule``: forward saves only its inputs and the
    state at the start of every chunk, backward recomputes the in-chunk WY factors and runs the reverse chunk
    recurrence (docs/gdn_backward.md). ``backward="autograd"`` is the plain-autograd reference.
    """
    if backward == "autograd":
        q, k = _repeat_kv_heads(q, k, v.shape[2])
        return gated_delta_rule_chunked_autograd(q, k, v, g, beta, doc_ids, initial_state, chunk_size)
    if backward != "custom":
        raise ValueError(f"backward must be one of {GDN_BACKWARDS}, got {backward!r}")
    dtype = v.dtype
    # Layout only: the fp32 cast, L2 norm and query scale happen inside the function (recomputed in backward), so
    # what it saves is the inputs in their own dtype (bf16 in a bf16 run) and no autograd of the norm.
    q, k, v = (rearrange(t, "b s h c -> b h s c") for t in (q, k, v))
    g, beta = (rearrange(t, "b s h -> b h s") for t in (g, beta))
    s = k.shape[2]
    C = chunk_size
    pad = (C - s % C) % C
    # Zero padding (k = v = β = g = 0) at the tail changes nothing; padded positions stay in the last document.
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    doc = None
    if doc_ids is not None:
        doc = F.pad(doc_ids.float()[:, None], (0, pad), mode="replicate")[:, 0].long()  # [b, s+pad]
    q, k, v = (rearrange(t, "b h (j u) c -> b h j u c", u=C) for t in (q, k, v))
    g, beta = (rearrange(t, "b h (j u) -> b h j u", u=C) for t in (g, beta))
    s0 = None if initial_state is None else initial_state.float()
    o, state = _ChunkGatedDeltaRule.apply(q, k, v, g, beta, doc, s0)
    o = rearrange(o, "b h j u p -> b (j u) h p")[:, :s]
    return o.to(dtype), state


def _repeat_kv_heads(q: Tensor, k: Tensor, h: int) -> tuple[Tensor, Tensor]:
    """``q, k [b s hk c]`` repeated to ``h`` heads (value head ``i`` reads key head ``i // (h / hk)``)."""
    r = h // q.shape[2]
    return (q, k) if r == 1 else (q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2))


def _doc_masks(doc: Tensor, C: int):
    """Per-chunk document masks from padded doc ids ``[b, n·C]``: ``same`` [b 1 j u u] (same document),
    ``cont`` [b 1 j u] (token continues the document carried into its chunk), ``last_same`` [b 1 j u] (same
    document as the chunk's last token)."""
    prev_doc = torch.cat([doc[:, :1], doc[:, :-1]], dim=1)  # the doc the state carries into position t
    doc_c = rearrange(doc, "b (j u) -> b j u", u=C)
    same = (doc_c[..., :, None] == doc_c[..., None, :])[:, None]
    first_doc = rearrange(prev_doc, "b (j u) -> b j u", u=C)[..., 0]
    cont = (doc_c == first_doc[..., None]).float()[:, None]
    last_same = (doc_c == doc_c[..., -1:]).float()[:, None]
    return same, cont, last_same


# Decay factors below exp(-64) ≈ 1.6e-28 are set to exactly 0. With production gates |γ| reaches ~10³ inside a
# chunk, so a band of exp(γ_r − γ_s) would otherwise land in (or, multiplied by O(1e-10) values, reach) fp32's
# denormal range (< 1.2e-38), where x86 CPUs take a microcode assist per operation: a matmul with a few denormal
# rows runs 8x slower (benchmarks/cpu_effects.py). What is dropped is ≥ 20 orders of magnitude below fp32 resolution (accelerators flush denormals
# in their kernels anyway); the autograd reference keeps exact exps and the tests compare the two.
_EXP_FLOOR = -64.0


def _exp_ftz(x: Tensor, keep: Tensor | None = None) -> Tensor:
    """``exp(x)`` with ``exp(x) = 0`` where ``x < _EXP_FLOOR`` (or where ``keep`` is False).

    The dropped entries are set to 0 before the exp (not to -inf): CPU exp takes a slow path for -inf and for
    inputs whose result underflows (11x and 85x slower per element than in the normal range; cpu_effects.py)."""
    ok = x >= _EXP_FLOOR
    if keep is not None:
        ok = ok & keep
    # out of place throughout: selective recompute caches op outputs and refuses their mutation
    return torch.where(ok, torch.where(ok, x, 0.0).exp(), 0.0)


def _flush_tiny(x: Tensor) -> Tensor:
    """``x`` with entries of magnitude ≤ ``exp(_EXP_FLOOR)`` set to 0 (the inverse ``T`` of a unit-lower matrix of
    decayed products collects such entries: its diagonal is 1, so they are far below its resolution)."""
    return F.hardshrink(x, _TINY)


_TINY = math.exp(_EXP_FLOOR)


def _chunk_factors(k, v, g, beta, doc):
    """Everything the chunk recurrence needs that depends on one chunk only (forward and recomputed in backward).

    Returns ``(kb, vb, A, T, Gam, E, E_q, Ec_k, decay, U, W_raw, W, masks)`` with document masks applied: ``A = Kβ Kᵀ``,
    whose product ``L = A ⊙ Gam`` is the unit-lower matrix (its diagonal ignored) with the WY factor ``T = L⁻¹``;
    ``Gam`` the masked ``exp(γ_r − γ_s)``, ``E_q`` / ``Ec_k`` the masked ``exp(γ)`` / ``exp(γ_C − γ)``, ``decay``
    the masked ``exp(γ_C)``.
    """
    C = k.shape[-2]
    kb, vb = k * beta[..., None], v * beta[..., None]
    # γ and its pairwise differences in fp64 (|γ| reaches ~10³ with A_log up to log 16), then back to fp32.
    gam64 = g.double().cumsum(-1)
    gam = gam64.float()
    supp = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    masks = None
    if doc is not None:
        masks = _doc_masks(doc, C)
        supp = masks[0] & supp
    Gam = _exp_ftz((gam64[..., :, None] - gam64[..., None, :]).float(), supp)
    E = _exp_ftz(gam)
    Ec = _exp_ftz((gam64[..., -1:] - gam64).float())
    decay = E[..., -1]
    A = kb @ k.transpose(-1, -2)
    # T = L⁻¹ for L = A ⊙ Γ (its diagonal ignored), explicitly (one solve against a contiguous I, then matmuls; backward reuses T for the transposed
    # products instead of a second solve). The decays factor out of the inverse: with D = diag(exp γ),
    # strict(A ⊙ Γ) = D·strict(A)·D⁻¹, so T = Γ ⊙ S for S = (I + strict(A))⁻¹ (document-masked). The solve then runs
    # on O(1) entries (with the decays inside, its substitution produced denormals and ran several times slower), and
    # W = T·(Kβ ⊙ exp γ) = exp γ ⊙ (S·Kβ) needs no products of two tiny factors.
    eye = torch.eye(C, dtype=A.dtype, device=A.device).expand_as(A).contiguous()
    A_in = A if masks is None else A.masked_fill(~supp, 0.0)
    S = torch.linalg.solve_triangular(A_in, eye, upper=False, unitriangular=True)
    T = _flush_tiny(Gam * S)
    U, W_raw = T @ vb, _flush_tiny(E[..., None] * (S @ kb))
    E_q, Ec_k, W = E, Ec, W_raw
    if masks is not None:
        _, cont, last_same = masks
        E_q, Ec_k, W = E * cont, Ec * last_same, W_raw * cont[..., None]
        decay = decay * cont[..., -1]
    return kb, vb, A, T, Gam, E, E_q, Ec_k, decay, U, W_raw, W, masks


def _prepared(q_raw, k_raw, v_raw, g_raw, beta_raw):
    """fp32 inputs with L2-normalised q/k and q scaled by dk^-0.5 (as ``_prep``), q/k expanded from their key heads
    to the value heads; plus the fp32 q/k per key head (``qf``, ``kf``) and their norm factors (``rq``, ``rk``) for
    the L2-norm backward, and the normalised ones per key head (``qn``, ``kn``: ``Q Kᵀ`` does not depend on the value
    head)."""
    # Contiguous [b h j u c] once here: the raw inputs are views of the [b s h c] projections, and a matmul over
    # non-contiguous 5-d operands copies them again at every product.
    qf, kf, vf = (t.float().contiguous() for t in (q_raw, k_raw, v_raw))
    rq, rk = _l2_factor(qf), _l2_factor(kf)
    qn, kn = qf * (rq * qf.shape[-1] ** -0.5), kf * rk  # l2norm(qf, scale=a^-½), l2norm(kf)
    r = vf.shape[1] // qf.shape[1]  # value heads per key head: normalised once per key head, then expanded
    q, k = (qn.repeat_interleave(r, dim=1), kn.repeat_interleave(r, dim=1)) if r > 1 else (qn, kn)
    return qf, kf, rq, rk, qn, kn, q, k, vf, g_raw.float().contiguous(), beta_raw.float().contiguous()


def _masked_qk(qn: Tensor, kn: Tensor, Gam: Tensor) -> Tensor:
    """``P = Q Kᵀ ⊙ Γ`` per value head, with ``Q Kᵀ`` taken once per key head (``qn, kn`` [b hk j u a]) and broadcast
    over the ``h / hk`` value heads of each by the product with ``Γ`` [b h j u u]."""
    b, hk = qn.shape[:2]
    qk = (qn @ kn.transpose(-1, -2))[:, :, None]
    return (qk * Gam.view(b, hk, -1, *Gam.shape[2:])).view(Gam.shape)


def _bmm5(x: Tensor, y: Tensor, add: Tensor, alpha: float = 1.0) -> Tensor:
    """``add + alpha · x @ y`` over the (equal) leading dims in one fused, out-of-place batched matmul."""
    out = torch.baddbmm(add.reshape(-1, *add.shape[-2:]), x.reshape(-1, *x.shape[-2:]), y.reshape(-1, *y.shape[-2:]),
                        alpha=alpha)
    return out.view(*add.shape)


def _acc_matmul(out: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """``out += x @ y`` in place over the leading dims (``out`` contiguous): no temporary for the product. The
    backward accumulates its gradients this way; on CPU every fresh buffer costs page faults (there is no caching
    allocator), which were about a third of the backward's time."""
    out.view(-1, *out.shape[-2:]).baddbmm_(x.reshape(-1, *x.shape[-2:]), y.reshape(-1, *y.shape[-2:]))
    return out


def _l2norm_backward(x: Tensor, dy: Tensor, r: Tensor, scale: float) -> Tensor:
    """Gradient through ``y = scale · x · r``, ``r = 1 / sqrt(‖x‖² + eps)`` (``_l2_factor``, given):
    ``scale · r · (dy − x · r² (x·dy))``, the row factor ``r² (x·dy)`` taken first: two passes over ``x`` after the
    dot product."""
    xdy = (x * dy).sum(-1, keepdim=True)
    return torch.addcmul(dy, x, r * r * xdy, value=-1.0).mul_(scale * r)


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """The chunked gated delta rule on raw chunks ``q, k [b h j u a]``, ``v [b h j u p]``, ``g, β [b h j u]`` in
    any float dtype (``doc`` [b j·u] or None, ``s0`` [b h a p] fp32 or None) → ``(o [b h j u p], S_final)`` in
    fp32. Casts to fp32, L2-normalises q/k and scales q inside.

    Saves the inputs as given and the fp32 state at every chunk start (``[b h j a p]``); backward recomputes the
    rest (docs/gdn_backward.md) and chains through the L2 norms.
    """

    @staticmethod
    def forward(ctx, q_raw, k_raw, v_raw, g_raw, beta_raw, doc, s0):
        _, _, _, _, qn, kn, q, k, v, g, beta = _prepared(q_raw, k_raw, v_raw, g_raw, beta_raw)
        b, h, n, C, a = k.shape
        p = v.shape[-1]
        _, _, _, _, Gam, _, E_q, Ec_k, decay, U, _, W, _ = _chunk_factors(k, v, g, beta, doc)
        kd = k * Ec_k[..., None]
        S = s0 if s0 is not None else q.new_zeros(b, h, a, p)
        # Lists then one stack (no in-place writes: selective recompute caches op outputs and refuses mutation).
        states, vnew = [], []
        for j in range(n):
            states.append(S)
            vn = torch.baddbmm(U[:, :, j].reshape(-1, C, p), W[:, :, j].reshape(-1, C, a), S.reshape(-1, a, p),
                               alpha=-1).view(b, h, C, p)
            vnew.append(vn)
            S = S * decay[:, :, j, None, None] + kd[:, :, j].transpose(-1, -2) @ vn
        states, vnew = torch.stack(states, dim=2), torch.stack(vnew, dim=2)
        ctx.save_for_backward(q_raw, k_raw, v_raw, g_raw, beta_raw, doc, s0, states)
        ctx.set_materialize_grads(False)
        # the outputs of every chunk at once: O = (Q ⊙ exp γ) S_j + (Q Kᵀ ⊙ Γ) Vnew
        o = _bmm5(_masked_qk(qn, kn, Gam), vnew, (q * E_q[..., None]) @ states)
        return o, S

    @staticmethod
    def backward(ctx, d_o, d_sfin):
        q_raw, k_raw, v_raw, g_raw, beta_raw, doc, s0, states = ctx.saved_tensors
        qf, kf, rq, rk, qn, kn, q, k, v, g, beta = _prepared(q_raw, k_raw, v_raw, g_raw, beta_raw)
        b, h, n, C, a = k.shape
        p = v.shape[-1]
        kb, vb, A, T, Gam, E, E_q, Ec_k, decay, U, W_raw, W, masks = _chunk_factors(k, v, g, beta, doc)
        kd = k * Ec_k[..., None]
        qd = q * E_q[..., None]
        P = _masked_qk(qn, kn, Gam)
        vnew = _bmm5(W, states, U, alpha=-1.0)  # U − W·S
        # contiguous once: the incoming gradient is a view of the [b s h p] output, and four products read it
        d_o = torch.zeros_like(vnew) if d_o is None else d_o.contiguous()
        # The reverse state recurrence: dS' (gradient of the state after chunk j) → dVnew_j and dS_j.
        dv_base = P.transpose(-1, -2) @ d_o  # [b h j u p]
        ds_base = qd.transpose(-1, -2) @ d_o  # [b h j a p]
        dS = d_sfin.float() if d_sfin is not None else q.new_zeros(b, h, a, p)
        dS_after = q.new_empty(b, h, n, a, p)
        dvnew = q.new_empty(b, h, n, C, p)
        for j in range(n - 1, -1, -1):
            dS_after[:, :, j] = dS
            dvn = dv_base[:, :, j] + kd[:, :, j] @ dS
            dvnew[:, :, j] = dvn
            dS = ds_base[:, :, j] - W[:, :, j].transpose(-1, -2) @ dvn + decay[:, :, j, None, None] * dS
        d_s0 = dS
        st_t = states.transpose(-1, -2)
        dgam = torch.zeros_like(g)
        # S_after = S·decay + Kdᵀ Vnew
        d_decay = (dS_after * states).sum((-1, -2))
        dgam[..., -1] += d_decay * decay
        dkd = vnew @ dS_after.transpose(-1, -2)  # [b h j u a]
        dk = dkd * Ec_k[..., None]
        y = (dkd * kd).sum(-1)
        dgam -= y
        dgam[..., -1] += y.sum(-1)
        # O = Qd S + P Vnew
        dqd = d_o @ st_t
        dq = dqd * E_q[..., None]
        dgam += (dqd * qd).sum(-1)
        dP = d_o @ vnew.transpose(-1, -2)
        x = dP * P
        dgam += x.sum(-1) - x.sum(-2)
        dP.mul_(Gam)
        hk = qf.shape[1]
        if hk == h:
            _acc_matmul(dq, dP, k)
            _acc_matmul(dk, dP.transpose(-1, -2), q)
        else:  # Q Kᵀ is per key head: its gradient sums over the value heads first, then one product per key head
            dP = dP.view(b, hk, h // hk, n, C, C).sum(2)
        # Vnew = U − W S  (W = W_raw ⊙ cont)
        dW = (dvnew @ st_t).neg_()
        if masks is not None:
            dW.mul_(masks[1][..., None])
        # U = T Vβ, W_raw = T X with T = L⁻¹: [dVβ | dX] = Tᵀ [dU | dW]; dL = −strict(dVβ Uᵀ + dX W_rawᵀ)
        # two products rather than one over [dU | dW]: the concatenation and the strided halves (which the batched
        # products below would copy again) cost more than the wider product saves
        Tt = T.transpose(-1, -2)
        dvb, dx = Tt @ dvnew, Tt @ dW
        dL = dvb @ U.transpose(-1, -2)
        dL.view(-1, C, C).baddbmm_(dx.reshape(-1, C, a), W_raw.reshape(-1, C, a).transpose(-1, -2))
        dL = dL.tril_(-1).neg_()
        dL.mul_(Gam)
        x = dL * A  # (dL ⊙ Γ) ⊙ A = dL ⊙ L: L = A ⊙ Γ is never formed
        dgam += x.sum(-1) - x.sum(-2)
        dkb = dL @ k
        _acc_matmul(dk, dL.transpose(-1, -2), kb)
        # X = Kβ ⊙ exp γ
        xe = dx * E[..., None]
        dkb.add_(xe)
        dgam += (xe * kb).sum(-1)
        dv = dvb * beta[..., None]
        dbeta = (dvb * v).sum(-1) + (dkb * k).sum(-1)
        dk.addcmul_(dkb, beta[..., None])
        dg = dgam.flip(-1).cumsum(-1).flip(-1)
        if hk < h:  # q/k were expanded from hk key heads: their gradients sum over the value heads of each
            dq, dk = (t.view(b, hk, h // hk, n, C, a).sum(2) for t in (dq, dk))
            _acc_matmul(dq, dP, kn)
            _acc_matmul(dk, dP.transpose(-1, -2), qn)
        dq = _l2norm_backward(qf, dq, rq, a**-0.5)
        dk = _l2norm_backward(kf, dk, rk, 1.0)
        return (dq.to(q_raw.dtype), dk.to(k_raw.dtype), dv.to(v_raw.dtype), dg.to(g_raw.dtype),
                dbeta.to(beta_raw.dtype), None, (d_s0 if s0 is not None else None))


def gated_delta_rule_chunked_autograd(
    q: Float[Tensor, "b s h a"],
    k: Float[Tensor, "b s h a"],
    v: Float[Tensor, "b s h p"],
    g: Float[Tensor, "b s h"],
    beta: Float[Tensor, "b s h"],
    doc_ids: Int[Tensor, "b s"] | None = None,
    initial_state: Float[Tensor, "b h a p"] | None = None,
    chunk_size: int = 64,
) -> tuple[Float[Tensor, "b s h p"], Float[Tensor, "b h a p"]]:
    """Chunked (WY/UT) gated delta rule in fp32 (docs/model.md#the-chunked-form), document-masked, differentiated by plain
    autograd through the chunk loop (every per-chunk intermediate is saved). The reference the custom backward of
    ``gated_delta_rule_chunked`` is tested against (``backward="autograd"`` selects it).

    ``initial_state`` belongs to the document of the first token (``doc_ids[:, 0]``). Returns the outputs and the
    state after the last token (for the document the row ends in).
    """
    dtype = v.dtype
    q, k, v, g, beta = _prep(q, k, v, g, beta)
    b, h, s, a = k.shape
    p = v.shape[-1]
    C = chunk_size
    pad = (C - s % C) % C
    # Zero padding (k = v = β = g = 0) at the tail changes nothing; padded positions stay in the last document.
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    masked = doc_ids is not None
    if masked:
        doc = F.pad(doc_ids.float()[:, None], (0, pad), mode="replicate")[:, 0].long()  # [b, s+pad]
        prev_doc = torch.cat([doc[:, :1], doc[:, :-1]], dim=1)  # the doc the state carries into position t
    n = (s + pad) // C
    q, k, v = (rearrange(t, "b h (j u) c -> b h j u c", u=C) for t in (q, k, v))
    g, beta = (rearrange(t, "b h (j u) -> b h j u", u=C) for t in (g, beta))

    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # In-chunk cumulative log decay γ. |γ| reaches ~10³ (A_log up to log 16), so the cumsum and the pairwise
    # differences γ_r − γ_s run in fp64 (a [.., C] and a [.., C, C] tensor: cheap) and only then return to fp32;
    # in fp32 they carry ~1e-7·|γ| absolute error into every decay factor.
    gam64 = g.double().cumsum(-1)
    gam = gam64.float()
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    if masked:
        doc_c = rearrange(doc, "b (j u) -> b j u", u=C)
        same = (doc_c[..., :, None] == doc_c[..., None, :]) & causal  # [b j u u]
        same = same[:, None]  # broadcast over heads
        first_doc = rearrange(prev_doc, "b (j u) -> b j u", u=C)[..., 0]  # doc carried into each chunk
        cont = (doc_c == first_doc[..., None]).float()[:, None]  # [b 1 j u]: token continues the carried doc
        last_same = (doc_c == doc_c[..., -1:]).float()[:, None]  # [b 1 j u]: same doc as the chunk's last token
    else:
        same = causal
    decay_uu = (gam64[..., :, None] - gam64[..., None, :]).float().masked_fill(~same, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * decay_uu
    # One triangular solve for both right-hand sides: U = T·Vβ and W = T·(Kβ ⊙ exp γ).
    uw = torch.linalg.solve_triangular(
        ut, torch.cat([v_beta, k_beta * gam.exp()[..., None]], dim=-1), upper=False, unitriangular=True
    )
    u_val, w_kc = uw[..., :p], uw[..., p:]
    intra = (q @ k.transpose(-1, -2)) * decay_uu
    q_dec = q * gam.exp()[..., None]
    k_dec = k * (gam64[..., -1:] - gam64).float().exp()[..., None]
    chunk_decay = gam[..., -1].exp()  # [b h j]
    if masked:
        w_kc, q_dec = w_kc * cont[..., None], q_dec * cont[..., None]
        k_dec = k_dec * last_same[..., None]
        chunk_decay = chunk_decay * cont[..., -1]

    S = torch.zeros(b, h, a, p, dtype=torch.float32, device=v.device)
    if initial_state is not None:
        S = initial_state.float()
    outs = []
    # unbind (not indexing) so backward stacks the per-chunk gradients once instead of zero-filling per chunk
    chunks = zip(*(t.unbind(2) for t in (u_val, w_kc, q_dec, intra, k_dec, chunk_decay)))
    for u_j, w_j, q_j, intra_j, k_j, decay_j in chunks:
        v_new = u_j - w_j @ S
        outs.append(q_j @ S + intra_j @ v_new)
        S = S * decay_j[..., None, None] + k_j.transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2)
    o = rearrange(o, "b h j u p -> b (j u) h p")[:, :s]
    return o.to(dtype), S


def _cp_core(core, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, info: SeqInfo) -> Tensor:
    """One rank's share of a context-parallel GDN, for either core: ``core(q, k, v, g, beta, doc_ids, s0) -> (o,
    S_final)`` with ``gated_delta_rule_chunked``'s contract (``s0`` belongs to each row's first document, ``S_final``
    is the state the row ends in).

    The output and final state are affine in the initial state S0. Running extra value columns (zero values, identity
    initial state) gives the response to S0 in the same pass; the comm then composes the ranks' (final state,
    transition) pairs into this rank's true S0 (``SeqComm.gdn_carry``, exact in fp32), and its gradient flows back
    through the same gather into every earlier rank's core (docs/gdn_backward.md#context-parallel-carry)."""
    comm = info.comm
    # The carry's doc ids (each row's first and last, per rank) need only ``info``: started before the core's pass.
    doc_ends = comm.all_gather_seq_async((torch.stack([info.doc_ids[:, 0], info.doc_ids[:, -1]])[None],), 0)
    b, s, h, a = v.shape[0], v.shape[1], v.shape[2], q.shape[-1]
    pv = v.shape[-1]
    v_aug = torch.cat([v, v.new_zeros(b, s, h, a)], dim=-1)
    eye = torch.eye(a, dtype=torch.float32, device=v.device).expand(b, h, a, a)
    s0 = torch.cat([torch.zeros(b, h, a, pv, dtype=torch.float32, device=v.device), eye], dim=-1)
    o_aug, s_aug = core(q, k, v_aug, g, beta, info.doc_ids, s0)
    o_zero, o_resp = o_aug[..., :pv].float(), o_aug[..., pv:].float()  # [b s h p], [b s h a]
    s_zero, transition = s_aug[..., :pv], s_aug[..., pv:]  # [b h a p], [b h a a]
    init = comm.gdn_carry(s_zero, transition, doc_ends)  # [b h a p]
    o = o_zero + torch.einsum("bsha,bhap->bshp", o_resp, init)
    return o.to(v.dtype)


def gdn_core_torch(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, info: SeqInfo, *, chunk_size: int, backward: str
) -> Tensor:
    """``kernels.gdn: torch``: ``gated_delta_rule_chunked`` (chunks of ``chunk_size``, ``backward`` custom or autograd),
    document-masked for packed rows; under context parallelism the ranks' states are composed by ``info.comm``
    (``_cp_core``)."""
    def core(q, k, v, g, beta, doc_ids, s0):
        return gated_delta_rule_chunked(q, k, v, g, beta, doc_ids, s0, chunk_size=chunk_size, backward=backward)

    if info.comm.is_local:
        return core(q, k, v, g, beta, info.doc_ids if info.packed else None, None)[0]
    return _cp_core(core, q, k, v, g, beta, info)


# ---- flash-linear-attention -------------------------------------------------------------------------------------


def fla_seqlens(doc_ids: Int[Tensor, "b s"]) -> tuple[Int[Tensor, " n1"], Int[Tensor, " b"], Int[Tensor, " b"]]:
    """The rows of ``doc_ids`` as FLA's variable-length layout: ``cu_seqlens`` (int32 ``[N + 1]``: where each of the
    ``N`` sequences of the flattened ``[1, b·s]`` row starts, then ``b·s``; a sequence is a run of one document
    inside one row, so a new row always starts one), and per row the index of its first and of its last sequence."""
    b, s = doc_ids.shape
    new = torch.ones(b, s, dtype=torch.bool, device=doc_ids.device)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    new = new.reshape(-1)
    starts = torch.nonzero(new).flatten()
    cu_seqlens = torch.cat([starts, starts.new_full((1,), b * s)]).to(torch.int32)
    seq_of_token = (torch.cumsum(new, 0) - 1).view(b, s)
    return cu_seqlens, seq_of_token[:, 0], seq_of_token[:, -1]


def gated_delta_rule_fla(
    q: Float[Tensor, "b s hk a"],
    k: Float[Tensor, "b s hk a"],
    v: Float[Tensor, "b s h p"],
    g: Float[Tensor, "b s h"],
    beta: Float[Tensor, "b s h"],
    doc_ids: Int[Tensor, "b s"] | None = None,
    initial_state: Float[Tensor, "b h a p"] | None = None,
) -> tuple[Float[Tensor, "b s h p"], Float[Tensor, "b h a p"]]:
    """``gated_delta_rule_chunked``'s contract (L2-normalised q/k, q scaled by ``a^-½``; ``initial_state`` belongs
    to each row's first document; returns the outputs and the fp32 state each row ends in) on flash-linear-attention's
    ``chunk_gated_delta_rule`` and its own backward. Packed rows (``doc_ids``) run as one flattened row with
    ``cu_seqlens`` (``fla_seqlens``): FLA gives every sequence its own initial and final state, so ``initial_state``
    goes to each row's first sequence (the others start from zero) and each row's last sequence's final state is
    returned; the gradient of the initial state comes back through FLA's ``dh0``."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # type: ignore

    b, s, h, a = v.shape[0], v.shape[1], v.shape[2], q.shape[-1]
    q, k = _repeat_kv_heads(q, k, h)
    s0 = None if initial_state is None else initial_state.float()
    if doc_ids is None:
        o, state = chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta, initial_state=s0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
        return o, state
    cu_seqlens, first, last = fla_seqlens(doc_ids)
    n = cu_seqlens.shape[0] - 1
    if s0 is not None:
        s0 = s0.new_zeros(n, *s0.shape[1:]).index_copy(0, first, s0)
    q, k, v, g, beta = (t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v, g, beta))
    o, states = chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta, initial_state=s0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    return o.reshape(b, s, *o.shape[2:]), states.index_select(0, last)


class _FLACtx:
    """What FLA's autograd function reads and writes on its ``ctx`` (saved tensors, attributes), for calling its
    forward and backward directly inside a custom op, where autograd does not record."""

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.saved_tensors = tensors


def _fla_direct(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_ids: Tensor | None, s0: Tensor | None,
                grads: tuple[Tensor, Tensor] | None = None) -> list[Tensor]:
    """``gated_delta_rule_fla`` through FLA's ``ChunkGatedDeltaRuleFunction`` forward called directly: ``[o, state]``;
    with ``grads = (d_o, d_state)`` its backward too, returning the gradients of ``q, k, v, g, beta`` (and ``s0``
    when given) through the same layout steps (head repeat, flattening, the per-sequence states) written out."""
    import inspect

    from fla.ops.gated_delta_rule.chunk import ChunkGatedDeltaRuleFunction  # type: ignore

    b, s, h, a = v.shape[0], v.shape[1], v.shape[2], q.shape[-1]
    hk = q.shape[2]
    qr, kr = _repeat_kv_heads(q, k, h)
    args = dict(q=qr, k=kr, v=v, g=g.float(), beta=beta, scale=a**-0.5, output_final_state=True,
                use_qk_l2norm_in_kernel=True, initial_state=None if s0 is None else s0.float())
    first = last = None
    if doc_ids is not None:
        cu_seqlens, first, last = fla_seqlens(doc_ids)
        n = cu_seqlens.shape[0] - 1
        for name in ("q", "k", "v", "g", "beta"):
            args[name] = args[name].reshape(1, b * s, *args[name].shape[2:])
        args["cu_seqlens"] = cu_seqlens
        if s0 is not None:
            args["initial_state"] = s0.new_zeros(n, *s0.shape[1:], dtype=torch.float32).index_copy(0, first,
                                                                                                   s0.float())
    names = list(inspect.signature(ChunkGatedDeltaRuleFunction.forward).parameters)[1:]
    params = inspect.signature(ChunkGatedDeltaRuleFunction.forward).parameters
    call = [args[nm] if nm in args else params[nm].default for nm in names]
    ctx = _FLACtx()
    o, states = ChunkGatedDeltaRuleFunction.forward(ctx, *call)
    state = states if last is None else states.index_select(0, last)
    if grads is None:
        return [o.reshape(b, s, h, -1), state]
    d_o, d_state = grads
    d_states = d_state.float()
    if last is not None:
        d_states = states.new_zeros(states.shape).index_copy(0, last, d_states)
    out = ChunkGatedDeltaRuleFunction.backward(ctx, d_o.reshape(o.shape).contiguous(), d_states.contiguous())
    dq, dk, dv, dg, dbeta = (out[names.index(nm)] for nm in ("q", "k", "v", "g", "beta"))
    dq, dk, dv, dg, dbeta = (t.reshape(b, s, *t.shape[2:]) for t in (dq, dk, dv, dg, dbeta))
    if hk < h:  # the repeated key heads: each key head's gradient sums over its value heads
        dq, dk = (t.view(b, s, hk, h // hk, a).sum(3) for t in (dq, dk))
    res = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype)]
    if s0 is not None:
        dh0 = out[names.index("initial_state")]
        res.append((dh0 if first is None else dh0.index_select(0, first)).to(s0.dtype))
    return res


# Under torch.compile FLA runs as one opaque op with a fake (shape) implementation, so the traced graph holds: its
# Triton launches are not traceable (FLA marks its entry point ``torch.compiler.disable``, a graph break). Autograd
# does not record inside a custom op, so the op calls FLA's autograd function's forward and backward itself
# (``_fla_direct``); its saved intermediates cannot cross the op's boundary, so the backward op runs FLA's forward
# again first: one extra GDN forward per backward, only in compiled blocks (eager calls FLA's public function).
@torch.library.custom_op("q38::fla_gdn", mutates_args=())
def _fla_gdn_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_ids: Optional[Tensor],
                initial_state: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    o, state = _fla_direct(q, k, v, g, beta, doc_ids, initial_state)
    return o.contiguous(), state.contiguous()


@_fla_gdn_op.register_fake
def _(q, k, v, g, beta, doc_ids, initial_state):
    b, s, h, p = v.shape
    return v.new_empty(b, s, h, p), v.new_empty(b, h, q.shape[-1], p, dtype=torch.float32)


@torch.library.custom_op("q38::fla_gdn_backward", mutates_args=())
def _fla_gdn_backward_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_ids: Optional[Tensor],
                         initial_state: Optional[Tensor], d_o: Tensor, d_state: Tensor) -> list[Tensor]:
    grads = _fla_direct(q, k, v, g, beta, doc_ids, initial_state, (d_o, d_state))
    return [t.contiguous() for t in grads]


@_fla_gdn_backward_op.register_fake
def _(q, k, v, g, beta, doc_ids, initial_state, d_o, d_state):
    return [torch.empty_like(t) for t in (q, k, v, g, beta, *(() if initial_state is None else (initial_state,)))]


def _fla_gdn_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _fla_gdn_grad(ctx, d_o, d_state):
    q, k, v, g, beta, doc_ids, s0 = ctx.saved_tensors
    d_o = torch.zeros_like(v) if d_o is None else d_o
    if d_state is None:
        d_state = torch.zeros(v.shape[0], v.shape[2], q.shape[-1], v.shape[-1], device=v.device)
    grads = _fla_gdn_backward_op(q, k, v, g, beta, doc_ids, s0, d_o, d_state)
    return (*grads[:5], None, grads[5] if s0 is not None else None)


_fla_gdn_op.register_autograd(_fla_gdn_grad, setup_context=_fla_gdn_setup)


def gated_delta_rule_fla_op(
    q: Float[Tensor, "b s hk a"],
    k: Float[Tensor, "b s hk a"],
    v: Float[Tensor, "b s h p"],
    g: Float[Tensor, "b s h"],
    beta: Float[Tensor, "b s h"],
    doc_ids: Int[Tensor, "b s"] | None = None,
    initial_state: Float[Tensor, "b h a p"] | None = None,
) -> tuple[Float[Tensor, "b s h p"], Float[Tensor, "b h a p"]]:
    """``gated_delta_rule_fla`` as the ``q38::fla_gdn`` custom op (what compiled blocks trace; equal to it)."""
    return torch.ops.q38.fla_gdn(q, k, v, g, beta, doc_ids, initial_state)


def gdn_core_fla(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, info: SeqInfo, *, chunk_size: int, backward: str
) -> Tensor:
    """``kernels.gdn: fla``: flash-linear-attention's ``chunk_gated_delta_rule`` (its own chunks of 64 and its own
    backward: ``chunk_size`` and ``backward`` steer the torch core only), packed rows through ``cu_seqlens``
    (``gated_delta_rule_fla``); under context parallelism the same exact state carry as the torch core
    (``_cp_core``: FLA's ``initial_state`` and final state give each rank's response, ``info.comm`` composes them).
    Inside ``torch.compile`` it runs as the ``q38::fla_gdn`` custom op."""
    core = gated_delta_rule_fla_op if torch.compiler.is_compiling() else gated_delta_rule_fla
    if info.comm.is_local:
        return core(q, k, v, g, beta, info.doc_ids if info.packed else None, None)[0]
    return _cp_core(core, q, k, v, g, beta, info)


def gdn_apply(
    p: GDNParams, x: Float[Tensor, "b s d"], cfg: ModelConfig, info: SeqInfo, *, backward: str = "custom"
) -> Float[Tensor, "b s d"]:
    """Gated DeltaNet token mixer (Qwen3.5 projection layout), with ``info.kernels``' conv and GDN core.
    ``backward``: the torch core's backward (``GDN_BACKWARDS``: ``custom``, or the ``autograd`` reference)."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    kernels = info.kernels
    # CP: the conv halo is started as soon as its inputs exist and waited by the conv, after the other projections.
    kw = p.conv_w.shape[1]
    doc_halo = start_doc_halo(kw, info)
    mixed = linear(x, p.w_qkv)
    halo = start_conv_halo(mixed, kw, info, doc_halo)
    z = rearrange(linear(x, p.w_z), "b s (h c) -> b s h c", h=nv)
    beta = torch.sigmoid(linear(x, p.w_b))
    log_decay = -p.A_log.float().exp() * F.softplus(linear(x, p.w_a).float() + p.dt_bias)  # fp32, ≤ 0
    qkv = F.silu(kernels.fn("causal_conv1d")(mixed, p.conv_w, info, halo))
    q, k, v = torch.split(qkv, [cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim], dim=-1)
    q = rearrange(q, "b s (hk c) -> b s hk c", hk=nk)
    k = rearrange(k, "b s (hk c) -> b s hk c", hk=nk)
    v = rearrange(v, "b s (h c) -> b s h c", h=nv)
    # q, k stay per key head (value head i reads key head i // (nv / nk)): the core expands them
    with info.region("gdn"):
        o = kernels.fn("gdn")(q, k, v, log_decay, beta, info, chunk_size=int(kernels.gdn_chunk_size),
                              backward=backward)
    o = gated_rms_norm(o, z, p.norm_w, cfg.rms_norm_eps)
    return linear(rearrange(o, "b s h c -> b s (h c)"), p.w_out)
