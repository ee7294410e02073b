"""``train_step(params, batch, mesh) -> (new_state, metrics)``: the whole training objective and one AdamW update.

Objective = main LM loss + ``mtp_loss_scaling_factor`` · mean over depths of the MTP losses + ``coef`` · aux loss.
Each LM term is ``Σ token CE / N_global`` (its own depth's valid-target count over the whole step), so micro-batches,
data-parallel and CP ranks only ever *sum* gradients. Inputs are never mutated.
"""

import typing

import attrs
import torch
from torch import Tensor

from q38.model import Runtime, forward, head_weight
from q38.pytree import pytree_node, tree_leaves
from q38.train.loss import chunked_lm_loss, unchunked_lm_loss
from q38.train.optim import adamw_step
from q38.train.objective import (
    IGNORE,
    StepBatch,
    aux_loss_partial,
    aux_stats,
    count_targets,
    prepare_batch,
    split_micro_batches,
)
from q38.train.remat import layer_wrapper
from q38.train.state import TrainState, decay_mask, learning_rate

import torch.utils._pytree as pytree


@pytree_node
@attrs.frozen
class Metrics:
    """What one step reports (0-dim tensors, already reduced over ranks)."""

    loss: Tensor  # main LM loss
    mtp_losses: tuple  # one per depth
    aux_loss: Tensor
    objective: Tensor
    grad_norm: Tensor
    lr: float
    tokens: Tensor  # valid main targets in the step
    skipped: bool = False
    mtp_tokens: tuple = ()  # valid targets per MTP depth (a depth with 0 reports loss 0 with count 0)

    def as_dict(self) -> dict[str, float]:
        d = {"loss": float(self.loss), "aux": float(self.aux_loss), "objective": float(self.objective),
             "grad_norm": float(self.grad_norm), "lr": float(self.lr), "tokens": int(self.tokens),
             "skipped": bool(self.skipped)}
        for i, m in enumerate(self.mtp_losses, start=1):
            d[f"mtp_{i}"] = float(m)
        for i, n in enumerate(self.mtp_tokens, start=1):
            d[f"mtp_{i}_tokens"] = int(n)
        return d


def parallel_for(mesh, train_config=None):
    """The runtime for ``mesh``: the one-device identity for ``None``, else the mesh's own runtime object."""
    if mesh is None:
        from q38.parallel.local import LocalParallel

        return LocalParallel(train_config.torch_param_dtype if train_config is not None else torch.float32)
    runtime = getattr(mesh, "runtime", None)
    if runtime is None:
        raise TypeError(
            "train_step's mesh must be None (one device) or a q38.parallel mesh (q38.parallel.make_mesh(...)); "
            f"got {type(mesh).__name__}"
        )
    return runtime(train_config)


def lm_loss(hidden: Tensor, w_head: Tensor, targets: Tensor, normalizer: Tensor, tc) -> Tensor:
    """Sum of CE over valid targets / ``normalizer``; rows with ignored targets never reach the head. A term with no
    valid targets in the whole step contributes 0 (the normalizer is clamped to >= 1), never NaN."""
    normalizer = normalizer.clamp(min=1) if isinstance(normalizer, Tensor) else max(normalizer, 1)
    d = hidden.shape[-1]
    h_nd, t_n = hidden.reshape(-1, d), targets.reshape(-1)
    valid = torch.nonzero(t_n != IGNORE).flatten()
    h_nd, t_n = h_nd.index_select(0, valid), t_n.index_select(0, valid)
    if tc.loss_chunk_size is None and not tc.dynamic_chunk_loss:
        return unchunked_lm_loss(h_nd, w_head, t_n, normalizer=normalizer)
    if tc.dynamic_chunk_loss:
        return chunked_lm_loss(h_nd, w_head, t_n, normalizer=normalizer, chunk_budget_bytes=tc.loss_chunk_budget_bytes)
    return chunked_lm_loss(h_nd, w_head, t_n, normalizer=normalizer, chunk_size=tc.loss_chunk_size)


def _as_step_batch(batch, depths: int) -> StepBatch:
    if isinstance(batch, StepBatch):
        return batch
    if isinstance(batch, dict):
        get = batch.get
    else:
        get = lambda k, default=None: getattr(batch, k, default)  # noqa: E731
    input_ids, labels = get("input_ids"), get("labels")
    if input_ids is None or labels is None:
        raise ValueError("a batch needs input_ids and labels ([batch, seq] int64; labels -100 = ignored)")
    if input_ids.shape != labels.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must have one shape")
    return prepare_batch(input_ids, labels, get("doc_ids"), depths)


