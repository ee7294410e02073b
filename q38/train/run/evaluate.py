"""Held-out evaluation: the objective's terms and per-token statistics over the eval batches, no gradient, the
training step's sharding (docs/evaluate.md).

Each LM term is the token-weighted mean over the whole eval set: ``Σ CE over all valid targets / number of targets``
(summed over batches and data-parallel / CP ranks before the division), the same definition as the training loss
of one step whose batch is the whole eval set. The aux term is each eval batch's aux as a step over that global
batch computes it (one micro-batch), averaged over the batches; top-1 accuracy counts the valid targets whose
logit is the largest; perplexity is ``exp(eval_loss)``.
"""

from __future__ import annotations

import math
import sys
import typing

import attrs
import torch

from q38.acceptance import acceptance_counts, acceptance_metrics, n_counts
from q38.lora import compute_form
from q38.model import LayerHooks, forward, head_weight
from q38.batch import IGNORE_INDEX, count_targets

PROGRESS_AFTER_S = 3.0  # an eval that runs longer than this shows a progress bar (on a terminal, on rank 0)
ACCURACY_ROWS = 4096  # valid targets per logits block of the top-1 accuracy (a [rows, vocab] block at a time)


def top1_correct(hidden: torch.Tensor, w_head: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many valid targets (``!= -100``) are the argmax of their logits, computed a block of rows at a time (never
    the whole ``[tokens, vocab]``)."""
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    keep = torch.nonzero(t != IGNORE_INDEX).flatten()
    h, t = h.index_select(0, keep), t.index_select(0, keep)
    n = torch.zeros((), dtype=torch.long, device=hidden.device)
    for i in range(0, h.shape[0], ACCURACY_ROWS):
        logits = torch.nn.functional.linear(h[i:i + ACCURACY_ROWS], w_head)
        n = n + (logits.argmax(-1) == t[i:i + ACCURACY_ROWS]).sum()
    return n


PP_EVAL_REFUSAL = ("evaluation on a layout with a pipeline axis (pp) is not implemented; evaluate the checkpoint on a "
                   "layout without pp (q38 eval --set layout=...), and train without data.eval_split / data.eval_path")


@typing.no_type_check
@torch.no_grad()
def eval_losses(state, batches, mesh=None, device: str = "cpu", *, progress: bool = True) -> dict[str, float]:
    """``batches``: this rank's eval batches (dicts of ``input_ids``, ``labels``, ``doc_ids``; on a mesh, this rank's
    rows as from ``EvalRows.batch``; an ``EvalRows`` itself gives the bar its total). Returns ``{"eval_loss",
    "eval_mtp_1", ..., "eval_aux", "eval_tokens", "eval_accuracy", "eval_ppl"}`` and, with MTP depths, the
    heads' acceptance (``eval_accept_<d>``, by position bucket, ``eval_accept_len_<k>``: ``q38.acceptance``); the
    layers and the loss run ``state.kernels``, routing uses the state's router bias (aux-loss-free runs) as the step
    does. With ``progress``, an eval longer than ``PROGRESS_AFTER_S`` seconds shows a bar on rank 0 (only on a
    terminal)."""
    import torch.distributed as dist
    from tqdm import tqdm

    from q38.train.core.objective import TermInput, aux_term, lm_loss, routing, step_context
    from q38.train.core.step import _as_step_batch, step_runtime

    if mesh is not None and mesh.pp > 1:
        from q38.errors import ConfigError

        raise ConfigError(PP_EVAL_REFUSAL)
    mc, tc = state.model_config, state.train_config
    runtime = step_runtime(mesh, tc)
    depths = mc.mtp_num_layers
    gather = runtime.gather
    if state.peft is not None:  # a LoRA run: adapters beside their frozen weights (unmerged) after each gather
        gather = lambda tree: compute_form(runtime.gather(tree))  # noqa: E731
    hooks = LayerHooks(gather=gather, dispatch=runtime.dispatch)
    p, bias = state.params, state.router_bias
    runtime.bind(p)
    one = torch.ones(())
    # per batch, this rank's partials: [main CE sum, main targets, correct top-1, aux, (mtp CE sum, mtp targets)...]
    # then the MTP heads' acceptance sums (q38.acceptance)
    sums = torch.zeros(4 + 2 * depths + n_counts(depths), dtype=torch.float64)
    n_batches = 0
    lead = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    bar = tqdm(batches, desc="eval", unit="batch", leave=False, delay=PROGRESS_AFTER_S, file=sys.stdout,
               dynamic_ncols=True, disable=None if (progress and lead) else True)
    for b in bar:
        b = {k: v.to(device) for k, v in b.items()}
        if mesh is not None:
            from q38.parallel.mesh import shard_batch

            sb = shard_batch(b, mesh, depths, local_rows=True)
        else:
            sb = _as_step_batch(b, depths)
        info = attrs.evolve(runtime.seq_info(sb), kernels=state.kernels)
        out = forward(p, sb.input_ids, mc, mtp_input_ids=sb.mtp_inputs, info=info, hooks=hooks, router_bias=bias)
        w_head = runtime.gather(head_weight(p))
        ctx = step_context([sb], runtime, mc, tc, None)  # the batch's aux tables, as one step over it
        ti = TermInput(out, sb, 0, routing(out.router_logits, mc.num_experts_per_tok, bias), w_head, ctx, runtime,
                       mc, tc, state.kernels)
        part = [lm_loss(out.hidden, w_head, sb.targets, one, tc, state.kernels), count_targets(sb.targets),
                top1_correct(out.hidden, w_head, sb.targets), aux_term(ti)]
        for d, h in enumerate(out.mtp_hidden):
            part += [lm_loss(h, w_head, sb.mtp_targets[d], one, tc, state.kernels), count_targets(sb.mtp_targets[d])]
        acc = acceptance_counts(out.hidden, out.mtp_hidden, w_head, sb.mtp_targets, info)
        sums += torch.cat([torch.stack([t.detach().double().cpu() for t in part]), acc])
        n_batches += 1
    if mesh is not None:  # sums over ranks (the step's runtime reduces on the device)
        sums = runtime.all_reduce_sum(sums.to(device)).cpu()
    s = sums.tolist()
    loss = s[0] / max(s[1], 1.0)
    out = {"eval_loss": loss, "eval_tokens": int(round(s[1])), "eval_accuracy": s[2] / max(s[1], 1.0),
           "eval_ppl": math.exp(min(loss, 700.0)), "eval_aux": s[3] / max(n_batches, 1)}
    for d in range(depths):
        out[f"eval_mtp_{d + 1}"] = s[4 + 2 * d] / max(s[5 + 2 * d], 1.0)
    out.update(acceptance_metrics(s[4 + 2 * depths:], depths))
    return out

