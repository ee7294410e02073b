"""Gated full attention: QK-norm, partial RoPE, GQA, sigmoid output gate (docs/model.md#gated-full-attention), and
the attention core's implementations (``kernels.attention``, docs/kernels.md#attention): ``eager`` and ``sdpa`` (the
references, a dense boolean ``[b, 1, s, t]`` mask), ``flex`` (FlexAttention over a block mask), ``varlen`` (torch's
flash ``varlen_attn`` over ``cu_seqlens``) and ``npu`` (``torch_npu.npu_fusion_attention``, TND layout). The layer
hands every implementation an ``AttentionMask`` (token indices and doc ids); only the references turn it into a
dense mask.

Extra dims: none beyond the legend (``h`` query heads, ``g`` kv heads, ``c`` head dim, ``t`` key positions).
"""

import dataclasses
from typing import Callable

import attrs
import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from q38.model_config import ModelConfig
from q38.errors import DataError
from q38.layers.common import ParamInfo, linear
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


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Which keys each query sees, given as what the mask is computed from (never the ``[s, t]`` mask itself): key
    ``j`` is visible to query ``i`` iff ``k_idx[j] <= q_idx[i]`` (not in the future) and ``k_doc[j] == q_doc[i]``
    (same document). ``q_idx``/``k_idx``: token indices in the un-split row (under CP the local queries sit at their
    global offset and the keys are the all-gathered row); ``q_doc``/``k_doc``: document ids (padding -1).

    A frozen dataclass, not attrs: the layer builds it in its forward, which ``torch.compile`` must be able to trace.
    """

    q_idx: Int[Tensor, "b s"]
    q_doc: Int[Tensor, "b s"]
    k_idx: Int[Tensor, "b t"]
    k_doc: Int[Tensor, "b t"]

    def dense(self) -> Bool[Tensor, "b 1 s t"]:
        """The boolean ``[b, 1, s, t]`` mask (the ``eager``/``sdpa`` references only: O(s·t) memory)."""
        causal = self.k_idx[:, None, :] <= self.q_idx[:, :, None]
        same_doc = self.k_doc[:, None, :] == self.q_doc[:, :, None]
        return (causal & same_doc)[:, None]


def attention_apply(p: AttnParams, x: Float[Tensor, "b s d"], cfg: ModelConfig, info: SeqInfo) -> Float[Tensor, "b s d"]:
    """``o_proj(attn(q, k, v) * sigmoid(gate))`` with causal, per-document masking."""
    h, g, c = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # Context parallel: the whole row's token indices and doc ids (for the mask), then its keys/values (identity on
    # one device); each exchange starts as soon as its input exists and is waited where it is used.
    comm = info.comm
    ids = None if (comm.is_local and not info.packed) else comm.all_gather_seq_async((info.seq_idx, info.doc_ids), 1)
    cos, sin = rope_cos_sin(info.positions, cfg.rotary_dim, cfg.rope_theta)
    k_bsgc = rms_norm(rearrange(linear(x, p.w_k), "b s (g c) -> b s g c", g=g), p.k_norm, cfg.rms_norm_eps)
    v_bsgc = rearrange(linear(x, p.w_v), "b s (g c) -> b s g c", g=g)
    kv = comm.all_gather_seq_async((apply_rope(k_bsgc, cos, sin), v_bsgc), 1)
    qg_bshc = rearrange(linear(x, p.w_q), "b s (h c2) -> b s h c2", h=h)
    q_bshc, gate_bshc = qg_bshc.chunk(2, dim=-1)  # one cat in backward, not two zero-filled slice grads
    q_bshc = apply_rope(rms_norm(q_bshc, p.q_norm, cfg.rms_norm_eps), cos, sin)
    # the mask as the indices it is computed from: each implementation builds its own form (dense, block, cu_seqlens)
    mask = None if ids is None else AttentionMask(info.seq_idx, info.doc_ids, *ids.wait())
    k_btgc, v_btgc = kv.wait()

    q_bhsc = rearrange(q_bshc, "b s h c -> b h s c")
    k_bgtc, v_bgtc = rearrange(k_btgc, "b t g c -> b g t c"), rearrange(v_btgc, "b t g c -> b g t c")
    with info.region("attention"):
        o_bhsc = info.kernels.fn("attention")(q_bhsc, k_bgtc, v_bgtc, mask, c**-0.5)
    # sigmoid before the merge of (h c): the gate is a strided half of the projection, whose merge would copy it;
    # the sigmoid's output is contiguous, so the merge is a view
    o_bsd = rearrange(o_bhsc, "b h s c -> b s (h c)") * rearrange(torch.sigmoid(gate_bshc), "b s h c -> b s (h c)")
    return linear(o_bsd, p.w_o)


# ---- the attention core's implementations (kernels.attention); contract: q [b h s c], k, v [b g t c],
# mask: AttentionMask | None (None: plain causal, s == t), scale -> o [b h s c] -------------------------------------


def _native_gqa(q_bhsc: Tensor, mask: AttentionMask | None) -> bool:
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
    q_bhsc: Tensor, k_bgtc: Tensor, v_bgtc: Tensor, mask: AttentionMask | None, scale: float
) -> Tensor:
    """``kernels.attention: sdpa``: ``F.scaled_dot_product_attention`` of ``h`` query heads over ``g`` kv heads,
    causal when ``mask`` is None, else under ``mask.dense()`` (a boolean ``[b, 1, s, t]``; a reference: SDPA with an
    explicit mask computes every (query, key) pair)."""
    r = q_bhsc.shape[1] // k_bgtc.shape[1]
    if r > 1 and _native_gqa(q_bhsc, mask):
        return F.scaled_dot_product_attention(q_bhsc, k_bgtc, v_bgtc, is_causal=True, scale=scale, enable_gqa=True)
    k_bhtc, v_bhtc = _repeat_kv(k_bgtc, v_bgtc, r)
    if mask is None:
        return F.scaled_dot_product_attention(q_bhsc, k_bhtc, v_bhtc, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q_bhsc, k_bhtc, v_bhtc, attn_mask=mask.dense(), scale=scale)


def eager_attention(
    q_bhsc: Tensor, k_bgtc: Tensor, v_bgtc: Tensor, mask: AttentionMask | None, scale: float
) -> Tensor:
    """``kernels.attention: eager``: explicit fp32 ``softmax(QKᵀ · scale)V`` (the reference), same contract as
    ``sdpa_attention``."""
    k_bhtc, v_bhtc = _repeat_kv(k_bgtc, v_bgtc, q_bhsc.shape[1] // k_bgtc.shape[1])
    scores = torch.einsum("bhsc,bhtc->bhst", q_bhsc.float(), k_bhtc.float()) * scale
    if mask is None:
        s, t = scores.shape[-2:]
        dense = torch.ones(s, t, dtype=torch.bool, device=q_bhsc.device).tril()[None, None]
    else:
        dense = mask.dense()
    scores = scores.masked_fill(~dense, float("-inf"))
    return torch.einsum("bhst,bhtc->bhsc", scores.softmax(-1), v_bhtc.float()).to(q_bhsc.dtype)


# ---- flex: FlexAttention over a block mask --------------------------------------------------------------------

_FLEX: dict[str, Callable] = {}  # the compiled flex_attention and create_block_mask, compiled once per process


def _flex_compiled() -> tuple[Callable, Callable]:
    """``torch.compile`` of torch's own ``flex_attention`` and ``create_block_mask`` (built on first use, then
    reused). Compiled: ``flex_attention`` uncompiled is the dense O(s·t) math, and ``create_block_mask`` uncompiled
    materialises the dense mask before it reduces it to blocks. The raw torch functions are compiled, not a q38
    function, so nothing q38 wraps (shape checks in the tests) sits inside the traced region."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        _FLEX["attention"] = torch.compile(flex_attention)
        # CPU (inductor's C++ backend; no effect on a GPU): with the index-lookup mask_mod, torch 2.13 generated
        # vectorised C++ that does not build (a masked load, on an AVX-512 CPU) for dynamic shapes and for lengths
        # that are not a multiple of the block: one graph per shape (a run has one or two) and scalar code
        _FLEX["block_mask"] = torch.compile(create_block_mask, dynamic=False, options={"cpp.simdlen": 1})
    return _FLEX["attention"], _FLEX["block_mask"]