@attrs.frozen
class Gradients:
    """``grads``: one tensor per parameter leaf (flatten order), summed over micro-batches (and, on a mesh, ranks)."""

    grads: list
    loss: Tensor
    mtp_losses: tuple
    aux_loss: Tensor
    objective: Tensor
    grad_norm: Tensor
    tokens: Tensor
    ep_max_load: tuple = ()  # EP: the largest per-rank count of routed slots, per MoE layer call
    prefetched: int = 0  # FSDP gathers that were started a layer early and consumed
    mtp_tokens: tuple = ()  # valid targets of each MTP depth in the step (0: that term is 0, not NaN)


def _accumulate(acc: list, g: tuple, reduce_dtype) -> list:
    """Micro-batch gradient accumulation in ``reduce_dtype`` (the mixed-precision policy; fp32 by default)."""
    return [
        gi if a is None else (a if gi is None else a.to(reduce_dtype) + gi.to(reduce_dtype))
        for a, gi in zip(acc, g)
    ]


def make_runtime(par, tc) -> Runtime:
    """How the model runs on ``par`` (from ``parallel_for``): gathers in the policy's ``param_dtype``, recompute /
    offload / reshard-after-forward around each layer, EP dispatch, FSDP prefetch."""
    return Runtime(
        gather=par.gather, wrap_layer=layer_wrapper(tc, _reshard_hooks(par, tc)), dispatch=par.dispatch,
        prefetch=par.prefetch if getattr(par, "prefetch_enabled", False) else None,
    )


def _reshard_hooks(par, tc):
    """FSDP reshard-after-forward without recompute (recompute re-gathers inside the recomputed layer anyway).
    Not with EP balance: its graph differs per rank (which experts a rank hosts copies of), so backward re-gathers
    would not line up across ranks (measured: a gloo collective mismatch on fsdp_ep_cp with bf16)."""
    if tc.recompute or tc.offload_activations or tc.enable_ep_balance:
        return None
    hooks = getattr(par, "saved_tensor_hooks", None)
    return hooks() if hooks is not None else None


@typing.no_type_check
def loss_and_grads(state: TrainState, batch, mesh=None) -> Gradients:
    """Forward and backward of the whole objective over all micro-batches; no update."""
    mc, tc = state.model_config, state.train_config
    par = parallel_for(mesh, tc)
    depths = mc.mtp_num_layers
    mbs = split_micro_batches(_as_step_batch(batch, depths), tc.micro_batches)
    n_mb = len(mbs)
    coef = mc.router_aux_loss_coef if tc.aux_loss_coef is None else tc.aux_loss_coef
    runtime = make_runtime(par, tc)

    # Global normalisers, known before any forward (DESIGN.md decision 5).
    n_main = par.all_reduce_sum(sum(count_targets(mb.targets) for mb in mbs))
    n_mtp = [par.all_reduce_sum(sum(count_targets(mb.mtp_targets[d]) for mb in mbs)) for d in range(depths)]

    flat, spec = pytree.tree_flatten(state.params)
    leaves = [t.detach().requires_grad_(True) for t in flat]
    p = pytree.tree_unflatten(leaves, spec)
    par.bind(p)

    def run(mb: StepBatch):
        info = par.seq_info(mb)
        return forward(p, mb.input_ids, mc, mtp_input_ids=mb.mtp_inputs, info=info, runtime=runtime)

    # Aux-loss expert counts: per (global) micro-batch, or for the whole step. With several micro-batches the
    # step's counts need every micro-batch's routing first: one extra no-grad forward pass.
    step_counts = None
    if tc.aux_loss_scope == "global_batch" and n_mb > 1:
        with torch.no_grad():
            sts = [aux_stats(run(mb).router_logits, mb.aux_mask, mc.num_experts_per_tok) for mb in mbs]
        step_counts = (par.all_reduce_sum(sum(s.counts for s in sts)), par.all_reduce_sum(sum(s.rows for s in sts)))

    grads = [None] * len(leaves)
    dev = mbs[0].input_ids.device
    main_sum = torch.zeros((), device=dev)
    mtp_sum = [torch.zeros((), device=dev) for _ in range(depths)]
    aux_sum = torch.zeros((), device=dev)
    for mb in mbs:
        out = run(mb)
        w_head = par.gather(head_weight(p))
        main = lm_loss(out.hidden, w_head, mb.targets, n_main, tc)
        objective = main
        if depths:
            mtp = [lm_loss(h, w_head, mb.mtp_targets[d], n_mtp[d], tc) for d, h in enumerate(out.mtp_hidden)]
            objective = objective + tc.mtp_loss_scaling_factor * torch.stack(mtp).mean()
        st = aux_stats(out.router_logits, mb.aux_mask, mc.num_experts_per_tok)
        if step_counts is not None:
            aux = aux_loss_partial(st, *step_counts)
        else:  # this (global) micro-batch's counts; the micro_batch scope averages over micro-batches
            aux = aux_loss_partial(st, par.all_reduce_sum(st.counts.detach()), par.all_reduce_sum(st.rows))
            if tc.aux_loss_scope == "micro_batch":
                aux = aux / n_mb
        if coef:
            objective = objective + coef * aux
        g = torch.autograd.grad(objective, leaves, allow_unused=True)
        grads = _accumulate(grads, g, tc.torch_reduce_dtype)
        main_sum = main_sum + main.detach()
        aux_sum = aux_sum + aux.detach()
        for d in range(depths):
            mtp_sum[d] = mtp_sum[d] + mtp[d].detach()
    grads = [torch.zeros_like(t) if g is None else g.to(t.dtype) for t, g in zip(leaves, grads)]

    loss = par.all_reduce_sum(main_sum)
    mtp_losses = tuple(par.all_reduce_sum(m) for m in mtp_sum)
    aux_loss = par.all_reduce_sum(aux_sum)
    objective = loss + (tc.mtp_loss_scaling_factor * torch.stack(mtp_losses).mean() if depths else 0.0)
    objective = objective + coef * aux_loss
    grad_norm = par.grad_sq_norm(grads).sqrt()
    loads = tuple(getattr(par.dispatch, "loads", ()) or ())
    return Gradients(grads, loss, mtp_losses, aux_loss, objective, grad_norm, n_main, loads,
                     getattr(par, "prefetched", 0), tuple(n_mtp))


