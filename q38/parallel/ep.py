"""Expert parallelism: token dispatch by uneven all-to-all, and EP balance (hot experts copied into spare slots)."""


import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from q38.layers.moe import swiglu_batched
from q38.parallel import links
from q38.errors import ConfigError
from q38.parallel.collectives import _AllGather, _AllToAll

# A slot's sort key (local expert · ep + source rank) is below this on every rank (the same on all ranks, also with
# EP-balance copies): the hierarchical dispatch packs (owner, key) into one int64 code.
_KEY_SPAN = 1 << 32

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
    """Expert parallelism for one MoE layer (the ``q38.layers.moe.ExpertDispatch`` contract): each routed slot
    travels to the rank owning its expert, runs there through ``experts`` (default ``swiglu_batched``), and its
    output travels back and is added, with the shared expert's, into its token's row. ``hierarchical``: a token
    crosses to each remote node once; ``overlap``: two halves of the tokens, one's exchange in flight while the
    other computes; ``balance``: hot experts copied into up to ``max_dup`` spare slots per rank. Every path adds in
    one canonical order, so they agree bit for bit (docs/parallel.md#expert-parallelism).
    """

    def __init__(self, group, rank: int, size: int, balance: bool = False, max_dup: int = 2,
                 hierarchical: bool = False, overlap: bool = False):
        self.group, self.rank, self.size = group, rank, size
        self.balance, self.max_dup = balance, max_dup
        self.hierarchical, self.overlap = hierarchical, overlap
        self.loads: list[int] = []  # max per-rank received slots, one entry per call (for reports and tests)
        self.copies: list[int] = []  # with balance: expert copies the plan made, one entry per call

    def __call__(self, x_nd, w_nk, idx_nk, p, cfg, experts=swiglu_batched, shared=None):
        """``shared() + Σ routed`` of every token (``shared``: the shared expert's output, computed while the
        first exchanges are in flight; None: zero)."""
        with record_function("q38.dispatch"):
            dest_nk, key_nk, w_gu, w_dn = self._route(idx_nk, p, cfg)
            node_of, rail_of, nodes, me = self._nodes(idx_nk.device)
        hier = self.hierarchical and nodes > 1
        n = x_nd.shape[0]
        cuts = [0, n // 2, n] if self.overlap else [0, n]
        halves = []
        for a, b in zip(cuts, cuts[1:]):
            args = (x_nd[a:b], w_nk[a:b], dest_nk[a:b], key_nk[a:b], node_of, nodes, w_gu, w_dn, experts, me)
            halves.append(self._hier(*args, rail_of) if hier else self._flat(*args))
        base, parts = _drive(halves, shared if shared is not None else lambda: x_nd.new_zeros(x_nd.shape))
        with record_function("q38.combine"):
            # the canonical order: own-node slot outputs (by owner), then the remote nodes' partials in node order
            for a, (adds, _) in zip(cuts, parts):
                for token, rows in adds:
                    base = base.index_add(0, token + a, rows)
            load = torch.tensor(sum(r for _, r in parts), device=x_nd.device)
            links.all_reduce(load, self.group, op=dist.ReduceOp.MAX)
            self.loads.append(int(load))
        return base

    def _route(self, idx_nk, p, cfg):
        """Per slot: the EP rank that runs it (``dest``), and its sort key on that rank, ``local expert · ep +
        source rank`` (which also orders the expert's rows canonically); the expert weights with any copies."""
        e_local = p.we_gate_up.shape[0]
        w_gu, w_dn = p.we_gate_up, p.we_down
        expert_m = idx_nk.reshape(-1)
        dest = torch.div(expert_m, e_local, rounding_mode="floor")
        local_idx = expert_m - dest * e_local
        if self.balance:
            dest, local_idx, w_gu, w_dn = self._balance(expert_m, dest, local_idx, w_gu, w_dn, cfg.num_experts)
        key = local_idx * self.size + self.rank
        return dest.view_as(idx_nk), key.view_as(idx_nk), w_gu, w_dn

    def _nodes(self, device) -> tuple[Tensor, Tensor, int, int]:
        """``node_of[r]``: the node index (0, 1, ... within the group) of EP rank r under
        ``links.current_topology()``; ``rail_of[b]``: the EP rank on node b with this rank's local index (hierarchical
        only); the number of nodes the group spans; this rank's node index."""
        topo = links.current_topology()
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.size))
        nodes = sorted({topo.node(r) for r in ranks})
        node_of = [nodes.index(topo.node(r)) for r in ranks]
        per = [node_of.count(b) for b in range(len(nodes))]
        rail = []
        if self.hierarchical and len(nodes) > 1:
            if len(set(per)) != 1 or node_of != sorted(node_of):
                raise ConfigError(
                    f"train.ep_dispatch: hierarchical needs the EP group node-major with the same number of ranks "
                    f"on every node; its ranks {ranks} lie on nodes {[topo.node(r) for r in ranks]}. Use "
                    f"ep_dispatch: flat"
                )
            local = node_of[: self.rank].count(node_of[self.rank])
            rail = [b * per[0] + local for b in range(len(nodes))]
        return (torch.tensor(node_of, dtype=torch.long, device=device),
                torch.tensor(rail, dtype=torch.long, device=device), len(nodes), node_of[self.rank])

    def _flat(self, x_nd, w_nk, dest_nk, key_nk, node_of, nodes, w_gu, w_dn, experts, me):
        """One hop: every slot to its owner and back. A generator: yields the works of each async exchange;
        returns the ``(token index, rows)`` to add into the output, in order (own-node slots, then remote units'
        sums), and the slots this rank's experts received."""
        n, k = dest_nk.shape
        token_m = torch.arange(n, device=x_nd.device).repeat_interleave(k)
        dest_m = dest_nk.reshape(-1)
        order = torch.argsort(dest_m, stable=True)
        token_s, node_s = token_m[order], node_of[dest_m][order]
        remote_s = node_s != me
        units, unit_r = torch.unique((token_s * nodes + node_s)[remote_s], sorted=True, return_inverse=True)
        token_u = torch.div(units, nodes, rounding_mode="floor")  # remote (token, node) units, token-major
        # rows gathered as the hierarchical path gathers them, so backward sums them alike: own-node slots straight
        # from the token, remote ones through their unit (slot order within it)
        rows = torch.cat([x_nd.index_select(0, token_s[~remote_s]),
                          x_nd.index_select(0, token_u).index_select(0, unit_r)])
        n_own = int((~remote_s).sum())
        pos = torch.where(remote_s, n_own + torch.cumsum(remote_s, 0) - 1, torch.cumsum(~remote_s, 0) - 1)
        send_l, recv_l = _exchange_counts(torch.bincount(dest_m, minlength=self.size), self.group)
        works: list = []
        x_r, w_r, key_r = _send([rows.index_select(0, pos), w_nk.reshape(-1)[order], key_nk.reshape(-1)[order]],
                                recv_l, send_l, self.group, works)
        yield works
        y_s = yield from self._experts_round_trip(x_r, w_r, key_r, w_gu, w_dn, experts, send_l, recv_l)
        partial = y_s.new_zeros(units.shape[0], y_s.shape[1]).index_add(0, unit_r, y_s[remote_s])
        return [(token_s[~remote_s], y_s[~remote_s]), (token_u, partial)], sum(recv_l)

    def _hier(self, x_nd, w_nk, dest_nk, key_nk, node_of, nodes, w_gu, w_dn, experts, me, rail_of):
        """Two hops for remote slots: each (node, token) unit to the rail peer on that node (inter-node), fanned
        out there to the owners with that node's own slots (intra-node); outputs summed per unit on the rail peer,
        the unit sent back. Own-node slots go straight to their owners. A generator as ``_flat``."""
        n, k = dest_nk.shape
        dev = x_nd.device
        node_nk = node_of[dest_nk]
        token_nk = torch.arange(n, device=dev)[:, None].expand(n, k)
        remote_nk = node_nk != me
        units = torch.unique((node_nk * n + token_nk)[remote_nk], sorted=True)  # node-major: rail-peer order
        node_u, token_u = torch.div(units, n, rounding_mode="floor"), units % n
        on_uk = node_nk.index_select(0, token_u) == node_u[:, None]  # the unit's slots: its token's slots there
        code_uk = torch.where(on_uk, dest_nk.index_select(0, token_u) * _KEY_SPAN + key_nk.index_select(0, token_u),
                              -1)  # a slot's code: owner · span + key; -1 for a slot on another node
        send_l, recv_l = _exchange_counts(torch.bincount(rail_of[node_u], minlength=self.size), self.group)
        works: list = []
        x_ru, w_ruk, code_ruk = _send([x_nd.index_select(0, token_u), w_nk.index_select(0, token_u).where(on_uk, 0.0),
                                       code_uk], recv_l, send_l, self.group, works)
        yield works
        # fan out inside the node: this rank's own-node slots (by owner), then the received units' slots
        own_m = torch.nonzero(~remote_nk.reshape(-1))[:, 0]
        own_m = own_m[torch.argsort(dest_nk.reshape(-1)[own_m], stable=True)]
        valid = code_ruk >= 0
        code_s = code_ruk[valid]
        n_own = own_m.shape[0]
        row_s = torch.cat([torch.arange(n_own, device=dev), n_own + torch.nonzero(valid)[:, 0]])
        dest_s = torch.cat([dest_nk.reshape(-1)[own_m], torch.div(code_s, _KEY_SPAN, rounding_mode="floor")])
        order = torch.argsort(dest_s, stable=True)
        rows = torch.cat([x_nd.index_select(0, own_m // k), x_ru])
        w_s = torch.cat([w_nk.reshape(-1)[own_m], w_ruk[valid]])
        key_s = torch.cat([key_nk.reshape(-1)[own_m], code_s % _KEY_SPAN])
        send2_l, recv2_l = _exchange_counts(torch.bincount(dest_s, minlength=self.size), self.group)
        works = []
        x_r, w_r, key_r = _send([rows.index_select(0, row_s[order]), w_s[order], key_s[order]], recv2_l, send2_l,
                                self.group, works)
        yield works
        y_s = yield from self._experts_round_trip(x_r, w_r, key_r, w_gu, w_dn, experts, send2_l, recv2_l)
        row_o = row_s[order]
        own_o = row_o < n_own
        partial_ru = y_s.new_zeros(x_ru.shape[0], y_s.shape[1]).index_add(0, row_o[~own_o] - n_own, y_s[~own_o])
        works = []
        (partial_u,) = _send([partial_ru], send_l, recv_l, self.group, works)
        yield works
        return [(own_m[row_o[own_o]] // k, y_s[own_o]), (token_u, partial_u)], sum(recv2_l)

    def _experts_round_trip(self, x_r, w_r, key_r, w_gu, w_dn, experts, send_l, recv_l):
        """The owner's experts over its received rows in key order (local expert, then source rank, then arrival),
        the outputs sent back to where the rows came from (in their order). A generator step of a half."""
        with record_function("q38.experts"):
            o = torch.argsort(key_r, stable=True)
            counts = torch.bincount(torch.div(key_r, self.size, rounding_mode="floor"), minlength=w_gu.shape[0])
            y = experts(x_r[o], counts, w_gu, w_dn, w_r[o])
            y_r = torch.empty_like(y).index_copy(0, o, y)
        works: list = []
        (y_back,) = _send([y_r], send_l, recv_l, self.group, works)
        yield works
        return y_back

    def _balance(self, expert_m, dest, local_idx, w_gu, w_dn, num_experts):
        if not (isinstance(w_gu, Tensor) and isinstance(w_dn, Tensor)):
            raise ConfigError("train.enable_ep_balance with a LoRA run (peft) or a block-FP8 base is not implemented "
                              "(expert copies would have to carry the adapters and FP8 scales); set "
                              "enable_ep_balance: false")
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




def _exchange_counts(send: Tensor, group) -> tuple[list[int], list[int]]:
    """Rows this rank sends to / receives from each peer (one all-to-all of the counts)."""
    recv = torch.empty_like(send)
    links.all_to_all_single(recv, send, group=group)
    return send.tolist(), recv.tolist()


def _send(tensors: list[Tensor], recv_l: list[int], send_l: list[int], group, works: list) -> list[Tensor]:
    """Start the uneven all-to-all of each tensor (rows in peer order); their works go to ``works``. The float
    tensors go through one differentiable ``_AllToAll`` (backward: their reverse exchanges, together), integer ones
    plain. The results are valid once every work has been waited for."""
    floats = [t for t in tensors if t.is_floating_point()]
    moved = iter(_AllToAll.apply(recv_l, send_l, group, works, *floats) if floats else ())
    out = []
    for t in tensors:
        if t.is_floating_point():
            out.append(next(moved))
        else:
            buf = t.new_empty((sum(recv_l), *t.shape[1:]))
            works.append(links.all_to_all_single(buf, t.contiguous(), recv_l, send_l, group, async_op=True))
            out.append(buf)
    return out


def _drive(halves: list, shared):
    """Run the halves' exchange chains interleaved: each half issues its first exchange, then ``shared()`` runs
    while they are in flight; then, in turn, each half waits for its pending exchange and computes up to its next
    one (so one half computes while the other's exchange is in flight). Returns ``(shared(), [each half's
    result])``; with one half this is the serial schedule."""
    pending = [next(h) for h in halves]
    base = shared()
    results: list = [None] * len(halves)
    live = list(range(len(halves)))
    while live:
        for i in list(live):
            for w in pending[i]:
                w.wait()
            try:
                pending[i] = halves[i].send(None)
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
    return base, results
