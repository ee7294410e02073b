"""Held-out evaluation: mean main and MTP losses over the eval batches, no gradient, the training step's sharding.

Each loss is the token-weighted mean over the whole eval set: ``Σ CE over all valid targets / number of targets``
(summed over batches and data-parallel / CP ranks before the division), the same definition as the training loss
of one step whose batch is the whole eval set.
"""

from __future__ import annotations

import sys
import typing

import attrs
import torch

from q38.lora import compute_form
from q38.model import LayerHooks, forward, head_weight
from q38.batch import count_targets

PROGRESS_AFTER_S = 3.0  # an eval that runs longer than this shows a progress bar (on a terminal, on rank 0)


@typing.no_type_check
@torch.no_grad()
def eval_losses(state, batches, mesh=None, device: str = "cpu", *, progress: bool = True) -> dict[str, float]:
    """``batches``: this rank's eval batches (dicts of ``input_ids``, ``labels``, ``doc_ids``; on a mesh, this rank's
    rows as from ``EvalRows.batch``; an ``EvalRows`` itself gives the bar its total). Returns ``{"eval_loss",
    "eval_mtp_1", ..., "eval_tokens"}``; the layers and the loss run ``state.kernels``. With ``progress``, an eval
    longer than ``PROGRESS_AFTER_S`` seconds shows a bar on rank 0 (only on a terminal)."""
    import torch.distributed as dist
    from tqdm import tqdm

    from q38.train.core.objective import lm_loss
    from q38.train.core.step import _as_step_batch, step_runtime

    mc, tc = state.model_config, state.train_config
    runtime = step_runtime(mesh, tc)
    depths = mc.mtp_num_layers
    gather = runtime.gather
    if state.peft is not None:  # a LoRA run: adapters beside their frozen weights (unmerged) after each gather
        gather = lambda tree: compute_form(runtime.gather(tree))  # noqa: E731
    hooks = LayerHooks(gather=gather, dispatch=runtime.dispatch)
    p = state.params
    runtime.bind(p)
    one = torch.ones(())
    main_sum, n_main = torch.zeros(()), torch.zeros(())
    mtp_sum, n_mtp = [torch.zeros(()) for _ in range(depths)], [torch.zeros(()) for _ in range(depths)]
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
        out = forward(p, sb.input_ids, mc, mtp_input_ids=sb.mtp_inputs, info=info, hooks=hooks)
        w_head = runtime.gather(head_weight(p))
        main_sum = main_sum + lm_loss(out.hidden, w_head, sb.targets, one, tc, state.kernels).float().cpu()
        n_main = n_main + count_targets(sb.targets).float().cpu()
        for d, h in enumerate(out.mtp_hidden):
            mtp_sum[d] = mtp_sum[d] + lm_loss(h, w_head, sb.mtp_targets[d], one, tc, state.kernels).float().cpu()
            n_mtp[d] = n_mtp[d] + count_targets(sb.mtp_targets[d]).float().cpu()
    if mesh is not None:  # sums over ranks (the step's runtime reduces on the device)
        main_sum, n_main = runtime.all_reduce_sum(main_sum.to(device)), runtime.all_reduce_sum(n_main.to(device))
        mtp_sum = [runtime.all_reduce_sum(m.to(device)) for m in mtp_sum]
        n_mtp = [runtime.all_reduce_sum(n.to(device)) for n in n_mtp]
    out = {"eval_loss": float(main_sum) / max(float(n_main), 1.0), "eval_tokens": int(n_main)}
    for d in range(depths):
        out[f"eval_mtp_{d + 1}"] = float(mtp_sum[d]) / max(float(n_mtp[d]), 1.0)
    return out
