"""How ``q38 plan`` prices a layout with a pipeline axis (``pp``; docs/parallel.md#the-pipeline-axis).

The plan first prices the whole model on one stage's ranks (the layout without ``pp``, ``world / pp`` ranks, the
same rows and micro-batches: ``q38.parallel.budget.estimate``), then gives each pipeline rank its part:

- state (master weights, moments, gradients, their accumulator, compute-dtype shards; the optimizer phase): the
  share of the per-rank parameter elements its chunks own, from the stage placements;
- saved activations: the most layers' worth of micro-batches the schedule keeps in flight on that rank (walked
  from ``q38.parallel.pipeline.schedule``: 1F1B stage ``i`` holds ``p - i`` micro-batches of its layers);
- the loss workspace on the rank with the head, the model edges on the ranks with the embedding or the head;
- compute: the rank's share of the layer FLOPs (``pipeline.layer_costs``, the split's own cost model) times
  ``(m + (p - 1) / v) / m`` (the bubble: ``(p - 1) / (m + p - 1)`` of a 1F1B step, the idle part divided by ``v``
  interleaved), plus the no-grad forward the pipelined step runs for the aux loss's expert counts when the
  one-process price has none;
- communication: the stage's collectives scaled by the rank's parameter share (gathers, reductions) and layer share
  (EP all-to-all), plus the point-to-point activations and their gradients (``p2p``), not overlapped.

The rank with the largest peak is reported as the budget (``Budget.pipeline`` lists every rank).
"""

import math

import attrs

from q38.parallel.budget_comm import CommTerm
from q38.parallel.param_stats import Item
from q38.parallel.pipeline import check_micro_batches, check_model, layer_costs, schedule

# items that hold the parameters' state (scale with the rank's parameter share)
STATE_ITEMS = ("master weights", "optimizer moments", "compute-dtype shards", "gradient accumulator", "gradients",
               "new compute-dtype shards", "new weights and moments", "fp32 gradients for the update",
               "update temporaries")


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


@attrs.frozen
class _Part:
    share: float  # of the parameter elements
    live: int  # layer-micro-batches in flight
    layers: int  # of the model
    embed: bool
    head: bool
    peaks: tuple = ()  # backward_peaks of the rank


def _scaled(items, part: _Part, act_scale: float | None) -> tuple:
    """One pipeline rank's items from the whole model's on a stage's ranks. Forward/backward phase
    (``act_scale`` given): the saved activations and the gradient accumulator at the schedule's worst backward
    (``part.peaks``: the largest of ``live`` layer-micro-batches + the accumulator when one exists)."""
    out = []
    if act_scale is not None:
        by = {it.name: it for it in items}
        act = by.get("activations (saved)")
        acc = by.get("gradient accumulator")
        per_layer = act.bytes / part.layers if act is not None else 0.0
        acc_bytes = acc.bytes * part.share if acc is not None else 0.0
        live, with_acc = max(part.peaks, key=lambda p: p[0] * per_layer + (acc_bytes if p[1] else 0.0))
        part = attrs.evolve(part, live=live)
        items = [attrs.evolve(it, bytes=live * per_layer) if it.name == "activations (saved)" else it
                 for it in items if not (it.name == "gradient accumulator" and not with_acc)]
        act_scale = None
    for it in items:
        if it.name == "activations (saved)":
            it = attrs.evolve(it, note=f"{part.live} layer × micro-batch(es) in flight at the worst backward "
                                       f"(of {part.layers} layers × 1 micro-batch)")
        elif it.name in STATE_ITEMS:
            it = attrs.evolve(it, bytes=it.bytes * part.share, note=f"{it.note}; this stage's {part.share:.1%}")
        elif (it.name == "loss workspace" and not part.head) or (it.name == "model edges"
                                                                 and not (part.embed or part.head)):
            continue
        out.append(it)
    return tuple(out)


def estimate_pipelined(estimate, cfg, layout, world: int, **kw):
    """The budget of ``layout`` (with ``pp``) on ``world`` ranks: the fullest pipeline rank's, ``pipeline`` listing
    every rank. ``estimate``: ``q38.parallel.budget.estimate`` (the one-stage price)."""
    from q38.model import abstract_params
    from q38.parallel.pipeline import owns

    sizes = layout.resolve_mesh(world)
    pp = sizes["pp"]
    chunks = check_model(layout, cfg)
    m = int(kw.get("micro_batches", 1))
    check_micro_batches(layout, m)
    v = len(chunks) // pp
    stage = layout.stage_layout().with_mesh(**{n: s for n, s in sizes.items() if n != "pp"})
    stage_world = world // pp
    base = estimate(cfg, stage, stage_world, **kw)
    stage_sizes = {n: s for n, s in sizes.items() if n != "pp"}
    pl = stage.placements(abstract_params(cfg), stage_sizes)
    local = {p: math.prod(x.shape) / x.shard_factor for p, x in pl.items()}
    total_local = sum(local.values())
    per, emb, head = layer_costs(cfg, kw.get("seq_len", 4096))
    all_cost = sum(per) + emb + head
    L = cfg.num_hidden_layers
    act_bytes = 2 if kw.get("param_dtype", "bf16") in ("bf16", "bfloat16", "fp16", "float16") else 4
    seq = kw["seq_len"] // sizes.get("cp", 1)
    rows_mb = kw["rows_per_rank"] / m
    bundle = rows_mb * seq * cfg.hidden_size * (1 + cfg.mtp_num_layers) * act_bytes  # one boundary, one micro-batch
    has_aux_pass = base.flops.aux_forward > 0
    rows, budgets = [], []
    for r in range(pp):
        mine = [c for c in chunks if c.rank == r]
        share = sum(n for p, n in local.items() if owns(chunks, r, p)) / total_local
        live = in_flight_layers(chunks, pp, v, m, r)
        embed, owns_head = any(c.embed for c in mine), any(c.head for c in mine)
        cost = sum(per[i] for c in mine for i in c.layers) + (emb if embed else 0.0) + (head if owns_head else 0.0)
        c_share = cost / all_cost

        part = _Part(share, live, L, embed, owns_head, tuple(backward_peaks(chunks, pp, v, m, r)))
        memory = _scaled(base.memory, part, 1.0)
        memory += (Item("pipeline receive buffer", bundle, "one micro-batch's activations from the previous stage"),)
        boundaries = sum(1 for c in mine if not c.head)
        p2p = 2 * boundaries * m * bundle  # forward activations and backward gradients
        aux_pass = 0.0 if has_aux_pass or kw.get("aux_loss_type") == "sequence" else base.compute_fwd_s
        compute = (base.compute_s + aux_pass) * c_share
        comm = tuple(attrs.evolve(t, bytes=t.bytes * (c_share if t.mesh_dim == "ep" else share),
                                  seconds=t.seconds * (c_share if t.mesh_dim == "ep" else share),
                                  inter_bytes=t.inter_bytes * (c_share if t.mesh_dim == "ep" else share))
                     for t in base.comm)
        hw = kw.get("hardware")
        inter = hw.inter_node_bandwidth if hw is not None else None  # stages are nodes apart (pp is the outer dim)
        comm += (CommTerm("send/recv", "pp", p2p, "inter", p2p / inter if inter else 0.0, False, "backward", p2p),)
        b = attrs.evolve(base, memory=memory, optimizer_phase=_scaled(base.optimizer_phase, part, None), comm=comm,
                         start_phase=_scaled(base.start_phase, part, None), ops=(),
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

