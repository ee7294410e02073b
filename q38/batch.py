"""What a step consumes, shared by ``q38.train`` and ``q38.parallel``: the label conventions and ``StepBatch``.

``IGNORE_INDEX`` (-100, as Hugging Face) marks a label that is not a target; ``PAD_DOC_ID`` (-1) marks padding in
``doc_ids``. ``prepare_batch`` shifts labels and MTP inputs per document on whole rows, before any context-parallel
split, so shifts cross CP borders; ``q38.parallel.shard_batch`` then takes each rank's part of every leaf.
"""

import attrs
import torch
import torch.utils._pytree as pytree
from jaxtyping import Int
from torch import Tensor

from q38.layers.rope import positions_from_docs
from q38.model import shift_tokens
from q38.pytree import pytree_node

IGNORE_INDEX = -100
PAD_DOC_ID = -1
# Per-token values a policy-gradient batch may carry beside its labels (docs/rl.md#the-batch): HF-aligned like
# ``labels`` (index ``t`` describes token ``t``), float ``[b, s]``. ``prepare_batch`` moves them to target positions.
TOKEN_VALUE_KEYS = ("old_logprobs", "ref_logprobs", "advantages")


@pytree_node
@attrs.frozen
class StepBatch:
    """What ``train_step`` consumes on one rank (shifts done on the un-split rows, so they cross CP borders).

    ``targets[t]`` = token ``t + 1`` of the same document or -100; ``mtp_targets[d-1][t]`` = token ``t + 1 + d``;
    ``mtp_inputs[d-1][t]`` = token ``t + d`` (0 across a document end); ``real_mask`` = non-padding positions;
    ``label_mask`` = positions whose label is not ignored; ``segments`` = index of the document within its row,
    counted from 0 along the whole row (the aux loss's sequences); ``seq_idx`` = index in the un-split row.
    Every leaf is ``[b, s]``, so ``tree_map`` over a StepBatch slices rows or columns.
    """

    input_ids: Tensor
    targets: Tensor
    doc_ids: Tensor
    seq_idx: Tensor
    positions: Tensor
    real_mask: Tensor
    label_mask: Tensor
    segments: Tensor
    mtp_inputs: tuple
    mtp_targets: tuple
    extra: dict | None = None  # per-token values of a policy-gradient batch, at target positions (TOKEN_VALUE_KEYS)
    routes: Tensor | None = None  # [b, s, main layers, k] routing replay: each input token's experts (-1: none)


def prepare_batch(
    input_ids: Int[Tensor, "b s"],
    labels: Int[Tensor, "b s"],
    doc_ids: Int[Tensor, "b s"] | None,
    mtp_depths: int,
    attention_mask: Int[Tensor, "b s"] | None = None,
    token_values: dict | None = None,
    routes: Int[Tensor, "b s l k"] | None = None,
) -> StepBatch:
    """Shift labels and MTP inputs per document on whole rows (labels are HF-style: ``labels[t]`` is token ``t``).

    Real (non-padding) tokens: ``attention_mask != 0`` when given, else ``doc_ids != -1``, else every token.
    ``token_values``: a policy-gradient batch's per-token values (``TOKEN_VALUE_KEYS``, HF-aligned float ``[b, s]``);
    they become ``extra`` at target positions, with ``seq_weight`` (1 / the valid targets of the token's document).
    ``routes``: routing replay's experts of each input token per main layer (not shifted: position ``t`` is token
    ``t``'s routing), carried as they are."""
    if routes is not None and tuple(routes.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(f"routes {tuple(routes.shape)} must start with the batch's shape {tuple(input_ids.shape)}")
    b, s = input_ids.shape
    packed_docs = doc_ids
    if doc_ids is None:
        doc_ids = torch.zeros_like(input_ids)
    if attention_mask is not None:
        real = attention_mask != 0
    else:
        real = doc_ids != PAD_DOC_ID
    change = torch.zeros_like(doc_ids)
    change[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).to(change.dtype)
    targets = shift_tokens(labels, packed_docs, 1, IGNORE_INDEX)
    segments = change.cumsum(1)
    extra = None if not token_values else _target_values(token_values, targets, packed_docs, segments)
    return StepBatch(
        input_ids=input_ids,
        targets=targets,
        doc_ids=doc_ids,
        seq_idx=torch.arange(s, device=input_ids.device).expand(b, s).contiguous(),
        positions=positions_from_docs(doc_ids),
        real_mask=real,
        label_mask=(labels != IGNORE_INDEX),
        segments=segments,
        mtp_inputs=tuple(shift_tokens(input_ids, packed_docs, d, 0) for d in range(1, mtp_depths + 1)),
        mtp_targets=tuple(shift_tokens(labels, packed_docs, 1 + d, IGNORE_INDEX) for d in range(1, mtp_depths + 1)),
        extra=extra,
        routes=routes,
    )


def _shift_values(x: Tensor, doc_ids: Tensor | None) -> Tensor:
    """``out[t] = x[t + 1]`` when that position is in the same document as ``t``, else 0 (float ``[b, s]``)."""
    out = torch.zeros_like(x)
    keep = torch.ones_like(x[:, 1:], dtype=torch.bool) if doc_ids is None else doc_ids[:, 1:] == doc_ids[:, :-1]
    out[:, :-1] = torch.where(keep, x[:, 1:], torch.zeros_like(x[:, 1:]))
    return out


def _target_values(values: dict, targets: Tensor, doc_ids: Tensor | None, segments: Tensor) -> dict:
    """The per-token values at target positions, plus ``seq_weight``: 1 / (valid targets of the document) on valid
    targets, else 0 (computed on whole rows, so a document split by CP keeps its count)."""
    unknown = sorted(set(values) - set(TOKEN_VALUE_KEYS))
    if unknown:
        raise ValueError(f"unknown per-token batch values {unknown}; the known ones are {list(TOKEN_VALUE_KEYS)}")
    out = {}
    for k, v in values.items():
        if v.shape != targets.shape:
            raise ValueError(f"batch value {k!r} has shape {tuple(v.shape)}; it must match labels "
                             f"{tuple(targets.shape)}")
        out[k] = _shift_values(v.float(), doc_ids)
    valid = (targets != IGNORE_INDEX).float()
    b, s = targets.shape
    width = int(segments.max()) + 1 if segments.numel() else 1
    key = (torch.arange(b, device=targets.device)[:, None] * width + segments).reshape(-1)
    per_doc = torch.zeros(b * width, device=targets.device).index_add(0, key, valid.reshape(-1))
    out["seq_weight"] = valid / per_doc[key].clamp(min=1).view(b, s)
    return out


def split_micro_batches(batch: StepBatch, n: int) -> list[StepBatch]:
    """Split along the batch dim into ``n`` equal micro-batches."""
    b = batch.input_ids.shape[0]
    if b % n:
        raise ValueError(f"the rank-local batch size {b} is not divisible by micro_batches={n}; change either")
    size = b // n
    return [pytree.tree_map(lambda t: t[i * size : (i + 1) * size], batch) for i in range(n)]


def count_targets(targets: Tensor) -> Tensor:
    return (targets != IGNORE_INDEX).sum()
