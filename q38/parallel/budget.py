"""The whole budget of a layout, predicted by arithmetic: itemised peak memory per rank, communication bytes per
collective and mesh dim, FLOPs, and a step time placed on a hardware profile (``specs/hardware/*.yaml``).

Nothing here allocates a tensor or starts a process: shapes come from the abstract parameter tree and the layout's
placements (``Layout.placements``), FLOPs from :mod:`q38.flops` (the formula MFU uses), activations from per-layer
formulas written from what each layer saves for backward.

**Memory** is the larger of two phases of ``train_step`` as the code runs it:

- *forward/backward*: fp32 master weights and AdamW moments, gradients accumulated over earlier micro-batches,
  the tensors autograd saves (per layer kind, per the recompute mode), the gathered compute-form parameters that
  stay alive (without recompute ``F.linear`` saves the gathered weight of every layer until its backward; with
  recompute only the layer being recomputed and the prefetched next one), the loss workspace, EP receive buffers
  and duplicated experts, CP key/value buffers, and the backward working set of one layer (the larger of its
  start, all its recomputed tensors, and its torch GDN core's own backward, which rebuilds the in-chunk factors:
  ``gdn_backward_working``);
- *optimizer*: the functional AdamW builds new parameter and moment tensors while the old ones are alive, with
  fp32 (clipped) gradient copies and, on the foreach path, a ``sqrt(exp_avg_sq)`` temporary per parameter.

Activation formulas exist for two implementations: the pure-torch reference (``gdn_implementation: torch``,
SDPA on CPU; checked against a live-storage measurement in tests/test_plan_budget.py) and the accelerator kernels
(``fla`` GDN, flash SDPA), written from the tensors those kernels save (not yet measured: benchmarks/gpu.sh).

**Time**: compute = executed FLOPs / (peak × achievable fraction), a third of it in forward. Each collective is
priced by ``q38.parallel.links.LinkModel`` on the group it really spans (``group_shape``: ranks are numbered
row-major over the mesh and consecutive ranks share a node, so the layout's mesh order decides which groups stay
inside a node), the price the simulated cluster (benchmarks/cluster_sim.py) holds the real collectives to. Overlap
is what the runtime does, switched by the same settings (``train.overlap_comm``, ``fsdp_prefetch``, ``ep_overlap``):
prefetched forward gathers (``prefetch``: the first even gather of every parameter of the layers after the first
and of the MTP block; several mesh dims sharding one tensor dim evenly are one collective), their recompute in
backward (layer i-1's started when layer i's recompute begins), CP key/value gathers started before the query-side
compute, gradient reductions issued async in backward (``async_reduce``) and the EP exchange of one half of
the slots in flight during the other half's experts (``ep_overlap``, hidden at most behind the MoE compute) hide
behind the compute of their phase; every other collective is synchronous. Each phase takes ``sync + max(compute,
async)``. The optimizer step is bound by memory bandwidth.
"""

import functools
import math
from typing import Any, Mapping

import attrs

from q38.model_config import ConfigError, ModelConfig
from q38.flops import StepFlops, step_flops
from q38.kernels import GDN_CHUNK
from q38.layers.kinds import MIXER_KINDS, RECOMPUTE_MODES, Workload, kept_regions, layer_kinds
from q38.parallel.layout import Layout
from q38.parallel.links import LinkModel, Topology
from q38.parallel.efficiency import DEFAULT_DOC_LEN, Efficiency, OpTime, attention_factor, parse_table
from q38.parallel.param_stats import Item, ParamStats, param_stats, phase_total  # noqa: F401 (Item, ParamStats: the budget's types)

GIB = 2**30


def _nbytes(dtype: str) -> int:
    return {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}[dtype]


def recompute_mode(train: Mapping[str, Any]) -> str:
    """The recompute mode of a run config's ``train`` settings (the YAML mapping or ``TrainConfig.to_dict()``)."""
    if not train.get("recompute"):
        return "none"
    kept = [k.region for k in MIXER_KINDS.values() if train.get(k.keep_flag)]
    if not kept:
        return "full"
    if len(kept) == len(MIXER_KINDS):
        return "selective_both"
    if len(kept) == 1:
        return f"selective_{kept[0]}"
    raise ConfigError(f"no recompute mode keeps exactly the regions {kept}; keep one of them or all")


# The share of a device's memory a plan may fill; the rest is for allocator fragmentation, the CUDA / CANN context
# and collective buffers (q38 plan --search's default cap; the plain plan reports against it too).
MEMORY_HEADROOM = 0.9

