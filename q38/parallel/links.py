"""Where the step's bytes travel: which ranks share a node (``Topology``), what a collective costs on the links it
crosses (``LinkModel``, the one price the plan and the simulated cluster both use), and the collective calls every
step exchange goes through (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all_single``), which count
the bytes each rank receives per link class (``Ledger``), time the host's wait (``CommClock``) and, in a simulated
cluster (``simulate``), hold each collective until its link would have delivered it. How ring and all-to-all
collectives are charged to intra- and inter-node links: docs/parallel.md#nodes-and-mesh-order.
"""

import contextlib
import os
import time

import attrs
import torch.distributed as dist
from torch import Tensor

# ---- topology -----------------------------------------------------------------------------------------------------


@attrs.frozen
class Topology:
    """Consecutive global ranks share a node, ``ranks_per_node`` of them (how torchrun and every cluster launcher
    number ranks)."""

    ranks_per_node: int

    def __attrs_post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def group_shape(self, ranks) -> tuple[int, int]:
        """(nodes the group spans, the most ranks it has in one node)."""
        per: dict[int, int] = {}
        for r in ranks:
            per[self.node(r)] = per.get(self.node(r), 0) + 1
        return len(per), max(per.values(), default=1)


def launcher_topology(world: int | None = None) -> Topology:
    """The node size the launcher reports: ``Q38_RANKS_PER_NODE`` (a simulated cluster on one host), else
    torchrun's ``LOCAL_WORLD_SIZE``, else one node holding every rank."""
    for var in ("Q38_RANKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        v = os.environ.get(var)
        if v:
            try:
                return Topology(int(v))
            except ValueError:
                raise ValueError(f"{var}={v!r} is not a positive rank count") from None
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    return Topology(max(1, world))


# ---- the price of one collective ---------------------------------------------------------------------------------

RING = ("all_gather", "reduce_scatter", "all_reduce")


@attrs.frozen
class LinkModel:
    """Bandwidths (bytes/s per rank, one direction) and latencies (s) of the two link classes; ``shares``: per
    (collective kind, link class) the (midpoint, low, high) share of the link's bandwidth the collective reaches
    (a hardware profile's ``collectives`` table; absent: the full bandwidth)."""

    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 0.0
    inter_latency: float = 0.0
    shares: tuple = ()

    @classmethod
    def from_hardware(cls, hw) -> "LinkModel":
        shares = tuple(((e.op, e.impl), (e.value, e.low, e.high)) for e in getattr(hw, "collectives", ()))
        return cls(hw.intra_node_bandwidth, hw.inter_node_bandwidth, getattr(hw, "intra_node_latency", 0.0),
                   getattr(hw, "inter_node_latency", 0.0), shares)

    def share(self, kind: str, link: str, end: str = "mid") -> float:
        """The share of ``link``'s bandwidth ``kind`` reaches at ``end`` (``mid``, ``slow``: the range's low end,
        ``fast``: its high end)."""
        for key, (mid, lo, hi) in self.shares:
            if key == (kind, link):
                return {"mid": mid, "slow": lo, "fast": hi}[end]
        return 1.0

    def seconds(self, kind: str, intra_bytes: float | int, inter_bytes: float | int, ranks_per_node: int = 1,
                end: str = "mid") -> float:
        """Time of one collective of ``kind`` receiving these bytes per rank; ``ranks_per_node``: the group's ranks
        in each node (the NICs a ring collective drives); ``end``: which end of the bus-bandwidth range."""
        nics = max(1, ranks_per_node) if kind in RING else 1
        lat = self.inter_latency if inter_bytes else self.intra_latency
        intra = intra_bytes / (self.intra_bandwidth * self.share(kind, "intra", end)) if intra_bytes else 0.0
        inter = (inter_bytes / (self.inter_bandwidth * nics * self.share(kind, "inter", end))
                 if inter_bytes else 0.0)
        return lat + max(intra, inter)


# ---- what this process sent, and the host's wait ------------------------------------------------------------------


class CommClock:
    """Host seconds this process spent inside the step's blocking collectives (observability only: it decides
    nothing). The trainer reads and resets it every step: a rank's own time is its step time minus this, so the
    rank the others wait for is the one with the most own time. On NCCL the collectives return before the device
    has run them, so the waiting shows up where the host next waits for the device instead."""

    seconds = 0.0

    @classmethod
    @contextlib.contextmanager
    def timed(cls):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            cls.seconds += time.perf_counter() - t0

    @classmethod
    def take(cls) -> float:
        s, cls.seconds = cls.seconds, 0.0
        return s


class Ledger:
    """Bytes this rank received through the collective calls of this module, per link class and per collective
    kind, and their number (counted from the tensors passed, not estimated). ``reset()`` starts a new count."""

    bytes: dict = {"intra": 0, "inter": 0}
    by_kind: dict = {}
    calls: int = 0
    model_seconds: float = 0.0  # the link model's time of every collective counted (whether hidden or not)

    @classmethod
    def reset(cls) -> None:
        cls.bytes, cls.by_kind, cls.calls, cls.model_seconds = {"intra": 0, "inter": 0}, {}, 0, 0.0

    @classmethod
    def add(cls, kind: str, intra: int, inter: int) -> None:
        cls.bytes["intra"] += intra
        cls.bytes["inter"] += inter
        k = cls.by_kind.setdefault(kind, {"intra": 0, "inter": 0, "calls": 0})
        k["intra"] += intra
        k["inter"] += inter
        k["calls"] += 1
        cls.calls += 1


# ---- the simulated cluster --------------------------------------------------------------------------------------


class _Sim:
    """The active simulation: link model, topology and this rank's communication queue (when it is next free)."""

    model: LinkModel | None = None
    topology: Topology | None = None
    free_at = 0.0


@contextlib.contextmanager
def simulate(model: LinkModel | None, topology: Topology):
    """Every collective of this module inside the context takes at least its ``model`` time on ``topology``'s links
    (queued one after another per rank): gloo ranks on one host behave like a cluster with slow links. ``model``
    None: only the topology (the ledger classifies bytes by it; nothing is held)."""
    prev = (_Sim.model, _Sim.topology)
    _Sim.model, _Sim.topology, _Sim.free_at = model, topology, 0.0
    try:
        yield
    finally:
        _Sim.model, _Sim.topology = prev


def current_topology() -> Topology:
    return _Sim.topology or launcher_topology()


_RANKS: dict = {}


def _group_ranks(group) -> list[int]:
    key = id(group) if group is not None else None
    hit = _RANKS.get(key)
    if hit is None or hit[0] is not group:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        hit = _RANKS[key] = (group, ranks)
    return hit[1]


def _split(kind: str, group, per_peer: list[int]) -> tuple[int, int, int]:
    """(intra, inter, group ranks per node) of the bytes this rank receives: ``per_peer[i]`` from group rank i."""
    ranks = _group_ranks(group)
    topo = current_topology()
    me = dist.get_rank()
    nodes, per_node = topo.group_shape(ranks)
    if kind in RING:
        total = sum(b for r, b in zip(ranks, per_peer) if r != me)
        return (total, 0, per_node) if nodes == 1 else (0, total, per_node)
    intra = sum(b for r, b in zip(ranks, per_peer) if r != me and topo.node(r) == topo.node(me))
    inter = sum(b for r, b in zip(ranks, per_peer) if topo.node(r) != topo.node(me))
    return intra, inter, per_node


class _HeldWork:
    """An async collective's work whose ``wait`` also holds until the simulated link has delivered it."""

    def __init__(self, work, until: float):
        self.work, self.until = work, until

    def wait(self, *args):
        with CommClock.timed():
            self.work.wait(*args)
            _hold(self.until)
        return True


class _TimedWork:
    def __init__(self, work):
        self.work = work

    def wait(self, *args):
        with CommClock.timed():
            self.work.wait(*args)
        return True


def _hold(until: float) -> None:
    dt = until - time.perf_counter()
    if dt > 0:
        time.sleep(dt)


def _run(kind: str, group, per_peer: list[int], call, async_op: bool):
    intra, inter, per_node = _split(kind, group, per_peer)
    Ledger.add(kind, intra, inter)
    m = _Sim.model
    seconds = m.seconds(kind, intra, inter, per_node) if m is not None else 0.0
    Ledger.model_seconds += seconds
    if m is None:
        if async_op:
            return _TimedWork(call(True))
        with CommClock.timed():
            call(False)
        return None
    start = max(time.perf_counter(), _Sim.free_at)
    _Sim.free_at = until = start + seconds
    if async_op:
        return _HeldWork(call(True), until)
    with CommClock.timed():
        call(False)
        _hold(until)
    return None


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(parts: list[Tensor], x: Tensor, group=None, async_op: bool = False):
    """``dist.all_gather`` counted and timed (and held in a simulation); returns the work when ``async_op``."""
    return _run("all_gather", group, [_nbytes(p) for p in parts],
                lambda a: dist.all_gather(parts, x, group=group, async_op=a), async_op)


def reduce_scatter(out: Tensor, chunks: list[Tensor], group=None, async_op: bool = False):
    """``dist.reduce_scatter`` (sum): each rank receives every peer's contribution to its chunk."""
    return _run("reduce_scatter", group, [_nbytes(out)] * len(chunks),
                lambda a: dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=group, async_op=a), async_op)


def all_reduce(t: Tensor, group=None, op=dist.ReduceOp.SUM, async_op: bool = False):
    """``dist.all_reduce``: a ring reduce-scatter then all-gather, 2 (n - 1) / n of the tensor received per rank."""
    n = len(_group_ranks(group))
    per = 2 * _nbytes(t) // max(n, 1)
    return _run("all_reduce", group, [per] * n, lambda a: dist.all_reduce(t, op=op, group=group, async_op=a),
                async_op)


def all_to_all_single(out: Tensor, inp: Tensor, out_splits=None, in_splits=None, group=None,
                      async_op: bool = False):
    """``dist.all_to_all_single``: each peer's rows (``out_splits[i]`` from group rank i; even when None)."""
    n = len(_group_ranks(group))
    row = _nbytes(out) // max(out.shape[0], 1) if out.dim() else _nbytes(out)
    if out_splits is None:
        per_peer = [_nbytes(out) // n] * n
    else:
        per_peer = [int(s) * row for s in out_splits]
    return _run("all_to_all", group, per_peer, lambda a: dist.all_to_all_single(
        out, inp, out_splits, in_splits, group=group, async_op=a), async_op)
