"""``train_step(params, batch, mesh) -> (new_state, metrics)``: the whole training objective and one AdamW update.

Objective = ``Σ weight · term`` over the named terms of ``q38.train.core.objective`` (``loss``, ``mtp_<d>``, ``aux``; see
there for the formulas). Each LM term is ``Σ token CE / N_global`` (its own depth's valid-target count over the whole
step), so micro-batches, data-parallel and CP ranks only ever *sum* gradients. Inputs are never mutated, unless the
state is donated (``train_step(..., donate=True)``: updated in place, the input then refused).
"""


import time

import attrs
import torch
from torch import Tensor
from torch.profiler import record_function

from q38.lora import compute_form
from q38.model import LayerHooks, forward, head_weight
from q38.pytree import named_leaves, pytree_node, tree_leaves, tree_map_with_path
from q38.train.core.optim import adamw_step, adamw_step_
from q38.qmoment import is_int8_moment
from q38.batch import TOKEN_VALUE_KEYS, StepBatch, prepare_batch, split_micro_batches
from q38.train.core.objective import TermInput, aux_mask, default_terms, expert_counts, routing, step_context, total
from q38.train.core.pipeline_step import accumulate
from q38.train.core.remat import KernelRegions, layer_wrapper
from q38.train.core.state import TrainState, decay_mask, learning_rate

import torch.utils._pytree as pytree


class _Terms:
    """The named terms of a step's objective (``self.terms``), read by the names the default objective uses."""

    terms: dict

    @property
    def loss(self) -> Tensor:
        """The main LM loss term."""
        return self.terms["loss"]

    @property
    def mtp_losses(self) -> tuple:
        """The MTP terms, one per depth (empty without MTP)."""
        return tuple(v for k, v in self.terms.items() if k.startswith("mtp_"))

    @property
    def aux_loss(self) -> Tensor | None:
        """The load-balancing term, or None when the step's term set has none."""
        return self.terms.get("aux")


@pytree_node
@attrs.frozen
class Metrics(_Terms):
    """What one step reports: the objective's terms by name (``terms``: whatever term set the step ran, e.g.
    ``loss``, ``mtp_<depth>``, ``aux``), plus the step's scalars. Tensors are 0-dim and already reduced over
    ranks."""

    terms: dict  # every objective term by name (reduced), the keys of the logs
    objective: Tensor  # the weighted sum of the terms
    grad_norm: Tensor
    lr: float
    tokens: Tensor  # valid main targets in the step
    skipped: bool = False
    router_load: Tensor | None = None  # [moe layers, e]: real tokens routed to each expert in the step (all ranks)
    mtp_tokens: tuple = ()  # valid targets per MTP depth (a depth with 0 reports loss 0 with count 0)
    forward_backward_s: float = 0.0  # seconds of forward + backward + gradient reduction (until the device is done)

    def as_dict(self) -> dict[str, float]:
        d = {name: float(v) for name, v in self.terms.items()}
        d.update({"objective": float(self.objective), "grad_norm": float(self.grad_norm), "lr": float(self.lr),
                  "tokens": int(self.tokens), "skipped": bool(self.skipped),
                  "time_forward_backward": float(self.forward_backward_s)})
        for i, n in enumerate(self.mtp_tokens, start=1):
            d[f"mtp_{i}_tokens"] = int(n)
        if self.router_load is not None:
            d.update(router_metrics(self.router_load))
        return d


def router_metrics(load: Tensor) -> dict[str, float]:
    """Per MoE layer ``i``: ``router_max_mean_<i>`` (largest expert load / mean load) and ``router_idle_<i>``
    (experts that received no token); ``router_max_mean`` / ``router_idle``: the worst layer and the total."""
    load = load.float()
    ratio = (load.max(-1).values / load.mean(-1).clamp(min=1e-9)).tolist()
    idle = (load == 0).sum(-1).tolist()
    d = {f"router_max_mean_{i}": r for i, r in enumerate(ratio)}
    d.update({f"router_idle_{i}": int(z) for i, z in enumerate(idle)})
    d.update({"router_max_mean": max(ratio), "router_idle": int(sum(idle))})
    return d


