"""How a layer names its weights in a Hugging Face checkpoint: the ``Rule`` record (q38 leaves ↔ HF tensors, with a
block reader) and the generic converters layers build their rules from. ``q38.hf`` walks the rules; the key tables
are in ``q38.hf`` (model edges, norms, MoE) and in each mixer kind's record (``q38.layers.kinds``)."""

from typing import Callable

import attrs
from torch import Tensor


@attrs.frozen
class Rule:
    """q38 leaves ``q38`` ↔ HF tensors ``hf`` (shapes ``hf_shapes``).

    ``to_hf(*q38 tensors) -> tuple of HF tensors``. ``block(read, which, index)``: only the block ``index`` (a tuple
    of slices) of q38 leaf ``q38[which]``, where ``read(i, hf_index)`` reads that block of HF tensor ``i`` (``None``:
    all of it). Rules whose q38 block is a block of HF tensors read only that; the grouped Qwen3-Next projections
    read their one HF tensor whole and gather the block's rows from it.
    """

    q38: tuple[str, ...]
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_hf: Callable[..., tuple]
    block: Callable


@attrs.frozen
class CheckpointLayout:
    """Where and how a checkpoint stores the text model.

    ``prefix``: ``model.`` or ``model.language_model.``; ``gdn_grouped``: Qwen3-Next qkvz/ba projections;
    ``fused_experts(hf_layer_prefix) -> bool``: routed experts of that layer as two 3-D tensors (else per expert).
    """

    prefix: str
    gdn_grouped: bool
    fused_experts: Callable[[str], bool]


def rename_rule(q: str, h: str, shape: tuple[int, ...]) -> Rule:
    """One q38 leaf is one HF tensor, unchanged."""
    return Rule((q,), (h,), (shape,), lambda t: (t,), lambda read, which, index: read(0, index))


def conv_rule(q: str, h: str, shape: tuple[int, ...]) -> Rule:
    """A depthwise conv weight: q38 ``[ch, w]`` ↔ HF ``[ch, 1, w]``."""
    ch, w = shape

    def block(read, which, index):
        rows, cols = index
        return read(0, (rows, slice(None), cols)).reshape(rows.stop - rows.start, cols.stop - cols.start)

    return Rule((q,), (h,), ((ch, 1, w),), lambda t: (t.unsqueeze(1),), block)


def grouped_block(rows_of: tuple[Tensor, ...]):
    """The block reader of a grouped rule whose q38 output ``w`` holds HF rows ``rows_of[w]`` (in order): the one HF
    tensor is read whole (its rows interleave every q38 output) and only the block's rows are gathered from it."""

    def block(read, which, index):
        rows, *rest = index
        return read(0, None)[(slice(None), *rest)][rows_of[which][rows]]  # columns as a view, then gather rows

    return block


def renames(table: dict[str, str], qp: str, hp: str, shapes: dict[str, tuple[int, ...]]) -> list[Rule]:
    """``rename_rule`` for every ``q38 suffix → HF suffix`` of ``table`` under the prefixes ``qp`` / ``hp``."""
    return [rename_rule(qp + q, hp + h, shapes[qp + q]) for q, h in table.items()]