def flex_mask_mod(mask: AttentionMask | None) -> Callable:
    """FlexAttention's ``mask_mod(b, h, q, kv) -> bool`` of ``mask`` (None: causal): the indices and doc ids looked
    up per (query, key) pair. A lambda, not a nested def: it is traced, and a lambda is never wrapped by a decorator
    (the tests' shape-check hook wraps every def)."""
    if mask is None:
        return lambda b, h, q, kv: kv <= q
    q_idx, q_doc, k_idx, k_doc = mask.q_idx, mask.q_doc, mask.k_idx, mask.k_doc
    return lambda b, h, q, kv: (k_idx[b, kv] <= q_idx[b, q]) & (k_doc[b, kv] == q_doc[b, q])


def flex_block_mask(mask: AttentionMask | None, s: int, t: int, device: torch.device | str):
    """The FlexAttention ``BlockMask`` of ``mask`` over ``s`` queries and ``t`` keys, built by the compiled
    ``create_block_mask`` from ``flex_mask_mod(mask)``, so no ``[s, t]`` tensor is ever made. The mask is the same
    for every head; each row has its own (its documents)."""
    _, block_mask = _flex_compiled()
    return block_mask(flex_mask_mod(mask), None if mask is None else mask.q_idx.shape[0], None, s, t, device=device)


