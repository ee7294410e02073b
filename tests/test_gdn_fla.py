"""``kernels.gdn: fla`` on packed rows and under context parallelism, against the torch core on one device, with
flash-linear-attention's Triton kernels run by Triton's interpreter on the CPU (``tests/fla_cpu.py``; slow: tens of
seconds per FLA forward + backward at these sizes, so a few cases).

Tolerance as the GDN tests (``tests/test_gdn.py``): max |Δ| ≤ 1e-5 · max(1, max |reference|) per tensor, fp32.
Measured: ≤ 2e-5 absolute on gradients up to ~10 (relative ≤ 2e-6).
"""

import pytest
import torch
import torch.nn.functional as F

from fla_cpu import fla_gdn
from q38.kernels import DEFAULT_KERNELS
from q38.layers.context import Ready, SeqInfo
from q38.layers.gdn import gated_delta_rule_chunked, gated_delta_rule_fla, gated_delta_rule_fla_op, gdn_core_fla
from q38.layers.rope import positions_from_docs
from q38.parallel.cp import CPComm

# numpy, which evaluates the kernels in the interpreter, warns on overflowing exps in the lanes the kernels mask out
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
TOL = 1e-5
B, S, HK, H, A, P = 2, 64, 1, 2, 32, 32  # two value heads reading one key head (GVA)
DOCS = [[0] * 20 + [1] * 44, [3] * 40 + [4] * 24]


