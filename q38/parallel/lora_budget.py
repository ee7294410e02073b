"""What a LoRA run (``peft``: q38.lora) changes in the plan's budget: the frozen base costs its storage dtype and
nothing else (no fp32 master, no moments, no gradient, no reduce-scatter), the adapters cost fp32 masters, AdamW
moments and gradients on their own placements, and each targeted weight is merged in compute form before its layer
runs (docs/plan.md#lora).

``base_dtype: fp8`` prices a block-FP8 base as the trainer holds it: the projections the released FP8 checkpoints
quantize cost 1 byte a value plus one fp32 scale per 128 × 128 block (gathered as FP8 and dequantized after the
gather), the other frozen leaves their compute dtype.

Compute (``lora_flops``): a frozen weight that carries no adapter gets no weight gradient (its backward is the
input gradient only: 1 × its forward instead of 2 ×); an adapted weight is merged (``base + s · B @ A``) before its
layer runs, so its layer computes the merged weight's gradient as a full fine-tune does, and the adapters add the
merge and its backward (3 × ``2 · r · o · i`` per gather).
"""

import functools

import attrs

from q38.parallel.param_stats import Item, ParamStats, param_stats
from q38.parallel.plan import local_numel_grid

FP8_BYTES = 1 + 4 / (128 * 128)  # e4m3 value + its share of the block's fp32 scale


@attrs.frozen(kw_only=True)
class LoraStats:
    """The parameter costs of a LoRA run on one mesh: ``all`` (base + adapters, what is gathered), ``base``,
    ``adapters``; ``merged_total`` / ``merged_layer``: compute-form elements of the merged weights over all layers /
    in the largest layer (fullest rank); ``base_bytes``: bytes per stored base value."""

    all: ParamStats
    base: ParamStats
    adapters: ParamStats
    merged_total: int
    merged_layer: int
    base_bytes: float  # bytes per stored base value, averaged over the base (fp8: quantized and other leaves)
    base_dtype: str


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
    per_layer: dict[str, int] = {}
    for path, pp in placements.items():
        if peft.adapts(path):
            n = int(local_numel_grid(pp.shape, pp.shard_dims(True), sizes).max())
            per_layer[_layer_of(path)] = per_layer.get(_layer_of(path), 0) + n
    base = param_stats(placements, mesh, prefetch)
    base_bytes = act
    if peft.base_dtype == "fp8" and base.numel:
        from q38.fp8 import default_quantized

        q = param_stats({p: pp for p, pp in placements.items() if default_quantized(p)}, mesh, prefetch).numel
        base_bytes = (q * FP8_BYTES + (base.numel - q) * act) / base.numel
    adapters = param_stats(ad_pl, mesh, prefetch)
    return LoraStats(all=_combined(base, adapters), base=base, adapters=adapters,
                     merged_total=sum(per_layer.values()), merged_layer=max(per_layer.values(), default=0),
                     base_bytes=base_bytes, base_dtype="fp8" if peft.base_dtype == "fp8" else f"{act * 8}-bit")


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
                      add(a.recompute_prefetchable, b.recompute_prefetchable))


def _base_item(ls: LoraStats) -> Item:
    dt = (f"fp8 + per-block scales (projections; {ls.base_bytes:.2f} B a value)" if ls.base_dtype == "fp8"
          else "the compute dtype")
    return Item("frozen base", ls.base.numel * ls.base_bytes,
                f"LoRA base in {dt}, {ls.base.numel:,} params: no master, moments or gradient")


def lora_memory(items: list[Item], ls: LoraStats, st) -> list[Item]:
    """The forward/backward items of the full fine-tune (priced on ``ls.all``) turned into a LoRA run's."""
    out = []
    ad = ls.adapters.numel
    for it in items:
        if it.name == "master weights":
            out += [_base_item(ls), Item("adapter master weights", ad * st.mst, f"{ad:,} adapter params, fp32")]
        elif it.name == "optimizer moments":
            out.append(Item("optimizer moments", ad * 8, "AdamW m and v of the adapters, fp32"))
        elif it.name == "gradient accumulator":
            out.append(Item("gradient accumulator", ad * st.red * 2, "adapters only"))
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
    if st.recompute == "none":
        out.append(Item("merged weights (held)", ls.merged_total * st.act,
                        "base + B·A of every targeted weight, saved for its layer's backward (no recompute)"))
    else:
        out.append(Item("merged weights (transient)", ls.merged_layer * st.act,
                        "base + B·A of the layer's targeted weights", "layer"))
    return out


def lora_optimizer(opt_items: list[Item], ls: LoraStats) -> list[Item]:
    """The optimizer phase (priced on the adapters' elements) plus the frozen base, alive throughout."""
    return [_base_item(ls), *opt_items]


def lora_start(items: list[Item], ls: LoraStats, st) -> list[Item]:
    out = []
    for it in items:
        if it.name == "master weights":
            out += [_base_item(ls), Item("adapter master weights", ls.adapters.numel * st.mst)]
        elif it.name == "optimizer moments":
            out.append(Item("optimizer moments", ls.adapters.numel * 8))
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


def optimizer_bytes(ls: LoraStats, st) -> float | int:
    return ls.adapters.numel * (st.mst * 2 + st.red + 8 * 2)



def lora_flops(fl, cfg, peft, tokens: int, micro_batches: int, recompute: str):
    """``fl`` (a full fine-tune's ``StepFlops`` over ``tokens`` tokens of this rank) for a LoRA run: the weight
    gradient of every frozen matmul weight without an adapter is dropped (its forward's FLOPs once: the LM head's,
    the router's unless adapted, any untargeted projection's or expert's; a routed expert weight is used by
    ``num_experts_per_tok`` of every token), and the adapters' merges are added to ``dense`` (``2 · r · o · i``
    forward, twice that backward, per gather: once per micro-batch, twice with recompute)."""
    dense, experts, merge = _lora_flop_terms(cfg, peft)
    gathers = micro_batches * (1 if recompute == "none" else 2)
    head = fl.head / 4  # the LM head's forward (main + MTP depths): its weight gradient goes
    return attrs.evolve(fl, dense=fl.dense - dense * tokens + merge * gathers, experts=fl.experts - experts * tokens,
                        head=fl.head - head)


@functools.lru_cache(maxsize=32)
def _lora_flop_terms(cfg, peft) -> tuple[float, float, float]:
    """Per token: the dropped weight-gradient FLOPs of untargeted dense and expert weights; per gather: the
    merges' FLOPs (one walk of the parameters per model and setting: the search asks for thousands of budgets)."""
    from q38.model import abstract_params, is_param_info
    from q38.pytree import named_leaves

    tokens = 1
    k = cfg.num_experts_per_tok
    dropped = {"dense": 0.0, "experts": 0.0}
    merge = 0.0
    for path, info in named_leaves(abstract_params(cfg), is_leaf=is_param_info):
        if info is None or len(info.shape) < 2 or not (path.startswith(("layers.", "mtp.")) and (
                ".mixer." in path or ".moe." in path or path == "mtp.fc")):
            continue  # embeddings and the head (below), norms, conv and gate vectors
        if path.endswith("conv_w"):
            continue
        o, i = info.shape[-2:]
        if peft.adapts(path):
            lead = info.shape[0] if len(info.shape) == 3 and peft.experts == "per_expert" else 1
            merge += 3 * 2 * peft.rank * o * i * lead
        elif len(info.shape) == 3:  # routed experts: each token runs k of them
            dropped["experts"] += 2 * tokens * k * o * i
        else:
            dropped["dense"] += 2 * tokens * o * i
    return dropped["dense"], dropped["experts"], merge
