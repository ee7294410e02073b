"""The small parallel-context protocol the layers see: where their tokens sit in the global sequence, and
the few sequence-dimension exchanges context parallelism needs. On one device every exchange is the identity.

Layers never import ``torch.distributed``; ``q38.parallel`` provides a ``SeqComm`` that does the collectives.
"""

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Protocol, runtime_checkable

import attrs
import torch
from jaxtyping import Int
from torch import Tensor

from q38.kernels import DEFAULT_KERNELS, KernelConfig


@runtime_checkable
class SeqHandle(Protocol):
    """A started sequence exchange: ``wait()`` returns its results (a tuple, one per exchanged tensor)."""

    def wait(self) -> tuple[Tensor, ...]:
        ...


class SeqComm(Protocol):
    """Sequence-dimension exchanges (all differentiable), started early and waited where their result is needed, so
    the compute that does not need them runs meanwhile. ``LocalSeqComm`` is the one-device identity; ``is_local``
    lets a layer take its single-device fast path."""

    is_local: bool

    def all_gather_seq_async(self, xs: tuple[Tensor, ...], dim: int) -> SeqHandle:
        """Start concatenating every CP rank's copy of each of ``xs`` along ``dim`` in rank order (backward:
        reduce-scatter)."""
        ...

    def prev_tail_async(self, xs: tuple[Tensor, ...], n: int, dim: int) -> SeqHandle:
        """Start fetching the last ``n`` entries along ``dim`` of the previous CP rank's copy of each of ``xs``
        (zeros on the first rank)."""
        ...

    def gdn_carry(self, state_zero: Tensor, transition: Tensor, doc_ends: SeqHandle) -> Tensor:
        """Given every rank's final state from a zero start ``[b h a p]`` and its state transition ``[b h a a]``
        (zero when the rank's last document started inside the rank), return this rank's true initial state:
        ``S0_r = [doc continues] · (M_{r-1} S0_{r-1} + S_{r-1})``, composed over the previous ranks. ``doc_ends``:
        the started ``all_gather_seq_async`` along dim 0 of ``[1, 2, b]`` (each row's first and last doc id)."""
        ...


@dataclasses.dataclass(frozen=True)
class Ready:
    """An exchange that is already complete (one device, or ``overlap_comm`` off): ``wait`` returns ``value``. A
    frozen dataclass, not a frozen attrs class: layers build it inside compiled blocks, and torch.compile cannot
    trace the construction of a frozen attrs instance."""

    value: tuple

    def wait(self) -> tuple:
        return self.value


class LocalSeqComm:
    """One device (or no context parallelism): nothing to exchange."""

    def all_gather_seq_async(self, xs: tuple[Tensor, ...], dim: int) -> Ready:
        return Ready(tuple(xs))

    def prev_tail_async(self, xs: tuple[Tensor, ...], n: int, dim: int) -> Ready:
        def zeros(x: Tensor) -> Tensor:
            shape = list(x.shape)
            shape[dim] = n
            return x.new_zeros(shape)

        return Ready(tuple(zeros(x) for x in xs))

    def gdn_carry(self, state_zero: Tensor, transition: Tensor, doc_ends: SeqHandle) -> Tensor:
        return torch.zeros_like(state_zero)

    is_local = True


