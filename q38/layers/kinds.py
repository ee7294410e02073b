"""The mixer kinds: one record per ``layer_types`` entry, holding everything that differs between a
``full_attention`` (gated attention) and a ``linear_attention`` (Gated DeltaNet) decoder layer.

Every reader goes through ``MIXER_KINDS``: ``block.py`` (params and apply), ``ModelConfig`` (the accepted
``layer_types``), ``q38.model.count_params`` (the declared shapes), ``q38.flops`` (matmul FLOPs),
``q38.parallel.budget`` (saved bytes, selective recompute, the CP exchange), ``q38.hf`` (checkpoint keys) and
``q38.train.core.remat`` (the recompute regions). Adding a kind is one record here plus its layer file
(docs/extending.md#add-a-layer-type-or-a-weight).

Dims: ``n`` local tokens (rows · seq), ``h``/``g`` query/kv heads, ``c`` head dim, ``H``/``Hk`` GDN value/key
heads, ``a``/``p`` GDN key/value head dims, ``C`` the GDN chunk.
"""

import math
from typing import Any, Callable

import attrs
import torch

from q38.model_config import LAYER_TYPES, ModelConfig
from q38.kernels import GDN_CHUNK
from q38.layers.attention import AttnParams, abstract_attention, attention_apply
from q38.layers.gdn import GDNParams, abstract_gdn, gdn_apply
from q38.layers.hf_keys import CheckpointLayout, Rule, conv_rule, grouped_block, renames

# ---- the record -------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Workload:
    """One layer call the formulas are evaluated at: ``rows`` rows of ``seq`` tokens local to a CP rank (attention
    keys span ``seq × cp``), activations of ``act_bytes``. ``causal_skip``: the attention kernel skips the masked
    triangle; ``kv_native``: attention takes k, v with their own heads; ``gdn_kernel``: fla's GDN kernel (else the
    torch core, in chunks of ``gdn_chunk``)."""

    rows: float | int
    seq: int
    cp: int = 1
    act_bytes: int = 2
    causal_skip: bool = True
    kv_native: bool = False
    gdn_kernel: bool = False
    gdn_chunk: int = GDN_CHUNK

    @property
    def tokens(self) -> float | int:
        return self.rows * self.seq


@attrs.frozen(kw_only=True)
class MixerFlops:
    """Forward matmul FLOPs of one mixer call. ``terms``: by ``q38.flops.StepFlops`` term (``dense``,
    ``attention``, ``gdn_core``, ``solve``: the GDN triangular solve, reported with ``gdn_core``); ``kernel``: the
    terms inside the recompute region (selective recompute does not run them again); ``backward``: what the
    backward of the kernel terms executes when that is not 2 × their forward (None: it is)."""

    terms: dict
    kernel: tuple[str, ...]
    backward: float | None = None


@attrs.frozen(kw_only=True)
class MixerSaved:
    """Bytes autograd saves for one mixer call: ``core`` (the kernel region's inputs and saved state), ``rest``
    (projections, norms, gates), ``widest`` (the largest single saved tensor), ``kept`` (what selective recompute
    stores for the region), ``mixer_backward`` (bytes alive at the peak of the core's own backward; 0: not
    modelled)."""

    core: float
    rest: float
    widest: float
    kept: float
    mixer_backward: float = 0.0


@attrs.frozen(kw_only=True)
class CPExchange:
    """What one mixer call exchanges over ``cp`` (context parallelism): ``bytes`` received per rank per call of
    ``collective``; ``calls``: how often it runs per step (forward, backward), ``recompute_calls`` when the kernel
    region is recomputed."""

    collective: str
    bytes: float
    calls: int
    recompute_calls: int
    early: bool = False  # its forward calls are started before the compute that does not need them (overlap_comm)


@attrs.frozen(kw_only=True)
class MixerKind:
    """One kind of token mixer (``name``: its ``layer_types`` entry, as in the HF config).

    ``params``: its attrs params class; ``abstract(cfg)``: its ``ParamInfo`` tree; ``apply(p, x, cfg, info)``: the
    layer math; ``region``: the region its apply marks with ``info.region`` (selective recompute keeps it when the train
    setting ``keep_flag`` is on); ``flops`` / ``saved`` / ``cp_exchange``: its formulas at a ``Workload``;
    ``hf_rules(cfg, layout, qp, hp, shapes)``: its checkpoint ``Rule`` s, q38 paths under ``qp`` (``….mixer.``), HF
    keys under the HF layer prefix ``hp``.
    """

    name: str
    params: type
    abstract: Callable[[ModelConfig], Any]
    apply: Callable[..., Any]
    region: str
    keep_flag: str
    flops: Callable[[ModelConfig, Workload], MixerFlops]
    saved: Callable[[ModelConfig, Workload], MixerSaved]
    cp_exchange: Callable[[ModelConfig, Workload], CPExchange]
    hf_rules: Callable[[ModelConfig, CheckpointLayout, str, str, dict], list[Rule]]