# ---- hardware ---------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Hardware:
    """One accelerator kind (``specs/hardware/<name>.yaml``). ``efficiency``: what each (op, kernel) reaches
    (``q38.parallel.efficiency``); ``achievable_fraction`` prices an (op, kernel) the table does not list.
    ``device``: the torch device type the kernels are resolved for (``cuda``, ``npu``)."""

    name: str
    peak_bf16_flops: float  # dense, per device
    peak_fp32_flops: float
    achievable_fraction: float  # of peak, for an (op, kernel) without an ``efficiency`` entry (an assumption)
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s per device, one direction (NVLink / HCCS)
    inter_node_bandwidth: float  # bytes/s per device, one direction (its share of the node's NICs)
    devices_per_node: int
    sources: tuple[str, ...] = ()
    device: str = "cuda"
    efficiency: tuple[Efficiency, ...] = ()

    @classmethod
    def load(cls, name: str) -> "Hardware":
        import yaml

        from q38.model_config import SPECS_DIR

        d = SPECS_DIR / "hardware"
        known = sorted(p.stem for p in d.glob("*.yaml"))
        path = d / f"{name}.yaml"
        if not path.is_file():
            from pathlib import Path

            if Path(name).is_file():
                path = Path(name)
            else:
                raise ConfigError(f"unknown hardware profile {name!r}; known: {', '.join(known)} "
                                  f"(or a YAML path with the fields of specs/hardware/h200.yaml)")
        raw = yaml.safe_load(path.read_text()) or {}
        fields = [a.name for a in attrs.fields(cls)]
        bad = [k for k in raw if k not in fields]
        if bad:
            raise ConfigError(f"{path}: unknown hardware key(s) {bad}; valid keys: {', '.join(fields)}")
        raw["sources"] = tuple(raw.get("sources") or ())
        raw["efficiency"] = parse_table(raw.get("efficiency"), str(path))
        raw["device"] = str(raw.get("device", "cuda"))
        if raw["device"] not in ("cuda", "npu", "cpu"):
            raise ConfigError(f"{path}: device must be cuda, npu or cpu (the torch device type), got {raw['device']!r}")
        optional = ("sources", "device", "efficiency")
        missing = [f for f in fields if f not in raw and f not in optional]
        if missing:
            raise ConfigError(f"{path}: missing hardware key(s) {missing}")
        for f in fields:
            if f == "name" or f in optional:
                continue
            try:  # YAML 1.1 reads 989.0e12 (no exponent sign) as a string
                raw[f] = int(raw[f]) if f == "devices_per_node" else float(raw[f])
            except (TypeError, ValueError):
                raise ConfigError(f"{path}: {f} must be a number, got {raw[f]!r}") from None
            if raw[f] <= 0:
                raise ConfigError(f"{path}: {f} must be > 0, got {raw[f]!r}")
        return cls(**raw)

    def peak(self, compute_dtype: str) -> float:
        return self.peak_fp32_flops if _nbytes(compute_dtype) == 4 else self.peak_bf16_flops

    def price(self, op: str, impl: str) -> Efficiency:
        """The efficiency of ``impl`` for ``op``: the table's entry, else ``achievable_fraction`` (marked assumed)."""
        for e in self.efficiency:
            if e.op == op and e.impl == impl:
                return e
        return Efficiency(op=op, impl=impl, value=self.achievable_fraction, status="assumed",
                          source=f"no entry for {op}/{impl} in the {self.name} profile: its achievable_fraction")

    def with_measured(self, measured: tuple[Efficiency, ...]) -> "Hardware":
        """This profile with ``measured`` entries over its own (``q38 plan --efficiencies``)."""
        over = {(e.op, e.impl) for e in measured}
        return attrs.evolve(self, efficiency=tuple(e for e in self.efficiency if (e.op, e.impl) not in over)
                            + tuple(measured))


# ---- activations per layer kind ----------------------------------------------------------------------------------


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


# ---- the budget -------------------------------------------------------------------------------------------------


@attrs.frozen
class CommTerm:
    """One collective over one mesh dim: bytes received per rank in a step, and its exposed time."""

    collective: str
    mesh_dim: str  # the mesh dims of the group, joined by "·" when one collective spans several
    bytes: float
    link: str  # intra | inter (some of its bytes cross nodes: ``inter_bytes``)
    seconds: float
    overlapped: bool  # issued async by the runtime, hidden behind the compute of its phase as far as that lasts
    phase: str = "forward"  # forward | backward (recompute and gradient reductions run in backward)
    inter_bytes: float = 0.0


