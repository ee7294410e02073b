"""Context parallelism: the sequence exchanges layers need (K/V all-gather, conv halo, exact GDN state carry), each
started async where its input exists and waited where its result is needed (``train.overlap_comm``;
docs/parallel.md#communication-overlap)."""

from typing import Callable

from torch import Tensor

from q38.layers.context import Ready, SeqHandle
from q38.parallel.collectives import _AllGatherAsync

# ---- CP exchanges ----------------------------------------------------------------------------------------------


class _Pending:
    """Issued all-gathers: ``wait`` completes them and returns ``finish`` of the stacked ``[cp, ...]`` results."""

    def __init__(self, works: list, stacked: tuple, finish: Callable[[tuple], tuple]):
        self.works, self.stacked, self.finish = works, stacked, finish

    def wait(self) -> tuple[Tensor, ...]:
        for w in self.works:
            w.wait()
        return self.finish(self.stacked)


class CPComm:
    """Sequence exchanges over the ``cp`` group (contiguous split, rank order = sequence order).

    ``overlap`` (``train.overlap_comm``): an ``*_async`` exchange returns while its collectives run, and ``early``
    counts the collectives so started (reported as ``Gradients.cp_early``); off, it completes before returning (the
    serial schedule: the same collectives in the same order)."""

    is_local = False

    def __init__(self, group, rank: int, size: int, overlap: bool = True):
        self.group, self.rank, self.size, self.overlap = group, rank, size, overlap
        self.early = 0

    def _issue(self, xs: tuple[Tensor, ...], finish: Callable[[tuple], tuple]) -> _Pending:
        works: list = []
        stacked = _AllGatherAsync.apply(self.group, works, *xs)
        return _Pending(works, stacked, finish)

    def _start(self, xs: tuple[Tensor, ...], finish: Callable[[tuple], tuple]) -> SeqHandle:
        pending = self._issue(xs, finish)
        if not self.overlap:
            return Ready(pending.wait())
        self.early += len(pending.works)
        return pending

    def all_gather_seq_async(self, xs: tuple[Tensor, ...], dim: int) -> SeqHandle:
        return self._start(xs, lambda st: tuple(t.movedim(0, dim).flatten(dim, dim + 1) for t in st))

    def prev_tail_async(self, xs: tuple[Tensor, ...], n: int, dim: int) -> SeqHandle:
        tails = tuple(x.narrow(dim, x.shape[dim] - n, n) for x in xs)
        return self._start(tails, lambda st: tuple(self._prev(t) for t in st))

    def _prev(self, stacked: Tensor) -> Tensor:
        """The previous rank's entry of ``[cp, ...]``; on rank 0 zeros, ``* 0`` keeping the gather in this rank's
        graph: its backward is a collective every rank joins."""
        return stacked[0] * 0 if self.rank == 0 else stacked[self.rank - 1]

    def gdn_carry(self, state_zero: Tensor, transition: Tensor, doc_ends: SeqHandle) -> Tensor:
        # Synchronous: the state and transition come out of the core's one pass together with the output they correct.
        s_all, t_all = self._issue((state_zero, transition), lambda st: st).wait()  # [cp, b, h, a, p|a]
        (ends_all,) = doc_ends.wait()  # [cp, 2, b]
        # Every rank's graph must use the gathered tensors (their backward is a collective): start from an exact 0
        # that depends on them.
        init = (s_all.sum() + t_all.sum()) * 0 * state_zero.new_zeros(state_zero.shape)
        for r in range(1, self.rank + 1):
            cont = (ends_all[r - 1, 1] == ends_all[r, 0]).to(init.dtype)[:, None, None, None]
            init = cont * (t_all[r - 1] @ init + s_all[r - 1])
        return init