# ---- full attention ---------------------------------------------------------------------------------------------

ATTN_RENAMES = {
    "w_q": "self_attn.q_proj.weight",  # per head: c query rows then c gate rows (same in both)
    "w_k": "self_attn.k_proj.weight",
    "w_v": "self_attn.v_proj.weight",
    "w_o": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}


def _attention_flops(cfg: ModelConfig, w: Workload) -> MixerFlops:
    d, h, g, c = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    tokens, seq, cp = w.tokens, w.seq, w.cp
    dense = 2 * tokens * d * (2 * h * c + 2 * g * c + h * c)
    if w.causal_skip:  # average keys per query, this rank's queries at CP offsets
        avg = sum((r * seq + (seq + 1) / 2) for r in range(cp)) / cp
    else:
        avg = seq * cp
    return MixerFlops(terms={"dense": dense, "attention": 2 * 2 * tokens * h * c * avg}, kernel=("attention",))


def _attention_saved(cfg: ModelConfig, w: Workload) -> MixerSaved:
    """Flash SDPA saves q, k, v, out and the logsumexp (same set as the CPU flash op); ``kv_native``: k and v go in
    with their own ``g`` heads (``enable_gqa``: the causal, unmasked case, see ``attention._native_gqa``), else
    repeated to all ``h`` query heads before the call (as the layer does then)."""
    h, g, c, rd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
    n, act, cp = w.tokens, w.act_bytes, w.cp
    kv_heads = g if w.kv_native else h
    core = n * c * (2 * h + 2 * cp * kv_heads) * act + n * h * 4  # q, k and v over the whole row, out; lse fp32
    # q|gate and k projections with their QK-norm rsqrts (the norms save their inputs), rope cos/sin, the output gate
    rest = n * (2 * h * c + h + g * c + g + 2 * rd + h * c + h * c) * act
    if cp > 1:  # gathered k and v before the repeat
        rest += 2 * n * cp * g * c * act
    kept = n * h * (c * act + 4)  # SDPA is one op: out + logsumexp
    return MixerSaved(core=core, rest=rest, widest=n * h * c * cp * act, kept=kept)


def _attention_cp(cfg: ModelConfig, w: Workload) -> CPExchange:
    kv = 2 * w.tokens * (w.cp - 1) * cfg.num_key_value_heads * cfg.head_dim * w.act_bytes
    return CPExchange(collective="all-gather k/v", bytes=kv, calls=2, recompute_calls=3, early=True)


def _attention_hf(cfg: ModelConfig, layout: CheckpointLayout, qp: str, hp: str, shapes: dict) -> list[Rule]:
    return renames(ATTN_RENAMES, qp, hp, shapes)


# ---- Gated DeltaNet ---------------------------------------------------------------------------------------------

GDN_RENAMES = {
    "dt_bias": "linear_attn.dt_bias",
    "A_log": "linear_attn.A_log",
    "norm_w": "linear_attn.norm.weight",
    "w_out": "linear_attn.out_proj.weight",
}
GDN_FLAT_RENAMES = {  # Qwen3.5 layout; Qwen3-Next groups these per key head (``_grouped_qkvz`` / ``_grouped_ba``)
    "w_qkv": "linear_attn.in_proj_qkv.weight",
    "w_z": "linear_attn.in_proj_z.weight",
    "w_b": "linear_attn.in_proj_b.weight",
    "w_a": "linear_attn.in_proj_a.weight",
}
GDN_CONV = ("conv_w", "linear_attn.conv1d.weight")  # q38 [ch, w] ↔ HF [ch, 1, w]