def step_runtime(mesh, train_config=None):
    """The ``StepRuntime`` for ``mesh`` (``q38.layers.context``): the one-device ``LocalRuntime`` for ``None``, else
    the mesh's ``MeshRuntime``."""
    if mesh is None:
        from q38.parallel.local import LocalRuntime

        if train_config is None:
            return LocalRuntime(torch.float32)
        return LocalRuntime(train_config.torch_param_dtype, train_config.compute_dtype)
    from q38.parallel.mesh import Mesh
    from q38.parallel.runtime import mesh_runtime

    if not isinstance(mesh, Mesh):
        raise TypeError(
            "train_step's mesh must be None (one device) or a q38.parallel mesh (q38.parallel.make_mesh(...)); "
            f"got {type(mesh).__name__}"
        )
    return mesh_runtime(mesh, train_config)


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
    values = {k: get(k) for k in TOKEN_VALUE_KEYS if get(k) is not None}
    return prepare_batch(input_ids, labels, get("doc_ids"), depths, get("attention_mask"), values, get("routes"))


@attrs.frozen
class Gradients(_Terms):
    """``grads``: one tensor per trained parameter leaf (flatten order; every leaf, or a LoRA run's adapter
    matrices), summed over micro-batches (and, on a mesh, ranks);
    ``terms``: each objective term's value by name (reduced over ranks); ``router_load``: real tokens per expert and
    MoE layer in the step (reduced over ranks, router bias included in the routing)."""

    grads: list
    terms: dict
    objective: Tensor
    grad_norm: Tensor
    tokens: Tensor
    router_load: Tensor
    ep_max_load: tuple = ()  # EP: the largest per-rank count of routed slots, per MoE layer call
    prefetched: int = 0  # FSDP gathers that were started a layer early (in forward) and consumed
    prefetched_backward: int = 0  # FSDP gathers started in backward for the next layer's recompute and consumed
    async_reductions: int = 0  # gradient reductions issued async in backward and waited after it (overlap_comm)
    async_reduce_bytes: int = 0  # the most bytes of full-size gradients awaiting their async reduce-scatter at once
    ep_copies: tuple = ()  # EP balance: expert copies the plan made, per MoE layer call
    mtp_tokens: tuple = ()  # valid targets of each MTP depth in the step (0: that term is 0, not NaN)
    cp_early: int = 0  # CP exchanges started async, before the compute that does not need them (overlap_comm)


_accumulate = accumulate


def make_layer_hooks(runtime, tc, regions: KernelRegions | None = None, lora: bool = False) -> LayerHooks:
    """How the model runs on ``runtime`` (from ``step_runtime``): gathers in the policy's ``param_dtype``, recompute /
    offload / reshard-after-forward around each layer, EP dispatch, FSDP prefetch. ``regions``: the step's
    ``KernelRegions`` (the layers' ``SeqInfo.region``), for selective recompute. ``lora``: the parameters hold LoRA
    nodes (or block-FP8 weights), put in compute form after each gather (``q38.lora.compute_form``: base and adapter
    unmerged, the base a constant)."""
    gather = runtime.gather
    if lora:
        gather = lambda tree: compute_form(runtime.gather(tree))  # noqa: E731
    return LayerHooks(
        gather=gather, wrap_layer=layer_wrapper(tc, _reshard_hooks(runtime, tc), regions),
        dispatch=runtime.dispatch,
        prefetch=runtime.prefetch if runtime.prefetch_enabled else None,
    )


def _reshard_hooks(runtime, tc):
    """FSDP reshard-after-forward without recompute (recompute re-gathers inside the recomputed layer anyway).
    Not with EP balance: its graph differs per rank (which experts a rank hosts copies of), so backward re-gathers
    would not line up across ranks (measured: a gloo collective mismatch on fsdp_ep_cp with bf16)."""
    if tc.recompute or tc.offload_activations or tc.enable_ep_balance:
        return None
    return runtime.saved_tensor_hooks()


