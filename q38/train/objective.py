"""Targets and loss terms of the training objective: shifted targets (main and MTP), the global normaliser, and the
load-balancing aux loss split into its non-differentiable counts and differentiable probability sums.

Aggregation rule (DESIGN.md decision 5): every term is a sum over this rank's tokens divided by a global count, so
summing gradients over ranks and micro-batches gives the single-device gradient.
"""

import attrs
import torch
from jaxtyping import Float, Int
from torch import Tensor

from q38.layers.rope import positions_from_docs
from q38.model import shift_tokens
from q38.pytree import pytree_node

IGNORE = -100


@pytree_node
@attrs.frozen
class StepBatch:
    """What ``train_step`` consumes on one rank (shifts done on the un-split rows, so they cross CP borders).

    ``targets[t]`` = token ``t + 1`` of the same document or -100; ``mtp_targets[d-1][t]`` = token ``t + 1 + d``;
    ``mtp_inputs[d-1][t]`` = token ``t + d`` (0 across a document end); ``aux_mask`` = positions counted by the
    aux loss (label not ignored); ``seq_idx`` = index in the un-split row.
    """

    input_ids: Tensor
    targets: Tensor
    doc_ids: Tensor
    seq_idx: Tensor
    positions: Tensor
    aux_mask: Tensor
    mtp_inputs: tuple
    mtp_targets: tuple


def prepare_batch(
    input_ids: Int[Tensor, "b s"],
    labels: Int[Tensor, "b s"],
    doc_ids: Int[Tensor, "b s"] | None,
    mtp_depths: int,
) -> StepBatch:
    """Shift labels and MTP inputs per document on whole rows (labels are HF-style: ``labels[t]`` is token ``t``)."""
    b, s = input_ids.shape
    packed_docs = doc_ids
    if doc_ids is None:
        doc_ids = torch.zeros_like(input_ids)
    return StepBatch(
        input_ids=input_ids,
        targets=shift_tokens(labels, packed_docs, 1, IGNORE),
        doc_ids=doc_ids,
        seq_idx=torch.arange(s, device=input_ids.device).expand(b, s).contiguous(),
        positions=positions_from_docs(doc_ids),
        aux_mask=(labels != IGNORE),
        mtp_inputs=tuple(shift_tokens(input_ids, packed_docs, d, 0) for d in range(1, mtp_depths + 1)),
        mtp_targets=tuple(shift_tokens(labels, packed_docs, 1 + d, IGNORE) for d in range(1, mtp_depths + 1)),
    )


def split_micro_batches(batch: StepBatch, n: int) -> list[StepBatch]:
    """Split along the batch dim into ``n`` equal micro-batches."""
    b = batch.input_ids.shape[0]
    if b % n:
        raise ValueError(f"the rank-local batch size {b} is not divisible by micro_batches={n}; change either")
    size = b // n

    def part(i):
        sl = slice(i * size, (i + 1) * size)
        return StepBatch(
            input_ids=batch.input_ids[sl], targets=batch.targets[sl], doc_ids=batch.doc_ids[sl],
            seq_idx=batch.seq_idx[sl], positions=batch.positions[sl], aux_mask=batch.aux_mask[sl],
            mtp_inputs=tuple(t[sl] for t in batch.mtp_inputs), mtp_targets=tuple(t[sl] for t in batch.mtp_targets),
        )

    return [part(i) for i in range(n)]


@attrs.frozen
class AuxStats:
    """Pooled router statistics over all MoE layers: ``counts`` (top-k assignments per expert, no gradient),
    ``prob_sum`` (sum of router probabilities per expert, differentiable) and ``rows`` (tokens × layers)."""

    counts: Tensor
    prob_sum: Tensor
    rows: Tensor


def aux_stats(router_logits: tuple[Tensor, ...], mask: Tensor, top_k: int) -> AuxStats:
    """Statistics of HF's ``load_balancing_loss_func`` (one softmax), masked by ``mask`` (flattened tokens)."""
    flat_mask = mask.reshape(-1).float()
    e = router_logits[0].shape[-1]
    counts = torch.zeros(e, device=flat_mask.device)
    prob_sum = torch.zeros(e, device=flat_mask.device)
    for logits_ne in router_logits:
        probs = torch.softmax(logits_ne.float(), dim=-1)
        idx_nk = torch.topk(probs.detach(), top_k, dim=-1).indices
        counts = counts.scatter_add(0, idx_nk.reshape(-1), flat_mask.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * flat_mask[:, None]).sum(0)
    rows = flat_mask.sum() * len(router_logits)
    return AuxStats(counts=counts, prob_sum=prob_sum, rows=rows)


def aux_loss_partial(stats: AuxStats, global_counts: Tensor, global_rows: Tensor) -> Float[Tensor, ""]:
    """``E · Σ_e f_e · P_e`` with ``f`` from global counts and this rank's share of ``P`` (sum over ranks = total)."""
    e = stats.counts.shape[0]
    rows = global_rows.clamp(min=1)
    return e * torch.sum((global_counts / rows) * (stats.prob_sum / rows))


def load_balancing_loss(router_logits: tuple[Tensor, ...], num_experts: int, top_k: int, mask: Tensor | None = None):
    """Single-device aux loss (the reference formula), for evaluation and parity checks."""
    n = router_logits[0].shape[0]
    mask = torch.ones(n, device=router_logits[0].device) if mask is None else mask
    st = aux_stats(router_logits, mask, top_k)
    return aux_loss_partial(st, st.counts, st.rows)


def count_targets(targets: Tensor) -> Tensor:
    return (targets != IGNORE).sum()
