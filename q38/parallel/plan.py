"""``q38 plan``: per-rank memory and FSDP traffic of a (model, layout, world size), by pure shape arithmetic.

No process group, no tensors: every rank's local shard shapes follow DTensor's nested ``torch.chunk`` split
(:func:`local_numel_grid`), computed for all ranks at once as one array per (shape, placements), so the 2.4T preset
on 1024 ranks plans in well under a second. Traffic counts the FSDP gathers, reduce-scatters and all-reduces of one
micro-batch as bytes received per rank (docs/plan.md#plan-a-large-run-without-hardware); EP and CP exchanges, which
scale with tokens, are the budget's (:mod:`q38.parallel.budget`).
"""

import math
import time
from typing import Sequence

import attrs
import torch

from q38.model_config import ModelConfig
from q38.parallel.layout import Layout, ParamPlacement, format_mesh
from q38.parallel.precision import Precision, format_precision

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def local_numel_grid(shape: Sequence[int], items: Sequence[int | None], mesh_sizes: Sequence[int]) -> torch.Tensor:
    """Local element count of every rank, as an int64 array of shape ``mesh_sizes``.

    ``items[j]`` is the tensor dim mesh dim ``j`` shards (``None``: replicated). Mesh dims are applied in mesh
    order, each splitting the current local size with ``torch.chunk`` semantics, exactly as DTensor's
    ``_compute_local_shape_and_global_offset`` does (tests/test_layout.py pins the two against each other).
    """
    k = len(mesh_sizes)
    out = torch.ones((1,) * k, dtype=torch.int64)
    for dim, n in enumerate(shape):
        size = torch.full((1,) * k, n, dtype=torch.int64)
        for j, (s, d) in enumerate(zip(mesh_sizes, items)):
            if d != dim:
                continue
            c = torch.arange(s, dtype=torch.int64).view([s if i == j else 1 for i in range(k)])
            full = (size + s - 1) // s
            size = (torch.minimum(size, full * (c + 1)) - full * c).clamp(min=0)
        out = out * size
    return out.expand(tuple(mesh_sizes)) if k else out.reshape(())


@attrs.frozen
class PatternRow:
    """One row of the plan table: the parameters matched by one pattern."""

    pattern: str
    count: int
    shape: tuple[int, ...]
    spec: tuple[tuple[str, ...], ...]
    local_shape: tuple[int, ...]  # rank 0
    bytes_per_rank: int  # params of this pattern on the fullest rank


@attrs.frozen
class ExpertPlacement:
    """Routed experts in compute form: which mesh dims split them, and which global experts each EP rank holds."""

    num_experts: int
    mesh_dims: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]  # per EP coordinate (row-major over mesh_dims): [start, stop)
    ep_coord_of_rank: tuple[int, ...]  # per global rank

    @property
    def per_rank(self) -> int:
        return max(b - a for a, b in self.ranges)

    def experts_of_rank(self, rank: int) -> range:
        return range(*self.ranges[self.ep_coord_of_rank[rank]])


@attrs.frozen
class PlanReport:
    model: str
    layout: str
    world_size: int
    mesh: tuple[tuple[str, int], ...]
    param_dtype: str
    optimizer_state_factor: int
    total_params: int
    expert_params: int
    numel_max: int  # parameters held by the fullest rank
    numel_min: int
    numel_rank0: int
    param_bytes_max: int
    param_bytes_rank0: int
    grad_bytes_max: int
    grad_bytes_rank0: int
    optimizer_bytes_max: int
    optimizer_bytes_rank0: int
    largest_layer: str
    largest_layer_bytes: int  # compute form (FSDP-gathered, experts EP-local), fullest rank
    largest_tensor: str
    largest_tensor_bytes: int
    experts: ExpertPlacement | None
    allgather_fwd_bytes: int
    allgather_bwd_bytes: int
    reduce_scatter_bytes: int
    all_reduce_bytes: int
    rows: tuple[PatternRow, ...]
    seconds: float
    reduce_dtype: str = "float32"  # gradient reduce-scatter / all-reduce dtype (the mixed-precision policy)

    @property
    def total_bytes_max(self) -> int:
        return self.param_bytes_max + self.grad_bytes_max + self.optimizer_bytes_max

    @property
    def precision(self) -> Precision:
        return Precision(param=self.param_dtype, reduce=self.reduce_dtype)

    @property
    def comm_bytes(self) -> int:
        return self.allgather_fwd_bytes + self.allgather_bwd_bytes + self.reduce_scatter_bytes + self.all_reduce_bytes


