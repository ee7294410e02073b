"""The step's forward and backward on a mesh with a pipeline axis (``pp``): the same objective as one process
(docs/objective.md), run chunk by chunk in the layout's schedule (``q38.parallel.pipeline``).

How the one-process math is kept:

- global normalisers (valid main / MTP targets, counted aux tokens) are counted before any forward over the stage's
  data ranks (every stage sees the same rows), as ``step_context`` does;
- the aux loss needs every layer's expert counts (``pooled``: summed over layers) before any chunk's backward, so the
  step first runs a no-grad forward of every micro-batch through the pipeline and sums the counts of all layers over
  every rank (per micro-batch for ``micro_batch`` scope; the one-process step does this pass too for ``global_batch``
  scope with several micro-batches); given the counts, the aux loss is a sum of per-layer terms, and each chunk adds
  its own layers' share to its backward (the ``sequence`` form is per layer already);
- every term but the aux loss (the main and MTP terms, a policy-gradient objective's terms: any ``Term``) runs on
  the last chunk, which owns the head and the MTP block; the per-token values a term reads (a policy batch's
  log-probs and advantages) are in every stage's copy of the micro-batch (``pp`` does not split the batch); the MTP
  depths' input embeddings are made by the first chunk (it owns the embedding) and travel with the residual stream;
  a head term's ``TermInput.routes`` is None (router statistics are per stage; the aux term is built stage by stage);
- each chunk's backward is one ``runtime.grad`` over its outputs (the received output gradients, 1 for its
  losses); gradients are accumulated per leaf over micro-batches in ``reduce_dtype``, as one process does;
- metrics (terms, router loads) are summed over every rank (a ``max`` term: its max over micro-batches and every
  rank), the gradient norm over stages.
"""

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from q38.errors import ConfigError
from q38.model import ChunkOutput, forward_chunk
from q38.parallel.pipeline import PipeLink, check_micro_batches, forward_order, run_schedule, schedule
from q38.train.core.objective import (
    TermInput,
    _segment_index,
    aux_from_stats,
    aux_mask,
    aux_term,
    expert_counts,
    prob_sums,
    routing,
    sequence_aux,
    step_context,
)

DEFAULT_TERM_NAMES = ("loss", "aux")


def accumulate(acc: list, g: tuple, reduce_dtype) -> list:
    """Micro-batch gradient accumulation in ``reduce_dtype`` (the mixed-precision policy; fp32 by default)."""
    return [
        gi if a is None else (a if gi is None else a.to(reduce_dtype) + gi.to(reduce_dtype))
        for a, gi in zip(acc, g)
    ]


@attrs.frozen
class PipelineResult:
    grads: list
    sums: dict  # term name -> Σ over every rank (reduced)
    router_load: Tensor
    grad_norm: Tensor
    ctx: object  # StepContext


def _split_terms(terms) -> tuple[list, list]:
    """``(aux terms, head terms)``: the load-balancing term (``objective.aux_term``) is added chunk by chunk, each
    stage its own layers' share; every other term runs on the last chunk, which owns the head."""
    aux = [t for t in terms if t.fn is aux_term]
    if len(aux) > 1:
        raise ConfigError(f"the objective has {len(aux)} load-balancing terms ({', '.join(t.name for t in aux)}); "
                          "keep one")
    return aux, [t for t in terms if t.fn is not aux_term]


