"""The training objective, defined once: named terms with weights (``objective = Σ weight · term``, :func:`total`),
their inputs (shifted targets, global normalisers, router statistics) and the load-balancing aux loss in its three
forms (``pooled``, ``per_layer``, ``sequence``).

A term returns this rank's and this micro-batch's partial; the term is the sum of the partials, so values and
gradients are only ever summed, and a new term is one function plus one weight. The default terms, the aux-loss
formulas, their parity with transformers, Megatron and DeepSeek-V3, counted tokens and scope: docs/objective.md.
"""

from typing import Callable

import attrs
import torch
from jaxtyping import Float
from torch import Tensor
from torch.profiler import record_function

from q38.kernels import DEFAULT_KERNELS, KernelConfig
from q38.layers.moe import replayed, select_experts
from q38.batch import IGNORE_INDEX, StepBatch, count_targets
from q38.train.core.loss import chunked_lm_loss, unchunked_lm_loss



def lm_loss(hidden: Tensor, w_head: Tensor, targets: Tensor, normalizer: Tensor, tc,
            kernels: KernelConfig = DEFAULT_KERNELS) -> Tensor:
    """Sum of CE over valid targets / ``normalizer``; rows with ignored targets never reach the head. A term with no
    valid targets in the whole step contributes 0 (the normalizer is clamped to >= 1), never NaN. ``kernels``: the
    step's resolved kernels (``kernels.loss`` for the chunked loss)."""
    with record_function("q38.loss"):
        return _lm_loss(hidden, w_head, targets, normalizer, tc, kernels)


def _lm_loss(hidden: Tensor, w_head: Tensor, targets: Tensor, normalizer: Tensor, tc, kernels: KernelConfig) -> Tensor:
    normalizer = normalizer.clamp(min=1) if isinstance(normalizer, Tensor) else max(normalizer, 1)
    d = hidden.shape[-1]
    h_nd, t_n = hidden.reshape(-1, d), targets.reshape(-1)
    valid = torch.nonzero(t_n != IGNORE_INDEX).flatten()
    h_nd, t_n = h_nd.index_select(0, valid), t_n.index_select(0, valid)
    if tc.loss_chunk_size is None and not tc.dynamic_chunk_loss:
        return unchunked_lm_loss(h_nd, w_head, t_n, normalizer=normalizer)
    if tc.dynamic_chunk_loss:
        return chunked_lm_loss(h_nd, w_head, t_n, normalizer=normalizer, chunk_budget_bytes=tc.loss_chunk_budget_bytes,
                               kernels=kernels)
    return chunked_lm_loss(h_nd, w_head, t_n, normalizer=normalizer, chunk_size=tc.loss_chunk_size, kernels=kernels)


# ---- router statistics ---------------------------------------------------------------------------------------------


def routing(router_logits: tuple[Tensor, ...], top_k: int, router_bias: Tensor | None = None,
            routes: Tensor | None = None):
    """Per MoE layer ``(probs [n, e] fp32, chosen experts [n, k])`` exactly as the layers routed (same functions):
    ``routes`` ``[b, s, main layers, k]``: the main layers' replayed experts (routing replay; -1: own top-k)."""
    out = []
    for i, rl in enumerate(router_logits):
        probs, idx = select_experts(rl, top_k, None if router_bias is None else router_bias[i])
        if routes is not None and i < routes.shape[2]:
            idx = replayed(idx, routes[:, :, i].reshape(-1, routes.shape[-1]))
        out.append((probs, idx))
    return out


def expert_counts(routes, mask: Tensor) -> Float[Tensor, "l e"]:
    """``c_le``: counted tokens (``mask``) whose top-k holds expert ``e``, per layer (no gradient)."""
    m = mask.reshape(-1).float()
    e = routes[0][0].shape[-1]
    out = []
    for _, idx_nk in routes:
        k = idx_nk.shape[-1]
        out.append(torch.zeros(e, device=m.device).scatter_add(0, idx_nk.reshape(-1), m.repeat_interleave(k)))
    return torch.stack(out)


def prob_sums(routes, mask: Tensor) -> Float[Tensor, "l e"]:
    """``p_le``: sum over counted tokens of the router probability of each expert, per layer (differentiable)."""
    m = mask.reshape(-1).float()
    return torch.stack([(probs * m[:, None]).sum(0) for probs, _ in routes])


