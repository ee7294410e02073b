"""What :func:`q38.parallel.budget.estimate` returns, a :class:`Budget` (peak memory, step time, MFU, the bound), and
how ``q38 plan`` prints it."""

from typing import Any

import attrs

from q38.flops import StepFlops
from q38.parallel.budget_comm import CommTerm
from q38.parallel.efficiency import OpTime
from q38.parallel.hardware import MEMORY_HEADROOM
from q38.parallel.param_stats import Item, phase_total
from q38.parallel.precision import Precision


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
    dequant_s: float = 0.0  # an FP8 LoRA base's dequantizations (HBM-bound, serial with the compute)
    # an offloaded optimizer: (host bytes per node, host AdamW seconds, device <-> host copy seconds per device)
    host_optimizer: tuple[float, float, float] | None = None
    optimizer_state: str = ""  # how the optimizer phase was priced (donated or pure step, state dtypes)
    pipeline: tuple = ()  # a pp layout: one q38.parallel.pipeline_plan.StageRow per pipeline rank (else empty)
    # without per-op pricing: the compute time's factor at the slow and fast ends of achievable_fraction's range
    compute_spread: tuple[float, float] = (1.0, 1.0)
    rollout_phase: tuple[Item, ...] = ()  # RL: decoding the rollout batch (q38.parallel.budget_rollout; else empty)
    rollout_note: str = ""  # RL: the rollout batch, rows per rank and tokens per row
    # micro_batches > 1: the moment a micro-batch's gradients are added into the sum (budget_memory.accumulate_items)
    accumulate_phase: tuple[Item, ...] = ()
    layer_saved: tuple[float, ...] = ()  # bytes each layer (main, then MTP depths) saves over one micro-batch

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
        if self.rollout_phase and self.peak_phase == "rollout (RL decode)":  # RL: the rollout phase is the peak
            fixes = "fewer prompts or samples per rollout batch, fewer new tokens, shorter prompts, or more ranks"
            largest = max(self.rollout_phase, key=lambda it: it.bytes).name.strip()
            return f"{verdict}: {share}; the rollout phase's largest item is {largest}: {fixes}"
        phase = {"optimizer step": self.optimizer_phase, "start (loading the state)": self.start_phase,
                 "gradient accumulation": self.accumulate_phase}.get(self.peak_phase, self.memory)
        largest = max(phase, key=lambda it: it.bytes).name.strip()
        return f"{verdict}: {share}; the largest item is {largest}: {fixes}"

    @property
    def precision(self) -> Precision:
        return Precision(param=self.param_dtype, reduce=self.reduce_dtype)

    @property
    def cp(self) -> int:
        return dict(self.mesh).get("cp", 1)

    @property
    def tokens_per_rank(self) -> int:
        """Tokens each rank computes per step: its ``rows_per_rank`` rows, each a ``1 / cp`` slice of the sequence
        (``q38.parallel.mesh.shard_batch``: rows split over the batch dims, the sequence over ``cp``)."""
        return self.rows_per_rank * (self.seq_len // self.cp)

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
    def peak_rollout(self) -> float:
        return phase_total(self.rollout_phase)

    @property
    def peak_accumulate(self) -> float:
        return phase_total(self.accumulate_phase)

    @property
    def peak_bytes(self) -> float:
        return max(self.peak_fwd_bwd, self.peak_optimizer, self.peak_start, self.peak_accumulate, self.peak_rollout)

    @property
    def peak_phase(self) -> str:
        phases = {"forward/backward": self.peak_fwd_bwd, "optimizer step": self.peak_optimizer,
                  "start (loading the state)": self.peak_start, "gradient accumulation": self.peak_accumulate,
                  "rollout (RL decode)": self.peak_rollout}
        return max(phases, key=phases.get)

    @property
    def comm_sync_s(self) -> float:
        return sum((t.seconds for t in self.comm if not t.overlapped), 0.0)  # 0.0, not 0, with no collective (world 1)

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
        return self.compute_s + self.comm_exposed_s + self.optimizer_s + self.dequant_s

    @property
    def tokens_per_s(self) -> float:
        return self.global_tokens / self.step_s if self.step_s else float("nan")

    @property
    def mfu(self) -> float | None:
        if not self.peak_flops or not self.step_s:
            return None
        return self.flops.model / (self.step_s * self.peak_flops)

    # ---- ranges: every efficiency at the low end of its range (slow) or at the high end (fast) -------------------

    def factors(self) -> list[str]:
        """What the step's spread comes from: each priced op's efficiency range (or the one ``compute`` range),
        and the collectives' bus-bandwidth ranges."""
        return ([o.op for o in self.ops] or ["compute"]) + (["collectives"] if self.comm else [])

    def step_at(self, end: str = "mid", **over: str) -> float:
        """The step time with every factor at ``end`` (``mid``, ``slow``, ``fast``) but those named in ``over``
        (factor → end), by the same rule as ``step_s``: compute, plus each phase's ``sync + max(compute, async)``,
        plus the optimizer and dequantization."""
        if self.ops:
            times = [o.at(over.get(o.op, end)) for o in self.ops]
            compute, fwd = sum(t[0] for t in times), sum(t[1] for t in times)
        else:
            k = {"mid": 1.0, "slow": self.compute_spread[0], "fast": self.compute_spread[1]}[over.get("compute", end)]
            compute, fwd = self.compute_s * k, self.compute_fwd_s * k
        ce = over.get("collectives", end)
        exposed = sum(t.at(ce) for t in self.comm if not t.overlapped)
        for phase, c in (("forward", fwd), ("backward", compute - fwd)):
            hidden = sum(t.at(ce) for t in self.comm if t.overlapped and t.phase == phase)
            exposed += max(0.0, hidden - c)
        return compute + exposed + self.optimizer_s + self.dequant_s

    @property
    def step_range(self) -> tuple[float, float]:
        """(fastest, slowest) step time over the efficiency and bus-bandwidth ranges."""
        return self.step_at("fast"), self.step_at("slow")

    @property
    def tokens_per_s_range(self) -> tuple[float, float]:
        fast, slow = self.step_range
        return self.global_tokens / slow, self.global_tokens / fast

    @property
    def mfu_range(self) -> tuple[float, float] | None:
        if not self.peak_flops:
            return None
        fast, slow = self.step_range
        return self.flops.model / (slow * self.peak_flops), self.flops.model / (fast * self.peak_flops)

    @property
    def spread_driver(self) -> tuple[str, float]:
        """The factor whose range alone moves the step most (the others at their fast end), and by how much."""
        fast = self.step_at("fast")
        moves = {f: self.step_at("fast", **{f: "slow"}) - fast for f in self.factors()}
        name = max(moves, key=moves.get)
        return name, moves[name]

    @property
    def bound(self) -> str:
        terms = {"compute": self.compute_s, "optimizer (host)" if self.host_optimizer else "optimizer (HBM)":
                 self.optimizer_s, "FP8 base dequantization (HBM)": self.dequant_s}
        for t in self.comm:
            if not t.overlapped:
                key = f"{t.collective} over {t.mesh_dim} ({t.link})"
                terms[key] = terms.get(key, 0.0) + t.seconds
        if self.comm_exposed_s > self.comm_sync_s:
            terms["async communication beyond compute"] = self.comm_exposed_s - self.comm_sync_s
        return max(terms.items(), key=lambda kv: kv[1])[0]


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
        f"  tokens per rank {b.tokens_per_rank:,} = {b.rows_per_rank} row(s) × {b.seq_len // b.cp} (seq_len "
        f"{b.seq_len}" + (f" split over cp={b.cp}" if b.cp > 1 else "") + f"), {b.micro_batches} micro-batch(es); "
        f"{b.global_tokens:,} tokens per step; recompute {b.recompute}",
        "peak memory per rank (fullest rank), forward/backward phase",
    ]
    if b.pipeline:  # a pp layout (q38.parallel.pipeline_plan): every stage, then the fullest one's items below
        from q38.parallel.pipeline_plan import format_pipeline

        lines[-1:-1] = format_pipeline(b)
    for it in b.memory:
        tag = f" [transient: {it.transient}]" if it.transient else ""
        lines.append(f"  {it.name:<32}{_fmt_bytes(it.bytes):>14}   {it.note}{tag}")
    lines.append(f"  {'total':<32}{_fmt_bytes(b.peak_fwd_bwd):>14}   (persistent + the largest transient group)")
    if b.start_phase:
        lines.append(f"start of the run (every rank loads only its shards): resume {_fmt_bytes(b.start_peak('resume'))}"
                     f", init_from a HF directory {_fmt_bytes(b.start_peak('init_from'))} per rank (shards "
                     f"{_fmt_bytes(b.start_peak('none'))} + the largest read in flight)")
    if b.accumulate_phase:
        lines.append(f"gradient accumulation total {_fmt_bytes(b.peak_accumulate)} (adding a micro-batch's gradients "
                     "into the sum: " + ", ".join(it.name for it in b.accumulate_phase
                                                   if it.name not in {m.name for m in b.memory}) + ")")
    lines.append(f"optimizer phase total {_fmt_bytes(b.peak_optimizer)}"
                 + (f" ({b.optimizer_state})" if b.optimizer_state else "")
                 + f"; peak {_fmt_bytes(b.peak_bytes)} in the {b.peak_phase}")
    for it in b.optimizer_phase:
        if it.name not in {m.name for m in b.memory}:
            lines.append(f"  {it.name:<32}{_fmt_bytes(it.bytes):>14}   {it.note}")
    if b.rollout_phase:  # RL: decoding the rollout batch (q38.parallel.budget_rollout)
        lines.append(f"rollout phase total {_fmt_bytes(b.peak_rollout)} (RL: decoding the rollout batch; "
                     f"{b.rollout_note})")
        for it in b.rollout_phase:
            tag = f" [transient: {it.transient}]" if it.transient else ""
            lines.append(f"  {it.name:<32}{_fmt_bytes(it.bytes):>14}   {it.note}{tag}")
    if b.host_optimizer:
        held, host_s, link_s = b.host_optimizer
        lines.append(f"offloaded optimizer: host memory {_fmt_bytes(held)} per node (masters and moments); host "
                     f"AdamW {_fmt_s(host_s)} per step, device <-> host copies {_fmt_s(link_s)}, overlapped with "
                     f"it: {_fmt_s(b.optimizer_s)} after the backward")
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
            f"{_fmt_s(b.comm_hidden_s)} hidden) + optimizer {_fmt_s(b.optimizer_s)}"
            + (f" + FP8 dequantization {_fmt_s(b.dequant_s)}" if b.dequant_s else "") + f"; bound by {b.bound}")
        mfu = b.mfu
        lines.append(f"  {b.tokens_per_s:,.0f} tokens/s; MFU {100 * mfu:.1f}%" if mfu is not None else "")
        lines.append(format_range(b))
    return "\n".join(lines)