@attrs.frozen
class Budget:
    model: str
    layout: str
    mesh: tuple[tuple[str, int], ...]
    world: int
    seq_len: int
    rows_per_rank: int  # rows of seq_len per data-parallel rank and step
    micro_batches: int
    recompute: str
    param_dtype: str
    reduce_dtype: str
    memory: tuple[Item, ...]  # forward/backward phase items
    optimizer_phase: tuple[Item, ...]
    flops: StepFlops
    comm: tuple[CommTerm, ...]
    compute_s: float
    optimizer_s: float
    hardware: str | None
    peak_flops: float | None
    global_tokens: int
    hbm_bytes: float | None = None  # the hardware's device memory (None: no --hardware)
    start_phase: tuple[Item, ...] = ()  # loading the state (resume / init_from): shards + one read in flight
    compute_fwd_s: float = 0.0  # the forward's share of compute_s (the rest, recompute included, is backward)
    ops: tuple[OpTime, ...] = ()  # compute per op at its kernel's efficiency (empty: one achievable_fraction)
    kernels: Any = None  # the resolved KernelConfig the ops are priced for (None: not resolved)
    doc_len: int | None = None  # tokens per document assumed in packed rows (None: one document per row)

    def fit_line(self, fixes: str = "try --recompute full, a fused GDN kernel (--gdn-kernel fla keeps 16-bit outputs, "
                                      "not fp32 per-chunk states), more ranks, or q38 plan --search") -> str | None:
        """Whether the peak fits the hardware's memory under the cap ``q38 plan --search`` applies
        (``MEMORY_HEADROOM`` of it), naming ``fixes`` when it does not; None without hardware."""
        if not self.hbm_bytes:
            return None
        cap = MEMORY_HEADROOM * self.hbm_bytes
        share = (f"peak {_fmt_bytes(self.peak_bytes)} = {100 * self.peak_bytes / self.hbm_bytes:.0f} % of the "
                 f"{self.hardware}'s {_fmt_bytes(self.hbm_bytes)}, cap {100 * MEMORY_HEADROOM:.0f} %")
        if self.peak_bytes <= cap:
            return f"fits: {share}"
        verdict = "DOES NOT FIT" if self.peak_bytes > self.hbm_bytes else "OVER THE CAP"
        largest = max(self.memory, key=lambda it: it.bytes).name.strip()
        return f"{verdict}: {share}; the largest item is {largest}: {fixes}"

    @property
    def peak_fwd_bwd(self) -> float:
        return phase_total(self.memory)

    @property
    def peak_optimizer(self) -> float:
        return phase_total(self.optimizer_phase)

    @property
    def peak_start(self) -> float:
        return phase_total(self.start_phase)

    def start_peak(self, path: str) -> float:
        """Peak while the state is loaded by ``path`` (``resume`` or ``init_from``)."""
        return phase_total([it for it in self.start_phase if it.transient in ("", path)])

    @property
    def peak_bytes(self) -> float:
        return max(self.peak_fwd_bwd, self.peak_optimizer, self.peak_start)

    @property
    def peak_phase(self) -> str:
        phases = {"forward/backward": self.peak_fwd_bwd, "optimizer step": self.peak_optimizer,
                  "start (loading the state)": self.peak_start}
        return max(phases, key=phases.get)

    @property
    def comm_sync_s(self) -> float:
        return sum(t.seconds for t in self.comm if not t.overlapped)

    @property
    def comm_exposed_s(self) -> float:
        """Communication the step waits for: every synchronous collective, plus the async ones (prefetched gathers,
        async reductions, EP exchanges in flight during expert compute) beyond the compute of their phase: each
        phase takes ``sync + max(compute, async)`` (one link queue, so async work cannot run during sync work)."""
        extra = 0.0
        for phase, compute in (("forward", self.compute_fwd_s), ("backward", self.compute_s - self.compute_fwd_s)):
            hidden = sum(t.seconds for t in self.comm if t.overlapped and t.phase == phase)
            extra += max(0.0, hidden - compute)
        return self.comm_sync_s + extra

    @property
    def comm_hidden_s(self) -> float:
        return sum(t.seconds for t in self.comm) - self.comm_exposed_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_exposed_s + self.optimizer_s

    @property
    def tokens_per_s(self) -> float:
        return self.global_tokens / self.step_s if self.step_s else float("nan")

    @property
    def mfu(self) -> float | None:
        if not self.peak_flops or not self.step_s:
            return None
        return self.flops.model / (self.step_s * self.peak_flops)

    @property
    def bound(self) -> str:
        terms = {"compute": self.compute_s, "optimizer (HBM)": self.optimizer_s}
        for t in self.comm:
            if not t.overlapped:
                key = f"{t.collective} over {t.mesh_dim} ({t.link})"
                terms[key] = terms.get(key, 0.0) + t.seconds
        if self.comm_exposed_s > self.comm_sync_s:
            terms["async communication beyond compute"] = self.comm_exposed_s - self.comm_sync_s
        return max(terms.items(), key=lambda kv: kv[1])[0]


