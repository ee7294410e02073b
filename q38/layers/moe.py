"""Sparse MoE (docs/model.md#sparse-moe-with-a-shared-expert): softmax top-k router with renormalisation, routed SwiGLU experts computed by
sorting token slots by expert and one grouped (or padded batched) matmul, plus a sigmoid-gated shared expert.

Extra dims: ``m`` = routed slots (n·k) sorted by expert, ``q`` = per-expert capacity in the padded batched path.
"""

from typing import Callable

import attrs
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from q38.model_config import ModelConfig
from q38.kernels import DEFAULT_KERNELS, KernelConfig
from q38.layers.common import ParamInfo, WeightNode, linear
from q38.pytree import pytree_node


@pytree_node
@attrs.frozen
class MoEParams:
    w_router: Tensor  # [e, d]
    we_gate_up: Tensor  # [e, 2f, d]: rows [0:f] gate, [f:2f] up (the Qwen3.5 fused layout)
    we_down: Tensor  # [e, d, f]
    ws_gate: Tensor  # [fs, d] shared expert gate_proj
    ws_up: Tensor  # [fs, d]
    ws_down: Tensor  # [d, fs]
    w_shared_gate: Tensor  # [1, d] sigmoid gate of the shared expert


def abstract_moe(cfg: ModelConfig) -> MoEParams:
    d, e, f, fs, std = (
        cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
        cfg.initializer_range,
    )
    return MoEParams(
        w_router=ParamInfo((e, d), std=std, axes=("router_expert", "router_in"), fsdp_dim=1),  # skinny
        we_gate_up=ParamInfo((e, 2 * f, d), std=std, axes=("expert", "expert_mlp", "expert_embed"), fsdp_dim=1),
        we_down=ParamInfo((e, d, f), std=std, axes=("expert", "expert_embed", "expert_mlp"), fsdp_dim=2),
        ws_gate=ParamInfo((fs, d), std=std, axes=("mlp", "embed")),
        ws_up=ParamInfo((fs, d), std=std, axes=("mlp", "embed")),
        ws_down=ParamInfo((d, fs), std=std, axes=("mlp_out", "mlp_in")),
        w_shared_gate=ParamInfo((1, d), std=std, axes=("shared_gate", "shared_gate_in"), fsdp_dim=1),  # skinny
    )


def select_experts(
    logits_ne: Float[Tensor, "n e"], top_k: int, bias_e: Float[Tensor, " e"] | None = None
) -> tuple[Float[Tensor, "n e"], Int[Tensor, "n k"]]:
    """Router probabilities (softmax over all experts, fp32) and the top-k experts each token picks.

    ``bias_e`` (aux-loss-free balancing, DeepSeek-V3 §2.1.2) is added to the scores for the *selection* only; the
    returned probabilities stay unbiased, so gate weights never see the bias."""
    probs_ne = torch.softmax(logits_ne.float(), dim=-1)
    scores_ne = probs_ne.detach() if bias_e is None else probs_ne.detach() + bias_e.to(probs_ne.dtype)
    return probs_ne, torch.topk(scores_ne, top_k, dim=-1).indices


def replayed(idx_nk: Int[Tensor, "n k"], replay_nk: Int[Tensor, "n k"] | None) -> Int[Tensor, "n k"]:
    """Routing replay: each token's experts from ``replay_nk`` (recorded when the token was sampled), or its own
    top-k ``idx_nk`` where the row of ``replay_nk`` is -1 (nothing recorded); ``replay_nk`` None: ``idx_nk``."""
    if replay_nk is None:
        return idx_nk
    replay_nk = replay_nk.to(idx_nk.device, idx_nk.dtype)
    return torch.where(replay_nk[:, :1] >= 0, replay_nk, idx_nk)


def route(
    logits_ne: Float[Tensor, "n e"], top_k: int, normalize: bool, bias_e: Float[Tensor, " e"] | None = None,
    replay_nk: Int[Tensor, "n k"] | None = None,
) -> tuple[Float[Tensor, "n k"], Int[Tensor, "n k"]]:
    """Softmax over all experts in fp32, top-k (of the biased scores when ``bias_e`` is given), gate weights from the
    unbiased probabilities of the chosen experts, optional renormalisation of the kept weights. ``replay_nk``: the
    experts to use instead of the top-k (``replayed``); their gates still come from these logits."""
    probs, idx_nk = select_experts(logits_ne, top_k, bias_e)
    idx_nk = replayed(idx_nk, replay_nk)
    w_nk = probs.gather(-1, idx_nk)
    if normalize:
        w_nk = w_nk / w_nk.sum(-1, keepdim=True)
    return w_nk.to(logits_ne.dtype), idx_nk


