"""The one-device runtime ``train_step`` uses when ``mesh`` is None: every exchange is the identity.

``q38.parallel`` mesh runtimes implement the same methods with collectives.
"""

import torch
from torch import Tensor

from q38.layers.context import SeqInfo, is_packed


class LocalRuntime:
    """``q38.layers.context.StepRuntime`` on one device."""

    is_local = True
    prefetch_enabled = False
    prefetched = 0
    prefetched_backward = 0
    async_reductions = 0
    async_reduce_bytes = 0
    cp_early = 0

    def __init__(self, param_dtype=torch.float32, compute_dtype=None):
        self.param_dtype = param_dtype  # compute dtype (the mixed-precision policy); masters stay fp32
        # compute_dtype(path): a leaf's compute dtype (train.fp32_params keeps some fp32); None: param_dtype for all
        self._compute_dtype = compute_dtype
        self._dtype_of: dict[int, torch.dtype] = {}

    def seq_info(self, mb) -> SeqInfo:
        return SeqInfo(mb.doc_ids, mb.positions, mb.seq_idx, is_packed(mb.doc_ids))

    def bind(self, params, defer_reductions: bool = False) -> None:
        """Record each leaf's compute dtype (by its path)."""
        from q38.pytree import named_leaves

        self._dtype_of = {}
        if self._compute_dtype is not None:
            self._dtype_of = {id(t): self._compute_dtype(path) for path, t in named_leaves(params)}

    def grad(self, loss: Tensor, leaves: list) -> tuple:
        """``autograd.grad(loss, leaves)``, None for a leaf without gradient (on a mesh: reductions waited too)."""
        return tuple(torch.autograd.grad(loss, leaves, allow_unused=True))

    def gather(self, tree):
        """Parameters in compute form: cast to ``param_dtype`` (a bound leaf: its own compute dtype; on a mesh: cast,
        then FSDP all-gather)."""
        import torch.utils._pytree as pytree

        cast = lambda t: t.to(self._dtype_of.get(id(t), self.param_dtype)) if t.is_floating_point() else t  # noqa: E731
        return pytree.tree_map(cast, tree)

    dispatch = None

    def prefetch(self, tree, when: str = "ahead") -> None:
        pass

    def saved_tensor_hooks(self):
        return None  # nothing is gathered, so nothing to reshard

    def ep_stats(self) -> tuple[tuple, tuple]:
        return (), ()

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        """Sum over every rank that holds a different part of the step's batch (data and CP dims)."""
        return t

    def all_reduce_max(self, t: Tensor) -> Tensor:
        """Elementwise max over the ranks ``all_reduce_sum`` sums over."""
        return t

    def seq_all_reduce_sum(self, t: Tensor) -> Tensor:
        """Sum over the ranks holding other parts of the same rows (the CP group)."""
        return t

    def grad_sq_norm(self, grads: list[Tensor]) -> Tensor:
        return sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=grads[0].device))