@functools.lru_cache(maxsize=256)
def group_shape(mesh_items: tuple, dims: tuple, devices_per_node: int) -> tuple[int, int, int]:
    """(ranks, nodes spanned, ranks in each node) of a group over mesh dims ``dims``: ranks are numbered row-major
    over the mesh (the last mesh dim innermost) and consecutive ranks share a node, so every group of these dims
    has the shape of rank 0's."""
    names = [n for n, _ in mesh_items]
    sizes = dict(mesh_items)
    ranks = [0]
    for d in dims:
        stride = math.prod(sizes[n] for n in names[names.index(d) + 1:])
        ranks = [r + i * stride for r in ranks for i in range(sizes[d])]
    topo = Topology(devices_per_node)
    nodes, per_node = topo.group_shape(ranks)
    return len(ranks), nodes, per_node


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

    @property
    def cp(self) -> int:
        return self.mesh.get("cp", 1)

    @property
    def ep(self) -> int:
        return self.mesh.get("ep", 1)

    @property
    def n_mb(self) -> float:
        return self.rows_mb * self.seq


def _activations(cfg: ModelConfig, st: _Step, kinds: list) -> tuple[float | int, float | int, str]:
    """``(saved, working, note)``: the bytes autograd saves over every layer of one micro-batch (per the recompute
    mode) and the backward working set of one layer."""
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
        return saved, working, f"{len(kinds)} layers × saved tensors"
    keep = kept_regions(st.recompute)
    kept = sum(a.kept for a, k in zip(acts, kinds) if k.region in keep)
    saved = len(kinds) * n_mb * d * act + kept
    # the layer in backward: its recomputed saved tensors at the start (MoE backward), or, later, the mixer
    # core's backward (torch GDN: its own working set, gdn_backward_working)
    working = max(max(a.total + a.widest, a.mixer_backward - not_at_mixer) for a in acts) + 2 * n_mb * d * act
    return saved, working, f"{len(kinds)} layer inputs" + (" + kept kernel outputs" if kept else "")


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
    saved, working, saved_note = _activations(cfg, st, kinds)
    memory = [
        Item("master weights", numel * st.mst, f"{st.master_dtype}, {numel:,} params on the fullest rank"),
        Item("optimizer moments", numel * 8, "AdamW m and v, fp32"),
    ]
    if st.micro_batches > 1:
        memory.append(Item("gradient accumulator", numel * st.red * 2,
                           f"{st.reduce_dtype}; sum and the next micro-batch's"))
    memory.append(Item("activations (saved)", 0.0 if st.offload_activations else saved,
                       saved_note + (" — offloaded to host" if st.offload_activations else "")
                       + f"; {st.rows_mb:g} rows × {st.seq} tokens per micro-batch"))
    if st.param_dtype != st.master_dtype:  # each layer's shards are cast just before its gather (FSDP2's policy)
        memory.append(Item("compute-dtype copy of shards", ps.largest_layer_local * act,
                           f"{st.param_dtype} cast of the layer's shards before the gather", "layer"))
    # Without recompute the runtime frees each gathered layer after its forward and gathers it again in backward
    # (train.reshard_after_forward, not with offload); otherwise the matmuls keep every gathered weight alive.
    if st.recompute == "none" and ps.gathered_layers and not st.resharded:
        memory.append(Item("gathered params (held)", ps.gathered_layers * act,
                           "every layer's gathered weights, saved for its backward (no recompute)"))
    elif ps.gathered_layers:
        ahead = any(v > 0 for v in ps.gather_prefetchable.values())
        memory.append(Item("gathered params (transient)", (2 if ahead else 1) * ps.largest_layer * act,
                           f"{'current + prefetched' if ahead else 'current'} layer, compute form", "layer"))
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


def _optimizer_items(st: _Step, numel: int, grad_clip: bool, impl: str) -> list[Item]:
    """q38.train.core.optim.adamw_step as it runs: the old state and the gradients stay alive while it updates fp32
    copies of weights and moments; the gradients it updates with are fp32 copies when they are scaled by the
    clipping factor (``_foreach_mul`` returns new tensors) or stored in another dtype; torch's foreach AdamW divides
    by ``_foreach_sqrt(exp_avg_sq)``, a new tensor per parameter of the group (≈ all of them), the fused kernel
    updates in place."""
    opt = [
        Item("master weights", numel * st.mst),
        Item("optimizer moments", numel * 8),
        Item("gradients", numel * st.red),
        Item("new weights and moments", numel * (4 + 8), "fp32 copies the functional AdamW updates and returns"),
    ]
    if grad_clip or st.red != 4:
        opt.append(Item("fp32 gradients for the update", numel * 4,
                        "scaled by the clipping factor" if grad_clip else f"{st.reduce_dtype} gradients cast to fp32"))
    if impl == "foreach":
        opt.append(Item("update temporaries", numel * 4, "foreach AdamW: sqrt(exp_avg_sq) of every parameter"))
    return opt


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
        Item("master weights", numel * st.mst),
        Item("optimizer moments", numel * 8),
        Item("resume: one saved chunk", big * 4, "fp32, read whole by DCP before its block is copied", "resume"),
        Item("init_from HF: one slice + fp32 copy", big * (2 + 4) + hf_whole,
             "bf16 slice and its cast" + (" + one grouped in_proj_qkvz read whole" if hf_whole else ""),
             "init_from"),
    ]


