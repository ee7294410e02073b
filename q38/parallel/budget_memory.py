"""The memory side of the budget: bytes autograd saves per layer kind, and the items of each phase of a step
(forward/backward, optimizer, start) on the fullest rank, as ``train_step`` allocates them
(docs/plan.md#what-the-budget-counts)."""

import math

import attrs

from q38.model_config import ModelConfig
from q38.kernels import GDN_CHUNK
from q38.layers.kinds import MIXER_KINDS, Workload, kept_regions
from q38.parallel.param_stats import Item, ParamStats


@attrs.frozen
class LayerActivations:
    """Bytes autograd saves for one layer over one micro-batch, split into the mixer core and the rest;
    ``kept``: what selective recompute stores for the layer (the outputs of the ops inside the kernel region:
    every intermediate of the torch GDN reference, the output (and logsumexp) of a fused kernel);
    ``widest``: the largest single saved tensor (backward working set)."""

    core: float
    rest: float
    widest: float
    kept: float = 0.0
    # bytes alive at the peak of the mixer core's own backward: the layer's saved tensors still needed then plus the
    # working set of that backward (0: not modelled; the layer total + ``widest`` bound applies alone)
    mixer_backward: float = 0.0

    @property
    def total(self) -> float:
        return self.core + self.rest


def _moe_saved(cfg: ModelConfig, n: float | int, act: int, ep: int, ep_balance: bool) -> tuple[float, float]:
    """Router, routed experts (grouped matmul path), shared expert. Returns (bytes, widest)."""
    d, e, k, f, fs = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                      cfg.shared_expert_intermediate_size)
    m = n * k
    # the gate weight scales the [m, f] activation inside the fused SwiGLU (moe.py: _WeightedSwiGLU), which saves
    # h = [gate | up] and the weights: no [m, d] weighted output, no separate silu(gate); the shared expert runs the
    # same function (moe.py: shared_expert): its h [n, 2fs] and activation [n, fs]
    elems = n * e + 2 * n + n * k + 3 * m * d + m * 2 * f + m * f + m + 3 * n * fs
    ints = n * k * 8 + 2 * m * 8
    if ep > 1:  # the dispatch's receive buffer, saved for the expert matmuls (the combine adds the returned rows into
        elems += m * d  # their tokens' rows by index_add, whose backward saves nothing of them)
    return elems * act + ints, m * 2 * f * act


def layer_activations(cfg: ModelConfig, kind: str, rows: float | int, seq: int, *, act_bytes: int, cp: int = 1,
                      ep: int = 1, ep_balance: bool = False, gdn_kernel: bool = False,
                      kv_native: bool = False, gdn_chunk: int = GDN_CHUNK) -> LayerActivations:
    """Saved bytes of one decoder layer of mixer kind ``kind`` (a ``layer_types`` entry; its ``saved`` formula,
    q38/layers/kinds.py) for ``rows`` rows of ``seq`` local tokens. Norms and residual stream included.
    ``kv_native``: attention takes k, v with their own heads (unpacked rows, no CP; see ``estimate``'s
    ``packed_rows``). ``gdn_kernel``: fla's GDN kernel (else the torch core, in chunks of ``gdn_chunk``)."""
    w = Workload(rows=rows, seq=seq, cp=cp, act_bytes=act_bytes, kv_native=kv_native, gdn_kernel=bool(gdn_kernel),
                 gdn_chunk=gdn_chunk)
    n, d = w.tokens, cfg.hidden_size
    mixer = MIXER_KINDS[kind].saved(cfg, w)
    moe, moe_w = _moe_saved(cfg, n, act_bytes, ep, ep_balance)
    common = (4 * n * d) * act_bytes + 2 * n * 4  # the two norms' inputs (residual stream) and outputs, rsqrt
    return LayerActivations(core=mixer.core, rest=mixer.rest + moe + common, widest=max(mixer.widest, moe_w),
                            kept=mixer.kept, mixer_backward=mixer.mixer_backward)


MOMENT_BLOCK = 256  # int8 moments: one fp32 scale per block of this many values