def swiglu_grouped_mm(
    x_md: Float[Tensor, "m d"],
    counts_e: Int[Tensor, " e"],
    we_gate_up: Float[Tensor, "e f2 d"] | WeightNode,
    we_down: Float[Tensor, "e d f"] | WeightNode,
    w_m: Float[Tensor, " m"],
) -> Float[Tensor, "m d"]:
    """``kernels.experts: grouped_mm``: SwiGLU of rows already sorted by expert (``counts_e`` rows for expert 0, then
    expert 1, ...), each row's activation scaled by its gate weight ``w_m`` before the down projection; one
    ``F.grouped_mm`` per projection."""
    offs = torch.cumsum(counts_e, 0).to(torch.int32)
    a_mf = _WeightedSwiGLU.apply(w_m, _grouped(x_md, we_gate_up, offs))
    return _GradContiguous.apply(_grouped(a_mf, we_down, offs))


def swiglu_batched(
    x_md: Float[Tensor, "m d"],
    counts_e: Int[Tensor, " e"],
    we_gate_up: Float[Tensor, "e f2 d"] | WeightNode,
    we_down: Float[Tensor, "e d f"] | WeightNode,
    w_m: Float[Tensor, " m"],
) -> Float[Tensor, "m d"]:
    """``kernels.experts: batched``: the same SwiGLU as ``swiglu_grouped_mm``, the rows scattered into
    ``[e, capacity, d]`` and one padded bmm per projection."""
    e = counts_e.shape[0]
    m = x_md.shape[0]
    if m == 0:  # empty, but connected to the inputs: an EP exchange that fed them still runs its backward
        return x_md * w_m[:, None]
    # the capacity: the fullest expert's count, or under torch.compile every slot (a count read back from the device
    # is a data-dependent shape the graph cannot hold; the padding rows are dropped below either way)
    cap = m if torch.compiler.is_compiling() else int(counts_e.max())
    starts = torch.cumsum(counts_e, 0) - counts_e
    expert_m = torch.repeat_interleave(torch.arange(e, device=x_md.device), counts_e, output_size=m)
    slot_m = torch.arange(m, device=x_md.device) - starts[expert_m]
    flat = expert_m * cap + slot_m
    x_eqd = x_md.new_zeros(e * cap, x_md.shape[1]).index_copy(0, flat, x_md).view(e, cap, -1)
    h_qf2 = _bmm(x_eqd, we_gate_up).reshape(e * cap, -1)
    w_q = w_m.new_zeros(e * cap).index_copy(0, flat, w_m)  # padding rows: weight 0
    a_eqf = _WeightedSwiGLU.apply(w_q, h_qf2).view(e, cap, -1)
    y_eqd = _bmm(a_eqf, we_down)
    return y_eqd.reshape(e * cap, -1).index_select(0, flat)


def _grouped(x_md: Float[Tensor, "m i"], w, offs: Tensor) -> Float[Tensor, "m o"]:
    """``x·W_eᵀ`` per expert over rows sorted by expert: ``F.grouped_mm`` of an expert weight ``[e, o, i]``, or the
    weight node's own product (a LoRA run's adapted or block-FP8 experts, ``q38.lora``: base and adapter unmerged,
    over the same rows and offsets)."""
    return F.grouped_mm(x_md, w.transpose(-2, -1), offs=offs) if isinstance(w, Tensor) else w.grouped_mm(x_md, offs)


def _bmm(x_eqd: Float[Tensor, "e q i"], w) -> Float[Tensor, "e q o"]:
    """``x·W_eᵀ`` per expert over padded rows ``[e, capacity, i]``: ``bmm`` of an expert weight, or the weight
    node's own product (as ``_grouped``)."""
    return torch.bmm(x_eqd, w.transpose(-2, -1)) if isinstance(w, Tensor) else w.bmm(x_eqd)