def format_range(b: Budget) -> str:
    """The step time, tokens/s (all ranks, and per rank) and MFU as ranges over the profile's efficiency and
    bus-bandwidth ranges, and the factor that moves the step most."""
    fast, slow = b.step_range
    tlo, thi = b.tokens_per_s_range
    mr = b.mfu_range
    name, move = b.spread_driver
    mfu = f"; MFU {100 * mr[0]:.1f}-{100 * mr[1]:.1f}%" if mr else ""
    return (f"  range over the profile's efficiency ranges: step {_fmt_s(fast)}-{_fmt_s(slow)}; {tlo:,.0f}-{thi:,.0f} "
            f"tokens/s ({tlo / b.world:,.0f}-{thi / b.world:,.0f} a rank){mfu}; the spread is dominated by {name} "
            f"({_fmt_s(move)} of the {_fmt_s(slow - fast)})")


def format_ops(b: Budget) -> list[str]:
    """The per-op compute table: each op's kernel (as ``resolve_kernels`` picked it), executed FLOPs per rank,
    efficiency, where that number comes from, and time."""
    lines = [f"compute per op on {b.hardware} (per rank and step; the kernels the run resolves, executed FLOPs at each "
             f"kernel's efficiency)",
             f"  {'op':<10} {'kernel':<11} {'FLOPs':>9} {'eff':>9} {'time':>10} {'range':>19}  {'what':<44} source"]
    for o in b.ops:
        span = f"{_fmt_s(o.fast_s)}-{_fmt_s(o.slow_s)}"
        work = f"{o.flops:>9.2e}" if o.flops or not o.bytes else f"{'(bytes)':>9}"
        lines.append(f"  {o.op:<10} {o.impl:<11} {work} {o.efficiency.span():>9} {_fmt_s(o.seconds):>10} "
                     f"{span:>19}  {o.note:<44} {o.efficiency.describe()}")
    return lines