def moment_bytes(moment_dtype: str) -> float:
    """Bytes per parameter of both AdamW moments stored in ``moment_dtype`` (int8: block-wise quantized, one fp32
    scale per ``MOMENT_BLOCK`` values)."""
    per = {"float32": 4.0, "fp32": 4.0, "bfloat16": 2.0, "bf16": 2.0, "int8": 1.0 + 4.0 / MOMENT_BLOCK}
    if moment_dtype not in per:
        raise ValueError(f"moment_dtype must be float32, bfloat16 or int8, got {moment_dtype!r}")
    return 2 * per[moment_dtype]


def _state_items(st, numel: int | float, what: str = "") -> list[Item]:
    """The stored optimizer state on the device: masters and moments, or (offloaded) the compute-dtype shards the
    gathers read, masters and moments on the host."""
    if st.offload_optimizer:
        return [Item("compute-dtype shards", numel * st.act, f"{numel:,} params{what}; masters and moments on the "
                     "host (offload_optimizer)")]
    mnote = "bf16 weight + int16 remainder (the bf16 half is the compute copy)" if st.remainder else ""
    return [Item("master weights", numel * st.mst, f"{numel:,} params{what}" + (f"; {mnote}" if mnote else "")),
            Item("optimizer moments", numel * st.mom, f"AdamW m and v, {st.moment_dtype}")]


@attrs.frozen(kw_only=True)
class _Step:
    """One step as :func:`estimate` prices it, its arguments resolved: the mesh, one micro-batch's local shape
    (``rows_mb`` rows of ``seq`` tokens on a CP rank) and the byte sizes of the compute (``act``: activations and
    gathered weights), gradient (``red``) and master (``mst``) dtypes."""

    mesh: dict
    micro_batches: int
    recompute: str
    seq: int
    rows_mb: float
    act: int
    red: int
    mst: int
    param_dtype: str
    reduce_dtype: str
    master_dtype: str
    offload_activations: bool
    resharded: bool  # without recompute, each gathered layer is freed after its forward and gathered again
    ep_balance: bool
    max_dup_experts: int
    gdn_kernel: bool
    kv_native: bool
    gdn_chunk: int
    async_reduce: bool = False  # gradient reduce-scatters / all-reduces issued async in backward
    ep_dispatch: str = "flat"  # flat | hierarchical
    ep_overlap: bool = False  # the EP exchange of one half of the slots in flight while the other half computes
    cp_early: bool = False  # CP exchanges marked ``early`` started before the compute that does not need them
    mom: float = 8  # bytes of both AdamW moments per parameter (moment_bytes)
    moment_dtype: str = "float32"
    donated: bool = True  # the optimizer phase as the donated step runs it (False: the pure train_step)
    offload_optimizer: bool = False  # masters and moments in host memory, AdamW on the host

    @property
    def remainder(self) -> bool:
        """Masters stored as the bf16 weight + an int16 remainder: the bf16 half is the compute copy."""
        return self.master_dtype == "bfloat16_remainder"

    @property
    def held(self) -> int:
        """Bytes a parameter of the gradients the optimizer phase holds: ``reduce_dtype``'s, but the leaf of a
        bf16 + remainder master or of an offloaded optimizer is the bf16 compute copy, so its reduced gradient is
        rounded to bf16 (q38/train/core/step.py)."""
        return min(self.red, 2) if self.remainder or self.offload_optimizer else self.red

    @property
    def cast_copy(self) -> bool:
        """Each layer's shards are cast to the compute dtype before the gather (not when the stored form already is
        the compute dtype: a bf16+remainder master, or the device copy of an offloaded optimizer)."""
        return (self.param_dtype not in (self.master_dtype, {"fp32": "float32"}.get(self.master_dtype))
                and not self.remainder and not self.offload_optimizer)

    @property
    def cp(self) -> int:
        return self.mesh.get("cp", 1)

    @property
    def ep(self) -> int:
        return self.mesh.get("ep", 1)

    @property
    def n_mb(self) -> float:
        return self.rows_mb * self.seq