def aux_from_stats(kind: str, counts: Tensor, probs: Tensor, n_tokens: Tensor) -> Float[Tensor, ""]:
    """``pooled`` or ``per_layer`` aux from ``c`` ``[l, e]`` (global), ``p`` ``[l, e]`` (this rank's share: the sum over
    ranks of the result is the loss) and the global counted-token count ``N``."""
    num_layers, e = counts.shape
    n = n_tokens.clamp(min=1)
    if kind == "pooled":
        rows = n * num_layers
        return e * torch.sum((counts.sum(0) / rows) * (probs.sum(0) / rows))
    if kind == "per_layer":
        return e * torch.sum((counts / n) * (probs / n)) / num_layers
    raise ValueError(f"aux_from_stats handles pooled and per_layer, not {kind!r}")


def load_balancing_loss(router_logits: tuple[Tensor, ...], num_experts: int, top_k: int, mask: Tensor | None = None,
                        kind: str = "pooled", segments: Tensor | None = None) -> Float[Tensor, ""]:
    """Single-device aux loss (the reference formulas), for evaluation and parity checks. ``mask``: counted tokens
    ``[n]``; ``segments``: sequence id ``[n]`` (0, 1, ...) for ``kind="sequence"``."""
    n = router_logits[0].shape[0]
    mask = torch.ones(n, device=router_logits[0].device) if mask is None else mask.reshape(-1)
    routes = routing(router_logits, top_k)
    if kind == "sequence":
        if segments is None:
            raise ValueError("load_balancing_loss(kind='sequence') needs segments= (a sequence id per token)")
        seg = segments.reshape(-1)
        num_seg = int(seg.max()) + 1
        seg_tokens = torch.zeros(num_seg, device=mask.device).index_add(0, seg, mask.float())
        n_seq = (seg_tokens > 0).sum()
        return sequence_aux(routes, mask, seg, num_seg, seg_tokens, n_seq, lambda t: t)
    return aux_from_stats(kind, expert_counts(routes, mask), prob_sums(routes, mask), mask.float().sum())


def _segment_index(mb: StepBatch, num_segments: int) -> Tensor:
    """Flat ``row · D + segment`` index of every token (the key of its sequence in ``[b, D]`` tables)."""
    b = mb.segments.shape[0]
    rows = torch.arange(b, device=mb.segments.device)[:, None]
    return (rows * num_segments + mb.segments).reshape(-1)


def sequence_aux(routes, mask: Tensor, seg: Tensor, num_seg: int, seg_tokens: Tensor, n_seq: Tensor,
                 seq_sum: Callable[[Tensor], Tensor]) -> Float[Tensor, ""]:
    """This rank's share of the ``sequence`` aux: ``E · Σ_l Σ_s Σ_e (c_lse/T_s)(p_lse/T_s) / (L · S)``.

    ``seg``: flat sequence index per token (``[b · D]`` table); ``seg_tokens``: ``T_s`` (summed over CP); ``n_seq``:
    ``S``; ``seq_sum``: sum over the ranks that hold parts of the same sequences (CP)."""
    m = mask.reshape(-1).float()
    e = routes[0][0].shape[-1]
    counts, probs = [], []
    for p_ne, idx_nk in routes:
        k = idx_nk.shape[-1]
        slot = (seg[:, None] * e + idx_nk).reshape(-1)
        counts.append(torch.zeros(num_seg * e, device=m.device).scatter_add(0, slot, m.repeat_interleave(k)))
        probs.append(torch.zeros(num_seg, e, device=m.device, dtype=p_ne.dtype).index_add(0, seg, p_ne * m[:, None]))
    c_lse = seq_sum(torch.stack(counts)).view(len(routes), num_seg, e)
    p_lse = torch.stack(probs)
    t = seg_tokens.clamp(min=1)[None, :, None]
    return e * torch.sum((c_lse / t) * (p_lse / t)) / (len(routes) * n_seq.clamp(min=1))


# ---- the step's context and the terms ---------------------------------------------------------------------------