@typing.no_type_check
def train_step(params: TrainState, batch, mesh=None) -> tuple[TrainState, Metrics]:
    """One optimizer step on ``batch`` (dict with ``input_ids``, ``labels``, optional ``doc_ids``, or a ``StepBatch``
    from ``q38.parallel.shard_batch``). ``params`` is the ``TrainState``; ``mesh`` is None or a q38 mesh."""
    state = params
    tc = state.train_config
    r = loss_and_grads(state, batch, mesh)
    grads, loss, mtp_losses, aux_loss, objective, grad_norm, n_main = (
        r.grads, r.loss, r.mtp_losses, r.aux_loss, r.objective, r.grad_norm, r.tokens
    )
    flat, spec = pytree.tree_flatten(state.params)
    step = int(state.step) + 1
    lr = learning_rate(step, tc)
    finite = bool(torch.isfinite(objective)) and bool(torch.isfinite(grad_norm))
    if not finite:
        if tc.nan_policy == "stop":
            raise FloatingPointError(
                f"non-finite loss or gradient at step {step} (loss={float(loss)}, grad_norm={float(grad_norm)}); "
                "lower the learning rate, check the data, or set nan_policy: skip"
            )
        metrics = Metrics(loss, mtp_losses, aux_loss, objective, grad_norm, lr, n_main, skipped=True,
                          mtp_tokens=r.mtp_tokens)
        return attrs.evolve(state, step=state.step + 1), metrics

    scale = 1.0
    if tc.grad_clip is not None:
        scale = torch.clamp(tc.grad_clip / (grad_norm + 1e-6), max=1.0)
    new_p, new_m, new_v = _adamw(state, flat, grads, scale, lr, step)
    new_state = attrs.evolve(
        state,
        params=pytree.tree_unflatten(new_p, spec),
        exp_avg=pytree.tree_unflatten(new_m, spec),
        exp_avg_sq=pytree.tree_unflatten(new_v, spec),
        step=state.step + 1,
    )
    return new_state, Metrics(loss, mtp_losses, aux_loss, objective, grad_norm, lr, n_main, mtp_tokens=r.mtp_tokens)


def _adamw(state: TrainState, flat: list[Tensor], grads: list[Tensor], scale, lr: float, step: int):
    """Decoupled-weight-decay Adam in fp32 with torch's kernels (``q38.train.optim``); returns new lists (the
    inputs are untouched)."""
    tc = state.train_config
    return adamw_step(
        flat, grads, tree_leaves(state.exp_avg), tree_leaves(state.exp_avg_sq), decay_mask(state.params, tc),
        step=step, lr=lr, beta1=tc.beta1, beta2=tc.beta2, eps=tc.eps, weight_decay=tc.weight_decay,
        grad_scale=scale,
    )