def flex_attention(
    q_bhsc: Tensor, k_bgtc: Tensor, v_bgtc: Tensor, mask: AttentionMask | None, scale: float
) -> Tensor:
    """``kernels.attention: flex``: compiled FlexAttention under ``flex_block_mask(mask)``: blocks of keys the mask
    hides entirely are skipped, none is materialised; grouped kv heads are read as they are (``enable_gqa``). On CPU
    forward only (torch has no FlexAttention backward there): a call that would need one raises."""
    if q_bhsc.device.type == "cpu" and torch.is_grad_enabled() and any(
            x.requires_grad for x in (q_bhsc, k_bgtc, v_bgtc)):
        raise NotImplementedError("kernels.attention: flex has no backward on CPU (torch's FlexAttention is forward-"
                                  "only there); train on CPU with kernels.attention: sdpa, or run under no_grad")
    attention, _ = _flex_compiled()
    bm = flex_block_mask(mask, q_bhsc.shape[2], k_bgtc.shape[2], q_bhsc.device)
    return attention(q_bhsc, k_bgtc, v_bgtc, block_mask=bm, scale=scale,
                     enable_gqa=q_bhsc.shape[1] != k_bgtc.shape[1])


# ---- varlen / npu: documents as variable-length sequences (cu_seqlens) ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class DocSegments:
    """The rows as variable-length sequences for the ``cu_seqlens`` kernels (``doc_segments``): segment ``i`` is
    the queries ``cu_q[i]:cu_q[i+1]`` of the flattened queries ``[(b s)]`` against the keys ``cu_k[i]:cu_k[i+1]`` of
    the concatenated key spans, causal aligned at the bottom right (the last query sees every key of its segment)."""

    cu_q: list[int]  # [n + 1] cumulative query lengths of the n segments (every row's queries in order)
    cu_k: list[int]  # [n + 1] cumulative key lengths
    k_spans: list[tuple[int, int, int]]  # per row (row, start, stop): the keys its segments read, concatenated
    max_q: int
    max_k: int


def doc_segments(mask: AttentionMask | None, b: int, s: int, t: int) -> DocSegments:
    """``mask`` as variable-length sequences: every run of equal doc ids in a row is one sequence (one device: its
    queries against its keys; under CP the local queries ``[c0, c1)`` of the document against its keys from the
    document's start up to ``c1``, so causal aligned at the bottom right is exactly "not in the future"). The keys
    of a row's segments are one span ``[start of the first document that reaches c0, c1)`` of the gathered row.

    Needs what the layer passes: the keys are the whole row in order (``k_idx`` = 0..t-1), the queries a contiguous
    slice of it, and each document one run of its row (what q38's packing produces); a document id that comes back
    after another one (``[0, 0, 1, 0]``) is a ``DataError``: the dense mask would join the runs, these kernels would
    not. One host sync (the run boundaries and the slice offsets)."""
    if mask is None:
        return DocSegments(list(range(0, b * s + 1, s)), list(range(0, b * t + 1, t)),
                           [(r, 0, t) for r in range(b)], s, t)
    dev = mask.k_doc.device
    k_doc = mask.k_doc
    starts = torch.ones_like(k_doc, dtype=torch.bool)
    starts[:, 1:] = k_doc[:, 1:] != k_doc[:, :-1]
    rows, cols = starts.nonzero(as_tuple=True)
    runs = torch.stack((rows, cols, k_doc[rows, cols])).tolist()
    bad_k = (mask.k_idx != torch.arange(t, device=dev)).any()
    bad_q = (mask.q_idx != mask.q_idx[:, :1] + torch.arange(s, device=dev)).any()
    *q0, bad = torch.cat((mask.q_idx[:, 0], (bad_k | bad_q).long()[None])).tolist()
    if bad or not all(0 <= c0 and c0 + s <= t for c0 in q0):
        raise ValueError("doc_segments: the keys must be the whole row in order and the queries a contiguous slice of "
                         "it (what attention_apply passes)")
    by_row: list[list[tuple[int, int]]] = [[] for _ in range(b)]
    for r, c, d in zip(*runs):
        by_row[r].append((c, d))
    cu_q, cu_k, spans = [0], [0], []
    for r, row in enumerate(by_row):
        c0, c1 = q0[r], q0[r] + s
        ends = [c for c, _ in row[1:]] + [t]
        seen: set[int] = set()
        first = None
        for (start, doc), end in zip(row, ends):
            if start >= c1:
                break
            if doc in seen:
                raise DataError(f"row {r}: document id {doc} comes back after another document; the cu_seqlens "
                                "attention kernels (kernels.attention: varlen / npu) need each document as one run of "
                                "its row: number every packed document apart, or use kernels.attention: flex or sdpa")
            seen.add(doc)
            if end <= c0:
                continue
            first = start if first is None else first
            cu_q.append(cu_q[-1] + min(end, c1) - max(start, c0))
            cu_k.append(cu_k[-1] + min(end, c1) - start)
        spans.append((r, first, c1))
    lens_q = [b_ - a for a, b_ in zip(cu_q, cu_q[1:])]
    lens_k = [b_ - a for a, b_ in zip(cu_k, cu_k[1:])]
    return DocSegments(cu_q, cu_k, spans, max(lens_q), max(lens_k))