def _gdn_flops(cfg: ModelConfig, w: Workload) -> MixerFlops:
    d, tokens, rows, seq, cp = cfg.hidden_size, w.tokens, w.rows, w.seq, w.cp
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    a, p, kw = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    conv = cfg.linear_conv_dim
    dense = 2 * tokens * d * (conv + nv * p + 2 * nv) + 2 * tokens * nv * p * d
    dense += 2 * tokens * conv * kw  # depthwise causal conv
    C = w.gdn_chunk
    chunks = rows * math.ceil(seq / C)
    pe = p + (a if cp > 1 else 0)  # CP runs extra value columns for the state response
    r = nk / nv  # q·kᵀ is taken once per key head (gdn.py `_masked_qk`); the rest per value head
    # The products of gdn.py's `_ChunkGatedDeltaRule`, per chunk and value head, counted from the code.
    # forward: A = Kβ Kᵀ, S·Kβ, q·kᵀ (C²a); U = T·Vβ, P·Vnew (C²p); W·S, Kdᵀ·Vnew, (Q⊙E)·S (Cap); T by one
    # triangular solve against I (C³)
    core = chunks * nv * (2 * C * C * a * (2 + r) + 4 * C * C * pe + 6 * C * a * pe)
    solve = chunks * nv * C**3
    # backward (executed): the factors again (A, S·Kβ, q·kᵀ, U, the solve), Vnew, Pᵀ·dO, (Q⊙E)ᵀ·dO, the reverse
    # recurrence (Kd·dS, Wᵀ·dVnew), dKd, dQd, dP, dq/dk from dP (per key head), dW, Tᵀ·[dVnew | dW], dL (two),
    # dKβ = dL·K and dk += dLᵀ·Kβ
    backward = chunks * nv * (2 * C * C * a * (7 + 3 * r) + 10 * C * C * pe + 14 * C * a * pe + C**3)
    return MixerFlops(terms={"dense": dense, "gdn_core": core, "solve": solve}, kernel=("gdn_core", "solve"),
                      backward=backward)


def gdn_backward_working(cfg: ModelConfig, rows: float | int, seq: int, act: int, cp: int = 1,
                         chunk: int = GDN_CHUNK) -> float:
    """Bytes the torch GDN core's backward (``_ChunkGatedDeltaRule.backward``, q38/layers/gdn.py) allocates at its
    peak on top of what its forward saved (inputs and one fp32 state per chunk), including the incoming ``d_o``.

    Everything in it is fp32 over ``N = rows·H·j`` chunks (``j = ⌈seq/C⌉``) of ``C = chunk`` tokens, in units of one
    ``[N, C, C]`` matrix (``C²``), one ``[N, C, a]`` / ``[N, C, p]`` column block (``Ca`` / ``Cp``; ``p`` = value
    columns, ``+a`` under CP, which runs the identity initial state as extra columns), ``[N, a, p]`` and ``[N, C]``.
    Alive throughout (Python names hold them to the return): the recomputed factors ``Gam``, ``A`` (``dL ⊙ L``
    is taken as ``(dL⊙Γ)⊙A``), ``T`` and ``P = QKᵀ⊙Γ`` (4 C²); ``q, k, kb, kd, qd`` (5 Ca), ``vb, vnew, dv_base, dvnew, d_o`` (5 Cp), ``U, W`` (Ca + Cp);
    ``ds_base, dS_after`` (2 ap); ``E, Ec, dgam, y`` (4 C); per row and head the reverse recurrence's last ``dS``
    and ``dvn`` (``ap + Cp``). The peak is the L2-norm backward of ``dq`` / ``dk`` at the end: ``x`` and ``dL``
    (``7 C²`` in all) with ``dkb, xe``, the norm backward's one temporary (3 Ca) and ``dv`` (Cp) →
    ``7 C² + C(15a + 8p)``; with 16-bit inputs the casts of the returned gradients come within ~2 % of it. (The
    other candidate, at ``dL = −strict(dVβ Uᵀ + dX Wᵀ)``, holds ``x = dP⊙P``, ``dP`` and ``dL`` — one buffer,
    accumulated in place: ``7 C²`` too — with ``dkd, dk, dqd, dq, dW`` and ``dvb, dx`` (6 Ca + Cp):
    ``7 C² + C(12a + 7p)``, never larger.) The contiguous fp32 copies ``qf, kf, v`` (``C(2a + p)``) and of ``g, β``
    (2 C) are alive too, whatever the input dtype (the inputs are strided views of the projections; one copy serves
    every product), and a contiguous copy of ``d_o`` (Cp), which arrives as a strided view of the layer's
    ``[b, s, h, p]`` gradient. Packed rows (document masks) add the masked ``W`` (Ca), left out. Not the fla kernel,
    whose backward is not modelled here.

    With ``r = H / Hk > 1`` value heads per key head, ``qf, kf`` are per key head (``2Ca / r``) and the peak moves to
    the ``dβ`` line, a little below the ``r = 1`` shape used here (measured: within 3 %, over).
    """
    H, a, p = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = H // cfg.linear_num_key_heads
    C = chunk
    pe = p + (a if cp > 1 else 0)
    N = rows * H * math.ceil(seq / C)
    per_chunk = 7 * C * C + C * (15 * a + 8 * pe) + 2 * a * pe + 4 * C
    per_chunk += C * (2 * a / r + pe) + 2 * C  # contiguous fp32 copies: q, k per key head; v, g, β (any dtype)
    per_chunk += C * pe  # the contiguous copy of d_o (it arrives as a strided view of the [b s h p] gradient)
    return float((N * per_chunk + rows * H * (a * pe + C * pe)) * 4)


