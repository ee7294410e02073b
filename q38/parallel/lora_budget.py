"""What a LoRA run (``peft``: q38.lora) changes in the plan's budget: the frozen base costs its storage dtype and
nothing else (no fp32 master, no moments, no gradient, no reduce-scatter), the adapters cost fp32 masters, AdamW
moments and gradients on their own placements, and each adapted matmul runs beside its adapter, unmerged
(docs/plan.md#lora).

``base_dtype: fp8`` prices a block-FP8 base as the trainer holds it: the projections the released FP8 checkpoints
quantize cost 1 byte a value plus one fp32 scale per 128 × 128 block (gathered as FP8 and dequantized after the
gather), the other frozen leaves their compute dtype.

Each adapted matmul runs unmerged, ``y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ`` (routed experts: grouped GEMMs, ``A [e, r, in]``,
``B [e, out, r]``): the frozen weight enters autograd as a constant, so no merged copy exists and backward takes
only its input gradient. Compute (``lora_flops``): no frozen matmul weight (adapted or not) gets a weight gradient
(its backward is the input gradient alone: 1 × its forward instead of 2 ×); each adapter adds its own two GEMMs
forward (``2 · r · (i + o)`` a row) and four backward (dX through B then A, dA, dB: twice the forward); a routed
expert's adapter runs on each of the ``num_experts_per_tok`` rows of a token. Memory: each adapted matmul saves
``x·Aᵀ`` (``[rows, r]``) beside its input ``x`` (which the activations of the full fine-tune already count).

An FP8 base is dequantized per gathered layer for the forward and again for the input gradient in backward
(``DEQUANT_IN_BACKWARD = "recompute"``: the backward keeps the FP8 bits and dequantizes them again; ``"saved"``:
the forward's dequantized weights are kept for backward, every layer's without recompute): each dequantization
reads 1 byte and writes ``act`` bytes a value at the hardware's HBM bandwidth (``dequant_seconds``).
"""

import functools

import attrs

from q38.parallel.budget_memory import accumulator_buffers
from q38.parallel.param_stats import Item, ParamStats, param_stats
from q38.parallel.plan import local_numel_grid

FP8_BYTES = 1 + 4 / (128 * 128)  # e4m3 value + its share of the block's fp32 scale
# how the input gradient of an FP8 base gets its dequantized weight: "recompute" (dequantized again from the FP8 bits in
# backward) or "saved" (the forward's dequantized copy kept for backward); the runtime's choice, one switch
DEQUANT_IN_BACKWARD = "recompute"


@attrs.frozen(kw_only=True)
class LoraStats:
    """The parameter costs of a LoRA run on one mesh: ``all`` (base + adapters, what is gathered), ``base``,
    ``adapters``; ``adapted_total`` / ``adapted_layer``: compute-form elements of the adapted weights over all layers
    / in the largest layer (fullest rank); ``base_bytes``: bytes per stored base value."""

    all: ParamStats
    base: ParamStats
    adapters: ParamStats
    adapted_total: int
    adapted_layer: int
    base_bytes: float  # bytes per stored base value, averaged over the base (fp8: quantized and other leaves)
    base_dtype: str
    quantized_total: int = 0  # compute-form elements of the FP8-quantized base over all layers (fullest rank)
    quantized_layer: int = 0  # the same in the largest layer


def _layer_of(path: str) -> str:
    parts = path.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return path


_CACHE: dict = {}


def lora_stats(cfg, layout, mesh: dict, peft, placements, prefetch: bool, act: int) -> LoraStats:
    """``placements``: the base model's (``layout.placements(abstract_params(cfg), mesh)``). Cached per placements
    object (the search prices many batch and recompute settings on one)."""
    key = (id(placements), tuple(mesh.items()), peft, prefetch, act)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is placements:
        return hit[1]
    if len(_CACHE) > 64:
        _CACHE.clear()
    out = _lora_stats(cfg, layout, mesh, peft, placements, prefetch, act)
    _CACHE[key] = (placements, out)
    return out