def _as_segments(q_bhsc: Tensor, k_bgtc: Tensor, v_bgtc: Tensor, seg: DocSegments) -> tuple[Tensor, Tensor, Tensor]:
    """q ``[(b s) h c]`` and the keys / values of ``seg.k_spans`` concatenated ``[T g c]`` (TND / varlen layout)."""
    b, _, t, _ = k_bgtc.shape
    q_thc = rearrange(q_bhsc, "b h s c -> (b s) h c")
    if all(a == 0 and z == t for _, a, z in seg.k_spans):
        return q_thc, rearrange(k_bgtc, "b g t c -> (b t) g c"), rearrange(v_bgtc, "b g t c -> (b t) g c")
    k_tgc = torch.cat([rearrange(k_bgtc[r, :, a:z], "g t c -> t g c") for r, a, z in seg.k_spans])
    v_tgc = torch.cat([rearrange(v_bgtc[r, :, a:z], "g t c -> t g c") for r, a, z in seg.k_spans])
    return q_thc, k_tgc, v_tgc


def varlen_attention(
    q_bhsc: Tensor, k_bgtc: Tensor, v_bgtc: Tensor, mask: AttentionMask | None, scale: float
) -> Tensor:
    """``kernels.attention: varlen``: torch's ``varlen_attn`` (the flash kernel over ``cu_seqlens``, CUDA, 16-bit)
    with every document of every row one sequence (``doc_segments``), causal, grouped kv heads as they are."""
    from torch.nn.attention.varlen import varlen_attn

    b, h, s, _ = q_bhsc.shape
    seg = doc_segments(mask, b, s, k_bgtc.shape[2])
    q_thc, k_tgc, v_tgc = _as_segments(q_bhsc, k_bgtc, v_bgtc, seg)
    cu_q = torch.tensor(seg.cu_q, dtype=torch.int32, device=q_bhsc.device)
    cu_k = torch.tensor(seg.cu_k, dtype=torch.int32, device=q_bhsc.device)
    o_thc = varlen_attn(q_thc, k_tgc, v_tgc, cu_q, cu_k, seg.max_q, seg.max_k, scale=scale, window_size=(-1, 0),
                        enable_gqa=h != k_bgtc.shape[1])
    return rearrange(o_thc, "(b s) h c -> b h s c", b=b)


_NPU_CAUSAL: dict[torch.device, Tensor] = {}  # the kernel's compressed causal mask, one per device


def npu_attention(
    q_bhsc: Tensor, k_bgtc: Tensor, v_bgtc: Tensor, mask: AttentionMask | None, scale: float
) -> Tensor:
    """``kernels.attention: npu``: ``torch_npu.npu_fusion_attention`` in TND layout, every document one sequence
    (``actual_seq_qlen`` / ``actual_seq_kvlen``: the cumulative ends of ``doc_segments``), causal aligned at the
    bottom right (``sparse_mode=3`` with the kernel's fixed 2048 × 2048 compressed mask, whatever the sequence
    length), grouped kv heads as they are."""
    import torch_npu

    b, h, s, _ = q_bhsc.shape
    seg = doc_segments(mask, b, s, k_bgtc.shape[2])
    q_thc, k_tgc, v_tgc = _as_segments(q_bhsc, k_bgtc, v_bgtc, seg)
    dev = q_bhsc.device
    if dev not in _NPU_CAUSAL:
        _NPU_CAUSAL[dev] = torch.ones(2048, 2048, dtype=torch.bool, device=dev).triu(1)  # True: masked out
    o_thc = torch_npu.npu_fusion_attention(
        q_thc, k_tgc, v_tgc, h, "TND", atten_mask=_NPU_CAUSAL[dev], scale=scale, keep_prob=1.0, sparse_mode=3,
        actual_seq_qlen=seg.cu_q[1:], actual_seq_kvlen=seg.cu_k[1:])[0]
    return rearrange(o_thc, "(b s) h c -> b h s c", b=b)