@attrs.frozen
class StepContext:
    """What terms need beyond one micro-batch, fixed before the first forward: global normalisers (valid main / MTP
    targets, counted aux tokens), step-wide aux counts (``global_batch``) and the sequence tables (``sequence``)."""

    n_main: Tensor
    n_mtp: tuple
    n_aux: Tensor  # counted aux tokens in the whole step
    n_mb: int
    aux_counts: Tensor | None = None  # [l, e] step counts when the scope is the whole step
    aux_mb: tuple = ()  # micro_batch scope: per micro-batch (global counted tokens,)
    seq: tuple = ()  # sequence aux: per micro-batch (D, T [b·D], S)
    n_seq: Tensor | None = None  # policy-gradient batches: sequences with a valid target in the whole step


@attrs.frozen
class TermInput:
    """One micro-batch's forward and everything a term may read."""

    out: object  # q38.model.ModelOutput
    mb: StepBatch
    index: int  # micro-batch index
    routes: list  # routing(out.router_logits, ...)
    w_head: Tensor
    step: StepContext
    runtime: object  # the runtime (all_reduce_sum, seq_all_reduce_sum, ...)
    model_config: object
    train_config: object
    kernels: KernelConfig = DEFAULT_KERNELS  # the step's resolved kernels


REDUCTIONS = ("sum", "max")


@attrs.frozen
class Term:
    """A named term: ``fn(TermInput)`` returns this rank's and micro-batch's partial; ``weight`` multiplies it.

    ``reduce``: how the partials combine over micro-batches and ranks: ``sum`` (every objective term), or ``max``
    for a reported metric (weight 0) such as the largest per-token value of the step (``fn`` returns the
    micro-batch's max on this rank, 0 when it has no token: the metric must be >= 0)."""

    name: str
    weight: float
    fn: Callable[[TermInput], Tensor]
    reduce: str = "sum"

    def __attrs_post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"term {self.name!r}: reduce must be one of {REDUCTIONS}, got {self.reduce!r}")
        if self.reduce == "max" and self.weight:
            raise ValueError(f"term {self.name!r} reduces by max, so it can only be reported (weight 0), not "
                             f"weighted ({self.weight}): the objective's gradient is a sum over ranks")


def aux_mask(mb: StepBatch, tc) -> Tensor:
    return mb.real_mask if tc.aux_loss_tokens == "real" else mb.label_mask


def main_term(ti: TermInput) -> Tensor:
    return lm_loss(ti.out.hidden, ti.w_head, ti.mb.targets, ti.step.n_main, ti.train_config, ti.kernels)


def mtp_term(depth: int) -> Callable[[TermInput], Tensor]:
    def fn(ti: TermInput) -> Tensor:
        d = depth - 1
        return lm_loss(ti.out.mtp_hidden[d], ti.w_head, ti.mb.mtp_targets[d], ti.step.n_mtp[d], ti.train_config,
                       ti.kernels)

    return fn


def aux_term(ti: TermInput) -> Tensor:
    tc, st = ti.train_config, ti.step
    mask = aux_mask(ti.mb, tc)
    if tc.aux_loss_type == "sequence":
        d, seg_tokens, n_seq = st.seq[ti.index]
        seg = _segment_index(ti.mb, d)
        part = sequence_aux(ti.routes, mask, seg, seg_tokens.numel(), seg_tokens, n_seq, ti.runtime.seq_all_reduce_sum)
    else:
        probs = prob_sums(ti.routes, mask)
        if st.aux_counts is not None:
            counts, n = st.aux_counts, st.n_aux
        else:
            counts, n = ti.runtime.all_reduce_sum(expert_counts(ti.routes, mask)), st.aux_mb[ti.index]
        part = aux_from_stats(tc.aux_loss_type, counts, probs, n)
    if tc.aux_loss_scope == "micro_batch":
        part = part / st.n_mb
    return part


def aux_coef(mc, tc) -> float:
    return mc.router_aux_loss_coef if tc.aux_loss_coef is None else tc.aux_loss_coef


def default_terms(mc, tc) -> tuple[Term, ...]:
    """``loss`` (main LM), ``mtp_1..mtp_D`` and ``aux``, with their weights."""
    depths = mc.mtp_num_layers
    mtp = tuple(Term(f"mtp_{d}", tc.mtp_loss_scaling_factor / depths, mtp_term(d)) for d in range(1, depths + 1))
    return (Term("loss", 1.0, main_term), *mtp, Term("aux", aux_coef(mc, tc), aux_term))


