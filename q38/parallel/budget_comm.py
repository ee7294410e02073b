"""The communication side of the budget: every collective of a step per group, with its bytes and its time on the
links its group spans (``links.LinkModel``); the EP exchange per dispatch (docs/plan.md#what-the-budget-counts)."""

import functools
import math

import attrs

from q38.model_config import ModelConfig
from q38.layers.kinds import MIXER_KINDS, Workload, kept_regions
from q38.parallel.budget_memory import _Step
from q38.parallel.hardware import Hardware
from q38.parallel.links import LinkModel, Topology
from q38.parallel.param_stats import ParamStats


@attrs.frozen
class CommTerm:
    """One collective over one mesh dim: bytes received per rank in a step, and its exposed time."""

    collective: str
    mesh_dim: str  # the mesh dims of the group, joined by "·" when one collective spans several
    bytes: float
    link: str  # intra | inter (some of its bytes cross nodes: ``inter_bytes``)
    seconds: float
    overlapped: bool  # issued async by the runtime, hidden behind the compute of its phase as far as that lasts
    phase: str = "forward"  # forward | backward (recompute and gradient reductions run in backward)
    inter_bytes: float = 0.0
    slow_s: float = attrs.field(default=None)  # at the low end of the profile's bus-bandwidth range
    fast_s: float = attrs.field(default=None)  # at its high end

    def __attrs_post_init__(self) -> None:
        for f in ("slow_s", "fast_s"):
            if getattr(self, f) is None:
                object.__setattr__(self, f, self.seconds)

    def at(self, end: str) -> float:
        return {"mid": self.seconds, "slow": self.slow_s, "fast": self.fast_s}[end]



@functools.lru_cache(maxsize=256)
def group_shape(mesh_items: tuple, dims: tuple, devices_per_node: int) -> tuple[int, int, int]:
    """(ranks, nodes spanned, ranks in each node) of a group over mesh dims ``dims``: ranks are numbered row-major
    over the mesh (the last mesh dim innermost) and consecutive ranks share a node, so every group of these dims
    has the shape of rank 0's."""
    names = [n for n, _ in mesh_items]
    sizes = dict(mesh_items)
    ranks = [0]
    for d in dims:
        stride = math.prod(sizes[n] for n in names[names.index(d) + 1:])
        ranks = [r + i * stride for r in ranks for i in range(sizes[d])]
    topo = Topology(devices_per_node)
    nodes, per_node = topo.group_shape(ranks)
    return len(ranks), nodes, per_node


def _comm_terms(cfg: ModelConfig, st: _Step, ps: ParamStats, kinds: list, hw: Hardware | None,
                moe_compute_s: float = 0.0, reduced: ParamStats | None = None) -> list[CommTerm]:
    """Every collective of the step per group: FSDP gathers (prefetched or not, again for recompute or after a
    reshard), gradient reduce-scatters and all-reduces, the EP all-to-all, each mixer kind's CP exchange; each
    priced by ``links.LinkModel`` on the links its group spans. ``moe_compute_s``: the routed and shared experts'
    compute of the step (what an overlapped EP exchange can hide behind). ``reduced``: the parameters whose
    gradients are reduced when not all of ``ps`` (a LoRA run: the adapters)."""
    comm: list[CommTerm] = []
    reduced = reduced or ps
    mesh, mb, act, red, recompute = st.mesh, st.micro_batches, st.act, st.red, st.recompute
    items = tuple(mesh.items())
    model = LinkModel.from_hardware(hw) if hw else None

    def shape(dims: tuple) -> tuple[int, int, int]:
        if hw:
            return group_shape(items, dims, hw.devices_per_node)
        n = math.prod(mesh[d] for d in dims)
        return n, 1, n  # no hardware: one node

    def add(coll: str, dims, nbytes: float | int, overlapped: bool = False, phase: str = "forward",
            kind: str = "all_gather", inter: float | None = None) -> None:
        if nbytes <= 0:
            return
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        n, nodes, per_node = shape(dims)
        if inter is None:  # ring collectives: all through the NIC once the group spans nodes; all-to-all: per peer
            inter = (nbytes if nodes > 1 else 0.0) if kind != "all_to_all" else nbytes * (n - per_node) / max(n - 1, 1)
        secs = {end: model.seconds(kind, nbytes - inter, inter, per_node, end) if model else 0.0
                for end in ("mid", "slow", "fast")}
        comm.append(CommTerm(coll, "·".join(dims), nbytes, "inter" if inter > 0 else "intra", secs["mid"],
                             overlapped, phase, inter, slow_s=secs["slow"], fast_s=secs["fast"]))

    re_gather = recompute != "none" or st.resharded
    groups = list(dict.fromkeys([*ps.gather_group, *ps.layer_gather]))
    for g in sorted(groups, key=lambda g: [list(mesh).index(x) for x in g]):
        per_mb_fwd = ps.gather_group.get(g, 0.0) * act
        pre = ps.gather_prefetchable.get(g, 0.0) * act
        add("all-gather fwd (prefetched)", g, pre * mb, overlapped=True)
        add("all-gather fwd", g, (per_mb_fwd - pre) * mb)
        if recompute != "none":  # prefetched behind the recompute of the layer after it (MeshRuntime, "behind")
            ahead = ps.recompute_prefetchable.get(g, 0.0) * act
            add("all-gather recompute (prefetched)", g, ahead * mb, overlapped=True, phase="backward")
            add("all-gather recompute", g, (ps.layer_gather.get(g, 0.0) * act - ahead) * mb, phase="backward")
        elif re_gather:
            add("all-gather backward (reshard)", g, ps.layer_gather.get(g, 0.0) * act * mb, phase="backward")
        add("reduce-scatter grads", g, reduced.gather_group.get(g, 0.0) * red * mb, overlapped=st.async_reduce,
            phase="backward", kind="reduce_scatter")
    for g, elems in reduced.allreduce_dim.items():
        add("all-reduce grads", g, elems * red * mb, overlapped=st.async_reduce, phase="backward", kind="all_reduce")
    if st.ep > 1:
        _ep_terms(cfg, st, kinds, add, shape, moe_compute_s, model)
    if st.cp > 1:
        w = Workload(rows=st.rows_mb, seq=st.seq, cp=st.cp, act_bytes=act)
        keep = kept_regions(recompute)
        for kind in MIXER_KINDS.values():
            ex = kind.cp_exchange(cfg, w)
            times = ex.recompute_calls if recompute != "none" and kind.region not in keep else ex.calls
            per_call = ex.bytes * sum(1 for k in kinds if k is kind) * mb
            if ex.early and st.cp_early:
                # the forward call (and its rerun on recompute) is in flight during the layer's compute that does not
                # need it; the backward's reduce-scatter is synchronous
                add(ex.collective, "cp", per_call, overlapped=True)
                if times > ex.calls:
                    add(f"{ex.collective} (recompute)", "cp", per_call * (times - ex.calls), overlapped=True,
                        phase="backward")
                add(f"{ex.collective} (backward)", "cp", per_call * (ex.calls - 1), phase="backward")
            else:
                add(ex.collective, "cp", per_call * times)
    return comm


