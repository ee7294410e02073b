"""The layer-kind table: one ``MixerKind`` record per ``layer_types`` entry, holding everything that differs between
kinds of token mixer (params, math, recompute region, cost formulas, checkpoint keys). Every reader goes through it,
so a new kind is one record here plus its layer file (docs/extending.md#add-a-layer-kind).

Dims: ``n`` local tokens (rows · seq), ``h``/``g`` query/kv heads, ``c`` head dim.
"""

import itertools
from typing import Any, Callable, Iterable, Mapping

import attrs
import torch

from q38.errors import ConfigError
from q38.layers.attention import AttnParams, abstract_attention, attention_apply
from q38.layers.cost import CPExchange, MixerFlops, MixerSaved, Workload  # noqa: F401 (the formulas' records)
from q38.layers.gdn import GDNParams, abstract_gdn, gdn_apply
from q38.layers.gdn_cost import gdn_cp_exchange, gdn_flops, gdn_saved
from q38.layers.hf_keys import CheckpointLayout, Rule, conv_rule, grouped_block, renames
from q38.model_config import ModelConfig, register_layer_kinds

# ---- the record -------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class MixerKind:
    """One kind of token mixer (``name``: its ``layer_types`` entry, as in the HF config).

    ``params``: its attrs params class (kinds may share one: the layer's kind comes from ``layer_types``, not from
    its params); ``abstract(cfg)``: its ``ParamInfo`` tree; ``apply(p, x, cfg, info)``: the layer math; ``region``:
    the name of the region its apply marks with ``info.region`` around its hot kernel (kinds running the same kernel
    share it); ``keep_flag``: the ``TrainConfig`` bool that makes selective recompute keep that region's outputs
    (one flag per region); ``flops`` / ``saved`` / ``cp_exchange``: its cost formulas at a ``Workload``;
    ``hf_rules(cfg, layout, qp, hp, shapes)``: its checkpoint ``Rule`` s, q38 paths under ``qp`` (``….mixer.``),
    HF keys under the HF layer prefix ``hp``.
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
              region="gdn", keep_flag="skip_gdn_recompute", flops=gdn_flops,
              saved=gdn_saved, cp_exchange=gdn_cp_exchange, hf_rules=_gdn_hf),
)
MTP_LAYER_TYPE = "full_attention"  # the mixer of every MTP depth


class KindTable(dict):
    """``name -> MixerKind``; its keys are the accepted ``layer_types`` entries (``ModelConfig`` checks them against
    this table, which registers itself with ``q38.model_config``). Looking up another name raises a ``ConfigError``."""

    def __missing__(self, name: str) -> MixerKind:
        raise ConfigError(f"layer_types entry {name!r} is not a layer kind; known kinds: {', '.join(self)} "
                          "(a new kind is a record in q38/layers/kinds.py: docs/extending.md#add-a-layer-kind)")


def check_kinds(kinds: Iterable[MixerKind]) -> None:
    """The table's rules: names are unique, and kinds that share a region share its keep flag."""
    kinds = list(kinds)
    names = [k.name for k in kinds]
    if len(set(names)) != len(names):
        raise ValueError(f"layer kinds named twice: {sorted({n for n in names if names.count(n) > 1})}")
    flag: dict[str, str] = {}
    for k in kinds:
        if flag.setdefault(k.region, k.keep_flag) != k.keep_flag:
            raise ValueError(f"kind {k.name}: region {k.region!r} is kept by {flag[k.region]!r} already, not "
                             f"{k.keep_flag!r}; one keep flag per region")


check_kinds(_KINDS)
MIXER_KINDS: KindTable = KindTable((k.name, k) for k in _KINDS)
register_layer_kinds(MIXER_KINDS)


def kind_of(mixer_params: Any) -> MixerKind:
    """The kind whose params class ``mixer_params`` is, when exactly one kind has that class (else a ``TypeError``:
    ask the config, ``layer_kinds``, which always knows)."""
    found = [k for k in MIXER_KINDS.values() if type(mixer_params) is k.params]
    if len(found) != 1:
        whose = f"of {', '.join(k.name for k in found)}" if found else f"of no layer kind ({', '.join(MIXER_KINDS)})"
        raise TypeError(f"{type(mixer_params).__name__} is the params class {whose}: the layer's kind is its "
                        "layer_types entry (layer_kinds(cfg))")
    return found[0]


def layer_kinds(cfg: ModelConfig) -> list[MixerKind]:
    """The mixer kind of every decoder layer of one forward: the main layers, then the MTP depths."""
    return [MIXER_KINDS[t] for t in cfg.layer_types] + [MIXER_KINDS[MTP_LAYER_TYPE]] * cfg.mtp_num_layers


def count_by_kind(cfg: ModelConfig) -> dict[str, int]:
    """How many main decoder layers (not MTP depths) are of each kind of the table (0 for a kind not used)."""
    counts = {name: 0 for name in MIXER_KINDS}
    for k in layer_kinds(cfg)[: cfg.num_hidden_layers]:
        counts[k.name] += 1
    return counts


# ---- recompute regions ------------------------------------------------------------------------------------------
# Selective recompute keeps the outputs of the named kernel regions: mode ``selective_<r1>+<r2>...`` (regions in
# table order) keeps those; ``full`` recomputes every layer whole; ``none`` saves everything.


def regions() -> tuple[str, ...]:
    """The kernel regions of the table, each once, in table order."""
    return tuple(dict.fromkeys(k.region for k in MIXER_KINDS.values()))


def selective_mode(kept: Iterable[str]) -> str:
    """The recompute mode that keeps the regions ``kept`` (``full`` for none of them)."""
    kept = set(kept)
    unknown = kept - set(regions())
    if unknown:
        raise ConfigError(f"no layer kind has the recompute region(s) {sorted(unknown)}; regions: {regions()}")
    return "selective_" + "+".join(r for r in regions() if r in kept) if kept else "full"


def recompute_modes() -> tuple[str, ...]:
    """Every recompute mode: ``none``, ``full``, then each non-empty set of regions kept."""
    sets = (c for n in range(1, len(regions()) + 1) for c in itertools.combinations(regions(), n))
    return ("none", "full", *(selective_mode(s) for s in sets))


RECOMPUTE_MODES = recompute_modes()


def kept_regions(recompute: str) -> frozenset[str]:
    """The kernel regions whose outputs recompute mode ``recompute`` keeps (one of ``recompute_modes()``)."""
    if recompute not in recompute_modes():
        raise ConfigError(f"recompute mode must be one of {recompute_modes()}, got {recompute!r}")
    if not recompute.startswith("selective_"):
        return frozenset()
    return frozenset(recompute.removeprefix("selective_").split("+"))


def flagged_regions(train: Mapping[str, Any] | Any) -> frozenset[str]:
    """The regions a run's train settings keep (a ``TrainConfig`` or its mapping): those whose keep flag is on."""
    get = train.get if isinstance(train, Mapping) else lambda flag: getattr(train, flag)
    return frozenset(k.region for k in MIXER_KINDS.values() if get(k.keep_flag))


def keep_flags(recompute: str) -> dict[str, bool]:
    """The train settings' keep flags for recompute mode ``recompute`` (every flag of the table, on or off)."""
    kept = kept_regions(recompute)
    return {k.keep_flag: k.region in kept for k in MIXER_KINDS.values()}