def loss_and_grads(state: TrainState, batch, mesh=None, terms=None) -> Gradients:
    """Forward and backward of the whole objective over all micro-batches; no update. ``terms``: the objective's
    named terms (default ``default_terms``; see ``q38.train.core.objective``). The layers and the loss run
    ``state.kernels``."""
    mc, tc = state.model_config, state.train_config
    terms = default_terms(mc, tc) if terms is None else tuple(terms)
    runtime = step_runtime(mesh, tc)
    depths = mc.mtp_num_layers
    mbs = split_micro_batches(_as_step_batch(batch, depths), tc.micro_batches)
    regions = KernelRegions()
    hooks = make_layer_hooks(runtime, tc, regions, lora=state.peft is not None)
    bias = state.router_bias
    if mbs[0].routes is not None:
        _check_routes(mbs, mc, mesh, runtime)

    # Only the leaves that train take part in autograd (a LoRA run's frozen base is gathered, never reduced).
    flat, spec = pytree.tree_flatten(state.params)
    trains = state.trainable()
    leaves = [t.detach().requires_grad_(m) for t, m in zip(flat, trains)]
    trained = [t for t, m in zip(leaves, trains) if m]
    p = pytree.tree_unflatten(leaves, spec)
    runtime.bind(p, defer_reductions=True)  # gradients come from runtime.grad, which waits the reductions
    if mesh is not None and mesh.pp > 1:  # a pipeline axis: the same objective, chunk by chunk in its schedule
        from q38.train.core.pipeline_step import pipelined_grads

        pr = pipelined_grads(state, mbs, mesh, runtime, hooks, regions, terms, p, trained)
        loads, copies = runtime.ep_stats()
        ctx = pr.ctx
        return Gradients(pr.grads, pr.sums, total(pr.sums, terms), pr.grad_norm, ctx.n_main, pr.router_load, loads,
                         prefetched=runtime.prefetched, prefetched_backward=runtime.prefetched_backward,
                         async_reductions=runtime.async_reductions, async_reduce_bytes=runtime.async_reduce_bytes,
                         ep_copies=copies, mtp_tokens=tuple(ctx.n_mtp), cp_early=runtime.cp_early)

    def run(mb: StepBatch):
        info = attrs.evolve(runtime.seq_info(mb), kernels=state.kernels, region=regions.enter)
        return forward(p, mb.input_ids, mc, mtp_input_ids=mb.mtp_inputs, info=info, hooks=hooks, router_bias=bias,
                       routes=mb.routes)

    def count_routing(mb: StepBatch):  # aux counts of the whole step need every micro-batch's routing first
        return expert_counts(routing(run(mb).router_logits, mc.num_experts_per_tok, bias, mb.routes),
                             aux_mask(mb, tc))

    # Global normalisers and aux tables, known before the forwards (docs/objective.md#terms).
    ctx = step_context(mbs, runtime, mc, tc, count_routing)

    grads = [None] * len(trained)
    sums = None  # {term name: Σ over micro-batches of this rank's partials}
    load = None  # [moe layers, e] real-token expert counts, for router metrics and the router-bias update
    for i, mb in enumerate(mbs):
        out = run(mb)
        routes = routing(out.router_logits, mc.num_experts_per_tok, bias, mb.routes)
        ti = TermInput(out, mb, i, routes, runtime.gather(head_weight(p)), ctx, runtime, mc, tc, state.kernels)
        values = {t.name: t.fn(ti) for t in terms}
        g = runtime.grad(total(values, terms), trained)
        grads = _accumulate(grads, g, tc.torch_reduce_dtype)
        values = {k: v.detach() for k, v in values.items()}
        sums = values if sums is None else {t.name: (torch.maximum if t.reduce == "max" else torch.add)(
            sums[t.name], values[t.name]) for t in terms}
        mb_load = expert_counts(routes, mb.real_mask)
        load = mb_load if load is None else load + mb_load
    # Held in reduce_dtype (bf16 gradients: 2 bytes a parameter until each leaf's update casts its own to fp32);
    # the clipping norm squares each leaf in fp32 (runtime.grad_sq_norm).
    keep = tc.torch_reduce_dtype
    grads = [torch.zeros_like(t, dtype=keep if t.dtype == torch.float32 else t.dtype) if g is None
             else g.to(keep if t.dtype == torch.float32 else t.dtype) for t, g in zip(trained, grads)]

    # One collective for every summed term and the router loads; one more for the terms reduced by max, if any.
    names = [t.name for t in terms if t.reduce == "sum"]
    packed = runtime.all_reduce_sum(torch.cat([torch.stack([sums[n].float() for n in names]), load.reshape(-1)]))
    reduced = dict(zip(names, packed[: len(names)]))
    router_load = packed[len(names) :].view_as(load)
    maxed = [t.name for t in terms if t.reduce == "max"]
    if maxed:
        reduced.update(zip(maxed, runtime.all_reduce_max(torch.stack([sums[n].float() for n in maxed]))))
    reduced = {t.name: reduced[t.name] for t in terms}  # the terms' order
    grad_norm = runtime.grad_sq_norm(grads).sqrt()
    loads, copies = runtime.ep_stats()
    return Gradients(grads, reduced, total(reduced, terms), grad_norm, ctx.n_main, router_load, loads,
                     prefetched=runtime.prefetched, prefetched_backward=runtime.prefetched_backward,
                     async_reductions=runtime.async_reductions,
                     async_reduce_bytes=runtime.async_reduce_bytes, ep_copies=copies, mtp_tokens=tuple(ctx.n_mtp),
                     cp_early=runtime.cp_early)