def _gdn_saved(cfg: ModelConfig, w: Workload) -> MixerSaved:
    """A Gated DeltaNet mixer. ``gdn_kernel=False``: the chunked torch reference with its own backward (inputs q, k
    per key head, v, g, beta in the activation dtype and one fp32 state per chunk; backward recomputes the in-chunk
    factors); ``gdn_kernel=True``: fla's chunk kernel, which saves its inputs (q, k, v, g, beta), the per-chunk ``A``
    matrix and the output."""
    H, a, p, K = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                  cfg.linear_conv_kernel_dim)
    Hk = cfg.linear_num_key_heads
    conv = cfg.linear_conv_dim
    rows, seq, act, cp, C = w.rows, w.seq, w.act_bytes, w.cp, w.gdn_chunk
    n = w.tokens
    S = rows * math.ceil(seq / C) * C  # padded tokens
    j = math.ceil(seq / C)
    pe = p + (a if cp > 1 else 0)
    # projections, conv, gates, gated norm, output projection input (activation dtype); the conv saves its input
    # (the projection's output) and the K - 1 halo rows, not a padded copy
    pre = (n * conv + rows * (K - 1) * conv * (cp > 1) + n * conv + 3 * n * H + n * H) * act  # saved before the core
    # gated norm (its own backward: saves its inputs o and z and the rsqrt) and the output projection's input
    rest = pre + (2 * n * H * p + n * H * p) * act + n * H * 4
    if w.gdn_kernel:
        core = n * H * (2 * a + pe + 2) * act + n * H * C * 4 + n * H * pe * act
        widest = n * H * C * 4
        return MixerSaved(core=core, rest=rest, widest=widest, kept=n * cfg.linear_value_dim * act)
    # q38's chunked rule with its own backward (gdn.py): saves its inputs and one fp32 state per chunk
    f32 = 4
    # q, k per key head (the core expands them inside), v, g, β per value head
    core = n * (2 * Hk * a + H * (pe + 2)) * act + rows * H * j * a * pe * f32
    widest = S * H * C * f32
    # at the core's backward the MoE, output projection and gated norm have run their backward: alive are the core's
    # saved inputs and states, what was saved before it (conv, gates), the input norm's input, output and rsqrt, the
    # gradient of the norm's gate z, and the core backward's own working set
    mixer_backward = (core + pre + (2 * n * cfg.hidden_size + n * cfg.linear_value_dim) * act + n * 4
                      + gdn_backward_working(cfg, rows, seq, act, cp, C))
    return MixerSaved(core=core, rest=rest, widest=widest, kept=core, mixer_backward=mixer_backward)


def _gdn_cp(cfg: ModelConfig, w: Workload) -> CPExchange:
    a, p, H = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    st = w.rows * H * a * (p + a) * 4 * (w.cp - 1)  # each rank's fp32 chunk-boundary state and state response
    return CPExchange(collective="all-gather GDN states", bytes=st, calls=3, recompute_calls=3)


def _grouped_qkvz(q_qkv: str, q_z: str, h: str, cfg: ModelConfig) -> Rule:
    """Flat ``w_qkv`` (rows [q all | k all | v all]) + ``w_z`` ↔ Qwen3-Next ``in_proj_qkvz``, whose rows are blocks
    per key head ``g``: ``[q_g (dk) | k_g (dk) | v_{g·r..g·r+r-1} (r·dv) | z_{same} (r·dv)]``."""
    nk, dk, d = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.hidden_size
    rdv = cfg.linear_value_groups * cfg.linear_value_head_dim
    kd, vd = cfg.linear_key_dim, cfg.linear_value_dim

    def to_hf(w_qkv, w_z):
        q, k, v = torch.split(w_qkv, [kd, kd, vd], dim=0)
        blocks = [q.reshape(nk, dk, d), k.reshape(nk, dk, d), v.reshape(nk, rdv, d), w_z.reshape(nk, rdv, d)]
        return (torch.cat(blocks, dim=1).reshape(2 * kd + 2 * vd, d),)

    hf_rows = torch.arange(2 * kd + 2 * vd).reshape(nk, 2 * dk + 2 * rdv, 1)
    q, k, v, z = (t.reshape(-1) for t in torch.split(hf_rows, [dk, dk, rdv, rdv], dim=1))
    return Rule((q_qkv, q_z), (h,), ((2 * kd + 2 * vd, d),), to_hf, grouped_block((torch.cat([q, k, v]), z)))


