"""The one-device runtime ``train_step`` uses when ``mesh`` is None: every exchange is the identity.

``q38.parallel`` mesh runtimes implement the same methods with collectives.
"""

import torch
from torch import Tensor

from q38.layers.context import SeqInfo
from q38.layers.rope import positions_from_docs


class LocalParallel:
    is_local = True
    ep_size = 1

    def seq_info(self, doc_ids: Tensor, seq_idx: Tensor) -> SeqInfo:
        s = doc_ids.shape[1]
        packed = bool((doc_ids[:, 1:] != doc_ids[:, :-1]).any()) if s > 1 else False
        return SeqInfo(doc_ids, positions_from_docs(doc_ids), seq_idx, packed)

    def gather(self, tree):
        """Parameters in compute form (FSDP all-gather on a mesh)."""
        return tree

    dispatch = None

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        """Sum over every rank that holds a different part of the step's batch (data and CP dims)."""
        return t

    def grad_sq_norm(self, grads: list[Tensor]) -> Tensor:
        return sum((g.float().pow(2).sum() for g in grads), torch.zeros(()))

    def local_grad(self, g: Tensor) -> Tensor:
        return g
