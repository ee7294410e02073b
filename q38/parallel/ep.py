"""Expert parallelism: token dispatch by uneven all-to-all, and EP balance (hot experts copied into spare slots)."""


import torch
import torch.distributed as dist
from torch.profiler import record_function

from q38.layers.moe import swiglu_batched
from q38.parallel import links
from q38.parallel.collectives import _AllGather, _AllToAll

# ---- EP dispatch -----------------------------------------------------------------------------------------------


def plan_ep_balance(load_e: list[float], ep: int, e_local: int, max_dup: int) -> dict[int, list[tuple[int, float]]]:
    """Greedy EP balance plan (deterministic, identical on every rank).

    Repeatedly copies the hottest expert replica of the most loaded rank into a spare slot of the least loaded rank
    (at most ``max_dup`` copies per rank), moving as much of its load as evens the two ranks out. Returns, for every
    expert with copies, its replicas ``[(rank, share of the expert's tokens)]`` with the owner first.
    """
    rank_load = [sum(load_e[r * e_local : (r + 1) * e_local]) for r in range(ep)]
    replicas: dict[int, list[list]] = {e: [[e // e_local, float(load_e[e])]] for e in range(len(load_e))}
    used = [0] * ep
    for _ in range(ep * max_dup):
        hot = max(range(ep), key=lambda r: (rank_load[r], -r))
        spare = [r for r in range(ep) if used[r] < max_dup and r != hot]
        if not spare:
            break
        cold = min(spare, key=lambda r: (rank_load[r], r))
        cands = [(rep[1], e, i) for e, reps in replicas.items() for i, rep in enumerate(reps)
                 if rep[0] == hot and all(x[0] != cold for x in reps)]
        if not cands:
            break
        cur, e, i = max(cands, key=lambda c: (c[0], -c[1]))
        move = min(cur / 2, (rank_load[hot] - rank_load[cold]) / 2)
        if move < 1:
            break
        replicas[e][i][1] -= move
        replicas[e].append([cold, move])
        rank_load[hot] -= move
        rank_load[cold] += move
        used[cold] += 1
    return {
        e: [(r, ld / max(float(load_e[e]), 1e-9)) for r, ld in reps]
        for e, reps in replicas.items() if len(reps) > 1
    }


class EPDispatch:
    """Send each routed slot to the rank owning its expert (uneven all-to-all), run its local experts through
    ``experts`` (the ``kernels.experts`` callable ``moe_apply`` passes; default ``swiglu_batched``), send back.

    With ``balance`` (EP balance), hot experts are copied into up to ``max_dup`` spare slots per rank from the
    layer's global load; the copies' weights come through an autograd all-gather, so their gradients are summed
    back into the originals by its reduce-scatter. Only where the work runs changes, not the math.
    """

    def __init__(self, group, rank: int, size: int, balance: bool = False, max_dup: int = 2):
        self.group, self.rank, self.size = group, rank, size
        self.balance, self.max_dup = balance, max_dup
        self.loads: list[int] = []  # max per-rank received slots, one entry per call (for reports and tests)
        self.copies: list[int] = []  # with balance: expert copies the plan made, one entry per call

    def __call__(self, x_md, w_m, expert_m, p, cfg, experts=swiglu_batched):
        with record_function("q38.dispatch"):
            x_recv, w_recv, e_recv, order, send_l, recv_l, w_gu, w_dn = self._dispatch(x_md, w_m, expert_m, p, cfg)
        with record_function("q38.experts"):
            o = torch.argsort(e_recv, stable=True)
            counts = torch.bincount(e_recv, minlength=w_gu.shape[0])
            y = experts(x_recv[o], counts, w_gu, w_dn, w_recv[o])
        with record_function("q38.combine"):
            y_recv = torch.empty_like(y).index_copy(0, o, y)
            y_sorted = _AllToAll.apply(y_recv, send_l, recv_l, self.group)
            return torch.empty_like(y_sorted).index_copy(0, order, y_sorted)

    def _dispatch(self, x_md, w_m, expert_m, p, cfg):
        """Each slot (and its gate weight and local expert index) sent to the rank that owns its expert."""
        e_local = p.we_gate_up.shape[0]
        w_gu, w_dn = p.we_gate_up, p.we_down
        dest = torch.div(expert_m, e_local, rounding_mode="floor")
        local_idx = expert_m - dest * e_local
        if self.balance:
            dest, local_idx, w_gu, w_dn = self._balance(expert_m, dest, local_idx, w_gu, w_dn, cfg.num_experts)
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=self.size)
        recv = torch.empty_like(send)
        links.all_to_all_single(recv, send, group=self.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        load = torch.tensor(sum(recv_l), device=x_md.device)
        links.all_reduce(load, self.group, op=dist.ReduceOp.MAX)
        self.loads.append(int(load))
        x_recv = _AllToAll.apply(x_md[order], recv_l, send_l, self.group)
        w_recv = _AllToAll.apply(w_m[order], recv_l, send_l, self.group)  # gate weights travel with their slots
        e_recv = torch.empty(sum(recv_l), dtype=expert_m.dtype, device=expert_m.device)
        links.all_to_all_single(e_recv, local_idx[order].contiguous(), recv_l, send_l, self.group)
        return x_recv, w_recv, e_recv, order, send_l, recv_l, w_gu, w_dn

    def _balance(self, expert_m, dest, local_idx, w_gu, w_dn, num_experts):
        e_local = w_gu.shape[0]
        load = torch.bincount(expert_m, minlength=num_experts).float()
        links.all_reduce(load, self.group)
        plan = plan_ep_balance(load.tolist(), self.size, e_local, self.max_dup)
        self.copies.append(sum(len(reps) - 1 for reps in plan.values()))
        if not plan:
            return dest, local_idx, w_gu, w_dn
        # Copies: which experts each owner sends, and where each copy lands in its host's weight table.
        sent = {o: sorted(e for e, reps in plan.items() if reps[0][0] == o) for o in range(self.size)}
        width = max(len(v) for v in sent.values())
        mine = sent[self.rank]
        pad = width - len(mine)
        idx = torch.tensor([e - self.rank * e_local for e in mine], dtype=torch.long, device=w_gu.device)
        gu_send = torch.cat([w_gu.index_select(0, idx), w_gu.new_zeros(pad, *w_gu.shape[1:])])
        dn_send = torch.cat([w_dn.index_select(0, idx), w_dn.new_zeros(pad, *w_dn.shape[1:])])
        gu_all = _AllGather.apply(gu_send, 0, self.group)  # backward: copies' grads reduce-scattered to owners
        dn_all = _AllGather.apply(dn_send, 0, self.group)
        host_slot: dict[tuple[int, int], int] = {}
        extra = {r: [] for r in range(self.size)}
        for e in sorted(plan):
            for r, _ in plan[e][1:]:
                host_slot[(e, r)] = e_local + len(extra[r])
                extra[r].append(plan[e][0][0] * width + sent[plan[e][0][0]].index(e))
        if extra[self.rank]:
            pick = torch.tensor(extra[self.rank], dtype=torch.long, device=w_gu.device)
            w_gu = torch.cat([w_gu, gu_all.index_select(0, pick)])
            w_dn = torch.cat([w_dn, dn_all.index_select(0, pick)])
        else:  # keep the gathered copies in this rank's graph: their backward is a collective every rank joins
            w_gu = w_gu + gu_all.sum() * 0
            w_dn = w_dn + dn_all.sum() * 0
        # Route this rank's slots of each copied expert to its replicas in proportion to the plan's shares.
        dest, local_idx = dest.clone(), local_idx.clone()
        for e, reps in plan.items():
            pos = torch.nonzero(expert_m == e).flatten()
            n = pos.numel()
            if n == 0:
                continue
            bounds, acc = [0], 0.0
            for _, share in reps:
                acc += share
                bounds.append(min(n, round(acc * n)))
            bounds[-1] = n
            for j, (r, _) in enumerate(reps[1:], start=1):
                sl = pos[bounds[j] : bounds[j + 1]]
                dest[sl] = r
                local_idx[sl] = host_slot[(e, r)]
        return dest, local_idx, w_gu, w_dn