def _check_routes(mbs: list[StepBatch], mc, mesh, runtime) -> None:
    """A batch's replayed routes fit the model (main layers, top-k, expert ids; the ids' range agreed over every
    rank, so all ranks refuse together) and the mesh (not pipelined)."""
    from q38.errors import ConfigError

    if mesh is not None and mesh.pp > 1:
        raise ConfigError("routing replay (a batch with routes) is not built for a pipelined step (pp > 1); drop pp "
                          "from the layout or train without routing_replay")
    r = mbs[0].routes
    want = (mc.num_hidden_layers, mc.num_experts_per_tok)
    if tuple(r.shape[2:]) != want:
        raise ConfigError(f"the batch's routes have {tuple(r.shape[2:])} (main layers, top-k) per token; the model "
                          f"routes {want}: record them with this model's rollout (routing_replay)")
    span = torch.stack([torch.stack([-m.routes.min(), m.routes.max()]) for m in mbs]).amax(0).float()
    neg_lo, hi = (int(v) for v in runtime.all_reduce_max(span).tolist())
    lo = -neg_lo
    if lo < -1 or hi >= mc.num_experts:
        raise ConfigError(f"the batch's routes name experts {lo}..{hi}; the model has {mc.num_experts} (-1: none "
                          "recorded): record them with this model's rollout")


def update_router_bias(bias: Tensor, load: Tensor, rate: float) -> Tensor:
    """DeepSeek-V3 §2.1.2: each expert's selection bias rises by ``rate`` when its load in the step is below its
    layer's mean and falls by ``rate`` when above (unchanged when equal). ``load``: ``[moe layers, e]`` global."""
    load = load.to(bias)
    return bias + rate * torch.sign(load.mean(-1, keepdim=True) - load)


