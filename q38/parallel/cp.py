"""Context parallelism: the sequence exchanges layers need (K/V all-gather, conv halo, exact GDN state carry)."""


import torch
from torch import Tensor


from q38.parallel import links
from q38.parallel.collectives import _AllGather

# ---- CP exchanges ----------------------------------------------------------------------------------------------


class CPComm:
    """Sequence exchanges over the ``cp`` group (contiguous split, rank order = sequence order)."""

    is_local = False

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def all_gather_seq(self, x: Tensor, dim: int) -> Tensor:
        if x.is_floating_point() and x.requires_grad:
            return _AllGather.apply(x, dim, self.group)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        links.all_gather(parts, x.contiguous(), self.group)
        return torch.cat(parts, dim=dim)

    def prev_tail(self, x: Tensor, n: int, dim: int) -> Tensor:
        tail = x.narrow(dim, x.shape[dim] - n, n)
        tails = self.all_gather_seq(tail, dim).chunk(self.size, dim=dim)
        if self.rank == 0:  # `* 0` keeps the gather in this rank's graph: its backward is a collective every rank joins
            return tails[0] * 0
        return tails[self.rank - 1]

    def gdn_carry(self, state_zero: Tensor, transition: Tensor, doc_ids: Tensor) -> Tensor:
        s_all = self.all_gather_seq(state_zero[None], 0)  # [cp, b, h, a, p]
        t_all = self.all_gather_seq(transition[None], 0)  # [cp, b, h, a, a]
        ends = torch.stack([doc_ids[:, 0], doc_ids[:, -1]], dim=0)[None]  # [1, 2, b]
        ends_all = self.all_gather_seq(ends, 0)  # [cp, 2, b]
        # Every rank's graph must use the gathered tensors (their backward is a collective): start from an exact 0
        # that depends on them.
        init = (s_all.sum() + t_all.sum()) * 0 * state_zero.new_zeros(state_zero.shape)
        for r in range(1, self.rank + 1):
            cont = (ends_all[r - 1, 1] == ends_all[r, 0]).to(init.dtype)[:, None, None, None]
            init = cont * (t_all[r - 1] @ init + s_all[r - 1])
        return init