def _comm_terms(cfg: ModelConfig, st: _Step, ps: ParamStats, kinds: list, hw: Hardware | None,
                moe_compute_s: float = 0.0, reduced: ParamStats | None = None) -> list[CommTerm]:
    """Every collective of the step per group: FSDP gathers (prefetched or not, again for recompute or after a
    reshard), gradient reduce-scatters and all-reduces, the EP all-to-all, each mixer kind's CP exchange; each
    priced by ``links.LinkModel`` on the links its group spans. ``moe_compute_s``: the routed and shared experts'
    compute of the step (what an overlapped EP exchange can hide behind). ``reduced``: the parameters whose
    gradients are reduced when not all of ``ps`` (a LoRA run: the adapters)."""
    comm: list[CommTerm] = []
    reduced = reduced or ps
    mesh, mb, act, red, recompute = st.mesh, st.micro_batches, st.act, st.red, st.recompute
    items = tuple(mesh.items())
    model = LinkModel.from_hardware(hw) if hw else None

    def shape(dims: tuple) -> tuple[int, int, int]:
        if hw:
            return group_shape(items, dims, hw.devices_per_node)
        n = math.prod(mesh[d] for d in dims)
        return n, 1, n  # no hardware: one node

    def add(coll: str, dims, nbytes: float | int, overlapped: bool = False, phase: str = "forward",
            kind: str = "all_gather", inter: float | None = None) -> None:
        if nbytes <= 0:
            return
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        n, nodes, per_node = shape(dims)
        if inter is None:  # ring collectives: all through the NIC once the group spans nodes; all-to-all: per peer
            inter = (nbytes if nodes > 1 else 0.0) if kind != "all_to_all" else nbytes * (n - per_node) / max(n - 1, 1)
        secs = model.seconds(kind, nbytes - inter, inter, per_node) if model else 0.0
        comm.append(CommTerm(coll, "·".join(dims), nbytes, "inter" if inter > 0 else "intra", secs, overlapped,
                             phase, inter))

    re_gather = recompute != "none" or st.resharded
    groups = list(dict.fromkeys([*ps.gather_group, *ps.layer_gather]))
    for g in sorted(groups, key=lambda g: [list(mesh).index(x) for x in g]):
        per_mb_fwd = ps.gather_group.get(g, 0.0) * act
        pre = ps.gather_prefetchable.get(g, 0.0) * act
        add("all-gather fwd (prefetched)", g, pre * mb, overlapped=True)
        add("all-gather fwd", g, (per_mb_fwd - pre) * mb)
        if recompute != "none":  # prefetched behind the recompute of the layer after it (MeshRuntime, "behind")
            ahead = ps.recompute_prefetchable.get(g, 0.0) * act
            add("all-gather recompute (prefetched)", g, ahead * mb, overlapped=True, phase="backward")
            add("all-gather recompute", g, (ps.layer_gather.get(g, 0.0) * act - ahead) * mb, phase="backward")
        elif re_gather:
            add("all-gather backward (reshard)", g, ps.layer_gather.get(g, 0.0) * act * mb, phase="backward")
        add("reduce-scatter grads", g, reduced.gather_group.get(g, 0.0) * red * mb, overlapped=st.async_reduce,
            phase="backward", kind="reduce_scatter")
    for g, elems in reduced.allreduce_dim.items():
        add("all-reduce grads", g, elems * red * mb, overlapped=st.async_reduce, phase="backward", kind="all_reduce")
    if st.ep > 1:
        _ep_terms(cfg, st, kinds, add, shape, moe_compute_s, model)
    if st.cp > 1:
        w = Workload(rows=st.rows_mb, seq=st.seq, cp=st.cp, act_bytes=act)
        keep = kept_regions(recompute)
        for kind in MIXER_KINDS.values():
            ex = kind.cp_exchange(cfg, w)
            times = ex.recompute_calls if recompute != "none" and kind.region not in keep else ex.calls
            per_call = ex.bytes * sum(1 for k in kinds if k is kind) * mb
            if ex.early and st.cp_early:
                # the forward call (and its rerun on recompute) is in flight during the layer's compute that does not
                # need it; the backward's reduce-scatter is synchronous
                add(ex.collective, "cp", per_call, overlapped=True)
                if times > ex.calls:
                    add(f"{ex.collective} (recompute)", "cp", per_call * (times - ex.calls), overlapped=True,
                        phase="backward")
                add(f"{ex.collective} (backward)", "cp", per_call * (ex.calls - 1), phase="backward")
            else:
                add(ex.collective, "cp", per_call * times)
    return comm