def saved_per_layer(cfg: ModelConfig, st: _Step, kinds: list) -> list[float]:
    """Bytes autograd keeps for each layer of ``kinds`` (``layer_kinds``: main layers, then the MTP depths) over one
    micro-batch until its backward, per the recompute mode: every saved tensor (``none``), else the layer's input and
    the kept kernel outputs. Their sum is the "activations (saved)" item; a pipeline rank holds its own layers'."""
    acts = [layer_activations(cfg, k.name, st.rows_mb, st.seq, act_bytes=st.act, cp=st.cp, ep=st.ep,
                              ep_balance=st.ep_balance, gdn_kernel=st.gdn_kernel, kv_native=st.kv_native,
                              gdn_chunk=st.gdn_chunk) for k in kinds]
    if st.recompute == "none":
        return [a.total for a in acts]
    keep = kept_regions(st.recompute)
    return [st.n_mb * cfg.hidden_size * st.act + (a.kept if k.region in keep else 0.0) for a, k in zip(acts, kinds)]


# The micro-batch loop's gradient buffers, as the step keeps them (q38/train/core/step.py ``loss_and_grads`` and
# q38/train/core/pipeline_step.py; ``accumulate`` returns a new list, the first micro-batch's gradients as they are,
# later sums as new tensors). Each buffer is the rank's trained elements in the gradient dtype.
ACCUMULATE_BUFFERS = 3  # while a micro-batch's gradients are added in: the old sum, those gradients and the new sum


def accumulator_buffers(micro_batch: int, pipelined: bool = False) -> int:
    """Gradient-sized buffers from earlier micro-batches alive while micro-batch ``micro_batch`` (0-based, in the
    order the rank runs its backwards) runs its forward and backward. None for the first. One process: the sum so
    far, and the previous micro-batch's gradients, still bound to the loop's variable until the next ones return (at
    the second micro-batch the sum *is* the first one's gradients: one buffer). A pipelined rank: the sum only (each
    backward's gradients are local to it)."""
    if micro_batch <= 0:
        return 0
    return 1 if pipelined or micro_batch == 1 else 2


def _activations(cfg: ModelConfig, st: _Step, kinds: list) -> tuple[float | int, float | int, str, float | int]:
    """``(saved, working, note, least)``: the bytes autograd saves over every layer of one micro-batch (per the
    recompute mode), the backward working set of one layer, and the least one layer saves."""
    n_mb, d, act = st.n_mb, cfg.hidden_size, st.act
    acts = [layer_activations(cfg, k.name, st.rows_mb, st.seq, act_bytes=act, cp=st.cp, ep=st.ep,
                              ep_balance=st.ep_balance, gdn_kernel=st.gdn_kernel, kv_native=st.kv_native,
                              gdn_chunk=st.gdn_chunk) for k in kinds]
    # The "layer" transient group also holds the EP receive buffers / duplicated experts and the CP k/v buffers;
    # those belong to the MoE and the attention, freed (or not yet made) when a GDN core runs its backward.
    not_at_mixer = 0.0
    if st.ep > 1:
        not_at_mixer += n_mb * cfg.num_experts_per_tok * d * act * 2
        if st.ep_balance:
            not_at_mixer += st.max_dup_experts * 3 * d * cfg.moe_intermediate_size * act * 2
    if st.cp > 1:
        not_at_mixer += 2 * n_mb * st.cp * cfg.num_key_value_heads * cfg.head_dim * act * 2
    if st.recompute == "none":
        saved = sum(a.total for a in acts)
        working = max(a.widest for a in acts) * 2 + 2 * n_mb * d * act
        # at a mixer core's backward the later layers' saved tensors (and this layer's MoE part) are already freed
        later = 0.0
        for a in reversed(acts):
            if a.mixer_backward:
                working = max(working, a.mixer_backward - a.total - later - not_at_mixer + 2 * n_mb * d * act)
            later += a.total
        return saved, working, f"{len(kinds)} layers × saved tensors", min(a.total for a in acts)
    keep = kept_regions(st.recompute)
    kept = sum(a.kept for a, k in zip(acts, kinds) if k.region in keep)
    saved = len(kinds) * n_mb * d * act + kept
    # the layer in backward: its recomputed saved tensors at the start (MoE backward), or, later, the mixer
    # core's backward (torch GDN: its own working set, gdn_backward_working)
    working = max(max(a.total + a.widest, a.mixer_backward - not_at_mixer) for a in acts) + 2 * n_mb * d * act
    least = n_mb * d * act + min(a.kept if k.region in keep else 0.0 for a, k in zip(acts, kinds))
    return saved, working, f"{len(kinds)} layer inputs" + (" + kept kernel outputs" if kept else ""), least