def _lora_stats(cfg, layout, mesh: dict, peft, placements, prefetch: bool, act: int) -> LoraStats:
    from q38.lora import adapter_info
    from q38.model import abstract_params, is_param_info
    from q38.pytree import named_leaves

    infos = {}
    for path, info in named_leaves(abstract_params(cfg), is_leaf=is_param_info):
        if info is None or not peft.adapts(path):
            continue
        shared = info.axes[:1] == ("expert",) and peft.experts == "shared"
        for key in (("shared_a", "shared_b") if shared else ("lora_a", "lora_b")):
            infos[f"{path}.{key}"] = adapter_info(info, key, peft.rank)
    ad_pl = layout.placements_of_shapes(list(infos.items()), mesh)
    sizes = list(mesh.values())
    from q38.fp8 import default_quantized

    per_layer: dict[str, int] = {}
    quant: dict[str, int] = {}
    fp8 = peft.base_dtype == "fp8"
    for path, pp in placements.items():
        if peft.adapts(path) or (fp8 and default_quantized(path)):
            n = int(local_numel_grid(pp.shape, pp.shard_dims(True), sizes).max())
            if peft.adapts(path):
                per_layer[_layer_of(path)] = per_layer.get(_layer_of(path), 0) + n
            if fp8 and default_quantized(path):
                quant[_layer_of(path)] = quant.get(_layer_of(path), 0) + n
    base = param_stats(placements, mesh, prefetch)
    base_bytes = act
    if fp8 and base.numel:
        q = param_stats({p: pp for p, pp in placements.items() if default_quantized(p)}, mesh, prefetch).numel
        base_bytes = (q * FP8_BYTES + (base.numel - q) * act) / base.numel
    adapters = param_stats(ad_pl, mesh, prefetch)
    return LoraStats(all=_combined(base, adapters), base=base, adapters=adapters,
                     adapted_total=sum(per_layer.values()), adapted_layer=max(per_layer.values(), default=0),
                     base_bytes=base_bytes, base_dtype="fp8" if fp8 else f"{act * 8}-bit",
                     quantized_total=sum(quant.values()), quantized_layer=max(quant.values(), default=0))


def _combined(a: ParamStats, b: ParamStats) -> ParamStats:
    """The statistics of two disjoint sets of parameters (the base and its adapters) from each one's: sums exact;
    the fullest rank's and the largest layer's elements as the sum of each set's (an upper bound, equal when the same
    rank and layer are the fullest in both, as with adapters on their weights' axes). ``param_stats`` over both sets
    at once costs as much again for every layout the search prices."""
    def add(x: dict, y: dict) -> dict:
        return {k: x.get(k, 0.0) + y.get(k, 0.0) for k in {*x, *y}}

    return ParamStats(a.numel + b.numel, max(a.largest_shard, b.largest_shard), a.largest_layer + b.largest_layer,
                      a.largest_layer_local + b.largest_layer_local, a.gathered_layers + b.gathered_layers,
                      add(a.gather_group, b.gather_group), add(a.gather_prefetchable, b.gather_prefetchable),
                      add(a.layer_gather, b.layer_gather), add(a.allreduce_dim, b.allreduce_dim),
                      add(a.recompute_prefetchable, b.recompute_prefetchable), max(a.largest_edge, b.largest_edge))


def _base_item(ls: LoraStats) -> Item:
    dt = (f"fp8 + per-block scales (projections; {ls.base_bytes:.2f} B a value)" if ls.base_dtype == "fp8"
          else "the compute dtype")
    return Item("frozen base", ls.base.numel * ls.base_bytes,
                f"LoRA base in {dt}, {ls.base.numel:,} params: no master, moments or gradient")