def distinct_nodes(experts: int, top_k: int, nodes: int) -> float:
    """Expected number of distinct nodes a token's ``top_k`` experts sit on, the ``experts`` split evenly over
    ``nodes`` and chosen uniformly without replacement: ``nodes · (1 − C(E − E/nodes, k) / C(E, k))``."""
    if nodes <= 1:
        return 1.0
    per = experts // nodes
    miss = math.comb(experts - per, top_k) / math.comb(experts, top_k)
    return nodes * (1.0 - miss)


def ep_exchange_bytes(cfg: ModelConfig, act: int, ep: int, nodes: int, per_node: int,
                      hierarchical: bool) -> tuple[float, float, float, float]:
    """Bytes one token's routed slots make a rank receive in one MoE layer's forward exchange (dispatch and
    combine), uniform routing: ``(intra float, intra int, inter float, inter int)``, as q38.parallel.ep sends them.
    Flat: each slot off the rank carries its row, gate weight and int64 expert key out, its output row back.
    Hierarchical (several nodes): the slots of a token on one remote node are one unit that crosses once (the row,
    then ``k`` keys and weights) to the rank of the same local index there, which fans its slots out to their
    owners inside the node and sends the unit's summed output back once; own-node slots go straight to their
    owners."""
    d, k = cfg.hidden_size, cfg.num_experts_per_tok
    row, meta = d * act, act + 8
    remote = k * (nodes - 1) / nodes  # slots on other nodes
    own = k * (per_node - 1) / ep  # slots on other ranks of this node
    if hierarchical and nodes > 1:
        units = distinct_nodes(cfg.num_experts, k, nodes) * (nodes - 1) / nodes  # remote nodes the token reaches
        relayed = remote * (per_node - 1) / per_node  # relayed slots whose owner is not the landing rank
        intra = relayed + own
        return intra * (2 * row + act), intra * 8, units * (2 * row + k * act), units * k * 8
    return own * (row + meta - 8 + row), own * 8, remote * (row + meta - 8 + row), remote * 8


def _ep_terms(cfg: ModelConfig, st: _Step, kinds: list, add, shape, moe_compute_s: float, model) -> None:
    """The EP exchanges of every MoE layer (``ep_exchange_bytes`` per token): the forward, its rerun when the layer
    is recomputed, and the reverse exchange of the float parts in backward. With ``ep_overlap`` the forward
    exchanges (and their rerun) of one half of the tokens are in flight while the other half's experts and the
    shared expert compute; the backward exchanges are synchronous."""
    n_tok = st.n_mb * len(kinds) * st.micro_batches  # tokens through MoE layers per pass
    ep, nodes, per_node = shape(("ep",))
    f_in, i_in, f_out, i_out = ep_exchange_bytes(cfg, st.act, ep, nodes, per_node,
                                                 st.ep_dispatch == "hierarchical")
    fwd = (n_tok * (f_in + i_in), n_tok * (f_out + i_out))  # (intra, inter) bytes of one forward pass
    rev = (n_tok * f_in, n_tok * f_out)
    passes = [("forward", fwd, True)]
    if st.recompute != "none":
        passes.append(("backward", fwd, True))
    passes.append(("backward", rev, False))
    for phase, (b_intra, b_inter), forward in passes:
        share = 0.0
        if st.ep_overlap and forward and model is not None:
            # one half's exchange in flight while the other half computes: hidden at most for as long as the
            # experts' and shared expert's forward lasts (a third of their forward + backward compute)
            half = model.seconds("all_to_all", b_intra / 2, b_inter / 2)
            share = 0.5 * min(1.0, moe_compute_s / 3 / half) if half else 0.0
            add("all-to-all tokens (overlapped)", "ep", (b_intra + b_inter) * share, overlapped=True, phase=phase,
                kind="all_to_all", inter=b_inter * share)
        name = "all-to-all tokens" if forward else "all-to-all tokens (reverse)"
        add(name, "ep", (b_intra + b_inter) * (1 - share), phase=phase, kind="all_to_all",
            inter=b_inter * (1 - share))
