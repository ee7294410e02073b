"""How ``q38 plan`` prices a layout with a pipeline axis (``pp``; docs/parallel.md#the-pipeline-axis).

The plan first prices the whole model on one stage's ranks (the layout without ``pp``, ``world / pp`` ranks, the
same rows and micro-batches: ``q38.parallel.budget.estimate``), then gives each pipeline rank its part:

- state (master weights, moments, gradients, compute-dtype shards; the optimizer phase): the share of the per-rank
  parameter elements its chunks own, from the stage placements;
- saved activations at the schedule's worst backward (walked from ``q38.parallel.pipeline.schedule``: 1F1B stage
  ``i`` holds ``p - i`` micro-batches of its layers at its first backward), each layer at the bytes its own kind
  saves (``Budget.layer_saved``; the head chunk's MTP layers included), with the gradient accumulator the step keeps
  at that backward (``budget_memory.accumulator_buffers``: the sum alone from the second backward on);
- the moment a micro-batch's gradients are added into the sum (three gradient buffers of the rank's share, the
  other micro-batches' activations still in flight): its own phase (``Budget.accumulate_phase``);
- the async reductions a layer's backward waits beside (``awaiting_units``): a layer's gradients where a chunk of
  the rank has two layers or more, an edge leaf's on the rank with the head, none otherwise;
- the loss workspace on the rank with the head, the model edges on the ranks with the embedding or the head;
- compute: the rank's share of the layer FLOPs (``pipeline.layer_costs``, the split's own cost model) times
  ``(m + (p - 1) / v) / m`` (the bubble: ``(p - 1) / (m + p - 1)`` of a 1F1B step, the idle part divided by ``v``
  interleaved), plus the no-grad forward the pipelined step runs for the aux loss's expert counts when the
  one-process price has none;
- communication: the stage's collectives scaled by the rank's parameter share (gathers, reductions) and layer share
  (EP all-to-all), plus the point-to-point activations and their gradients (``p2p``), not overlapped.

The rank with the largest peak is reported as the budget (``Budget.pipeline`` lists every rank).
"""

import functools
import math

import attrs

from q38.parallel.budget_comm import CommTerm
from q38.parallel.budget_memory import accumulator_buffers
from q38.parallel.hardware import _nbytes
from q38.parallel.param_stats import Item, param_stats
from q38.parallel.pipeline import check_micro_batches, check_model, layer_costs, schedule

# items that hold the parameters' state (scale with the rank's parameter share)
STATE_ITEMS = ("master weights", "optimizer moments", "compute-dtype shards", "gradient accumulator", "gradients",
               "new compute-dtype shards", "new weights and moments", "fp32 gradients for the update",
               "update temporaries", "gradient sum", "micro-batch gradients", "new gradient sum", "frozen base",
               "adapter master weights")


@attrs.frozen
class StageRow:
    """One pipeline rank in the plan."""

    rank: int
    layers: tuple[tuple[int, int], ...]  # its chunks' (first, last) layers
    param_share: float  # of the per-rank parameter elements of the whole model on a stage's ranks
    in_flight_layers: int  # the most layers × micro-batches of saved activations the schedule holds at once
    peak_bytes: float
    compute_s: float  # its compute over the step, bubble excluded
    p2p_bytes: float  # sent per step (activations forward, gradients back)


def in_flight_layers(chunks, pp: int, v: int, m: int, rank: int) -> int:
    """The most layer-micro-batches of saved activations ``rank`` holds at once under the schedule (a chunk's
    forward holds its layers' activations until its backward)."""
    size = {c.index: len(c.layers) for c in chunks}
    live = most = 0
    for a in schedule(pp, v, m, rank):
        live += size[a.chunk] if a.kind == "F" else -size[a.chunk]
        most = max(most, live)
    return most


def backward_peaks(chunks, pp: int, v: int, m: int, rank: int) -> list[tuple[int, bool]]:
    """At each backward of ``rank``'s schedule: ``(layer-micro-batches of saved activations alive, whether a
    gradient accumulator exists)`` (it does from the second backward on). The activations peak at the first
    backward; the accumulator appears only after it, with fewer micro-batches in flight."""
    size = {c.index: len(c.layers) for c in chunks}
    live, done, out = 0, 0, []
    for a in schedule(pp, v, m, rank):
        if a.kind == "F":
            live += size[a.chunk]
        else:
            out.append((live, done > 0))
            live -= size[a.chunk]
            done += 1
    return out


