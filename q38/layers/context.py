"""The small parallel-context protocol the layers see: where their tokens sit in the global sequence, and
the few sequence-dimension exchanges context parallelism needs. On one device every exchange is the identity.

Layers never import ``torch.distributed``; ``q38.parallel`` provides a ``SeqComm`` that does the collectives.
"""

from typing import Protocol

import attrs
import torch
from jaxtyping import Int
from torch import Tensor


class SeqComm(Protocol):
    """Sequence-dimension exchanges (all differentiable). ``LocalSeqComm`` is the one-device identity."""

    def all_gather_seq(self, x: Tensor, dim: int) -> Tensor:
        """Concatenate every CP rank's ``x`` along ``dim`` in rank order (backward: reduce-scatter)."""
        ...

    def prev_tail(self, x: Tensor, n: int, dim: int) -> Tensor:
        """The last ``n`` entries along ``dim`` of the previous CP rank's ``x`` (zeros on the first rank)."""
        ...

    def gdn_carry(self, state_zero: Tensor, transition: Tensor, doc_ids: Tensor) -> Tensor:
        """Given every rank's final state from a zero start ``[b h a p]`` and its state transition ``[b h a a]``
        (zero when the rank's last document started inside the rank), return this rank's true initial state:
        ``S0_r = [doc continues] · (M_{r-1} S0_{r-1} + S_{r-1})``, composed over the previous ranks."""
        ...


class LocalSeqComm:
    """One device (or no context parallelism): nothing to exchange."""

    def all_gather_seq(self, x: Tensor, dim: int) -> Tensor:
        return x

    def prev_tail(self, x: Tensor, n: int, dim: int) -> Tensor:
        shape = list(x.shape)
        shape[dim] = n
        return x.new_zeros(shape)

    def gdn_carry(self, state_zero: Tensor, transition: Tensor, doc_ids: Tensor) -> Tensor:
        return torch.zeros_like(state_zero)

    @property
    def is_local(self) -> bool:
        return True


@attrs.frozen
class SeqInfo:
    """Per-token facts every layer may need, for this rank's tokens.

    ``doc_ids``: document of each token (padding = -1); ``positions``: RoPE position (restarts per document);
    ``seq_idx``: index of the token in the full (un-split) row, for causal masks across CP ranks.
    ``packed``: whether any row holds more than one document (lets layers take the fast unmasked path).
    """

    doc_ids: Int[Tensor, "b s"]
    positions: Int[Tensor, "b s"]
    seq_idx: Int[Tensor, "b s"]
    packed: bool
    comm: object = attrs.field(factory=LocalSeqComm)


def seq_info(doc_ids: Tensor | None, batch: int, seq: int, device) -> SeqInfo:
    """``SeqInfo`` for an un-split batch (one device)."""
    from q38.layers.rope import positions_from_docs

    seq_idx = torch.arange(seq, device=device).expand(batch, seq)
    if doc_ids is None:
        return SeqInfo(torch.zeros(batch, seq, dtype=torch.long, device=device), seq_idx, seq_idx, False)
    packed = bool((doc_ids[:, 1:] != doc_ids[:, :-1]).any()) if seq > 1 else False
    return SeqInfo(doc_ids, positions_from_docs(doc_ids), seq_idx, packed)