# The routed experts' SwiGLU over slots sorted by expert: ``swiglu_grouped_mm`` or ``swiglu_batched`` (the
# ``kernels.experts`` callable).
ExpertsFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class _WeightedSwiGLU(torch.autograd.Function):
    """``a = silu(gate) ⊙ up ⊙ w`` with per-row gate weights ``w`` ``[m]``, of ``h = [gate | up]`` ``[m, 2f]`` (one
    tensor: the experts' fused projection) or of ``gate`` and ``up`` given apart (the shared expert's two
    projections). Called as ``apply(w, h)`` or ``apply(w, gate, up)``.

    Forward is the reference expression, op for op, into one buffer; it saves its inputs only. Backward (in at least
    fp32) writes the input gradients in the inputs' layout (for ``h``: the two halves of one ``[m, 2f]`` gradient,
    where autograd would make two and concatenate them): ``dup = da ⊙ w ⊙ silu(gate)``, ``dgate = silu'(gate) ⊙
    (da ⊙ w ⊙ up)`` by the fused ``silu_backward`` kernel (what autograd runs for ``F.silu``), ``dw = Σ_f da ⊙
    silu(gate) ⊙ up``: seven passes over ``[m, f]`` where the formula written out elementwise took thirteen. The gate
    weight scales the ``[m, f]`` activation rather than the ``[m, d]`` output: the same product, on the narrower
    tensor whenever f < d, and no ``[m, d]`` tensor is saved for the weight's gradient."""

    @staticmethod
    def forward(ctx, w, *gate_up):
        gate, up = gate_up[0].chunk(2, dim=-1) if len(gate_up) == 1 else gate_up
        ctx.save_for_backward(w, *gate_up)
        return F.silu(gate).mul_(up).mul_(w[:, None])

    @staticmethod
    def backward(ctx, da):
        w, *saved = ctx.saved_tensors
        acc = torch.promote_types(saved[0].dtype, torch.float32)
        gu, daf, wf = [t.to(acc) for t in saved], da.to(acc), w.to(acc)[:, None]
        gate, up = gu[0].chunk(2, dim=-1) if len(gu) == 1 else gu
        silu = F.silu(gate)
        dw = torch.linalg.vecdot(daf, silu * up).to(w.dtype) if ctx.needs_input_grad[0] else None
        daw = daf * wf
        if torch.compiler.is_compiling():  # functional: torch.compile cannot trace ``out=`` writes into views
            dup = daw * silu
            dgate = torch.ops.aten.silu_backward(daw * up, gate)
            grads = (torch.cat([dgate, dup], dim=-1),) if len(gu) == 1 else (dgate, dup)
            return (dw, *(g.to(t.dtype) for g, t in zip(grads, saved)))
        if len(gu) == 1:
            grads = (torch.empty_like(gu[0]),)
            dgate, dup = grads[0].chunk(2, dim=-1)
        else:
            grads = dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        torch.mul(daw, silu, out=dup)
        torch.ops.aten.silu_backward.grad_input(daw.mul_(up), gate, grad_input=dgate)
        return (dw, *(g.to(t.dtype) for g, t in zip(grads, saved)))