def saved_backward_peaks(chunks, pp: int, v: int, m: int, rank: int, size: dict) -> list[tuple[float, float, int]]:
    """At each backward of ``rank``'s schedule, with ``size`` the bytes a chunk's forward saves for one micro-batch:
    ``(saved bytes alive during it, saved bytes alive once it has freed its own, its index among the rank's
    backwards)``: the accumulator the step keeps depends on that index (``budget_memory.accumulator_buffers``)."""
    live, k, out = 0.0, 0, []
    for a in schedule(pp, v, m, rank):
        if a.kind == "F":
            live += size[a.chunk]
        else:
            out.append((live, live - size[a.chunk], k))
            live -= size[a.chunk]
            k += 1
    return out


def awaiting_units(chunks, rank: int) -> tuple[bool, bool]:
    """What gradients can wait for their async reduction while a layer of ``rank`` runs its backward: those of the
    gather call back-propagated just before it in the same chunk's backward (``runtime.grad`` waits for all of a
    chunk's at its end). ``(a layer's, an edge leaf's)``: a layer's where a chunk of the rank has two layers or more;
    an edge's (the LM head's before the MTP layers, the MTP block's projection before the last layer) on the rank
    with the head; neither on a rank whose chunks are single layers without the head."""
    mine = [c for c in chunks if c.rank == rank]
    return any(len(c.layers) > 1 for c in mine), any(c.head for c in mine)


@attrs.frozen
class _Part:
    share: float  # of the parameter elements
    layers: int  # of the model
    embed: bool
    head: bool
    saved: float = 0.0  # bytes of saved activations alive at the rank's worst backward
    live: int = 0  # layer-micro-batches in flight at that backward
    awaiting: tuple[bool, bool] = (True, True)  # awaiting_units of the rank


def _scaled(items, part: _Part) -> tuple:
    """One pipeline rank's items from the whole model's on a stage's ranks: the state items by its parameter share,
    the activations as ``part.saved``, the edges and the loss only where the rank holds them."""
    out = []
    for it in items:
        if it.name == "activations (saved)":
            it = attrs.evolve(it, bytes=part.saved,
                              note=f"{part.live} layer × micro-batch(es) in flight at the worst backward, each layer "
                                   "its own kind's bytes (the head stage's MTP layers included)")
        elif it.name in STATE_ITEMS:
            it = attrs.evolve(it, bytes=it.bytes * part.share,
                              note=f"{it.note}; this stage holds {part.share:.1%} of that")
        elif (it.name == "loss workspace" and not part.head) or (it.name == "model edges"
                                                                 and not (part.embed or part.head)):
            continue
        out.append(it)
    return tuple(out)


def _awaiting(items, units: tuple[bool, bool], ps, red: int, freed: float) -> tuple:
    """The async-reduction items of a rank, sized by what can wait on it (``awaiting_units``): the largest layer's
    full-size gradients, an edge leaf's, or none (the whole model's price takes the larger of the two everywhere)."""
    full = max(ps.largest_layer if units[0] else 0, ps.largest_edge if units[1] else 0) * red
    what = "a layer" if units[0] and ps.largest_layer >= (ps.largest_edge if units[1] else 0) else "an edge leaf"
    out = []
    for it in items:
        if it.name in ("gradients awaiting reduction", "reduce-scatter staging"):
            if not full:
                continue
            if it.name.startswith("gradients"):
                it = attrs.evolve(it, bytes=full, note=f"{what}'s full-size gradients, reduce-scatter in flight "
                                                       "(async), the one back-propagated before on this rank")
            else:
                it = attrs.evolve(it, bytes=max(0.0, full + ps.largest_layer_local * red - freed))
        out.append(it)
    return tuple(out)