def _expert_placement(pl: dict[str, ParamPlacement], num_experts: int, world: int) -> ExpertPlacement | None:
    pp = next((p for path, p in pl.items() if path.endswith("moe.we_gate_up")), None)
    if pp is None:
        return None
    sizes = dict(pp.mesh)
    dims = tuple(m for m in pp.compute_axes_per_dim[0] if sizes[m] > 1)
    ranges: list[tuple[int, int]] = [(0, num_experts)]
    for m in dims:  # nested torch.chunk split, major → minor
        nxt = []
        for a, b in ranges:
            full = -(-(b - a) // sizes[m])
            nxt += [(min(b, a + full * c), min(b, a + full * (c + 1))) for c in range(sizes[m])]
        ranges = nxt
    names = [n for n, _ in pp.mesh]
    coords = torch.arange(world).reshape([s for _, s in pp.mesh] or [1])
    ep = torch.zeros_like(coords)
    for m in dims:  # row-major EP coordinate over the EP mesh dims
        j = names.index(m)
        c = torch.arange(sizes[m]).view([sizes[m] if i == j else 1 for i in range(len(names))])
        ep = ep * sizes[m] + c
    return ExpertPlacement(
        num_experts=num_experts, mesh_dims=dims, ranges=tuple(ranges),
        ep_coord_of_rank=tuple(int(x) for x in ep.expand_as(coords).reshape(-1)),
    )


def _layer_of(path: str) -> str | None:
    parts = path.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return None


@attrs.frozen
class _Tally:
    """Per-rank element counts over the mesh grid (one entry per mesh coordinate), summed over the parameters."""

    held: torch.Tensor  # elements each rank stores (its shards)
    gathered: torch.Tensor  # elements each rank receives by all-gather to bring them into compute form
    reduced: torch.Tensor  # all-reduce elements (ring: 2 (r - 1) / r per replicated element)
    layers: dict  # decoder layer -> elements of that layer in compute form, per rank
    rows: dict  # rule pattern -> [parameter count, one placement, elements held per rank]
    largest_tensor: str
    largest_tensor_numel: int


def _tally(pl: dict[str, ParamPlacement], mesh: dict[str, int]) -> _Tally:
    mesh_sizes = list(mesh.values())
    grid_cache: dict[tuple, torch.Tensor] = {}

    def grid(pp: ParamPlacement, compute: bool) -> torch.Tensor:
        key = (pp.shape, tuple(pp.shard_dims(compute)))
        if key not in grid_cache:
            grid_cache[key] = local_numel_grid(pp.shape, key[1], mesh_sizes)
        return grid_cache[key]

    zeros = torch.zeros(mesh_sizes, dtype=torch.int64)
    held, gathered, reduced = zeros.clone(), zeros.clone(), torch.zeros(mesh_sizes, dtype=torch.float64)
    layers: dict[str, torch.Tensor] = {}
    rows: dict[str, list] = {}
    largest_tensor, largest_tensor_numel = "", -1
    for path, pp in pl.items():
        local, comp = grid(pp, False), grid(pp, True)
        held += local
        gathered += comp - local
        # all-reduce over the mesh dims that replicate this parameter
        sharding = {m for dims in pp.mesh_axes_per_dim for m in dims}
        r = math.prod(s for m, s in mesh.items() if m not in sharding)
        if r > 1:
            reduced += 2.0 * (r - 1) / r * local
        layer = _layer_of(path)
        if layer is not None:
            layers[layer] = layers.get(layer, zeros) + comp
        cmax = int(comp.max())
        if cmax > largest_tensor_numel:
            largest_tensor, largest_tensor_numel = path, cmax
        row = rows.setdefault(pp.pattern, [0, pp, zeros.clone()])
        row[0] += 1
        row[2] += local
    return _Tally(held, gathered, reduced, layers, rows, largest_tensor, largest_tensor_numel)


def plan(
    model_cfg: ModelConfig,
    layout: Layout,
    world_size: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    optimizer_state_factor: int = 2,
    model_name: str | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> PlanReport:
    """Per-rank parameter, gradient and optimizer bytes, the largest gathered layer, the expert placement and the
    FSDP collective volume of one step, for ``model_cfg`` under ``layout`` on ``world_size`` ranks.

    Under the mixed-precision policy (:class:`~q38.parallel.precision.Precision`): master weights are fp32,
    optimizer state is ``optimizer_state_factor`` fp32 values per parameter (AdamW m and v), gradients and their
    reductions are in ``reduce_dtype``; gathered layers and all-gathers in ``param_dtype`` (the compute dtype). Raises :class:`LayoutError` when the layout does not fit the model or the world size.
    """
    from q38.model import abstract_params

    t0 = time.perf_counter()
    keep = None
    if layout.pp > 1:  # a pipeline axis: the placements of the stage holding the most (q38.parallel.pipeline)
        from q38.parallel.pipeline import fullest_stage

        layout, world_size, keep = fullest_stage(model_cfg, layout, world_size)
    mesh = layout.resolve_mesh(world_size)
    pl = layout.placements(abstract_params(model_cfg), mesh)
    if keep is not None:
        pl = {p: x for p, x in pl.items() if keep(p)}
    mesh_sizes = list(mesh.values())
    pbytes = torch.tensor([], dtype=param_dtype).element_size()  # compute form: gathered layers, all-gathers
    rbytes = torch.tensor([], dtype=reduce_dtype).element_size()  # gradient reductions
    mbytes = 4  # fp32 master weights
    t = _tally(pl, mesh)
    held, gathered, reduced, layers, rows = t.held, t.gathered, t.reduced, t.layers, t.rows
    largest_tensor, largest_tensor_numel = t.largest_tensor, t.largest_tensor_numel

    flat = held.reshape(-1)
    rank0 = int(flat[0])
    numel_max = int(flat.max())
    if layers:
        largest_layer, lg = max(((k, int(v.max())) for k, v in layers.items()), key=lambda kv: kv[1])
    else:
        largest_layer, lg = "", 0
    gmax = int(gathered.max())
    infos = [(path, math.prod(pp.shape)) for path, pp in pl.items()]
    origin = (0,) * len(mesh_sizes)
    report_rows = tuple(
        PatternRow(
            pattern=pat, count=n, shape=pp.shape, spec=pp.mesh_axes_per_dim,
            local_shape=pp.local_shape(origin), bytes_per_rank=int(g.max()) * mbytes,
        )
        for pat, (n, pp, g) in rows.items()
    )
    return PlanReport(
        model=model_name or model_cfg.model_type,
        layout=layout.name,
        world_size=world_size,
        mesh=tuple(mesh.items()),
        param_dtype=str(param_dtype).replace("torch.", ""),
        optimizer_state_factor=optimizer_state_factor,
        total_params=sum(n for _, n in infos),
        expert_params=sum(n for p, n in infos if ".moe.we_" in p),
        numel_max=numel_max,
        numel_min=int(flat.min()),
        numel_rank0=rank0,
        param_bytes_max=numel_max * mbytes,
        param_bytes_rank0=rank0 * mbytes,
        grad_bytes_max=numel_max * rbytes,
        grad_bytes_rank0=rank0 * rbytes,
        optimizer_bytes_max=numel_max * 4 * optimizer_state_factor,
        optimizer_bytes_rank0=rank0 * 4 * optimizer_state_factor,
        largest_layer=largest_layer,
        largest_layer_bytes=lg * pbytes,
        largest_tensor=largest_tensor,
        largest_tensor_bytes=largest_tensor_numel * pbytes,
        experts=_expert_placement(pl, model_cfg.num_experts, world_size),
        allgather_fwd_bytes=gmax * pbytes,
        allgather_bwd_bytes=gmax * pbytes,
        reduce_scatter_bytes=gmax * rbytes,
        all_reduce_bytes=int(math.ceil(float(reduced.max()))) * rbytes if reduced.numel() else 0,
        rows=report_rows,
        seconds=time.perf_counter() - t0,
        reduce_dtype=str(reduce_dtype).replace("torch.", ""),
    )


# ---- formatting ---------------------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _spec_str(spec: tuple[tuple[str, ...], ...]) -> str:
    return "(" + ", ".join("·".join(d) if d else "-" for d in spec) + ")"


def format_plan(r: PlanReport, *, precision: Precision | None = None, budget_follows: bool = False) -> str:
    """The report as a table (per pattern) plus per-rank totals, expert placement and traffic. ``precision``: the
    dtype block to print (default: the report's own, a full fine-tune's). ``budget_follows``: the budget of the run
    as configured is printed next (``q38 plan --train / --hardware / ...``), which holds the one set of memory and
    traffic figures; the report gives only the placements then (no per-rank bytes, totals or FSDP traffic priced
    as a full fp32 state)."""
    head = ["pattern", "n", "global shape", "spec (tensor dims)", "local shape (rank 0)", "per rank (max)"]
    body = [
        [row.pattern, str(row.count), "×".join(map(str, row.shape)), _spec_str(row.spec),
         "×".join(map(str, row.local_shape)), _gib(row.bytes_per_rank)]
        for row in r.rows
    ]
    if budget_follows:
        head, body = head[:-1], [row[:-1] for row in body]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in (1, 5) else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [
        f"q38 plan · model {r.model} ({_count(r.total_params)} params, {_count(r.expert_params)} in routed experts)"
        f" · layout {r.layout} · world {r.world_size} = {format_mesh(r.mesh)}",
        format_precision(precision or r.precision),
        "",
        fmt(head),
        fmt(["-" * w for w in widths]),
        *map(fmt, body),
        "",
    ]
    e = r.experts
    if budget_follows:
        if e is not None:
            lines.append(_experts_line(r, e))
        lines.append("per-rank memory, traffic and step: the budget below, for the run as configured")
        return "\n".join(lines)
    lines += [
        "per rank                      fullest rank      rank 0",
        f"  master weights        {_gib(r.param_bytes_max):>16}  {_gib(r.param_bytes_rank0):>12}"
        f"   ({_count(r.numel_max)} params; emptiest rank {_count(r.numel_min)})",
        f"  gradients             {_gib(r.grad_bytes_max):>16}  {_gib(r.grad_bytes_rank0):>12}",
        f"  AdamW moments         {_gib(r.optimizer_bytes_max):>16}  {_gib(r.optimizer_bytes_rank0):>12}",
        f"  total                 {_gib(r.total_bytes_max):>16}  "
        f"{_gib(r.param_bytes_rank0 + r.grad_bytes_rank0 + r.optimizer_bytes_rank0):>12}",
        f"largest gathered layer    {r.largest_layer}: {_gib(r.largest_layer_bytes)} "
        "(compute form: FSDP-gathered, experts EP-local)",
        f"largest gathered tensor   {r.largest_tensor}: {_gib(r.largest_tensor_bytes)}",
    ]
    if e is not None:
        lines.append(_experts_line(r, e))
    lines += [
        "FSDP traffic per step (bytes received by the fullest rank, one micro-batch)",
        f"  all-gather forward    {_gib(r.allgather_fwd_bytes):>16}",
        f"  all-gather backward   {_gib(r.allgather_bwd_bytes):>16}   (reshard after forward / recompute)",
        f"  reduce-scatter grads  {_gib(r.reduce_scatter_bytes):>16}",
        f"  all-reduce grads      {_gib(r.all_reduce_bytes):>16}   (over mesh dims that replicate a parameter)",
        f"  total                 {_gib(r.comm_bytes):>16}",
        f"planned in {r.seconds:.2f} s",
    ]
    return "\n".join(lines)


def _experts_line(r: PlanReport, e: ExpertPlacement) -> str:
    if not e.mesh_dims:
        return f"experts                   all {e.num_experts} gathered on every rank in compute (no EP)"
    n = len(e.ranges)
    shown = ", ".join(f"{c}: {a}-{b - 1}" for c, (a, b) in enumerate(e.ranges[:2]))
    last = e.ranges[-1]
    return (f"experts                   {e.num_experts} over {'·'.join(e.mesh_dims)} ({n} EP ranks): "
            f"{e.per_rank} per rank; EP coordinate {shown}, ..., {n - 1}: {last[0]}-{last[1] - 1}; "
            f"rank {r.world_size - 1} holds {e.experts_of_rank(r.world_size - 1).start}-"
            f"{e.experts_of_rank(r.world_size - 1).stop - 1}")