def distinct_nodes(experts: int, top_k: int, nodes: int) -> float:
    """Expected number of distinct nodes a token's ``top_k`` experts sit on, the ``experts`` split evenly over
    ``nodes`` and chosen uniformly without replacement: ``nodes · (1 − C(E − E/nodes, k) / C(E, k))``."""
    if nodes <= 1:
        return 1.0
    per = experts // nodes
    miss = math.comb(experts - per, top_k) / math.comb(experts, top_k)
    return nodes * (1.0 - miss)


def ep_exchange_bytes(cfg: ModelConfig, act: int, ep: int, nodes: int, per_node: int,
                      hierarchical: bool) -> tuple[float, float, float, float]:
    """Bytes one token's routed slots make a rank receive in one MoE layer's forward exchange (dispatch and
    combine), uniform routing: ``(intra float, intra int, inter float, inter int)``, as q38.parallel.ep sends them.
    Flat: each slot off the rank carries its row, gate weight and int64 expert key out, its output row back.
    Hierarchical (several nodes): the slots of a token on one remote node are one unit that crosses once (the row,
    then ``k`` keys and weights) to the rank of the same local index there, which fans its slots out to their
    owners inside the node and sends the unit's summed output back once; own-node slots go straight to their
    owners."""
    d, k = cfg.hidden_size, cfg.num_experts_per_tok
    row, meta = d * act, act + 8
    remote = k * (nodes - 1) / nodes  # slots on other nodes
    own = k * (per_node - 1) / ep  # slots on other ranks of this node
    if hierarchical and nodes > 1:
        units = distinct_nodes(cfg.num_experts, k, nodes) * (nodes - 1) / nodes  # remote nodes the token reaches
        relayed = remote * (per_node - 1) / per_node  # relayed slots whose owner is not the landing rank
        intra = relayed + own
        return intra * (2 * row + act), intra * 8, units * (2 * row + k * act), units * k * 8
    return own * (row + meta - 8 + row), own * 8, remote * (row + meta - 8 + row), remote * 8


