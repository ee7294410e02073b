"""``q38 plan --search``: enumerate layouts for N ranks of one hardware kind, drop those that do not fit, rank the rest
by predicted step time, and write the best as a layout YAML plus the matching run config.

Candidates: every factorisation ``N = fsdp × cp × ep`` over the mesh dims the shipped layouts use (ep divides the
expert count, cp divides the sequence, the data-parallel size fsdp × ep divides the global batch), each built from
the shipped layout of that shape (``fsdp``, ``fsdp_cp``, ``fsdp_ep``, ``fsdp_ep_cp``; embed and lm_head opt into
uneven shards when the vocab does not divide), times every micro-batch count that divides a rank's rows, times the
recompute modes. With a pipeline axis (``pp``, outermost; each divisor of the world from 2 to ``MAX_PP`` and the
model's layers, not with cp, not for a LoRA run): 1F1B over the automatic stage split, written explicit in the
layout, at every micro-batch count of at least ``pp``. All arithmetic: no tensors, no processes.
"""

import functools
import math
from pathlib import Path
from typing import Any, Mapping

import attrs
import yaml

from q38.model_config import ConfigError, ModelConfig
from q38.errors import reading
from q38.kernels import KernelConfig, auto_gdn_chunk, resolve_kernels
from q38.parallel.efficiency import DEFAULT_DOC_LEN, read_measured
from q38.parallel.budget import GIB, MEMORY_HEADROOM, RECOMPUTE_MODES, Budget, Hardware, estimate, recompute_mode
from q38.parallel.budget_result import _fmt_bytes, _fmt_s
from q38.parallel.layout import Layout, LayoutError
from q38.parallel.plan_out import (RunChoices, is_finetune, layout_beside, planned_run_config, write_best,
                                   written_by_plan)
from q38.parallel.precision import Precision, run_precision

TEMPLATES = {(False, False): "fsdp", (True, False): "fsdp_cp", (False, True): "fsdp_ep", (True, True): "fsdp_ep_cp"}
MAX_CP = 16
# pipeline sizes the search tries: each divisor of the world from 2 up to this (and the model's layers), 1F1B with
# the automatic stage split, the most micro-batches first; not with cp (untested) nor for a LoRA run (untested)
MAX_PP = 8


@attrs.frozen
class Candidate:
    layout_dict: dict = attrs.field(eq=False)
    budget: Budget
    ep_dispatch: str = "flat"
    # the fastest candidate with a pipeline axis of the same search when this one has none (what --fewest-ranks
    # prints beside its row); None: no pp candidate fits, or this one is pipelined
    pp_alternative: "Candidate | None" = attrs.field(default=None, eq=False)

    @property
    def mesh(self) -> str:
        return " × ".join(f"{n}={s}" for n, s in self.budget.mesh)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=64)
def pipeline_stages(cfg: ModelConfig, pp: int) -> tuple[tuple[int, int], ...]:
    """The automatic 1F1B split of ``cfg`` over ``pp`` stages (``q38.parallel.pipeline``: balanced by the per-layer
    cost, the embedding and the head counted), as the explicit ``[first, last]`` ranges a layout writes."""
    from q38.parallel.pipeline import balanced_split, layer_costs

    per, emb, head = layer_costs(cfg)
    return tuple((int(a), int(b)) for a, b in balanced_split(per, pp, emb, head))


def pipeline_sizes(cfg: ModelConfig, world: int) -> list[int]:
    """The ``pp`` sizes the search tries on ``world`` ranks (``MAX_PP``; none with tied embeddings, which a pipeline
    refuses)."""
    if cfg.tie_word_embeddings:
        return []
    return [p for p in _divisors(world) if 1 < p <= min(MAX_PP, cfg.num_hidden_layers)]


def candidate_layout(cfg: ModelConfig, fsdp: int, cp: int, ep: int, dp_replicate: int = 1,
                     order: tuple[str, ...] | None = None, pp: int = 1) -> dict:
    """The layout table for one factorisation: the shipped layout of that shape, resized (``dp_replicate`` > 1:
    ``hsdp``, FSDP over ``fsdp`` consecutive ranks and replicated ``dp_replicate`` times; without cp and ep).
    ``order``: the mesh dims major → minor (the last one is innermost: its groups are consecutive ranks, inside a
    node when small enough); None: the template's order (fsdp, cp, ep)."""
    if dp_replicate > 1:
        if cp > 1 or ep > 1:
            raise ValueError("the search builds HSDP candidates without cp and ep")
        d = {"include": "hsdp.yaml", "name": f"hsdp_r{dp_replicate}_f{fsdp}",
             "mesh": {"dp_replicate": dp_replicate, "fsdp": fsdp}}
        if cfg.vocab_size % fsdp:
            d["uneven"] = ["embed", "lm_head"]
        return d
    tpl = TEMPLATES[(cp > 1, ep > 1)]
    mesh = {"fsdp": fsdp}
    if cp > 1:
        mesh["cp"] = cp
    if ep > 1:
        mesh["ep"] = ep
    d = {"include": f"{tpl}.yaml", "name": f"{tpl}_f{fsdp}" + (f"_c{cp}" if cp > 1 else "") + (f"_e{ep}" if ep > 1
                                                                                              else ""), "mesh": mesh}
    if order is not None and tuple(order) != tuple(mesh):
        if sorted(order) != sorted(mesh):
            raise ValueError(f"order {order} does not name the mesh dims {tuple(mesh)}")
        # every mesh dim takes the FSDP role and every one but cp splits the batch, listed in mesh order
        d["name"] += "_" + "".join(n[0] for n in order)
        d["mesh"] = {n: mesh[n] for n in order}
        d["fsdp"] = list(order)
        d["activations"] = {"batch": [n for n in order if n != "cp"]}
    if cfg.vocab_size % (fsdp * cp * ep):
        d["uneven"] = ["embed", "lm_head"]
    if pp > 1:  # the pipeline axis outermost (stages nodes apart), the stage split written as priced
        if order is not None:
            raise ValueError("the search builds pp candidates in the template's mesh order")
        d["name"] = f"pp{pp}_{d['name']}"
        d["mesh"] = {"pp": pp, **d["mesh"]}
        d["pipeline"] = {"schedule": "1f1b", "virtual_stages": 1,
                         "stages": [list(r) for r in pipeline_stages(cfg, pp)]}
    return d