@functools.lru_cache(maxsize=32)
def _stage_facts(cfg, layout, world: int, prefetch: bool):
    """What a pipelined layout's plan needs beyond the batch (the search prices many batches of one layout):
    ``(mesh sizes, chunks, stage layout, stage placements, each rank's share of the per-rank parameter elements,
    the stage's ParamStats)``. Raises the layout's errors (``check_model``)."""
    from q38.model import abstract_params
    from q38.parallel.pipeline import owns

    sizes = layout.resolve_mesh(world)
    chunks = check_model(layout, cfg)
    stage_sizes = {n: s for n, s in sizes.items() if n != "pp"}
    stage = layout.stage_layout().with_mesh(**stage_sizes)
    pl = stage.placements(abstract_params(cfg), stage_sizes)
    local = {p: math.prod(x.shape) / x.shard_factor for p, x in pl.items()}
    total = sum(local.values())
    shares = tuple(sum(n for p, n in local.items() if owns(chunks, r, p)) / total for r in range(sizes["pp"]))
    return sizes, chunks, stage, pl, shares, param_stats(pl, stage_sizes, prefetch)


def estimate_pipelined(estimate, cfg, layout, world: int, **kw):
    """The budget of ``layout`` (with ``pp``) on ``world`` ranks: the fullest pipeline rank's, ``pipeline`` listing
    every rank. ``estimate``: ``q38.parallel.budget.estimate`` (the one-stage price)."""
    sizes, chunks, stage, pl, shares, ps = _stage_facts(cfg, layout, world, bool(kw.get("prefetch", True)))
    pp = sizes["pp"]
    m = int(kw.get("micro_batches", 1))
    check_micro_batches(layout, m)
    v = len(chunks) // pp
    stage_world = world // pp
    base = estimate(cfg, stage, stage_world, **{**kw, "placements": pl})
    per, emb, head = layer_costs(cfg, kw.get("seq_len", 4096))
    all_cost = sum(per) + emb + head
    L = cfg.num_hidden_layers
    act_bytes = 2 if kw.get("param_dtype", "bf16") in ("bf16", "bfloat16", "fp16", "float16") else 4
    seq = kw["seq_len"] // sizes.get("cp", 1)
    rows_mb = kw["rows_per_rank"] / m
    bundle = rows_mb * seq * cfg.hidden_size * (1 + cfg.mtp_num_layers) * act_bytes  # one boundary, one micro-batch
    has_aux_pass = base.flops.aux_forward > 0
    # a stage's compute is a share of the whole model's, priced per op: its spread is the whole model's (the ops'
    # efficiency ranges at their slow and fast ends, over the midpoint)
    spread = base.compute_spread
    if base.ops and base.compute_s:
        spread = tuple(sum(o.at(end)[0] for o in base.ops) / sum(o.at("mid")[0] for o in base.ops)
                       for end in ("slow", "fast"))
    # saved activations: each chunk's own layers (the head chunk's MTP depths too), at the bytes their kind saves
    n_kinds = L + cfg.mtp_num_layers
    layer_saved = base.layer_saved or (0.0,) * n_kinds
    size = {c.index: sum(layer_saved[i] for i in c.layers) + (sum(layer_saved[L:]) if c.head else 0.0)
            for c in chunks}
    count = {c.index: len(c.layers) + (cfg.mtp_num_layers if c.head else 0) for c in chunks}
    acc_item = next((it for it in base.memory if it.name == "gradient accumulator"), None)
    acc_unit = acc_item.bytes / accumulator_buffers(m - 1) if acc_item is not None else 0.0  # one buffer, every rank
    red = _nbytes(kw.get("reduce_dtype", "fp32"))
    rows, budgets = [], []
    for r in range(pp):
        mine = [c for c in chunks if c.rank == r]
        share = shares[r]
        live = in_flight_layers(chunks, pp, v, m, r)
        embed, owns_head = any(c.embed for c in mine), any(c.head for c in mine)
        cost = sum(per[i] for c in mine for i in c.layers) + (emb if embed else 0.0) + (head if owns_head else 0.0)
        c_share = cost / all_cost

        # the worst backward: the saved activations alive then + the accumulator the step keeps at that point
        peaks = saved_backward_peaks(chunks, pp, v, m, r, size)
        during, _, k = max(peaks, key=lambda p: p[0] + acc_unit * share * accumulator_buffers(p[2], True))
        n_live = saved_backward_peaks(chunks, pp, v, m, r, count)[k][0]
        part = _Part(share, L, embed, owns_head, during, int(n_live), awaiting_units(chunks, r))
        fb = [attrs.evolve(it, bytes=acc_unit * accumulator_buffers(k, True),
                           note="the first micro-batch's gradients" if k == 1 else "the sum of earlier micro-batches "
                           "(a pipelined backward's own gradients are local to it)")
              if it.name == "gradient accumulator" else it for it in base.memory]
        fb = [it for it in fb if not (it.name == "gradient accumulator" and not it.bytes)]
        recv = Item("pipeline receive buffer", bundle, "one micro-batch's activations from the previous stage")
        memory = _awaiting(_scaled(fb, part), part.awaiting, ps, red, min(layer_saved)) + (recv,)
        acc_phase = ()
        if base.accumulate_phase:  # adding a later micro-batch's gradients: the other micro-batches' activations
            after = max(p[1] for p in peaks if p[2] >= 1)  # still in flight stay alive
            acc_phase = _scaled(base.accumulate_phase, part) + (
                Item("activations (saved)", after, "the other micro-batches in flight"), recv)
        boundaries = sum(1 for c in mine if not c.head)
        p2p = 2 * boundaries * m * bundle  # forward activations and backward gradients
        aux_pass = 0.0 if has_aux_pass or kw.get("aux_loss_type") == "sequence" else base.compute_fwd_s
        compute = (base.compute_s + aux_pass) * c_share
        comm = tuple(attrs.evolve(t, **{f: getattr(t, f) * (c_share if t.mesh_dim == "ep" else share)
                                        for f in ("bytes", "seconds", "inter_bytes", "slow_s", "fast_s")})
                     for t in base.comm)
        hw = kw.get("hardware")
        inter = hw.inter_node_bandwidth if hw is not None else None  # stages are nodes apart (pp is the outer dim)
        comm += (CommTerm("send/recv", "pp", p2p, "inter", p2p / inter if inter else 0.0, False, "backward", p2p),)
        b = attrs.evolve(base, memory=memory, optimizer_phase=_scaled(base.optimizer_phase, part), comm=comm,
                         start_phase=_scaled(base.start_phase, part), accumulate_phase=acc_phase, ops=(),
                         compute_spread=spread,
                         compute_s=compute * (m + (pp - 1) / v) / m, compute_fwd_s=base.compute_fwd_s * c_share,
                         layout=layout.name, mesh=tuple(sizes.items()), world=world)
        rows.append(StageRow(r, tuple((c.first, c.last) for c in mine), share, live, b.peak_bytes, compute, p2p))
        budgets.append(b)
    worst = max(range(pp), key=lambda r: budgets[r].peak_bytes)
    slowest = max(rows, key=lambda row: row.compute_s)
    fl = base.flops  # a rank runs 1/pp of the model's FLOPs on average (MFU's numerator per rank)
    fl = attrs.evolve(fl, **{k: getattr(fl, k) / pp for k in ("dense", "experts", "attention", "gdn_core", "head",
                                                                "recompute", "aux_forward")})
    return attrs.evolve(budgets[worst], pipeline=tuple(rows), flops=fl,
                        compute_s=slowest.compute_s * (m + (pp - 1) / v) / m)


def format_pipeline(b) -> list[str]:
    """The plan's lines for a pipelined budget: the schedule's bubble and one line per pipeline rank."""
    from q38.parallel.pipeline import bubble_fraction

    rows = b.pipeline
    pp = len(rows)
    v = max(len(r.layers) for r in rows)
    m = b.micro_batches
    lines = [(f"pipeline: pp={pp}, {v} chunk(s) a rank, {m} micro-batches: bubble {bubble_fraction(pp, m, v):.1%} "
              f"of the step ((p-1)/(m+p-1){f' / v, v={v}' if v > 1 else ''})")]
    for r in rows:
        ranges = ", ".join(f"{a}-{z}" for a, z in r.layers)
        lines.append(f"  stage {r.rank}: layers {ranges}; {r.param_share:.1%} of the parameters; "
                     f"{r.in_flight_layers} layer-micro-batches of activations in flight; peak "
                     f"{r.peak_bytes / 2**30:,.2f} GiB; compute {r.compute_s * 1e3:,.1f} ms; p2p "
                     f"{r.p2p_bytes / 2**20:,.1f} MiB sent")
    return lines

