"""The whole budget of a layout, predicted by arithmetic: itemised peak memory per rank, communication bytes per
collective and mesh dim, FLOPs, and a step time placed on a hardware profile (``specs/hardware/*.yaml``).

Nothing here allocates a tensor or starts a process: shapes come from the abstract parameter tree and the layout's
placements, FLOPs from :mod:`q38.flops` (the formula MFU uses). :func:`estimate` puts together the memory
(``budget_memory``), the collectives (``budget_comm``) and the per-op compute (:func:`price_ops`) into a
:class:`Budget` (``budget_result``); what each counts and why: docs/plan.md#what-the-budget-counts.
"""

import functools
import math
from typing import Any, Mapping

from q38.model_config import ConfigError, ModelConfig
from q38.flops import StepFlops, step_flops
from q38.kernels import GDN_CHUNK
from q38.layers.kinds import RECOMPUTE_MODES, flagged_regions, layer_kinds, selective_mode
from q38.parallel.layout import Layout
from q38.parallel.efficiency import DEFAULT_DOC_LEN, Efficiency, OpTime, attention_factor
from q38.parallel.param_stats import Item, ParamStats, param_stats
from q38.parallel.hardware import GIB, MEMORY_HEADROOM, Hardware, _nbytes
from q38.parallel.budget_memory import (
    LayerActivations, _forward_backward_items, _loss_workspace, _optimizer_items, _start_items, _Step,
    accumulate_items, host_optimizer, layer_activations, moment_bytes, optimizer_traffic, saved_per_layer,
)
from q38.parallel.budget_comm import CommTerm, _comm_terms, distinct_nodes, ep_exchange_bytes, group_shape
from q38.parallel.budget_result import Budget, format_budget, format_ops

# the budget's API, wherever each part lives (hardware, budget_memory, budget_comm, budget_result)
__all__ = [
    "GIB", "MEMORY_HEADROOM", "RECOMPUTE_MODES", "Budget", "CommTerm", "Hardware", "Item", "LayerActivations",
    "ParamStats", "distinct_nodes", "ep_exchange_bytes", "estimate", "format_budget", "format_ops", "group_shape",
    "layer_activations", "price_ops", "recompute_mode",
]


def recompute_mode(train: Mapping[str, Any]) -> str:
    """The recompute mode of a run config's ``train`` settings (the YAML mapping or ``TrainConfig.to_dict()``)."""
    return selective_mode(flagged_regions(train)) if train.get("recompute") else "none"