def total(values: dict, terms) -> Tensor:
    """``Σ weight · value`` over the terms (zero-weight terms are reported but never enter the objective)."""
    out = None
    for t in terms:
        if t.weight:
            v = t.weight * values[t.name]
            out = v if out is None else out + v
    return out if out is not None else 0 * next(iter(values.values()))


def step_context(mbs: list[StepBatch], runtime, mc, tc,
                 count_routing: Callable[[StepBatch], Tensor] | None) -> StepContext:
    """Normalisers and aux tables for the step (a few batched collectives). ``count_routing(mb)`` returns the
    micro-batch's aux expert counts ``[l, e]`` from a no-grad forward; it is called only for ``pooled`` /
    ``per_layer`` with ``global_batch`` scope and more than one micro-batch."""
    depths = mc.mtp_num_layers
    n_mb = len(mbs)
    dev = mbs[0].input_ids.device
    pg = mbs[0].extra is not None  # a policy-gradient batch: also count its sequences (Σ seq_weight)
    per_mb = [torch.stack([count_targets(mb.targets), *(count_targets(t) for t in mb.mtp_targets),
                           aux_mask(mb, tc).sum()]) for mb in mbs]
    if pg:  # float64 holds the counts exactly
        per_mb = [torch.cat([c.double(), mb.extra["seq_weight"].double().sum()[None]]) for c, mb in zip(per_mb, mbs)]
    counts = runtime.all_reduce_sum(torch.stack(per_mb))  # [n_mb, 2 + depths (+1)]: one collective
    step_counts = counts.sum(0)
    n_main, n_mtp, n_aux = step_counts[0], tuple(step_counts[1 : 1 + depths]), step_counts[1 + depths]
    aux_mb = tuple(counts[:, 1 + depths])
    aux_counts, seq = None, ()
    if tc.aux_loss_type == "sequence":
        seq = _sequence_tables(mbs, runtime, tc, dev)
    elif tc.aux_loss_scope == "global_batch":
        if n_mb > 1:
            with torch.no_grad():
                aux_counts = runtime.all_reduce_sum(sum(count_routing(mb) for mb in mbs))
        # one micro-batch: its own counts are the step's (computed in the aux term, no extra forward)
    n_seq = step_counts[2 + depths].round() if pg else None
    return StepContext(n_main=n_main, n_mtp=n_mtp, n_aux=n_aux, n_mb=n_mb, aux_counts=aux_counts, aux_mb=aux_mb,
                       seq=seq, n_seq=n_seq)


def _sequence_tables(mbs: list[StepBatch], runtime, tc, dev) -> tuple:
    """Per micro-batch ``(D, T_s [b·D], S)``: the sequence table width (identical on the CP ranks of a row), each
    sequence's counted tokens summed over CP, and the number of sequences with a counted token (``global_batch``:
    the whole step's, the same for every micro-batch)."""
    widths = torch.stack([mb.segments.max() + 1 if mb.segments.numel() else torch.zeros((), dtype=torch.long,
                                                                                        device=dev) for mb in mbs])
    widths = runtime.seq_all_reduce_sum(widths)  # ≥ every CP rank's own count: an upper bound they all agree on
    tokens = []
    for mb, d in zip(mbs, widths.tolist()):
        seg = _segment_index(mb, int(d))
        tokens.append(torch.zeros(mb.segments.shape[0] * int(d), device=dev).index_add(
            0, seg, aux_mask(mb, tc).reshape(-1).float()))
    sizes = [t.numel() for t in tokens]
    tokens = runtime.seq_all_reduce_sum(torch.cat(tokens)).split(sizes)
    # Σ over counted tokens of 1 / T_(its sequence) counts each sequence once, however CP splits it.
    per_mb = []
    for mb, d, t in zip(mbs, widths.tolist(), tokens):
        m = aux_mask(mb, tc).reshape(-1).float()
        per_mb.append((m / t.clamp(min=1)[_segment_index(mb, int(d))]).sum())
    n_seq = runtime.all_reduce_sum(torch.stack(per_mb)).round()
    if tc.aux_loss_scope == "global_batch":
        n_seq = n_seq.sum().expand(len(mbs))
    return tuple((int(d), t, s) for d, t, s in zip(widths.tolist(), tokens, n_seq))