def lora_memory(items: list[Item], ls: LoraStats, st, cfg, peft) -> list[Item]:
    """The forward/backward items of the full fine-tune (priced on ``ls.all``) turned into an unmerged LoRA run's:
    no merged copy of any weight, the adapters' saved ``x·Aᵀ`` added."""
    out = []
    ad = ls.adapters.numel
    for it in items:
        if it.name == "master weights":
            out += [_base_item(ls), Item("adapter master weights", ad * st.mst, f"{ad:,} adapter params, fp32")]
        elif it.name == "optimizer moments":
            out.append(Item("optimizer moments", ad * st.mom, f"AdamW m and v of the adapters, {st.moment_dtype}"))
        elif it.name == "gradient accumulator":
            out.append(Item("gradient accumulator", ad * st.red * accumulator_buffers(st.micro_batches - 1),
                            "adapters only"))
        elif it.name == "layer weight gradients":  # the frozen base has none
            out.append(Item(it.name, ls.adapters.largest_layer * st.act, "LoRA adapters: " + it.note, "layer"))
        elif it.name in ("gradients awaiting reduction", "reduce-scatter staging"):  # adapters only: the base is
            full = ls.adapters.largest_layer * st.red  # frozen, never reduced
            staged = full + ls.adapters.largest_layer_local * st.red
            out.append(Item(it.name, full if it.name.startswith("gradients") else staged, "LoRA adapters: "
                            + it.note, "layer"))
        elif it.name == "compute-dtype copy of shards":
            out.append(Item(it.name, ls.adapters.largest_layer_local * st.act, "the layer's adapter shards cast",
                            "layer"))
        elif it.name == "gathered params (transient)" and ls.base_dtype == "fp8":
            k = round(it.bytes / (ls.all.largest_layer * st.act)) if ls.all.largest_layer else 1  # + prefetched
            held = k * (ls.base.largest_layer * ls.base_bytes + ls.adapters.largest_layer * st.act)
            out.append(Item(it.name, held + ls.base.largest_layer * st.act,
                            f"{'current + prefetched' if k > 1 else 'current'} layer: base gathered in FP8, "
                            "dequantized to the compute dtype", "layer"))
        else:
            out.append(it)
    per_token_total, per_token_layer = adapter_saved_per_token(cfg, peft)
    u = st.n_mb * st.act  # one [rows, r] column of x·Aᵀ over the micro-batch's tokens, per rank unit
    if st.recompute == "none":
        out.append(Item("adapter activations (saved)", per_token_total * u,
                        "x·Aᵀ of every adapted matmul, every layer, one micro-batch"))
        out.append(Item("adapter backward working set", per_token_layer * u, "gradient of x·Aᵀ, the layer in "
                        "backward", "layer"))
    else:
        out.append(Item("adapter activations (layer)", 2 * per_token_layer * u,
                        "x·Aᵀ of the recomputed layer's adapted matmuls and its gradient", "layer"))
    if ls.base_dtype == "fp8" and DEQUANT_IN_BACKWARD == "saved" and st.recompute == "none":
        out.append(Item("dequantized base (held)", ls.quantized_total * st.act,
                        "every layer's dequantized FP8 weights, saved for the input gradient"))
    return out


def adapter_saved_per_token(cfg, peft) -> tuple[float, float]:
    """Elements of ``x·Aᵀ`` an unmerged LoRA run saves per token: over every adapted matmul of the model, and in its
    largest layer (a routed expert's adapter: ``num_experts_per_tok`` rows a token)."""
    return _adapter_terms(cfg, peft)[4:6]


def dequant_seconds(ls: LoraStats, st, hbm_bandwidth: float) -> float:
    """HBM time of the FP8 base's dequantizations in one step: each gathered layer's quantized weights read as FP8
    (1 byte) and written in the compute dtype, for the forward and (``DEQUANT_IN_BACKWARD == "recompute"``) again
    for the input gradient, plus once more for the recomputed forward under recompute; per micro-batch."""
    if ls.base_dtype != "fp8" or not hbm_bandwidth:
        return 0.0
    times = 1 + (DEQUANT_IN_BACKWARD == "recompute") + (st.recompute != "none")
    return st.micro_batches * times * ls.quantized_total * (1 + st.act) / hbm_bandwidth


def lora_optimizer(opt_items: list[Item], ls: LoraStats) -> list[Item]:
    """The optimizer phase (priced on the adapters' elements) plus the frozen base, alive throughout."""
    return [_base_item(ls), *opt_items]


def lora_start(items: list[Item], ls: LoraStats, st) -> list[Item]:
    out = []
    for it in items:
        if it.name == "master weights":
            out += [_base_item(ls), Item("adapter master weights", ls.adapters.numel * st.mst)]
        elif it.name == "optimizer moments":
            out.append(Item("optimizer moments", ls.adapters.numel * st.mom))
        else:
            out.append(it)
    return out


def scaled_gathers(ls: LoraStats, act: int) -> ParamStats:
    """``ls.all`` with the base's gathered elements weighted by its storage bytes over the compute dtype's (an FP8
    base is gathered as FP8): what the gathers move, in compute-dtype elements."""
    if ls.base_dtype != "fp8":
        return ls.all
    w = ls.base_bytes / act

    def mix(key):
        a, b = getattr(ls.adapters, key), getattr(ls.base, key)
        return {g: a.get(g, 0.0) + b.get(g, 0.0) * w for g in {*a, *b}}

    return attrs.evolve(ls.all, gather_group=mix("gather_group"), gather_prefetchable=mix("gather_prefetchable"),
                        layer_gather=mix("layer_gather"), recompute_prefetchable=mix("recompute_prefetchable"))