def estimate(
    cfg: ModelConfig,
    layout: Layout,
    world: int,
    *,
    seq_len: int,
    rows_per_rank: int,
    micro_batches: int = 1,
    recompute: str = "none",
    param_dtype: str = "bf16",
    reduce_dtype: str = "fp32",
    master_dtype: str = "fp32",
    moment_dtype: str = "float32",
    offload_optimizer: bool = False,
    donated: bool = True,
    offload_activations: bool = False,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    loss_chunk_tokens: int | None = 1024,
    loss_chunk_budget_bytes: int | None = None,
    ep_balance: bool = False,
    max_dup_experts: int = 2,
    aux_global: bool = True,
    hardware: Hardware | None = None,
    model_name: str | None = None,
    placements=None,
    gdn_kernel: bool | None = None,
    grad_clip: bool = True,
    adamw_impl: str | None = None,
    packed_rows: bool = True,
    gdn_chunk: int = GDN_CHUNK,
    async_reduce: bool = True,
    ep_dispatch: str = "flat",
    ep_overlap: bool = True,
    cp_early: bool = True,
    peft=None,
    kernels=None,
    doc_len: int = DEFAULT_DOC_LEN,
    rl=None,
) -> Budget:
    """Predict one step of ``cfg`` under ``layout`` on ``world`` ranks; ``rows_per_rank`` rows of ``seq_len`` per
    data-parallel rank (split into ``micro_batches``). ``param_dtype``: compute form (gathers move it);
    ``reduce_dtype``: gradients; ``master_dtype``: stored weights (``fp32`` | ``bfloat16_remainder``: the bf16 weight
    plus an int16 remainder, 4 bytes, no cast copy); ``moment_dtype``: AdamW moments (``float32`` | ``bfloat16`` |
    ``int8``: block-wise, one fp32 scale per 256 values); ``offload_optimizer``: masters and moments in host memory,
    AdamW on the host (``hardware``'s host fields price it); ``donated``: the optimizer phase as the donated step runs
    it (the trainer's), False: the pure ``train_step``'s. ``gdn_kernel``: True
    for fla's GDN kernel, False or None for the torch core, whose chunk length is ``gdn_chunk`` (``kernels.
    gdn_chunk_size``; the default is the accelerator one).
    ``grad_clip``: the run clips gradients (``train.grad_clip``, on by default). ``adamw_impl``: ``foreach`` |
    ``fused`` (q38.train.core.optim); None: ``fused`` with a hardware profile (an accelerator), ``foreach`` without
    (CPU), as ``optim.default_impl`` picks. ``packed_rows``: rows hold several documents (pretraining data), so
    attention runs with a document mask and k, v repeated to the query heads; False: one document per row, where
    16-bit accelerator runs and CPU runs hand SDPA the kv heads as they are (``attention._native_gqa``).
    ``peft``: a LoRA run (``q38.lora.PeftConfig``): priced by ``q38.parallel.lora_budget``.
    ``kernels``: the resolved ``KernelConfig`` the run uses (``resolve_kernels``); with a hardware profile each op's
    executed FLOPs are priced at its kernel's efficiency (``price_ops``); None: every FLOP at the profile's
    ``achievable_fraction``. ``doc_len``: tokens per document in packed rows (what block-sparse and per-document
    attention kernels skip). ``rl``: a ``budget_rollout.RolloutPlan``: the RL rollout phase and the reference policy
    priced too (``q38.parallel.budget_rollout``)."""
    if rl is not None and layout.pp > 1:
        raise ConfigError("RL (--rl-*) on a pipelined layout (pp > 1) is not priced: the pipelined step runs only the "
                          "LM objective; pick a layout without pp")
    if layout.pp > 1:  # a pipeline axis: priced per stage (q38.parallel.pipeline_plan)
        args = {n: v for n, v in locals().items() if n not in ("cfg", "layout", "world")} | {"placements": None}
        from q38.parallel.pipeline_plan import estimate_pipelined

        return estimate_pipelined(estimate, cfg, layout, world, **args)
    from q38.model import abstract_params

    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute mode must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    mesh = layout.resolve_mesh(world)
    if placements is None:
        placements = layout.placements(abstract_params(cfg), mesh)
    cp = mesh.get("cp", 1)
    if seq_len % cp:
        raise ConfigError(f"seq_len {seq_len} is not divisible by the layout's cp size {cp}")
    if rows_per_rank % micro_batches:
        raise ConfigError(f"{rows_per_rank} rows per rank do not split into {micro_batches} micro-batches")
    impl = adamw_impl or ("fused" if hardware is not None else "foreach")
    if impl not in ("foreach", "fused"):
        raise ConfigError(f"adamw_impl must be 'foreach' or 'fused', got {impl!r}")
    act = _nbytes(param_dtype)
    master_dtype = {"float32": "fp32"}.get(master_dtype, master_dtype)
    if master_dtype not in ("fp32", "bfloat16_remainder"):
        raise ConfigError(f"master_dtype must be float32 or bfloat16_remainder, got {master_dtype!r}")
    if master_dtype == "bfloat16_remainder" and param_dtype not in ("bf16", "bfloat16"):
        raise ConfigError(f"master_dtype bfloat16_remainder keeps the bf16 compute weight as the master's high half: "
                          f"it needs param_dtype bf16 (got {param_dtype}); add --param-dtype bf16")
    if offload_optimizer and param_dtype not in ("bf16", "bfloat16"):
        raise ConfigError(f"offload_optimizer keeps a bf16 compute copy on the device: it needs param_dtype bf16 (got "
                          f"{param_dtype}); add --param-dtype bf16")
    try:
        mom = moment_bytes(moment_dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if offload_optimizer and hardware is not None and not (hardware.host_memory_bandwidth
                                                           and hardware.host_link_bandwidth):
        raise ConfigError(f"offload_optimizer needs the host side of the {hardware.name} profile (host_memory_bandwidth,"
                          " host_link_bandwidth, host_memory_bytes); add them to its YAML")
    if offload_optimizer and peft is not None:
        raise ConfigError("offload_optimizer with a LoRA run is not priced (the adapters' state is small); drop one")
    st = _Step(
        mesh=mesh, micro_batches=micro_batches, recompute=recompute, seq=seq_len // cp,
        rows_mb=rows_per_rank / micro_batches, act=act, red=_nbytes(reduce_dtype), mst=4,
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, master_dtype=master_dtype,
        offload_activations=offload_activations,
        resharded=recompute == "none" and reshard_after_forward and not offload_activations,
        ep_balance=ep_balance, max_dup_experts=max_dup_experts, gdn_kernel=bool(gdn_kernel),
        kv_native=not packed_rows and cp == 1 and (hardware is None or act == 2), gdn_chunk=gdn_chunk,
        async_reduce=async_reduce, ep_dispatch=ep_dispatch, ep_overlap=ep_overlap, cp_early=cp_early,
        mom=mom, moment_dtype=moment_dtype, donated=donated, offload_optimizer=offload_optimizer,
    )
    if ep_dispatch not in ("flat", "hierarchical"):
        raise ConfigError(f"ep_dispatch must be 'flat' or 'hierarchical', got {ep_dispatch!r}")
    ps = param_stats(placements, mesh, prefetch)
    ls = None
    if peft is not None:
        from q38.parallel import lora_budget

        ls = lora_budget.lora_stats(cfg, layout, mesh, peft, placements, prefetch, act)
        ps = ls.all
    kinds = layer_kinds(cfg)
    memory = _forward_backward_items(cfg, st, ps, kinds,
                                     _loss_workspace(cfg, st, loss_chunk_tokens, loss_chunk_budget_bytes))
    opt_items = _optimizer_items(st, ps.numel if ls is None else ls.adapters.numel, grad_clip, impl,
                                 ps.largest_shard if ls is None else ls.adapters.largest_shard)
    start_items = _start_items(cfg, st, ps)
    comm_ps, reduced = ps, None
    if ls is not None:
        memory = lora_budget.lora_memory(memory, ls, st, cfg, peft)
        opt_items = lora_budget.lora_optimizer(opt_items, ls)
        start_items = lora_budget.lora_start(start_items, ls, st)
        comm_ps, reduced = lora_budget.scaled_gathers(ls, act), ls.adapters
    acc_items = accumulate_items(st, memory, ps.numel if ls is None else ls.adapters.numel)
    rollout_phase, rollout_note = [], ""
    if rl is not None:  # the reference is held in every phase; the rollout is a phase of its own
        from q38.parallel import budget_rollout

        ref, rollout_phase, rollout_note = budget_rollout.rollout_budget(
            cfg, layout, mesh, rl, st, ps, ls, start_items, seq_len=seq_len, tokens_per_rank=rows_per_rank * st.seq)
        memory, opt_items, start_items = memory + ref, opt_items + ref, start_items + ref
        acc_items = acc_items + ref if acc_items else acc_items
    fl = _step_flops(cfg, rows_per_rank, st.seq, cp=cp, recompute=recompute, micro_batches=micro_batches,
                    gdn_chunk=gdn_chunk, aux_global=aux_global, causal_skip=True)
    if ls is not None:  # no weight gradient for any frozen weight; the adapters' own GEMMs added
        fl = lora_budget.lora_flops(fl, cfg, peft, rows_per_rank * st.seq, micro_batches, recompute,
                                    aux=aux_global and micro_batches > 1)
    hw = hardware
    peak = hw.peak(param_dtype) if hw else None
    ops: tuple[OpTime, ...] = ()
    shared = _shared_expert_flops(cfg, rows_per_rank * st.seq)
    if hw and kernels is not None:
        ops = price_ops(fl, hw, param_dtype, kernels, packed=packed_rows, seq=st.seq, cp=cp, doc_len=doc_len,
                        widths={"experts": cfg.moe_intermediate_size, "*": cfg.hidden_size})
        if hw.hbm_efficiency:
            ops += (memory_op(cfg, hw, rows_per_rank * st.seq, micro_batches, recompute, param_dtype,
                              kernels.causal_conv1d),)
        compute_s, compute_fwd_s = sum(o.seconds for o in ops), sum(o.forward_s for o in ops)
        by = {o.op: o for o in ops}
        moe_s = by["experts"].seconds + shared / (peak * by["matmul"].efficiency.value)
    elif hw:
        rate = peak * hw.achievable_fraction
        compute_s, compute_fwd_s = fl.executed / rate, fl.model / 3 / rate  # forward ≈ a third; recompute: backward
        moe_s = (fl.experts + shared) / rate
    else:
        compute_s = compute_fwd_s = moe_s = 0.0
    opt_numel = ps.numel if ls is None else ls.adapters.numel
    optimizer_s, host = (optimizer_traffic(st, opt_numel) / hw.hbm_bandwidth if hw else 0.0), None
    if offload_optimizer and hw:
        held, streamed, link = host_optimizer(st, opt_numel, hw.devices_per_node)
        host_s = streamed / hw.host_memory_bandwidth
        link_s = link / hw.host_link_bandwidth
        # as q38.offload runs it: after backward, leaf by leaf, each gradient's copy overlapping the host update of
        # the leaf before (CUDA), nothing overlapping the backward: the longer of the host update and the copies
        optimizer_s = max(host_s, link_s)
        host = (held, host_s, link_s)
    dequant_s = lora_budget.dequant_seconds(ls, st, hw.hbm_bandwidth) if ls is not None and hw else 0.0
    dp = math.prod(mesh.get(n, 1) for n in layout.batch_mesh_dims)
    return Budget(
        model=model_name or cfg.model_type, layout=layout.name, mesh=tuple(mesh.items()), world=world,
        seq_len=seq_len, rows_per_rank=rows_per_rank, micro_batches=micro_batches, recompute=recompute,
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, memory=tuple(memory),
        optimizer_phase=tuple(opt_items), start_phase=tuple(start_items), flops=fl,
        accumulate_phase=tuple(acc_items),
        layer_saved=tuple(0.0 for _ in kinds) if offload_activations else tuple(saved_per_layer(cfg, st, kinds)),
        comm=tuple(_comm_terms(cfg, st, comm_ps, kinds, hw, moe_s, reduced)),
        compute_s=compute_s, compute_fwd_s=compute_fwd_s,
        optimizer_s=optimizer_s, dequant_s=dequant_s, host_optimizer=host,
        optimizer_state=f"{'pure' if not donated else 'donated'} step, masters {master_dtype}, moments "
                        f"{moment_dtype}, gradients {reduce_dtype}" + (", offloaded to the host" if offload_optimizer
                                                                        else ""),
        hardware=hw.name if hw else None, peak_flops=peak, global_tokens=dp * rows_per_rank * seq_len,
        hbm_bytes=hw.hbm_bytes if hw else None, ops=ops, kernels=kernels if ops else None,
        doc_len=doc_len if packed_rows else None, compute_spread=_spread(hw) if hw and not ops else (1.0, 1.0),
        rollout_phase=tuple(rollout_phase), rollout_note=rollout_note,
    )


def _spread(hw: Hardware) -> tuple[float, float]:
    """The compute time's factor at the slow and fast ends of the profile's ``achievable_fraction`` range."""
    lo, hi = hw.achievable_range or (hw.achievable_fraction, hw.achievable_fraction)
    return hw.achievable_fraction / lo, hw.achievable_fraction / hi


_step_flops = functools.lru_cache(maxsize=512)(step_flops)  # the search prices thousands of budgets of few shapes


def price_ops(fl: StepFlops, hw: Hardware, param_dtype: str, kernels, *, packed: bool, seq: int, cp: int,
              doc_len: int, widths: Mapping[str, int] | None = None) -> tuple[OpTime, ...]:
    """Each priced op's executed FLOPs (``fl``'s term with its recompute and aux share; attention scaled to what
    its kernel computes: ``efficiency.attention_factor``) at its kernel's efficiency on ``hw``, at the op's width
    in ``widths`` (op → width, ``*`` for the rest: a profile entry's ``narrow`` range prices narrow shapes).
    Forward: a third of each term (the loss: a quarter, its logits are recomputed in backward)."""
    peak = hw.peak(param_dtype)
    att = attention_factor(kernels.attention, packed=packed, seq=seq, cp=cp, doc_len=doc_len)
    rows = (  # op, impl, executed, forward, note
        ("matmul", "torch", fl.executed_term("dense"), fl.dense / 3, "projections, router, shared experts, MTP fc"),
        ("experts", kernels.experts, fl.executed_term("experts"), fl.experts / 3, "routed experts"),
        ("attention", kernels.attention, fl.executed_term("attention") * att, fl.attention / 3 * att,
         f"{att:.2f} x the causal count" + (f" ({doc_len}-token documents)" if packed else "")),
        ("gdn", kernels.gdn, fl.executed_term("gdn_core"), fl.gdn_core / 3, "chunked delta rule"),
        ("loss", kernels.loss, fl.head, fl.head / 4, "LM head + CE, main and MTP depths"),
    )
    out = []
    for op, impl, flops, fwd, note in rows:
        w = (widths or {}).get(op, (widths or {}).get("*"))
        e = hw.price(op, impl, w)
        out.append(OpTime(op=op, impl=impl, flops=flops, efficiency=e, seconds=flops / (peak * e.value),
                          forward_s=fwd / (peak * e.value), note=note))
    return tuple(out)


def memory_op(cfg: ModelConfig, hw: Hardware, tokens: int, micro_batches: int, recompute: str, param_dtype: str,
              conv: str) -> OpTime:
    """The step's memory-bound ops (``q38.parallel.traffic``: norms, residuals, gates, casts, the torch causal conv,
    counted from the layers' code at the model's widths) at the profile's ``hbm_efficiency`` share of its HBM
    bandwidth, serial with the compute on the same stream."""
    from q38.parallel.traffic import step_traffic

    nbytes, fwd = step_traffic(cfg, tokens, micro_batches, recompute, param_dtype, conv)
    lo, hi = hw.hbm_efficiency
    src = hw.sources.get("hbm_efficiency", "") if isinstance(hw.sources, Mapping) else ""
    status = "published" if src.startswith("published") else "assumed"
    e = Efficiency(op="elementwise", impl="eager", value=(lo + hi) / 2, low=lo, high=hi, status=status,
                   source=src.removeprefix(f"{status}:").strip() or "the profile's hbm_efficiency")
    rate = hw.hbm_bandwidth * e.value
    return OpTime(op="elementwise", impl="eager", flops=0.0, efficiency=e, seconds=nbytes / rate,
                  forward_s=fwd / rate, bytes=nbytes, note=f"memory-bound ops: {nbytes / 1e12:,.2f} TB through HBM")


def _shared_expert_flops(cfg: ModelConfig, tokens: int) -> float:
    """Forward + backward FLOPs of the shared expert (gate, up, down and its sigmoid gate) over ``tokens``."""
    d, f = cfg.hidden_size, cfg.shared_expert_intermediate_size
    return 6.0 * tokens * (3 * d * f + d) * cfg.num_hidden_layers