def train_step(params: TrainState, batch, mesh=None, terms=None, *, donate: bool = False
               ) -> tuple[TrainState, Metrics]:
    """One optimizer step on ``batch`` (dict with ``input_ids``, ``labels``, optional ``doc_ids``, or a ``StepBatch``
    from ``q38.parallel.shard_batch``). ``params`` is the whole train state (a ``TrainState``: parameters, AdamW moments,
    step, router bias, and the kernels the layers run), as an optax-style train state is; ``mesh`` is None or a q38
    mesh. ``terms``: the objective's named terms (default ``default_terms``).

    ``donate=True`` (JAX's ``donate_argnums``): the caller gives up ``params``. The update is written into its own
    local shards, leaf by leaf (each gradient clipped in place and released once its leaf is updated), so the
    optimizer phase holds the state once plus one leaf's temporaries; the returned state holds those buffers and
    the input is marked donated (using it again raises ``DonatedStateError``). The same bits as the pure step."""
    state = params
    state.check_not_donated("the state passed to train_step")
    tc = state.train_config
    t0 = time.perf_counter()
    with record_function("q38.forward_backward"):
        r = loss_and_grads(state, batch, mesh, terms)
    grads, loss, objective, grad_norm = r.grads, r.loss, r.objective, r.grad_norm
    flat, spec = pytree.tree_flatten(state.params)
    trains = state.trainable()
    step = int(state.step) + 1
    lr = learning_rate(step, tc)
    finite = bool(torch.isfinite(objective)) and bool(torch.isfinite(grad_norm))  # waits for the device
    forward_backward_s = time.perf_counter() - t0
    if not finite:
        if tc.nan_policy == "stop":
            raise FloatingPointError(
                f"non-finite loss or gradient at step {step} (loss={float(loss)}, grad_norm={float(grad_norm)}); "
                "lower the learning rate, check the data, or set nan_policy: skip"
            )
        metrics = Metrics(r.terms, objective, grad_norm, lr, r.tokens, skipped=True, router_load=r.router_load,
                          mtp_tokens=r.mtp_tokens, forward_backward_s=forward_backward_s)
        new_state = attrs.evolve(state, step=state.step + 1)
        if donate:  # the next state shares every buffer: the input is given up all the same
            state.donate(step)
        return new_state, metrics

    router_load = r.router_load
    metrics = Metrics(r.terms, objective, grad_norm, lr, r.tokens, router_load=router_load, mtp_tokens=r.mtp_tokens,
                      forward_backward_s=forward_backward_s)
    scale = 1.0
    if tc.grad_clip is not None:
        scale = torch.clamp(tc.grad_clip / (grad_norm + 1e-6), max=1.0)
    if donate:
        trained = [t for t, m in zip(flat, trains) if m]
        moments = (tree_leaves(state.exp_avg, is_leaf=is_int8_moment),
                   tree_leaves(state.exp_avg_sq, is_leaf=is_int8_moment))
        decay = decay_mask(state.params, tc)
        remainders = state.masters() if state.master_remainder is not None else None  # (updated in place too)
        hosts = state.host_masters() if state.host_master is not None else None  # offloaded: stepped on the host
        new_state = attrs.evolve(state, step=state.step + 1)  # the same buffers, updated below
        state.donate(step)  # before any buffer is written: a failure half-way leaves no usable input behind
        del r  # the gradients live on only in `grads`, which the update empties leaf by leaf
        with record_function("q38.optimizer"):
            adamw_step_(trained, grads, *moments, decay, step=step, lr=lr, beta1=tc.beta1, beta2=tc.beta2,
                        eps=tc.eps, weight_decay=tc.weight_decay, grad_scale=scale, remainders=remainders,
                        host_masters=hosts)
        if state.router_bias is not None:
            new_state = attrs.evolve(new_state, router_bias=update_router_bias(state.router_bias, router_load,
                                                                               tc.router_bias_rate))
        return new_state, metrics
    with record_function("q38.optimizer"):
        new_p, new_m, new_v, new_r = _adamw(state, [t for t, m in zip(flat, trains) if m], grads, scale, lr, step)
    updated = iter(new_p)
    if new_r is not None:  # the new host masters (offloaded) or remainders (bf16 + remainder), by path
        field = "host_master" if state.host_master is not None else "master_remainder"
        names = [n for (n, _), m in zip(named_leaves(state.params), trains) if m]
        by_name = {n: x for n, x in zip(names, new_r) if x is not None}
        state = attrs.evolve(state, **{field: tree_map_with_path(lambda p, x: None if x is None else by_name[p],
                                                                 getattr(state, field))})
    new_state = attrs.evolve(
        state,
        params=pytree.tree_unflatten([next(updated) if m else t for t, m in zip(flat, trains)], spec),
        exp_avg=pytree.tree_unflatten(new_m, pytree.tree_structure(state.exp_avg, is_leaf=is_int8_moment)),
        exp_avg_sq=pytree.tree_unflatten(new_v, pytree.tree_structure(state.exp_avg_sq, is_leaf=is_int8_moment)),
        step=state.step + 1,
    )
    if state.router_bias is not None:
        new_state = attrs.evolve(new_state, router_bias=update_router_bias(state.router_bias, r.router_load,
                                                                           tc.router_bias_rate))
    return new_state, metrics


def _adamw(state: TrainState, flat: list[Tensor], grads: list[Tensor], scale, lr: float, step: int):
    """Decoupled-weight-decay Adam in fp32 with torch's kernels (``q38.train.core.optim``) over the trained leaves
    ``flat`` (their moments are the leaves of ``exp_avg`` / ``exp_avg_sq``); returns new lists (the inputs are
    untouched). Returns ``(params, exp_avgs, exp_avg_sqs, remainders or host masters or None)``."""
    tc = state.train_config
    rems = state.masters() if state.master_remainder is not None else None
    hosts = state.host_masters() if state.host_master is not None else None
    out = adamw_step(
        flat, grads, tree_leaves(state.exp_avg, is_leaf=is_int8_moment),
        tree_leaves(state.exp_avg_sq, is_leaf=is_int8_moment), decay_mask(state.params, tc),
        step=step, lr=lr, beta1=tc.beta1, beta2=tc.beta2, eps=tc.eps, weight_decay=tc.weight_decay,
        grad_scale=scale, remainders=rems, host_masters=hosts,
    )
    return out if rems is not None or hosts is not None else (*out, None)