def lora_flops(fl, cfg, peft, tokens: int, micro_batches: int, recompute: str, aux: bool = False):
    """``fl`` (a full fine-tune's ``StepFlops`` over ``tokens`` tokens of this rank) for an unmerged LoRA run: the
    weight gradient of every frozen matmul weight is dropped (its forward's FLOPs once: the LM head's, every
    projection's, router's and expert's; a routed expert weight is used by ``num_experts_per_tok`` rows a token),
    and each adapter's own GEMMs are added (``2 · r · (i + o)`` a row forward, twice that backward; dense adapters
    to ``dense``, routed experts' to ``experts``), their forward again where the layer is recomputed (every mode
    recomputes the projections) and in the aux forward (``aux``)."""
    dense, experts, ad_dense, ad_experts, _, _, ad_layers_dense, ad_layers_experts = _adapter_terms(cfg, peft)
    head = fl.head / 4  # the LM head's forward (main + MTP depths): its weight gradient goes
    rec = dict(fl.recompute_terms)
    extra_rec = 0.0
    if recompute != "none":
        rec["dense"] = rec.get("dense", 0.0) + ad_layers_dense * tokens
        rec["experts"] = rec.get("experts", 0.0) + ad_layers_experts * tokens
        extra_rec = (ad_layers_dense + ad_layers_experts) * tokens
    aux_terms = dict(fl.aux_terms)
    extra_aux = 0.0
    if aux and fl.aux_forward:
        aux_terms["dense"] = aux_terms.get("dense", 0.0) + ad_dense * tokens
        aux_terms["experts"] = aux_terms.get("experts", 0.0) + ad_experts * tokens
        extra_aux = (ad_dense + ad_experts) * tokens
    return attrs.evolve(fl, dense=fl.dense - dense * tokens + 3 * ad_dense * tokens,
                        experts=fl.experts - experts * tokens + 3 * ad_experts * tokens, head=fl.head - head,
                        recompute=fl.recompute + extra_rec, aux_forward=fl.aux_forward + extra_aux,
                        recompute_terms=rec, aux_terms=aux_terms)


@functools.lru_cache(maxsize=32)
def _adapter_terms(cfg, peft) -> tuple[float, ...]:
    """Per token: the dropped weight-gradient FLOPs of the frozen dense and expert weights; the adapters' forward
    FLOPs (dense, experts); the saved ``x·Aᵀ`` elements (whole model, largest layer); the adapters' forward FLOPs of
    the decoder layers alone (dense, experts: what recompute runs again). One walk of the parameters per model and
    setting: the search asks for thousands of budgets."""
    from q38.model import abstract_params, is_param_info
    from q38.pytree import named_leaves

    k, r = cfg.num_experts_per_tok, peft.rank
    dropped = {"dense": 0.0, "experts": 0.0}
    fwd = {"dense": 0.0, "experts": 0.0}
    in_layers = {"dense": 0.0, "experts": 0.0}
    saved: dict[str, float] = {}
    for path, info in named_leaves(abstract_params(cfg), is_leaf=is_param_info):
        if info is None or len(info.shape) < 2 or not (path.startswith(("layers.", "mtp.")) and (
                ".mixer." in path or ".moe." in path or path == "mtp.fc")):
            continue  # embeddings and the head (below), norms and gate vectors; the GDN conv's weight is frozen too
        o, i = info.shape[-2:]
        term, rows = ("experts", k) if len(info.shape) == 3 else ("dense", 1)
        dropped[term] += 2 * rows * o * i
        if peft.adapts(path):
            f = 2 * rows * r * (i + o)
            fwd[term] += f
            if path.startswith("layers."):
                in_layers[term] += f
            saved[_layer_of(path)] = saved.get(_layer_of(path), 0.0) + rows * r
    return (dropped["dense"], dropped["experts"], fwd["dense"], fwd["experts"], sum(saved.values()),
            max(saved.values(), default=0.0), in_layers["dense"], in_layers["experts"])