class _GradContiguous(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (CPU grouped_mm backward needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


# How routed slots reach their experts when they are spread over ranks: ``(x_nd, w_nk, idx_nk, params, cfg, experts,
# shared) -> out_nd``, the shared expert's output (``shared()``, a thunk the dispatch may run while its exchanges are
# in flight) plus every token's routed outputs, each scaled by its slot's gate weight (applied to the activation,
# ``_WeightedSwiGLU``); ``experts`` the ``ExpertsFn`` that runs them. The dispatch chooses the order in which a
# token's slot outputs are summed (q38.parallel.ep.EPDispatch: per destination node, then node by node).
# ``local_experts`` is the per-slot reference: every expert on this device (``moe_apply`` without a dispatch fuses it
# with the token gather and scatter, ``_local_routed``).
ExpertDispatch = Callable[[Tensor, Tensor, Tensor, MoEParams, ModelConfig, ExpertsFn, Callable[[], Tensor]], Tensor]


def _sorted_swiglu(
    rows: Tensor, w_m: Tensor, expert_m: Tensor, row_of_slot: Callable[[Tensor], Tensor], p: MoEParams,
    cfg: ModelConfig, experts: ExpertsFn,
) -> tuple[Tensor, Tensor, Tensor]:
    """Slots sorted by expert, each reading row ``row_of_slot(slot)`` of ``rows`` and scaled by its weight, through
    ``experts``. Returns ``(y_sorted, order, row_sorted)``: the outputs in sorted order, the sort, and the rows
    they read."""
    order = torch.argsort(expert_m, stable=True)
    # the per-expert counts by a scatter-add (bincount's output size depends on the data: torch.compile breaks on it)
    counts_e = expert_m.new_zeros(cfg.num_experts).scatter_add_(0, expert_m, torch.ones_like(expert_m))
    row_sorted = row_of_slot(order)
    y_sorted = experts(rows.index_select(0, row_sorted), counts_e, p.we_gate_up, p.we_down, w_m[order])
    return y_sorted, order, row_sorted


def local_experts(
    x_md: Tensor, w_m: Tensor, expert_m: Tensor, p: MoEParams, cfg: ModelConfig, experts: ExpertsFn = swiglu_batched
) -> Tensor:
    """Every expert is on this device: sort slots by expert, one ``experts`` call, unsort."""
    y_sorted, order, _ = _sorted_swiglu(x_md, w_m, expert_m, lambda slot: slot, p, cfg, experts)
    return torch.empty_like(y_sorted).index_copy(0, order, y_sorted)


def _local_routed(
    x_nd: Float[Tensor, "n d"], w_nk: Float[Tensor, "n k"], idx_nk: Int[Tensor, "n k"], p: MoEParams, cfg: ModelConfig,
    base_nd: Float[Tensor, "n d"], experts: ExpertsFn,
) -> Float[Tensor, "n d"]:
    """``base_nd`` plus the routed experts with every expert on this device, in one gather and one scatter-add: slots
    sorted by expert read their token's row directly (``order // k``) and add their weighted output straight into
    it (equal to ``local_experts`` on ``x[token_m]`` followed by the ``index_add``, without the two extra permutations
    and their backward scatters; the same expert arithmetic as the dispatched path, so both round alike: layouts are
    compared with one process at ~1e-5)."""
    k = idx_nk.shape[1]
    y_sorted, _, token_sorted = _sorted_swiglu(x_nd, w_nk.reshape(-1), idx_nk.reshape(-1), lambda slot: slot // k, p,
                                               cfg, experts)
    return base_nd.index_add(0, token_sorted, y_sorted)


def shared_expert(p: MoEParams, x_nd: Float[Tensor, "n d"]) -> Float[Tensor, "n d"]:
    """``sigmoid(x·w_g) ⊙ down(silu(x·Wgᵀ) ⊙ x·Wuᵀ)`` with the sigmoid gate applied to the ``[n, fs]`` activation
    inside the routed experts' weighted SwiGLU: the same product, without saving the ``[n, d]`` output for the
    gate's gradient or a separate ``silu(gate)`` (saved: ``gate``, ``up``, the activation, the gate weights). The
    gate and up projections stay two matmuls on the parameters themselves: a matmul over ``[Wg; Wu]`` would save the
    concatenated weight for its backward in full, outside FSDP's reshard-after-forward."""
    gate_n = torch.sigmoid(F.linear(x_nd, p.w_shared_gate)).squeeze(-1)
    a = _WeightedSwiGLU.apply(gate_n, linear(x_nd, p.ws_gate), linear(x_nd, p.ws_up))
    return linear(a, p.ws_down)


def moe_apply(
    p: MoEParams,
    x: Float[Tensor, "b s d"],
    cfg: ModelConfig,
    dispatch: ExpertDispatch | None = None,
    router_bias: Float[Tensor, " e"] | None = None,
    kernels: KernelConfig = DEFAULT_KERNELS,
    replay: Int[Tensor, "n k"] | None = None,
) -> tuple[Float[Tensor, "b s d"], Float[Tensor, "n e"]]:
    """Routed + shared experts. Returns the output and the raw router logits (for the aux loss).

    ``router_bias``: per-expert selection bias (aux-loss-free balancing); not a parameter, no gradient.
    ``kernels``: the step's resolved kernels (``kernels.experts`` runs the routed experts).
    ``replay``: routing replay, each token's experts (``n = b·s`` rows; -1 rows: the router's own top-k), gated by
    the router's probabilities of them (docs/rl.md#routing-replay)."""
    b, s, d = x.shape
    x_nd = x.reshape(-1, d)
    logits_ne = linear(x_nd, p.w_router)
    w_nk, idx_nk = route(logits_ne, cfg.num_experts_per_tok, cfg.norm_topk_prob, router_bias, replay)
    experts = kernels.fn("experts")
    if dispatch is None:
        # the routed outputs are added into the shared expert's output (no zero-filled buffer and no separate sum)
        out_nd = _local_routed(x_nd, w_nk, idx_nk, p, cfg, shared_expert(p, x_nd), experts)
    else:
        out_nd = dispatch(x_nd, w_nk, idx_nk, p, cfg, experts, lambda: shared_expert(p, x_nd))
    return out_nd.reshape(b, s, d), logits_ne