def _ep_terms(cfg: ModelConfig, st: _Step, kinds: list, add, shape, moe_compute_s: float, model) -> None:
    """The EP exchanges of every MoE layer (``ep_exchange_bytes`` per token): the forward, its rerun when the layer
    is recomputed, and the reverse exchange of the float parts in backward. With ``ep_overlap`` the forward
    exchanges (and their rerun) of one half of the tokens are in flight while the other half's experts and the
    shared expert compute; the backward exchanges are synchronous."""
    n_tok = st.n_mb * len(kinds) * st.micro_batches  # tokens through MoE layers per pass
    ep, nodes, per_node = shape(("ep",))
    f_in, i_in, f_out, i_out = ep_exchange_bytes(cfg, st.act, ep, nodes, per_node,
                                                 st.ep_dispatch == "hierarchical")
    fwd = (n_tok * (f_in + i_in), n_tok * (f_out + i_out))  # (intra, inter) bytes of one forward pass
    rev = (n_tok * f_in, n_tok * f_out)
    passes = [("forward", fwd, True)]
    if st.recompute != "none":
        passes.append(("backward", fwd, True))
    passes.append(("backward", rev, False))
    for phase, (b_intra, b_inter), forward in passes:
        share = 0.0
        if st.ep_overlap and forward and model is not None:
            # one half's exchange in flight while the other half computes: hidden at most for as long as the
            # experts' and shared expert's forward lasts (a third of their forward + backward compute)
            half = model.seconds("all_to_all", b_intra / 2, b_inter / 2)
            share = 0.5 * min(1.0, moe_compute_s / 3 / half) if half else 0.0
            add("all-to-all tokens (overlapped)", "ep", (b_intra + b_inter) * share, overlapped=True, phase=phase,
                kind="all_to_all", inter=b_inter * share)
        name = "all-to-all tokens" if forward else "all-to-all tokens (reverse)"
        add(name, "ep", (b_intra + b_inter) * (1 - share), phase=phase, kind="all_to_all",
            inter=b_inter * (1 - share))


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
) -> Budget:
    """Predict one step of ``cfg`` under ``layout`` on ``world`` ranks; ``rows_per_rank`` rows of ``seq_len`` per
    data-parallel rank (split into ``micro_batches``). ``param_dtype``: compute form (gathers move it);
    ``reduce_dtype``: gradients; ``master_dtype``: stored weights (AdamW moments are fp32). ``gdn_kernel``: True
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
    attention kernels skip)."""
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
    st = _Step(
        mesh=mesh, micro_batches=micro_batches, recompute=recompute, seq=seq_len // cp,
        rows_mb=rows_per_rank / micro_batches, act=act, red=_nbytes(reduce_dtype), mst=_nbytes(master_dtype),
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, master_dtype=master_dtype,
        offload_activations=offload_activations,
        resharded=recompute == "none" and reshard_after_forward and not offload_activations,
        ep_balance=ep_balance, max_dup_experts=max_dup_experts, gdn_kernel=bool(gdn_kernel),
        kv_native=not packed_rows and cp == 1 and (hardware is None or act == 2), gdn_chunk=gdn_chunk,
        async_reduce=async_reduce, ep_dispatch=ep_dispatch, ep_overlap=ep_overlap, cp_early=cp_early,
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
    opt_items = _optimizer_items(st, ps.numel if ls is None else ls.adapters.numel, grad_clip, impl)
    start_items = _start_items(cfg, st, ps)
    comm_ps, reduced = ps, None
    if ls is not None:
        memory = lora_budget.lora_memory(memory, ls, st)
        opt_items = lora_budget.lora_optimizer(opt_items, ls)
        start_items = lora_budget.lora_start(start_items, ls, st)
        comm_ps, reduced = lora_budget.scaled_gathers(ls, act), ls.adapters
    fl = _step_flops(cfg, rows_per_rank, st.seq, cp=cp, recompute=recompute, micro_batches=micro_batches,
                    gdn_chunk=gdn_chunk, aux_global=aux_global, causal_skip=True)
    if ls is not None:  # no weight gradient for the frozen weights without an adapter; the merges added
        fl = lora_budget.lora_flops(fl, cfg, peft, rows_per_rank * st.seq, micro_batches, recompute)
    hw = hardware
    peak = hw.peak(param_dtype) if hw else None
    ops: tuple[OpTime, ...] = ()
    shared = _shared_expert_flops(cfg, rows_per_rank * st.seq)
    if hw and kernels is not None:
        ops = price_ops(fl, hw, param_dtype, kernels, packed=packed_rows, seq=st.seq, cp=cp, doc_len=doc_len)
        compute_s, compute_fwd_s = sum(o.seconds for o in ops), sum(o.forward_s for o in ops)
        by = {o.op: o for o in ops}
        moe_s = by["experts"].seconds + shared / (peak * by["matmul"].efficiency.value)
    elif hw:
        rate = peak * hw.achievable_fraction
        compute_s, compute_fwd_s = fl.executed / rate, fl.model / 3 / rate  # forward ≈ a third; recompute: backward
        moe_s = (fl.experts + shared) / rate
    else:
        compute_s = compute_fwd_s = moe_s = 0.0
    opt_bytes = ps.numel * (st.mst * 2 + st.red + 8 * 2) if ls is None else lora_budget.optimizer_bytes(ls, st)
    dp = math.prod(mesh.get(n, 1) for n in layout.batch_mesh_dims)
    return Budget(
        model=model_name or cfg.model_type, layout=layout.name, mesh=tuple(mesh.items()), world=world,
        seq_len=seq_len, rows_per_rank=rows_per_rank, micro_batches=micro_batches, recompute=recompute,
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, memory=tuple(memory),
        optimizer_phase=tuple(opt_items), start_phase=tuple(start_items), flops=fl,
        comm=tuple(_comm_terms(cfg, st, comm_ps, kinds, hw, moe_s, reduced)),
        compute_s=compute_s, compute_fwd_s=compute_fwd_s,
        optimizer_s=opt_bytes / hw.hbm_bandwidth if hw else 0.0,
        hardware=hw.name if hw else None, peak_flops=peak, global_tokens=dp * rows_per_rank * seq_len,
        hbm_bytes=hw.hbm_bytes if hw else None, ops=ops, kernels=kernels if ops else None,
        doc_len=doc_len if packed_rows else None,
    )


_step_flops = functools.lru_cache(maxsize=512)(step_flops)  # the search prices thousands of budgets of few shapes


def price_ops(fl: StepFlops, hw: Hardware, param_dtype: str, kernels, *, packed: bool, seq: int, cp: int,
              doc_len: int) -> tuple[OpTime, ...]:
    """Each priced op's executed FLOPs (``fl``'s term with its recompute and aux share; attention scaled to what
    its kernel computes: ``efficiency.attention_factor``) at its kernel's efficiency on ``hw``. Forward: a third
    of each term (the loss: a quarter, its logits are recomputed in backward)."""
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
        e = hw.price(op, impl)
        out.append(OpTime(op=op, impl=impl, flops=flops, efficiency=e, seconds=flops / (peak * e.value),
                          forward_s=fwd / (peak * e.value), note=note))
    return tuple(out)


def _shared_expert_flops(cfg: ModelConfig, tokens: int) -> float:
    """Forward + backward FLOPs of the shared expert (gate, up, down and its sigmoid gate) over ``tokens``."""
    d, f = cfg.hidden_size, cfg.shared_expert_intermediate_size
    return 6.0 * tokens * (3 * d * f + d) * cfg.num_hidden_layers


# ---- formatting -------------------------------------------------------------------------------------------------


def _fmt_bytes(n: float | int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _fmt_s(s: float | int) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 1 else f"{s:,.2f} s"


def format_budget(b: Budget) -> str:
    from q38.parallel.layout import format_mesh

    lines = [
        f"budget · {b.model} · layout {b.layout} · world {b.world} = {format_mesh(b.mesh)}",
        f"  {b.rows_per_rank} rows × {b.seq_len} tokens per data-parallel rank, {b.micro_batches} micro-batch(es), "
        f"recompute {b.recompute}, params {b.param_dtype} / grads {b.reduce_dtype} / master + moments fp32",
        "peak memory per rank (fullest rank), forward/backward phase",
    ]
    for it in b.memory:
        tag = f" [transient: {it.transient}]" if it.transient else ""
        lines.append(f"  {it.name:<32}{_fmt_bytes(it.bytes):>14}   {it.note}{tag}")
    lines.append(f"  {'total':<32}{_fmt_bytes(b.peak_fwd_bwd):>14}   (persistent + the largest transient group)")
    if b.start_phase:
        lines.append(f"start of the run (every rank loads only its shards): resume {_fmt_bytes(b.start_peak('resume'))}"
                     f", init_from a HF directory {_fmt_bytes(b.start_peak('init_from'))} per rank (shards "
                     f"{_fmt_bytes(b.start_peak('none'))} + the largest read in flight)")
    lines.append(f"optimizer phase total {_fmt_bytes(b.peak_optimizer)}; peak {_fmt_bytes(b.peak_bytes)} "
                 f"in the {b.peak_phase}")
    fit = b.fit_line()
    if fit:
        lines.append(fit)
    f = b.flops
    lines.append(f"FLOPs per rank and step: model {f.model:.3e} (dense {f.dense:.2e}, experts {f.experts:.2e}, "
                 f"attention {f.attention:.2e}, GDN {f.gdn_core:.2e}, head {f.head:.2e}); executed {f.executed:.3e} "
                 f"(+ recompute {f.recompute:.2e}, aux forward {f.aux_forward:.2e})")
    if b.comm:
        lines.append("communication per rank and step (bytes received; time on the link its group spans)")
        for t in b.comm:
            lines.append(f"  {t.collective:<30} {t.mesh_dim:<9} {t.phase:<8} {_fmt_bytes(t.bytes):>14}  {t.link:<5} "
                         f"{_fmt_s(t.seconds) if b.hardware else '':>10}{'  (async)' if t.overlapped else ''}")
    if b.ops:
        lines.extend(format_ops(b))
    if b.hardware:
        lines.append(
            f"step time on {b.hardware}: {_fmt_s(b.step_s)} = compute {_fmt_s(b.compute_s)} + exposed comm "
            f"{_fmt_s(b.comm_exposed_s)} (of {_fmt_s(b.comm_exposed_s + b.comm_hidden_s)}; "
            f"{_fmt_s(b.comm_hidden_s)} hidden) + optimizer {_fmt_s(b.optimizer_s)}; bound by {b.bound}")
        mfu = b.mfu
        lines.append(f"  {b.tokens_per_s:,.0f} tokens/s over {b.global_tokens:,} tokens per step; "
                     f"MFU {100 * mfu:.1f}%" if mfu is not None else "")
    return "\n".join(lines)


def format_ops(b: Budget) -> list[str]:
    """The per-op compute table: each op's kernel (as ``resolve_kernels`` picked it), executed FLOPs per rank,
    efficiency, where that number comes from, and time."""
    lines = [f"compute per op on {b.hardware} (per rank and step; the kernels the run resolves, executed FLOPs at each "
             f"kernel's efficiency)",
             f"  {'op':<10} {'kernel':<11} {'FLOPs':>9} {'eff':>5} {'time':>10}  {'what':<44} source"]
    for o in b.ops:
        lines.append(f"  {o.op:<10} {o.impl:<11} {o.flops:>9.2e} {o.efficiency.value:>5.2f} {_fmt_s(o.seconds):>10}"
                     f"  {o.note:<44} {o.efficiency.describe()}")
    return lines