def _loss_workspace(cfg: ModelConfig, st: _Step, chunk_tokens: int | None,
                    chunk_budget_bytes: int | None) -> tuple[float | int, float | int]:
    """``(logits live, bytes)`` of the chunked loss: each depth's valid hidden rows (index_select, saved), the chunk
    workspace and the dx accumulators."""
    n_mb, v, act = st.n_mb, cfg.vocab_size, st.act
    if chunk_budget_bytes is not None:
        chunk_logits = min(n_mb, max(1, chunk_budget_bytes // (v * 8))) * v
    elif chunk_tokens is not None:
        chunk_logits = min(n_mb, chunk_tokens) * v
    else:
        chunk_logits = n_mb * v * 3
    d = cfg.hidden_size
    loss_ws = (1 + cfg.mtp_num_layers) * n_mb * d * act + chunk_logits * (4 + (act if act < 4 else 0)) + 2 * n_mb * d * 4
    return chunk_logits, loss_ws


def _forward_backward_items(cfg: ModelConfig, st: _Step, ps: ParamStats, kinds: list,
                            loss: tuple[float | int, float | int]) -> list[Item]:
    """The memory of the forward/backward phase, item by item."""
    numel, n_mb, d, act = ps.numel, st.n_mb, cfg.hidden_size, st.act
    saved, working, saved_note, layer_saved = _activations(cfg, st, kinds)
    memory = _state_items(st, numel, " on the fullest rank")
    if st.micro_batches > 1:
        n_acc = accumulator_buffers(st.micro_batches - 1)
        memory.append(Item("gradient accumulator", numel * st.red * n_acc,
                           "the first micro-batch's gradients" if n_acc == 1 else
                           "the sum of earlier micro-batches + the previous one's gradients (bound until the next "
                           "return)"))
    memory.append(Item("activations (saved)", 0.0 if st.offload_activations else saved,
                       saved_note + (" — offloaded to host" if st.offload_activations else "")
                       + ", one micro-batch"))
    if st.cast_copy:  # each layer's shards are cast just before its gather (FSDP2's policy)
        memory.append(Item("compute-dtype copy of shards", ps.largest_layer_local * act,
                           "the layer's shards cast before the gather", "layer"))
    # Without recompute the runtime frees each gathered layer after its forward and gathers it again in backward
    # (train.reshard_after_forward, not with offload); otherwise the matmuls keep every gathered weight alive.
    if st.recompute == "none" and ps.gathered_layers and not st.resharded:
        memory.append(Item("gathered params (held)", ps.gathered_layers * act,
                           "every layer's gathered weights, saved for its backward (no recompute)"))
    elif ps.gathered_layers:
        # At the backward peak: the layer in backward (gathered again, or kept by its recompute) and, with recompute,
        # the layer before it, prefetched as this one's recompute began (forward holds two too: the current layer
        # and the one prefetched ahead)
        behind = st.recompute != "none" and any(v > 0 for v in ps.recompute_prefetchable.values())
        memory.append(Item("gathered params (transient)", (2 if behind else 1) * ps.largest_layer * act,
                           f"{'current + prefetched' if behind else 'current'} layer, compute form", "layer"))
    if ps.gathered_layers:
        # autograd makes the gathered weights' gradients full-size in the compute dtype; each gather's backward node
        # runs after the layer's whole backward (it was recorded before the layer's ops), so all of them are alive
        # together before their reductions are issued
        memory.append(Item("layer weight gradients", ps.largest_layer * act,
                           "full-size, compute dtype, the layer in backward", "layer"))
    if st.async_reduce and (ps.gathered_layers or ps.largest_edge):
        # Backward issues each gathered leaf's reduction async (MeshRuntime with overlap_comm) and completes one
        # gather call's (a layer's) when the next call's first is issued: while a layer runs its backward, the
        # full-size gradients of the one backward finished before it (or of an edge gathered alone, the lm_head
        # being reduced first) wait in reduce_dtype for their reduce-scatter, with the collective's staging copy
        # of their chunks (the list reduce-scatter flattens them into one buffer, gloo and NCCL alike, until it
        # completes) and its output: the reduced shard. Their layer's backward is done: its saved activations
        # (counted among the saved ones, at least the smallest layer's) are freed by then.
        full = max(ps.largest_layer, ps.largest_edge) * st.red
        what = "a layer" if ps.largest_layer >= ps.largest_edge else "an edge leaf"
        freed = 0.0 if st.offload_activations else layer_saved
        memory.append(Item("gradients awaiting reduction", full,
                           f"{what}'s full-size gradients in {st.reduce_dtype}, reduce-scatter in flight (async)",
                           "layer"))
        memory.append(Item("reduce-scatter staging", max(0.0, full + ps.largest_layer_local * st.red - freed),
                           "the collective's flattened copy of those chunks + the reduced shard, less their "
                           "layer's saved activations (freed)", "layer"))
    memory.append(Item("layer backward working set", working, "recomputed layer + gradients of its widest tensors"
                       if st.recompute != "none" else "gradients of the widest saved tensors", "layer"))
    model_extra = (n_mb * d * 2 + cfg.mtp_num_layers * n_mb * (5 * d)) * act  # embedding out, final norm, MTP block
    memory.append(Item("model edges", model_extra, "embedding output, final norm, MTP block"))
    chunk_logits, loss_ws = loss
    memory.append(Item("loss workspace", loss_ws, f"chunked CE: {chunk_logits:,.0f} logits live + hidden rows",
                       "loss"))
    if st.ep > 1:
        e_local = math.ceil(cfg.num_experts / st.ep)
        recv = n_mb * cfg.num_experts_per_tok * d * act * 2
        memory.append(Item("EP receive buffers", recv, f"dispatch + combine of {n_mb * cfg.num_experts_per_tok:,.0f}"
                           f" routed rows ({e_local} local experts), the layer in flight", "layer"))
        if st.ep_balance:
            memory.append(Item("EP-balance duplicate experts", st.max_dup_experts * 3 * d * cfg.moe_intermediate_size
                               * act * 2, f"{st.max_dup_experts} copied experts per rank (weights + gradients)",
                               "layer"))
    if st.cp > 1:
        memory.append(Item("CP buffers", 2 * n_mb * st.cp * cfg.num_key_value_heads * cfg.head_dim * act * 2,
                           "gathered keys/values of the layer in flight (+ gradient)", "layer"))
    return memory


STATE_NAMES = ("master weights", "optimizer moments", "compute-dtype shards", "frozen base", "adapter master weights")


def accumulate_items(st: _Step, memory: list[Item], numel: int | float) -> list[Item]:  # noqa: PYI041
    """The moment a later micro-batch's gradients are added into the sum (``micro_batches > 1``): the stored state
    (the forward/backward phase's state items), the old sum, the micro-batch's gradients and the new sum
    (``ACCUMULATE_BUFFERS``); that micro-batch's activations are freed by then. Empty with one micro-batch."""
    if st.micro_batches < 2:
        return []
    return [*(it for it in memory if it.name in STATE_NAMES),
            Item("gradient sum", numel * st.red, f"{st.reduce_dtype}, earlier micro-batches"),
            Item("micro-batch gradients", numel * st.held, "the micro-batch just back-propagated"),
            Item("new gradient sum", numel * st.red, "accumulate's result (a new tensor per leaf)")]


def _optimizer_items(st: _Step, numel: int, grad_clip: bool, impl: str, largest_leaf: int = 0) -> list[Item]:
    """The optimizer phase on the fullest rank. ``st.donated`` (what the trainer runs): the donated step updates the
    state's own shards in place, leaf by leaf, releasing each gradient once its leaf is updated (clipping scales the
    gradients in place): the state once, the gradients (all alive when the phase starts) and one leaf's
    temporaries (``largest_leaf`` elements): fp32 copies of its master (bf16+remainder), moments (not fp32) and
    gradient (not fp32), and foreach AdamW's ``sqrt(exp_avg_sq)``. Otherwise the pure ``train_step``
    (q38.train.core.optim.adamw_step): the old state and the gradients stay alive while it updates fp32 copies of
    weights and moments; the gradients it updates with are fp32 copies when they are scaled by the clipping factor
    (``_foreach_mul`` returns new tensors) or stored in another dtype; torch's foreach AdamW divides by
    ``_foreach_sqrt(exp_avg_sq)``, a new tensor per parameter of the group (≈ all of them), the fused kernel updates
    in place. Offloaded (``st.offload_optimizer``): the device holds its compute-dtype shards and the gradients,
    copied to the host leaf by leaf; the update runs there (the donated step writes each new compute copy into its
    shard; the pure step returns new ones, the old still alive)."""
    opt = _state_items(st, numel)
    held = "bf16 (the compute-copy leaves' dtype)" if st.held != st.red else st.reduce_dtype
    opt.append(Item("gradients", numel * st.held, f"{held}, all leaves at the end of backward"))
    if st.offload_optimizer:
        if not st.donated:
            opt.append(Item("new compute-dtype shards", numel * st.act,
                            "the pure step's new compute copies of the host masters"))
        return opt
    if st.donated:
        tmp = 4 * st.remainder + 8 * (st.mom != 8) + 4 * (st.held != 4) + 4 * (impl == "foreach")
        if tmp and largest_leaf:
            opt.append(Item("one leaf's update temporaries", largest_leaf * tmp,
                            f"fp32 working copies of the largest leaf ({largest_leaf:,} elements), donated step"))
        return opt
    opt.append(Item("new weights and moments", numel * (st.mst + st.mom),
                    "copies the functional AdamW updates and returns (pure step)"))
    if grad_clip or st.held != 4:
        opt.append(Item("fp32 gradients for the update", numel * 4,
                        "scaled by the clipping factor" if grad_clip else f"{held} gradients cast to fp32"))
    if impl == "foreach":
        opt.append(Item("update temporaries", numel * 4, "foreach AdamW: sqrt(exp_avg_sq) of every parameter"))
    return opt


def optimizer_traffic(st: _Step, numel: int | float) -> float:
    """HBM bytes the on-device AdamW moves per step: masters and moments read and written, the gradients read."""
    return numel * (2 * st.mst + 2 * st.mom + st.held)


def host_optimizer(st: _Step, numel: int | float, devices_per_node: int) -> tuple[float, float, float]:
    """An offloaded optimizer: ``(host bytes per node, host-memory bytes AdamW streams per node and step, device <->
    host bytes per device and step)``. The host holds each local rank's masters and moments (as ``q38.offload`` does:
    the gradients land leaf by leaf, one leaf's pinned buffer and the next one's in flight, not counted); AdamW reads
    masters, moments and gradients and writes masters, moments and the compute-dtype weights the device gathers
    from; the device sends its gradients and receives its compute-dtype shards."""
    held = devices_per_node * numel * (st.mst + st.mom)
    streamed = devices_per_node * numel * (2 * st.mst + 2 * st.mom + st.held + st.act)
    return float(held), float(streamed), float(numel * (st.held + st.act))


def _start_items(cfg: ModelConfig, st: _Step, ps: ParamStats) -> list[Item]:
    """Starting the run: every path that loads state allocates only the rank's shards (the template, or the shards
    read from a Hugging Face directory) plus what one read holds: resume reads each saved chunk whole
    (``torch.load`` of one DCP item; the saving layout's largest shard, assumed to be this one), init_from a HF
    directory reads one slice in the file's dtype (bf16 assumed) and casts it to fp32; the grouped Qwen3-Next
    projections read their one HF tensor whole. The moments are zeros of the same shards."""
    numel, big = ps.numel, ps.largest_shard
    hf_whole = 0
    if cfg.family.checkpoint_layout == "qwen3_next":
        hf_whole = (2 * cfg.linear_key_dim + 2 * cfg.linear_value_dim) * cfg.hidden_size * 2
    return [
        *_state_items(st, numel),
        Item("resume: one saved chunk", big * 4, "fp32, read whole by DCP before its block is copied", "resume"),
        Item("init_from HF: one slice + fp32 copy", big * (2 + 4) + hf_whole,
             "bf16 slice and its cast" + (" + one grouped in_proj_qkvz read whole" if hf_whole else ""),
             "init_from"),
    ]