def _close(x, ref, tol=TOL):
    return (x - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def _inputs(gen, b=B, s=S):
    q = torch.randn(b, s, HK, A, generator=gen)
    k = torch.randn(b, s, HK, A, generator=gen)
    v = torch.randn(b, s, H, P, generator=gen)
    # the model's decay: -exp(A_log)·softplus(·), A_log spread over the heads
    g = -torch.linspace(0.0, 2.0, H).exp() * F.softplus(torch.randn(b, s, H, generator=gen) + 1.0)
    beta = torch.rand(b, s, H, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _loss(o, S=None):
    """A loss weighting every output (and the final state, so its gradient is not zero)."""
    out = (o * torch.sin(torch.arange(o.numel(), dtype=o.dtype)).view_as(o)).sum()
    return out if S is None else out + (S * torch.cos(torch.arange(S.numel(), dtype=S.dtype)).view_as(S)).sum()


@pytest.mark.parametrize("core", [gated_delta_rule_fla, gated_delta_rule_fla_op], ids=["fla", "custom_op"])
def test_fla_equals_the_torch_core_on_packed_rows(gen, core):
    """Two packed rows (documents restarting inside each) with an initial state for each row's first document and
    the final state of its last: outputs, final states and the gradients of q, k, v, g, beta and the initial state.
    ``custom_op`` is the ``q38::fla_gdn`` op compiled blocks trace (FLA's forward and backward called inside it)."""
    fla_gdn()
    ins = _inputs(gen)
    s0 = torch.randn(B, H, A, P, generator=gen).requires_grad_()
    doc = torch.tensor(DOCS)
    o, S_fin = core(*ins, doc, s0)
    got = (o, S_fin, *torch.autograd.grad(_loss(o, S_fin), [*ins, s0]))
    o_ref, S_ref = gated_delta_rule_chunked(*ins, doc, s0, chunk_size=16)
    ref = (o_ref, S_ref, *torch.autograd.grad(_loss(o_ref, S_ref), [*ins, s0]))
    for name, x, r in zip(("o", "S_final", "dq", "dk", "dv", "dg", "dbeta", "dS0"), got, ref):
        assert _close(x, r), (name, (x - r).abs().max().item())


class SerialCP(CPComm):
    """The CP ranks of one sequence run one after another in this process: each rank's ``gdn_carry`` reads the
    (final state, transition) pairs the earlier ranks stored, and composes them with ``CPComm``'s own code.
    ``carried[rank]``: the initial state the carry handed that rank (its gradient retained)."""

    def __init__(self, rank, size, store, doc_ids):
        super().__init__(None, rank, size, overlap=False)
        self.store, self.doc_ids, self.carried = store, doc_ids, {}

    def _issue(self, xs, finish):
        self.store[self.rank] = xs
        stacked = tuple(torch.stack([self.store.get(r, xs)[i] for r in range(self.size)]) for i in range(len(xs)))
        return Ready(finish(stacked))

    def all_gather_seq_async(self, xs, dim):  # only the carry's doc ends: every rank's rows' first and last ids
        n = self.doc_ids.shape[1] // self.size
        parts = [self.doc_ids[:, r * n:(r + 1) * n] for r in range(self.size)]
        return Ready((torch.stack([torch.stack([d[:, 0], d[:, -1]]) for d in parts]),))

    def gdn_carry(self, state_zero, transition, doc_ends):
        init = super().gdn_carry(state_zero, transition, doc_ends)
        if init.requires_grad:
            init.retain_grad()
        self.carried[self.rank] = init
        return init


def _rank_info(doc, lo, hi, comm):
    d = doc[:, lo:hi]
    return SeqInfo(d, positions_from_docs(d), torch.arange(lo, hi).expand(d.shape[0], -1), True, comm=comm,
                   kernels=DEFAULT_KERNELS.replace(gdn="fla"))


def test_fla_under_a_two_rank_cp_split_equals_one_device(gen):
    """The production path: ``gdn_core_fla`` per CP rank (each rank's FLA run with the identity-augmented initial
    state, the carry composing the ranks' states; ``SerialCP`` runs the two ranks in sequence) against the torch core
    over the whole rows. Row 0's second document crosses the split (the state is carried), row 1's first document
    ends exactly at it (nothing carried). Outputs, input gradients (rank 1's loss reaches rank 0's inputs through
    the carry), and the gradient of the carried state against the torch core started from the true state."""
    fla_gdn()
    ins = _inputs(gen)
    doc = torch.tensor([[0] * 20 + [1] * 44, [3] * 32 + [4] * 32])
    half = S // 2
    store, outs, comms = {}, [], []
    for rank, (lo, hi) in enumerate(((0, half), (half, S))):
        comm = SerialCP(rank, 2, store, doc)
        comms.append(comm)
        outs.append(gdn_core_fla(*(t[:, lo:hi] for t in ins), _rank_info(doc, lo, hi, comm), chunk_size=64,
                                 backward="custom"))
    o = torch.cat(outs, dim=1)
    loss = _loss(o)
    grads = torch.autograd.grad(loss, ins, retain_graph=True)
    carried = comms[1].carried[1]
    (d_carried,) = torch.autograd.grad(loss, [carried])

    o_ref, _ = gated_delta_rule_chunked(*ins, doc, chunk_size=16)
    ref_grads = torch.autograd.grad(_loss(o_ref), ins)
    for name, x, r in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), (o, *grads), (o_ref, *ref_grads)):
        assert _close(x, r), (name, (x - r).abs().max().item())

    # the carried state: the true state after rank 0's half (torch core), and its gradient from rank 1's outputs
    first = [t.detach()[:, :half] for t in ins]
    _, S_half = gated_delta_rule_chunked(*first, doc[:, :half], chunk_size=16)
    S_half = S_half * torch.tensor([1.0, 0.0])[:, None, None, None]  # row 1's document ends at the split
    assert _close(carried, S_half)
    s0 = S_half.clone().requires_grad_()
    second = [t.detach()[:, half:] for t in ins]
    o2, _ = gated_delta_rule_chunked(*second, doc[:, half:], s0, chunk_size=16)
    w = torch.sin(torch.arange(o_ref.numel(), dtype=o_ref.dtype)).view_as(o_ref)[:, half:]
    (d_s0,) = torch.autograd.grad((o2 * w).sum(), [s0])
    # row 1 carries nothing: its carried state is an exact zero times the gathered states, its gradient stays 0
    assert _close(d_carried[0], d_s0[0]) and d_s0[0].abs().max() > 0