def _grouped_ba(q_b: str, q_a: str, h: str, cfg: ModelConfig) -> Rule:
    """``w_b`` / ``w_a`` ``[nv, d]`` ↔ Qwen3-Next ``in_proj_ba``: per key head ``[b (r) | a (r)]``."""
    nk, nv, r, d = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_groups, cfg.hidden_size

    def to_hf(w_b, w_a):
        return (torch.cat([w_b.reshape(nk, r, d), w_a.reshape(nk, r, d)], dim=1).reshape(2 * nv, d),)

    b, a = (t.reshape(-1) for t in torch.split(torch.arange(2 * nv).reshape(nk, 2 * r), [r, r], dim=1))
    return Rule((q_b, q_a), (h,), ((2 * nv, d),), to_hf, grouped_block((b, a)))


def _gdn_hf(cfg: ModelConfig, layout: CheckpointLayout, qp: str, hp: str, shapes: dict) -> list[Rule]:
    if layout.gdn_grouped:
        la = hp + "linear_attn."
        rules = [_grouped_qkvz(qp + "w_qkv", qp + "w_z", la + "in_proj_qkvz.weight", cfg),
                 _grouped_ba(qp + "w_b", qp + "w_a", la + "in_proj_ba.weight", cfg)]
    else:
        rules = renames(GDN_FLAT_RENAMES, qp, hp, shapes)
    rules.append(conv_rule(qp + GDN_CONV[0], hp + GDN_CONV[1], shapes[qp + GDN_CONV[0]]))
    return rules + renames(GDN_RENAMES, qp, hp, shapes)


# ---- the table --------------------------------------------------------------------------------------------------

_KINDS = (
    MixerKind(name="full_attention", params=AttnParams, abstract=abstract_attention, apply=attention_apply,
              region="attention", keep_flag="skip_flash_attn_recompute", flops=_attention_flops,
              saved=_attention_saved, cp_exchange=_attention_cp, hf_rules=_attention_hf),
    MixerKind(name="linear_attention", params=GDNParams, abstract=abstract_gdn, apply=gdn_apply,
              region="gdn", keep_flag="skip_gdn_recompute", flops=_gdn_flops,
              saved=_gdn_saved, cp_exchange=_gdn_cp, hf_rules=_gdn_hf),
)
MIXER_KINDS: dict[str, MixerKind] = {k.name: k for k in _KINDS}  # its keys are the accepted ``layer_types``
if tuple(sorted(MIXER_KINDS)) != tuple(sorted(LAYER_TYPES)):
    raise ImportError(f"q38.layers.kinds has records for {sorted(MIXER_KINDS)} but q38.model_config.LAYER_TYPES names "
                      f"{sorted(LAYER_TYPES)}; add the new kind's name to LAYER_TYPES (docs/extending.md)")
MTP_LAYER_TYPE = "full_attention"  # the mixer of every MTP depth

# Selective recompute keeps the outputs of the named kernel regions (``selective_<region>``; ``selective_both``:
# every region); ``full`` recomputes every layer whole.
RECOMPUTE_MODES = ("none", "full", *(f"selective_{k.region}" for k in _KINDS), "selective_both")


def kind_of(mixer_params: Any) -> MixerKind:
    """The kind whose params class ``mixer_params`` is."""
    for k in MIXER_KINDS.values():
        if type(mixer_params) is k.params:
            return k
    raise TypeError(f"{type(mixer_params).__name__} is the params class of no mixer kind ({', '.join(MIXER_KINDS)})")


def layer_kinds(cfg: ModelConfig) -> list[MixerKind]:
    """The mixer kind of every decoder layer of one forward: the main layers, then the MTP depths."""
    return [MIXER_KINDS[t] for t in cfg.layer_types] + [MIXER_KINDS[MTP_LAYER_TYPE]] * cfg.mtp_num_layers


def kept_regions(recompute: str) -> frozenset[str]:
    """The kernel regions whose outputs recompute mode ``recompute`` keeps (one of ``RECOMPUTE_MODES``)."""
    if recompute == "selective_both":
        return frozenset(k.region for k in MIXER_KINDS.values())
    return frozenset({recompute.removeprefix("selective_")} if recompute.startswith("selective_") else ())