@runtime_checkable
class StepRuntime(Protocol):
    """What ``q38.train`` asks of a parallel runtime during a step, implemented by the one-device runtime
    (``q38.parallel.local.LocalRuntime``) and the mesh runtime (``q38.parallel.runtime.MeshRuntime``); the step
    never probes for anything else. ``mb`` is a ``q38.batch.StepBatch``."""

    is_local: bool
    prefetch_enabled: bool  # start the next layer's FSDP gathers early
    prefetched: int  # gathers prefetched in forward and consumed so far (reported, checked by the tests)
    prefetched_backward: int  # gathers prefetched in backward for the layer recomputed next, consumed so far
    cp_early: int  # CP exchanges started before the compute that does not need them (reported, checked by tests)
    dispatch: Any  # the MoE expert dispatch (q38.layers.moe.ExpertDispatch) or None: experts run locally

    def seq_info(self, mb: Any) -> "SeqInfo":
        """This rank's tokens' ``SeqInfo`` (with the CP ``SeqComm``)."""
        ...

    def bind(self, params: Any) -> None:
        """Record the step's parameter leaves (which dims stay sharded in compute form)."""
        ...

    def gather(self, tree: Any) -> Any:
        """Parameters in compute form, in the policy's ``param_dtype`` (FSDP all-gather on a mesh)."""
        ...

    def prefetch(self, tree: Any, when: str = "ahead") -> None:
        """Start gathering ``tree`` now (consumed by the next ``gather`` of it); ``when``: what consumes it, the
        next layer in forward (``ahead``), the layer recomputed next in backward (``behind``) or the layer about to
        run (``now``)."""
        ...

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        """Sum over every rank that holds a different part of the step's batch (data and CP dims)."""
        ...

    def all_reduce_max(self, t: Tensor) -> Tensor:
        """Elementwise max over the same ranks as ``all_reduce_sum`` (metrics such as a step's largest value)."""
        ...

    def seq_all_reduce_sum(self, t: Tensor) -> Tensor:
        """Sum over the ranks that split one sequence (CP)."""
        ...

    def grad_sq_norm(self, grads: list[Tensor]) -> Tensor:
        """The squared global norm of the step's gradients (each counted once over the mesh)."""
        ...

    def saved_tensor_hooks(self) -> Any:
        """A saved-tensors-hooks context that reshards gathered parameters after forward, or None."""
        ...

    def ep_stats(self) -> tuple[tuple, tuple]:
        """Per MoE layer call of the step: the largest per-rank routed-slot count, and the expert copies EP balance
        made (empty without EP)."""
        ...


def no_region(name: str) -> ContextManager:
    """``SeqInfo.region`` when nothing marks kernel regions (no selective recompute)."""
    return contextlib.nullcontext()


@attrs.frozen
class SeqInfo:
    """What every layer of a step may need, for this rank's tokens.

    ``doc_ids``: document of each token (padding = -1); ``positions``: RoPE position (restarts per document);
    ``seq_idx``: index of the token in the full (un-split) row, for causal masks across CP ranks.
    ``packed``: whether any row holds more than one document (lets layers take the fast unmasked path).
    ``comm``: the CP exchanges. ``kernels``: the step's resolved ``KernelConfig`` (a layer calls
    ``kernels.fn(op)``). ``region(name)``: a context the layer enters around its hot kernel (``attention``,
    ``gdn``), so that selective recompute can keep that kernel's outputs (``q38.train.core.remat``); it never changes
    the math.
    """

    doc_ids: Int[Tensor, "b s"]
    positions: Int[Tensor, "b s"]
    seq_idx: Int[Tensor, "b s"]
    packed: bool
    comm: object = attrs.field(factory=LocalSeqComm)
    kernels: KernelConfig = attrs.field(default=DEFAULT_KERNELS, kw_only=True)
    region: Callable[[str], ContextManager] = attrs.field(default=no_region, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not self.kernels.resolved:
            raise ValueError(f"SeqInfo needs resolved kernels (resolve_kernels first), got {self.kernels}")


def is_packed(doc_ids: Tensor) -> bool:
    """Whether any row holds more than one document (a doc id changes along the row)."""
    return doc_ids.shape[1] > 1 and bool((doc_ids[:, 1:] != doc_ids[:, :-1]).any())


def seq_info(doc_ids: Tensor | None, batch: int, seq: int, device, *,
             kernels: KernelConfig = DEFAULT_KERNELS) -> SeqInfo:
    """``SeqInfo`` for an un-split batch (one device), running ``kernels``."""
    from q38.layers.rope import positions_from_docs

    seq_idx = torch.arange(seq, device=device).expand(batch, seq)
    if doc_ids is None:
        return SeqInfo(torch.zeros(batch, seq, dtype=torch.long, device=device), seq_idx, seq_idx, False,
                       kernels=kernels)
    return SeqInfo(doc_ids, positions_from_docs(doc_ids), seq_idx, is_packed(doc_ids), kernels=kernels)