def mesh_orders(fsdp: int, cp: int, ep: int) -> list[tuple[str, ...] | None]:
    """The mesh orders the search tries for one factorisation: the template's, then every other order of the dims
    larger than 1 (which dim is innermost decides which groups stay inside a node), size-1 dims first."""
    import itertools

    dims = [n for n, s in (("fsdp", fsdp), ("cp", cp), ("ep", ep)) if s > 1 or n == "fsdp"]
    big = [n for n in dims if {"fsdp": fsdp, "cp": cp, "ep": ep}[n] > 1]
    small = [n for n in dims if n not in big]
    out: list[tuple[str, ...] | None] = [None]
    for perm in itertools.permutations(big):
        o = (*small, *perm)
        if o != tuple(dims):
            out.append(o)
    return out


def factorisations(cfg: ModelConfig, world: int, seq_len: int, global_batch: int) -> tuple[list[tuple], list[str]]:
    """Valid (fsdp, cp, ep, dp_replicate) factorisations and, for the error message, why the others were
    dropped."""
    ok, why = [], []
    for ep in _divisors(world):
        if cfg.num_experts % ep:
            why.append(f"ep={ep} does not divide {cfg.num_experts} experts")
            continue
        for cp in _divisors(world // ep):
            if cp > MAX_CP or seq_len % cp:
                continue
            fsdp = world // (ep * cp)
            if global_batch % (fsdp * ep):
                why.append(f"fsdp×ep={fsdp * ep} does not divide the global batch {global_batch}")
                continue
            ok.append((fsdp, cp, ep, 1))
    if global_batch % world == 0:  # HSDP: fsdp shards inside a replica, the rows split over every rank
        ok += [(world // r, 1, 1, r) for r in _divisors(world) if 1 < r < world]
    return ok, why


def pipeline_factorisations(cfg: ModelConfig, world: int, seq_len: int, global_batch: int) -> list[tuple]:
    """``(fsdp, cp, ep, 1, pp)`` with a pipeline axis: each of ``pipeline_sizes`` times the factorisations of a stage's
    ``world / pp`` ranks without cp or HSDP, where a data rank's rows make at least ``pp`` micro-batches (1F1B)."""
    out = []
    for pp in pipeline_sizes(cfg, world):
        for fsdp, cp, ep, dpr in factorisations(cfg, world // pp, seq_len, global_batch)[0]:
            if cp == 1 and dpr == 1 and global_batch // (fsdp * ep) >= pp:
                out.append((fsdp, cp, ep, dpr, pp))
    return out


def search(
    cfg: ModelConfig,
    world: int,
    hardware: Hardware,
    *,
    seq_len: int,
    global_batch: int,
    memory_cap: float | int | None = None,
    recompute_modes=RECOMPUTE_MODES,
    model_name: str | None = None,
    ep_dispatches: tuple[str, ...] = ("flat", "hierarchical"),
    kernels: KernelConfig | None = None,
    prune: bool = False,
    **kw,
) -> tuple[list[Candidate], float]:
    """All fitting candidates, fastest first, and the memory cap used (bytes). Raises ConfigError (one line) when
    the world size has no valid factorisation or no candidate fits. Every candidate with EP is tried with each of
    ``ep_dispatches`` (the run config's ``ep_dispatch`` in ``kw`` is the search's to choose). ``kernels``: the run
    config's kernel choices, resolved per candidate for the hardware's device (``plan_kernels``: what the trainer
    would run with that candidate's CP) and priced per op; a candidate the choices cannot serve (an explicit kernel
    without CP support on a CP layout) is left out. None: the run's own ``gdn_kernel`` / ``gdn_chunk`` in ``kw``, every
    FLOP at the profile's ``achievable_fraction``. ``prune`` (what ``fewest_ranks`` asks): a factorisation is first
    priced at its least-memory settings (the most micro-batches, full recompute, each EP dispatch) on one mesh
    order (memory does not depend on the order), and dropped with all its orders and settings when none fits."""
    from q38.model import abstract_params

    kw.pop("ep_dispatch", None)
    resolved: dict[int, KernelConfig | None] = {}
    cap = float(memory_cap) if memory_cap is not None else MEMORY_HEADROOM * hardware.hbm_bytes
    facts, why = factorisations(cfg, world, seq_len, global_batch)
    facts = [(*f, 1) for f in facts]
    if kw.get("peft") is None:
        facts += pipeline_factorisations(cfg, world, seq_len, global_batch)
    if not facts:
        shown = "; ".join(sorted(set(why))[:3]) or f"no cp ≤ {MAX_CP} divides seq_len {seq_len}"
        raise ConfigError(
            f"world {world} has no valid factorisation (pp ×) fsdp × cp × ep for {model_name or cfg.model_type} "
            f"(seq_len {seq_len}, global batch {global_batch} sequences): {shown}; change --world or --global-batch")
    from q38.model import is_param_info
    from q38.pytree import named_leaves

    leaves = named_leaves(abstract_params(cfg), is_leaf=is_param_info)  # once: every layout places the same leaves
    # full recompute keeps the fewest activations of all modes (the others keep kernel outputs besides)
    least_modes = ("full",) if "full" in recompute_modes else tuple(recompute_modes)
    fits: list[Candidate] = []
    smallest: tuple[float, str] | None = None
    for fsdp, cp, ep, dpr, pp in facts:
        orders = mesh_orders(fsdp, cp, ep) if dpr == 1 and pp == 1 else [None]
        probed = not prune
        for order in orders:
            d = candidate_layout(cfg, fsdp, cp, ep, dpr, order, pp)
            try:
                layout = Layout.from_dict(d, source=d["name"])
                mesh = layout.resolve_mesh(world)
                if pp == 1:
                    pl = layout.placements_of_shapes(leaves, mesh)
                else:  # a pp plan places its stages (and checks the split against the model)
                    from q38.parallel.pipeline_plan import _stage_facts

                    pl = None
                    _stage_facts(cfg, layout, world, bool(kw.get("prefetch", True)))
            except LayoutError:
                continue
            rows = global_batch // (fsdp * ep * dpr)
            ckw = dict(kw)
            if kernels is not None:
                if cp not in resolved:
                    try:
                        resolved[cp] = plan_kernels(kernels, hardware, cp=cp, param_dtype=kw.get("param_dtype", "bf16"),
                                                    cfg=cfg)
                    except ConfigError as e:
                        resolved[cp] = None
                        why.append(f"cp={cp}: {e}")
                if resolved[cp] is None:
                    continue
                ckw.update(kernels_kwargs(resolved[cp]))
            if not probed:  # the least memory this factorisation can take (the most micro-batches)
                probed = True
                least = min((estimate(cfg, layout, world, seq_len=seq_len, rows_per_rank=rows, micro_batches=rows,
                                      recompute=rc, hardware=hardware, placements=pl, model_name=model_name,
                                      ep_dispatch=disp, **ckw).peak_bytes, rc)
                            for disp in (ep_dispatches if ep > 1 else ("flat",)) for rc in least_modes)
                if smallest is None or least[0] < smallest[0]:
                    smallest = (least[0], f"{d['name']} mb={rows} recompute={least[1]}")
                if least[0] > cap:
                    break
            for disp in (ep_dispatches if ep > 1 else ("flat",)):
                for mb in [n for n in _divisors(rows) if n >= pp]:  # 1F1B runs at least pp micro-batches
                    for rc in recompute_modes:
                        b = estimate(cfg, layout, world, seq_len=seq_len, rows_per_rank=rows, micro_batches=mb,
                                     recompute=rc, hardware=hardware, placements=pl, model_name=model_name,
                                     ep_dispatch=disp, **ckw)
                        if smallest is None or b.peak_bytes < smallest[0]:
                            smallest = (b.peak_bytes, f"{d['name']} mb={mb} recompute={rc}")
                        if b.peak_bytes <= cap and _host_fits(b, hardware):
                            fits.append(Candidate(d, b, disp))
    if not fits and smallest is None and kernels is not None:
        raise ConfigError(f"no layout can run the run's kernels on {hardware.name} ({'; '.join(sorted(set(why))[:2])})")
    if not fits:
        need = f"{smallest[0] / GIB:,.1f} GiB ({smallest[1]})" if smallest else "n/a"
        raise ConfigError(f"no layout fits the memory cap of {cap / GIB:,.1f} GiB per device; the smallest needs "
                          f"{need}; raise --memory-cap, use more devices, or shorten --seq-len")
    fits.sort(key=lambda c: (c.budget.step_s, c.budget.peak_bytes))
    return fits, cap


def format_search(cands: list[Candidate], cap: float | int, shipped: Budget | None, top: int = 10) -> str:
    gb = cands[0].budget.global_tokens // cands[0].budget.seq_len
    lines = [f"{len(cands)} layouts fit {cap / GIB:,.1f} GiB per device at a global batch of {gb} sequences; "
             "fastest first",
             f"  {'mesh':<28} {'mb':>3} {'recompute':<24} {'peak GiB':>9} {'step s':>8} {'tok/s':>12} {'MFU':>6}  bound"]

    def row(mesh: str, b: Budget) -> str:
        return (f"  {mesh:<28} {b.micro_batches:>3} {b.recompute:<24} {b.peak_bytes / GIB:>9.1f} {b.step_s:>8.2f} "
                f"{b.tokens_per_s:>12,.0f} {100 * (b.mfu or 0):>5.1f}%  {b.bound}")

    for c in cands[:top]:
        lines.append(row(c.mesh + (" hier" if c.ep_dispatch == "hierarchical" else ""), c.budget))
    if shipped is not None:
        mesh = " × ".join(f"{n}={s}" for n, s in shipped.mesh)
        lines.append(f"shipped layout {shipped.layout}:")
        lines.append(row(mesh, shipped) + ("" if shipped.peak_bytes <= cap else "  (does not fit)"))
    best = cands[0].budget
    disp = f", {cands[0].ep_dispatch} EP dispatch" if dict(best.mesh).get("ep", 1) > 1 else ""
    lines.append(f"best: {cands[0].mesh}{disp}, {best.micro_batches} micro-batch(es), recompute {best.recompute}: "
                 f"{best.step_s:.2f} s/step, {best.tokens_per_s:,.0f} tokens/s, MFU {100 * (best.mfu or 0):.1f}%")
    return "\n".join(lines)


def shipped_budget(cfg: ModelConfig, layout: Layout, world: int, hardware: Hardware | None, *, seq_len: int,
                   global_batch: int, recompute: str, micro_batches: int, **kw) -> Budget:
    mesh = layout.resolve_mesh(world)
    dp = math.prod(mesh.get(n, 1) for n in layout.batch_mesh_dims)
    if global_batch % dp:
        raise ConfigError(f"global batch {global_batch} does not split over the layout's {dp} data-parallel ranks")
    return estimate(cfg, layout, world, seq_len=seq_len, rows_per_rank=global_batch // dp,
                    micro_batches=micro_batches, recompute=recompute, hardware=hardware, **kw)


def plan_kernels(kernels: KernelConfig, hw: Hardware, *, cp: int, param_dtype: str, cfg: ModelConfig) -> KernelConfig:
    """The kernels a run of ``kernels`` (the run config's choices, ``auto`` or named) would resolve to on ``hw``'s
    device with ``cp`` ranks of context parallelism, packed rows and ``param_dtype``: ``resolve_kernels``, the
    trainer's resolver, asked about a machine with every optional package installed (``environment=False``: the
    target, not the machine the plan runs on). Raises its ``ConfigError`` when a named kernel cannot serve."""
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[_dtype_name(param_dtype)]
    return resolve_kernels(kernels, device=hw.device, cp=cp > 1, packed=True, train=True, dtype=dtype, model=cfg,
                           environment=False)


def kernels_kwargs(resolved: KernelConfig) -> dict[str, Any]:
    """``estimate``'s kernel settings from a resolved ``KernelConfig``: the priced kernels, the GDN activations
    (fla's or the torch core's) and the torch core's chunk."""
    return dict(kernels=resolved, gdn_kernel=resolved.gdn == "fla", gdn_chunk=int(resolved.gdn_chunk_size))


FALLBACKS = {"attention": "sdpa", "gdn": "torch"}  # the torch paths: SDPA with a dense mask, the torch GDN core


def format_fallback(auto: Budget, fallback: Budget) -> str:
    """One line: the predicted MFU with the kernels the run resolves beside the torch fallbacks'."""
    names = ", ".join(f"{op} {getattr(auto.kernels, op)}" for op in FALLBACKS)
    fb = ", ".join(f"{op} {v}" for op, v in FALLBACKS.items())
    fits = "" if fallback.fit_line() is None or fallback.fit_line().startswith("fits") else " (does not fit)"
    return (f"kernels: with what the run resolves ({names}) {auto.step_s:,.2f} s/step, MFU "
            f"{100 * (auto.mfu or 0):.1f}%; with the torch fallbacks ({fb}) {fallback.step_s:,.2f} s/step, MFU "
            f"{100 * (fallback.mfu or 0):.1f}%{fits}")


# ---- what q38 plan asks (q38.cli parses it) ------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class BudgetQuery:
    """The settings of one ``q38 plan`` budget or search; None: from the run config (``train``), else the default."""

    world: int
    model: str  # the model argument as given (a preset name or a path): names the shipped run config
    layout: str | None = None  # the layout argument (a preset or a path), None with search
    train: str | None = None  # run config whose data/train/kernels settings to plan
    hardware: str | None = None  # a profile name under specs/hardware or a YAML
    seq_len: int | None = None
    global_batch: int | None = None
    micro_batches: int | None = None
    recompute: str | None = None
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    gdn_kernel: str | None = None  # "fla" | "torch"
    search: bool = False
    memory_cap: float | None = None  # GiB per device (search)
    lora_rank: int | None = None  # plan a LoRA run of this rank (else the run config's peft section, if any)
    lora_base_dtype: str | None = None  # compute | fp8: how the LoRA run's frozen base is stored
    fewest_ranks: bool = False  # print the fewest ranks of --hardware that fit (up to --world), LoRA and full
    out: str | None = None  # where the search writes its best layout and run config (None: nowhere)
    overwrite: bool = False
    doc_len: int | None = None  # tokens per document in packed rows (default: efficiency.DEFAULT_DOC_LEN)
    efficiencies: str | None = None  # a JSON-lines file of measured efficiencies over the profile's
    moment_dtype: str | None = None  # float32 | bfloat16 | int8 (else the run config's train.moment_dtype)
    master_dtype: str | None = None  # float32 | bfloat16_remainder
    offload_optimizer: bool | None = None  # masters and moments in host memory, AdamW on the host
    pure_step: bool = False  # price the optimizer phase of the pure train_step (the library default), not the donated
    rl: Any = None  # a budget_rollout.RolloutPlan: the RL rollout phase and reference priced too (None: no RL)
    choices: RunChoices = RunChoices()  # --finetune, --init-from, --data, --tokenizer, --steps: what --out writes


def _train_defaults(q, model_arg: str) -> tuple[dict, str | None]:
    """Settings from --train, or the shipped run config named like the model; {} when there is none."""
    from q38.model_config import SPECS_DIR

    path = q.train or (str(SPECS_DIR / "train" / f"{model_arg}.yaml")
                        if (SPECS_DIR / "train" / f"{model_arg}.yaml").is_file() else None)
    if path is None:
        return {}, None
    if not Path(path).is_file():
        raise ConfigError(f"--train {path}: file not found")
    with reading("--train", path):
        raw = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--train {path}: expected a run config mapping (model, data, train, ...), got "
                          f"{type(raw).__name__}")
    return raw, path


def query_precision(q: BudgetQuery) -> Precision:
    """The dtypes ``q38 plan`` reports and prices: the run config's (``--train``, or the shipped one named like the
    model) with ``--dtype`` / ``--reduce-dtype`` applied, as the trainer would resolve them."""
    raw, src = _train_defaults(q, str(q.model))
    peft = planned_peft(raw.get("peft"), q.lora_rank, q.lora_base_dtype, src)
    return run_precision(raw, param_dtype=q.param_dtype, reduce_dtype=q.reduce_dtype, moment_dtype=q.moment_dtype,
                         master_dtype=q.master_dtype, offload=q.offload_optimizer,
                         lora_base=None if peft is None else peft.base_dtype)


def _dtype_name(x: str) -> str:
    names = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
    if str(x) not in names:
        raise ConfigError(f"unknown dtype {x!r}; use one of bf16, fp16, fp32")
    return names[str(x)]


def budget_kwargs(train: Mapping[str, Any], *, gdn: str, chunk: int) -> dict[str, Any]:
    """``estimate``'s settings from a run config's ``train`` section (the YAML mapping or ``TrainConfig.to_dict()``;
    missing keys take ``TrainConfig``'s defaults) and the run's GDN kernel and chunk: what ``q38 plan --train`` and the
    trainer's memory check (q38/train/run/launch.py: ``check_memory``) both predict from."""
    return dict(param_dtype=_dtype_name(train.get("param_dtype") or "fp32"),
                reduce_dtype=_dtype_name(train.get("reduce_dtype") or "fp32"),
                gdn_kernel=gdn == "fla", gdn_chunk=chunk,
                ep_balance=bool(train.get("enable_ep_balance", False)),
                max_dup_experts=int(train.get("max_dup_experts_num", 2)),
                loss_chunk_tokens=train.get("loss_chunk_size", 1024),
                loss_chunk_budget_bytes=train.get("loss_chunk_budget_bytes") if train.get("dynamic_chunk_loss") else None,
                prefetch=bool(train.get("overlap_comm", True) if train.get("fsdp_prefetch") is None
                              else train["fsdp_prefetch"]),
                async_reduce=bool(train.get("overlap_comm", True)), cp_early=bool(train.get("overlap_comm", True)),
                ep_dispatch=str(train.get("ep_dispatch", "flat")), ep_overlap=bool(train.get("ep_overlap", True)),
                offload_activations=bool(train.get("offload_activations", False)),
                grad_clip=train.get("grad_clip", 1.0) is not None,
                moment_dtype=str(train.get("moment_dtype") or "float32"),
                master_dtype=str(train.get("master_dtype") or "float32"),
                offload_optimizer=bool(train.get("offload_optimizer", False)))

# the run config keys the planned settings write back (what ``budget_kwargs`` reads), by ``estimate`` keyword
_WRITTEN_TRAIN = {"moment_dtype": "moment_dtype", "master_dtype": "master_dtype",
                  "offload_optimizer": "offload_optimizer"}


def budget_report(q: BudgetQuery, cfg: ModelConfig, layout: Layout | None, check_output_dir=None) -> int:
    """``q38 plan ... --hardware/--seq-len/--search``: the budget of a layout, or the search. Prints; returns 0.
    ``check_output_dir(out, inputs, *, what, own, overwrite)``: the rule the search's ``out`` is held to (``q38.cli``
    passes ``q38.train.io.dirs.check_output_dir``; ``q38.parallel`` imports nothing of ``q38.train``); None: not
    checked."""
    import sys

    from q38.parallel.budget import format_budget

    raw, src = _train_defaults(q, str(q.model))
    if q.search and q.out is not None and check_output_dir is not None:  # before anything is printed or searched
        inputs = [p for p in (src, q.layout, q.hardware, q.model) if p and Path(p).exists()]
        check_output_dir(q.out, inputs, what="--out", own=written_by_plan, overwrite=q.overwrite)
    data, train = raw.get("data") or {}, raw.get("train") or {}
    seq_len = q.seq_len or int(data.get("seq_len", 4096))
    if layout is None and src is not None and raw.get("layout"):
        try:  # the run config's layout, when it fits this world size: shown next to the search's best
            layout = Layout.load(layout_beside(str(raw["layout"]), Path(src).parent))
            layout.resolve_mesh(q.world)
        except LayoutError:
            layout = None
    if q.recompute:
        recompute = q.recompute
    elif train.get("recompute"):
        recompute = recompute_mode(train)
    else:
        recompute = "none" if src is not None or not q.search else "full"
    micro = q.micro_batches or int(train.get("micro_batches", 1))
    with reading("--hardware", q.hardware):
        hw = Hardware.load(q.hardware) if q.hardware else None
    if q.efficiencies is not None:
        if hw is None:
            raise ConfigError("--efficiencies needs --hardware (the profile whose efficiencies it replaces)")
        hw = hw.with_measured(read_measured(q.efficiencies, hw.peak))
    kernels = KernelConfig.from_dict(raw.get("kernels"), source=f"{src or 'q38 plan'}: kernels")
    if q.gdn_kernel:
        kernels = kernels.replace(gdn=q.gdn_kernel)
    gdn = kernels.gdn
    # the torch core's chunk as the run would resolve it (an accelerator with a hardware profile, else the CPU)
    chunk = kernels.gdn_chunk_size if kernels.gdn_chunk_size != "auto" else auto_gdn_chunk(
        "cuda" if hw is not None else "cpu", cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    prec = run_precision(raw, param_dtype=q.param_dtype, reduce_dtype=q.reduce_dtype)
    lean = {k: v for k, v in (("moment_dtype", q.moment_dtype), ("master_dtype", q.master_dtype),
                              ("offload_optimizer", q.offload_optimizer)) if v is not None}
    kw = budget_kwargs({**train, "param_dtype": prec.param, "reduce_dtype": prec.reduce, **lean}, gdn=gdn,
                       chunk=chunk)
    kw["peft"] = planned_peft(raw.get("peft"), q.lora_rank, q.lora_base_dtype, src)
    full_ep_balance = kw["ep_balance"]  # what a full fine-tune row of --fewest-ranks runs
    if kw["peft"] is not None and kw["ep_balance"]:  # q38 train refuses it: priced off, written off
        kw["ep_balance"] = False
        print(f"train.enable_ep_balance from {src}: off (priced and written off): q38 train does not run EP balance "
              "with a LoRA run (peft)", file=sys.stderr)
    kw["doc_len"] = q.doc_len or DEFAULT_DOC_LEN
    kw["donated"] = not q.pure_step
    if q.rl is not None:
        kw["rl"] = q.rl
    shipped = fallback = None
    global_batch = q.global_batch
    batch_source = "--global-batch" if global_batch is not None else None
    if layout is not None:
        mesh = layout.resolve_mesh(q.world)
        dp = math.prod(mesh.get(n, 1) for n in layout.batch_mesh_dims)
        if global_batch is None:
            global_batch = dp * int(data.get("batch_size", 1))
            batch_source = (f"the run config's batch_size {int(data.get('batch_size', 1))} × the data-parallel size "
                            f"{dp} of layout {layout.name} at --world {q.world}")
        if hw is not None:
            def planned(kc: KernelConfig) -> Budget:
                res = plan_kernels(kc, hw, cp=mesh.get("cp", 1), param_dtype=kw["param_dtype"], cfg=cfg)
                return shipped_budget(cfg, layout, q.world, hw, seq_len=seq_len, global_batch=global_batch,
                                      recompute=recompute, micro_batches=micro, model_name=str(q.model),
                                      **{**kw, **kernels_kwargs(res)})

            try:
                shipped = planned(kernels)
            except (ConfigError, LayoutError) as e:
                if not q.search:
                    raise
                print(f"shipped layout {layout.name}: {' '.join(str(e).split())}", file=sys.stderr)
            if shipped is not None:
                fallback = planned(kernels.replace(**FALLBACKS))
    if global_batch is None:
        global_batch = q.world
        batch_source = f"one sequence per rank at --world {q.world}"
    if src:  # --fewest-ranks says the global batch in its own header
        gb = "" if q.fewest_ranks else f"global batch {global_batch} sequences ({batch_source}), "
        print(f"settings from {src}: seq_len {seq_len}, {gb}recompute {recompute}, {micro} micro-batch(es)",
              file=sys.stderr)
    if not q.search:
        if layout is None:
            raise ConfigError("q38 plan needs --layout (or --search to find one)")
        if shipped is None:
            mesh = layout.resolve_mesh(q.world)
            dp = math.prod(mesh.get(n, 1) for n in layout.batch_mesh_dims)
            shipped = shipped_budget(cfg, layout, q.world, None, seq_len=seq_len, global_batch=global_batch,
                                     recompute=recompute, micro_batches=micro, model_name=str(q.model), **kw)
        print(format_budget(shipped))
        if fallback is not None:
            print(format_fallback(shipped, fallback))
        return 0
    if hw is None:
        raise ConfigError("q38 plan --search needs --hardware (one of the profiles under specs/hardware, e.g. h200)")
    # a fine-tune plan writes every row as a fine-tune (a LoRA plan's full fine-tune row too)
    choices = attrs.evolve(q.choices, finetune=is_finetune(raw, kw["peft"] is not None, q.choices))

    def run_config(row_kw: Mapping[str, Any]) -> dict:  # the run config a row (or the search's best) writes
        return planned_run_config(raw, row_kw, kernels, model=str(q.model), choices=choices, own=q.train is not None)

    if q.fewest_ranks:
        rows = fewest_rows(cfg, hw, q.world, seq_len=seq_len, global_batch=global_batch, model_name=str(q.model),
                           kernels=kernels, full_ep_balance=full_ep_balance,
                           memory_cap=q.memory_cap * GIB if q.memory_cap is not None else None, **kw)
        print(format_fewest(rows, hw, q.world, seq_len=seq_len, global_batch=global_batch,
                            batch_source=batch_source, memory_cap=q.memory_cap * GIB if q.memory_cap else None))
        if q.out is None:
            print("not written: add --out DIR to write each row's layout and run config (one subdirectory a row)")
            return 0
        for r in rows:
            if r.found is None or r.unwritten:
                why = r.unwritten or f"nothing fits up to {q.world} devices"
                print(f"{r.slug}: not written ({why})")
                continue
            world, c = r.found
            lp, tp = write_best(c, Path(q.out) / r.slug, str(q.model), seq_len, run_config(r.kw))
            print(f"{r.slug}: wrote {lp} and {tp} (run on {world} devices: torchrun ... q38 train {tp})")
        return 0
    cap = q.memory_cap * GIB if q.memory_cap is not None else None
    cands, cap = search(cfg, q.world, hw, seq_len=seq_len, global_batch=global_batch, memory_cap=cap,
                        model_name=str(q.model), kernels=kernels, **kw)
    print(format_search(cands, cap, shipped))
    if fallback is not None:
        print(f"shipped layout's {format_fallback(shipped, fallback)}")
    if q.out is None:
        print("not written: add --out DIR to write the best layout and its run config")
        return 0
    lp, tp = write_best(cands[0], q.out, str(q.model), seq_len, run_config(kw))
    print(f"wrote {lp} and {tp} (run: torchrun --nproc_per_node ... q38 train {tp})")
    return 0


# ---- LoRA and the fewest ranks that fit ----------------------------------------------------------------------------


def planned_peft(section, rank: int | None, base_dtype: str | None, src: str | None):
    """The LoRA setting to plan: the run config's ``peft`` section, with ``--lora-rank`` / ``--lora-base-dtype``
    applied (either alone plans LoRA with the defaults of ``q38.lora.PeftConfig``); None: a full fine-tune."""
    from q38.lora import PeftConfig

    if section is None and rank is None and base_dtype is None:
        return None
    peft = PeftConfig.from_dict(dict(section or {}), source=src or "q38 plan")
    changes = {k: v for k, v in (("rank", rank), ("base_dtype", base_dtype)) if v is not None}
    return attrs.evolve(peft, **changes) if changes else peft


def _host_fits(b, hardware: Hardware) -> bool:
    """An offloaded optimizer's host bytes per node (masters and moments of every local rank) within
    ``MEMORY_HEADROOM`` of the profile's ``host_memory_bytes`` (always, without offload or without that figure). Not
    counted: an async checkpoint's staged copy of the state (``run.async_save``), the data loader, the OS."""
    if not b.host_optimizer or not hardware.host_memory_bytes:
        return True
    return b.host_optimizer[0] <= MEMORY_HEADROOM * hardware.host_memory_bytes


def fewest_ranks(cfg: ModelConfig, hardware: Hardware, max_world: int, *, seq_len: int,
                 global_batch: int | None = None, min_world: int | None = None, **kw) -> tuple[int, Candidate] | None:
    """The smallest world (whole nodes of ``hardware``, doubling from one node or ``min_world``, up to ``max_world``)
    where some layout of :func:`search` fits, with its fastest candidate; None when none fits up to ``max_world``.
    ``global_batch``: sequences per step at every world (default: one per rank)."""
    world = min_world or hardware.devices_per_node
    cap = float(kw["memory_cap"]) if kw.get("memory_cap") is not None else MEMORY_HEADROOM * hardware.hbm_bytes
    floor = _state_floor_bytes(cfg, kw.get("peft"), kw.get("param_dtype", "bf16"), kw)
    while world <= max_world:
        if floor / world > cap:  # the state alone, spread evenly, does not fit: no layout can
            world *= 2
            continue
        try:
            cands, _ = search(cfg, world, hardware, seq_len=seq_len, global_batch=global_batch or world, prune=True,
                              **kw)
            pp = [c for c in cands if dict(c.budget.mesh).get("pp", 1) > 1]
            best = cands[0]
            if pp and pp[0] is not best:
                best = attrs.evolve(best, pp_alternative=pp[0])
            return world, best
        except ConfigError:
            world *= 2
    return None


def _state_floor_bytes(cfg: ModelConfig, peft, param_dtype: str, kw: Mapping[str, Any] | None = None) -> float:
    """Bytes of state a run holds over all its ranks at the least (each value stored once): a full fine-tune's
    masters and AdamW moments in their dtypes (offloaded: the compute-dtype shards); a LoRA run's frozen base in its
    storage dtype (adapters left out)."""
    from q38.fp8 import default_quantized
    from q38.model import abstract_params, is_param_info
    from q38.parallel.budget import _nbytes
    from q38.parallel.budget_memory import moment_bytes
    from q38.parallel.lora_budget import FP8_BYTES
    from q38.pytree import named_leaves

    kw = kw or {}
    leaves = [(p, math.prod(i.shape)) for p, i in named_leaves(abstract_params(cfg), is_leaf=is_param_info)
              if i is not None]
    total = sum(n for _, n in leaves)
    act = _nbytes(param_dtype)
    if peft is None:
        if kw.get("offload_optimizer"):
            return float(total * act)
        return float(total * (4 + moment_bytes(kw.get("moment_dtype", "float32"))))
    if peft.base_dtype != "fp8":
        return float(total * act)
    q = sum(n for p, n in leaves if default_quantized(p))
    return float(q * FP8_BYTES + (total - q) * act)


# the optimizer-state settings --fewest-ranks prices for a full fine-tune beside the planned one: (name, settings)
LEAN_OPTIONS = (
    ("pure train_step (fp32 state)", dict(donated=False)),
    ("bf16 moments", dict(moment_dtype="bfloat16")),
    ("bf16 moments + bf16 gradients", dict(moment_dtype="bfloat16", reduce_dtype="bf16")),
    ("int8 moments + bf16 gradients", dict(moment_dtype="int8", reduce_dtype="bf16")),
    ("fp32 masters and moments offloaded to host memory", dict(offload_optimizer=True, param_dtype="bf16")),
    ("offloaded + bf16 gradients", dict(offload_optimizer=True, param_dtype="bf16", reduce_dtype="bf16")),
)
# settings q38 train does not run (printed as "priced only"): none now. The offloaded row needs the profile's host
# side (host_memory_bytes, host_memory_bandwidth, host_link_bandwidth); its host bytes per node must fit
# MEMORY_HEADROOM of host_memory_bytes (_host_fits). (bf16 + remainder masters, --master-dtype bfloat16_remainder,
# run: they hold the same 4 bytes a parameter as fp32 masters, plus one leaf's fp32 master in the donated update, so
# as an option here they could not lower the fewest devices.)
NOT_RUN: dict = {}


def _state_name(kw: Mapping[str, Any]) -> str:
    m = kw.get("moment_dtype", "float32")
    bits = [f"{'pure' if kw.get('donated') is False else 'donated'} step", f"masters {kw.get('master_dtype', 'float32')}",
            f"moments {m}", f"gradients {kw.get('reduce_dtype', 'fp32')}"]
    if kw.get("offload_optimizer"):
        bits.append("offloaded to the host")
    if any(kw.get(k) == v for k, v in NOT_RUN.items()):
        bits.append("priced only: q38 train does not run this state yet")
    return ", ".join(bits)


@attrs.frozen
class FewestRow:
    """One line of ``--fewest-ranks``: its name, the subdirectory ``--out`` writes it to (``slug``), the budget
    settings it was priced with (``kw``: ``estimate``'s, ``peft`` included), what it found (``(world, best
    candidate)``, None: nothing fits) and why it is not written (``unwritten``, when no run config runs it)."""

    name: str
    slug: str
    kw: dict = attrs.field(eq=False)
    found: tuple[int, Candidate] | None
    suffix: str = ""  # printed after the row's figures
    unwritten: str | None = None


def fewest_rows(cfg: ModelConfig, hardware: Hardware, max_world: int, *, seq_len: int,
                global_batch: int | None = None, full_ep_balance: bool | None = None, **kw) -> list[FewestRow]:
    """The fewest devices of ``hardware`` that fit, one row per setting, all at one global batch: for a LoRA run
    (``kw['peft']``) the planned base and the other base, then the full fine-tune (with ``full_ep_balance``, the run
    config's EP balance, which LoRA rows price off) and the LoRA run priced on the full fine-tune's devices (step
    time side by side); for a full fine-tune the planned optimizer state and each of ``LEAN_OPTIONS``."""
    peft = kw.get("peft")
    run = dict(seq_len=seq_len, global_batch=global_batch)
    rows: list[FewestRow] = []
    if peft is not None:
        other = attrs.evolve(peft, base_dtype="compute" if peft.base_dtype == "fp8" else "fp8")
        for p in (peft, other):
            base = "FP8 base" if p.base_dtype == "fp8" else "base in the compute dtype"
            pkw = {**kw, "peft": p}
            rows.append(FewestRow(f"LoRA rank {p.rank} ({p.experts} experts, {base})", f"lora_{p.base_dtype}", pkw,
                                  fewest_ranks(cfg, hardware, max_world, **run, **pkw)))
        fkw = {**kw, "peft": None}
        if full_ep_balance is not None:
            fkw["ep_balance"] = full_ep_balance
        full = fewest_ranks(cfg, hardware, max_world, **run, **fkw)
        rows.append(FewestRow(f"full fine-tune ({_state_name(fkw)})", "full_finetune", fkw, full))
        if full is not None:  # the planned LoRA run on the full fine-tune's devices: the step times side by side
            same = fewest_ranks(cfg, hardware, full[0], min_world=full[0], **run, **kw)
            if same is not None:
                ratio = same[1].budget.step_s / full[1].budget.step_s
                base = "FP8 base" if peft.base_dtype == "fp8" else "base in the compute dtype"
                rows.append(FewestRow(f"LoRA rank {peft.rank} ({base}) on the full fine-tune's {full[0]}",
                                      f"lora_{peft.base_dtype}_on_{full[0]}", dict(kw), same,
                                      suffix=f"; LoRA / full step time {ratio:.2f}"))
        return rows
    rows.append(FewestRow(f"full fine-tune, planned state ({_state_name(kw)})", "planned", dict(kw),
                          fewest_ranks(cfg, hardware, max_world, **run, **kw)))
    for name, opt in LEAN_OPTIONS:
        okw = {**kw, **opt}
        slug = LEAN_SLUGS[name]
        if opt.get("offload_optimizer") and not (hardware.host_memory_bandwidth and hardware.host_link_bandwidth):
            rows.append(FewestRow(name, slug, okw, None, unwritten=f"not priced ({hardware.name} profile has no "
                                                                   "host side)"))
            continue
        found = fewest_ranks(cfg, hardware, max_world, **run, **okw)
        suffix = (f"; host memory {_fmt_bytes(found[1].budget.host_optimizer[0])} per node"
                  if found is not None and found[1].budget.host_optimizer else "")
        rows.append(FewestRow(f"{name} ({_state_name(okw)})", slug, okw, found, suffix=suffix,
                              unwritten="q38 train runs the donated step; the planned row is its run"
                              if opt.get("donated") is False else None))
    return rows


# the subdirectory ``--fewest-ranks --out`` writes each of ``LEAN_OPTIONS`` to
LEAN_SLUGS = {"pure train_step (fp32 state)": "pure_step", "bf16 moments": "bf16_moments",
              "bf16 moments + bf16 gradients": "bf16_moments_bf16_grads",
              "int8 moments + bf16 gradients": "int8_moments_bf16_grads",
              "fp32 masters and moments offloaded to host memory": "offloaded",
              "offloaded + bf16 gradients": "offloaded_bf16_grads"}


def format_fewest(rows: list[FewestRow], hardware: Hardware, max_world: int, *, seq_len: int,
                  global_batch: int | None = None, batch_source: str | None = None,
                  memory_cap: float | None = None) -> str:
    """The rows of :func:`fewest_rows` under one header (the global batch, the memory cap). Each line: devices,
    layout, peak, step time, MFU."""
    gb = "one sequence per rank" if global_batch is None else f"global batch {global_batch} sequences"
    lines = [f"fewest {hardware.name} devices that fit ({seq_len} tokens a sequence, {gb}"
             + (f" = {batch_source}" if batch_source and global_batch is not None else "")
             + ", the same at every world; memory cap "
             + (f"{_fmt_bytes(memory_cap)}" if memory_cap is not None
                else f"{MEMORY_HEADROOM:.0%} of {hardware.hbm_bytes / GIB:.0f} GiB") + "):"]
    for r in rows:
        if r.found is None:
            lines.append(f"  {r.name}: {r.unwritten}" if r.unwritten and "not priced" in r.unwritten
                         else f"  {r.name}: none up to {max_world}")
            continue
        world, c = r.found
        b = c.budget
        lines.append(f"  {r.name}: {world} ({c.mesh}{' hier' if c.ep_dispatch == 'hierarchical' else ''}, recompute "
                     f"{b.recompute}, {b.micro_batches} micro-batch(es); peak {_fmt_bytes(b.peak_bytes)} per device, "
                     f"step {_fmt_s(b.step_s)}, MFU {100 * (b.mfu or 0):.1f}%){r.suffix}")
        if dict(b.mesh).get("pp", 1) == 1 and r.kw.get("peft") is None:  # (the search tries no pp for LoRA)
            p = c.pp_alternative
            if p is None:
                lines.append(f"    with pp: no pipelined layout fits {world} devices")
            else:
                pb = p.budget
                lines.append(f"    with pp: {p.mesh}{' hier' if p.ep_dispatch == 'hierarchical' else ''}, recompute "
                             f"{pb.recompute}, {pb.micro_batches} micro-batch(es); peak {_fmt_bytes(pb.peak_bytes)}, "
                             f"step {_fmt_s(pb.step_s)} ({pb.step_s / b.step_s:.2f} × the row's)")
    return "\n".join(lines)