def pipelined_grads(state, mbs, mesh, runtime, hooks, regions, terms, p, trained) -> PipelineResult:
    """Forward and backward of the objective ``terms`` over micro-batches ``mbs`` on pipelined ``mesh``; ``runtime``
    is the stage mesh's runtime (bound to ``p``), ``trained`` the leaves of ``p`` that train (this stage's)."""
    mc, tc = state.model_config, state.train_config
    aux_terms, head_terms = _split_terms(terms)
    check_micro_batches(mesh.layout, len(mbs))
    chunks, pp, rank = mesh.chunks, mesh.pp, mesh.pp_rank
    v = len(chunks) // pp
    n_layers = mc.num_hidden_layers + mc.mtp_num_layers  # router tables: main layers, then MTP depths
    e = mc.num_experts
    bias = state.router_bias
    pp_group = mesh.group("pp")
    dev = runtime.device
    m = len(mbs)

    def run_chunk(c, mb, inputs):
        info = attrs.evolve(runtime.seq_info(mb), kernels=state.kernels, region=regions.enter)
        if chunks[c].embed:
            return forward_chunk(p, chunks[c].layers, mc, input_ids=mb.input_ids, mtp_input_ids=mb.mtp_inputs,
                                 info=info, hooks=hooks, router_bias=bias)
        return forward_chunk(p, chunks[c].layers, mc, x=inputs[0], mtp_embeds=tuple(inputs[1:]), info=info,
                             hooks=hooks, router_bias=bias)

    def layer_ids(c) -> list[int]:
        ids = list(chunks[c].layers)
        if chunks[c].head:
            ids += [mc.num_hidden_layers + d for d in range(mc.mtp_num_layers)]
        return ids

    def input_shapes(c, mb):
        shape = (*mbs[mb].input_ids.shape, mc.hidden_size)
        return [shape] * (1 + mc.mtp_num_layers)

    aux_kind = tc.aux_loss_type
    # 1. expert counts of every layer, per micro-batch, before any backward (a no-grad pipelined forward)
    counts_mb = None
    if aux_terms and aux_kind != "sequence":
        table = torch.zeros(m, n_layers, e, device=dev)

        def count_forward(c, i, inputs):
            out = run_chunk(c, mbs[i], inputs)
            ids = layer_ids(c)
            routes = routing(out.router_logits, mc.num_experts_per_tok, None if bias is None else bias[ids])
            table[i, ids] = expert_counts(routes, aux_mask(mbs[i], tc))
            return None if chunks[c].head else [out.x, *out.mtp_embeds]

        with torch.no_grad():
            link = PipeLink(pp_group, pp, rank, dev, pass_id=1)
            run_schedule(forward_order(chunks, rank, m), chunks, link, count_forward, None, input_shapes)
        counts_mb = _world_sum(table)

    # 2. normalisers over the stage's data ranks (the one-process step_context; its aux counts come from step 1)
    def no_count(mb):
        return torch.zeros(n_layers, e, device=dev)

    ctx = step_context(mbs, runtime, mc, tc, no_count)
    if counts_mb is not None and tc.aux_loss_scope == "global_batch":
        ctx = attrs.evolve(ctx, aux_counts=counts_mb.sum(0))

    # 3. the schedule
    grads = [None] * len(trained)
    sums: dict = {}
    load = torch.zeros(n_layers, e, device=dev)
    saved: dict = {}  # (chunk, mb) -> (inputs that need gradients, outputs, objective part)
    weights = {t.name: t.weight for t in terms}
    combine = {t.name: torch.maximum if t.reduce == "max" else torch.add for t in terms}  # over micro-batches

    def chunk_aux(c, i, routes, mb) -> Tensor:
        ids = layer_ids(c)
        mask = aux_mask(mb, tc)
        if aux_kind == "sequence":
            d, seg_tokens, n_seq = ctx.seq[i]
            seg = _segment_index(mb, d)
            part = sequence_aux(routes, mask, seg, seg_tokens.numel(), seg_tokens, n_seq,
                                runtime.seq_all_reduce_sum) * (len(ids) / n_layers)
        else:
            probs = prob_sums(routes, mask)
            full = torch.zeros(n_layers, e, device=probs.device, dtype=probs.dtype).index_copy(
                0, torch.tensor(ids, device=probs.device), probs)
            if ctx.aux_counts is not None:
                counts, n = ctx.aux_counts, ctx.n_aux
            else:
                counts, n = counts_mb[i], ctx.aux_mb[i]
            part = aux_from_stats(aux_kind, counts, full, n)
        if tc.aux_loss_scope == "micro_batch":
            part = part / ctx.n_mb
        return part

    def forward(c, i, inputs):
        nonlocal load
        mb = mbs[i]
        ins = []
        if inputs is not None:
            ins = [t.requires_grad_() for t in inputs]
        out: ChunkOutput = run_chunk(c, mb, ins)
        ids = layer_ids(c)
        routes = routing(out.router_logits, mc.num_experts_per_tok, None if bias is None else bias[ids])
        values = {t.name: chunk_aux(c, i, routes, mb) for t in aux_terms}
        if chunks[c].head:
            from q38.model import ModelOutput, head_weight

            # router statistics are per stage here: the aux term is computed stage by stage above, and a head term
            # gets no routes (None) rather than the last stage's layers only
            mo = ModelOutput(hidden=out.x, router_logits=(), mtp_hidden=out.mtp_hidden)
            ti = TermInput(mo, mb, i, None, runtime.gather(head_weight(p)), ctx, runtime, mc, tc, state.kernels)
            for t in head_terms:
                values[t.name] = t.fn(ti)
        objective = None
        for name, val in values.items():
            if weights[name]:
                objective = weights[name] * val if objective is None else objective + weights[name] * val
        for name, val in values.items():
            val = val.detach()
            sums[name] = val if name not in sums else combine[name](sums[name], val)
        with torch.no_grad():
            load = load.index_add(0, torch.tensor(ids, device=dev), expert_counts(routes, mb.real_mask))
        if chunks[c].head:
            saved[(c, i)] = (ins, [], objective)
            return None
        outs = [out.x, *out.mtp_embeds]
        saved[(c, i)] = (ins, outs, objective)
        return [t.detach() for t in outs]

    def backward(c, i, out_grads):
        nonlocal grads
        ins, outs, objective = saved.pop((c, i))
        passthrough, carried = {}, set()
        for k, o in enumerate(outs):  # a carried MTP embedding this chunk did not touch: its gradient goes back
            for j, t in enumerate(ins):
                if o is t:
                    passthrough[j] = out_grads[k]
                    carried.add(k)
        roots, seeds = [], []
        if objective is not None:
            roots.append(objective)
            seeds.append(torch.ones_like(objective))
        for k, (o, g) in enumerate(zip(outs, out_grads or ())):
            if k not in carried and o.requires_grad:
                roots.append(o)
                seeds.append(g)
        need = [t for j, t in enumerate(ins) if j not in passthrough]
        g = runtime.grad(roots, [*trained, *need], seeds) if roots else (None,) * (len(trained) + len(need))
        grads = accumulate(grads, g[: len(trained)], tc.torch_reduce_dtype)
        gin, it = [], iter(g[len(trained):])
        for j, t in enumerate(ins):
            gj = passthrough[j] if j in passthrough else next(it)
            gin.append(torch.zeros_like(t) if gj is None else gj)
        return gin

    link = PipeLink(pp_group, pp, rank, dev, pass_id=0)
    run_schedule(schedule(pp, v, m, rank), chunks, link, forward, backward, input_shapes)

    keep = tc.torch_reduce_dtype
    grads = [torch.zeros_like(t, dtype=keep if t.dtype == torch.float32 else t.dtype) if g is None
             else g.to(keep if t.dtype == torch.float32 else t.dtype) for t, g in zip(trained, grads)]
    names = [t.name for t in terms if t.reduce == "sum"]
    zero = torch.zeros((), device=dev)
    packed = _world_sum(torch.cat([torch.stack([sums.get(n, zero).float() for n in names]), load.reshape(-1)]))
    reduced = dict(zip(names, packed[: len(names)]))
    router_load = packed[len(names):].view_as(load)
    maxed = [t.name for t in terms if t.reduce == "max"]  # a max term: 0 on the stages without the head (values >= 0)
    if maxed:
        mx = torch.stack([sums.get(n, zero).float() for n in maxed]).detach().clone()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        reduced.update(zip(maxed, mx))
    reduced = {t.name: reduced[t.name] for t in terms}
    sq = runtime.grad_sq_norm(grads)  # over the stage's ranks
    dist.all_reduce(sq, group=pp_group)
    return PipelineResult(grads, reduced, router_load, sq.sqrt(), ctx)


def _world_sum(t: Tensor) -> Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t
