"""Meshes, sharded train states and the mesh runtime ``train_step`` uses: FSDP gathers, EP dispatch, CP exchanges.

Every mesh dim splits the data (``fsdp``, ``ep``, ``dp_replicate`` split the batch rows, ``cp`` the sequence), so a
parameter's gradient is the *sum* over every rank of its local contribution: gathered and replicated dims reduce
(reduce-scatter / all-reduce) in backward, EP-local expert dims keep their shard. Collectives are explicit
autograd functions on local tensors (shard_map style); parameters and optimizer moments live as DTensors.
"""

import contextlib
import functools
import weakref

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from q38.layers.context import SeqInfo
from q38.layers.moe import swiglu_grouped
from q38.parallel.layout import Layout
from q38.pytree import named_leaves
from q38.batch import StepBatch


# ---- differentiable collectives on local tensors ------------------------------------------------------------------


def _ag(x: Tensor, dim: int, group, sizes=None) -> Tensor:
    """All-gather equal shards (``sizes`` None) or DTensor's uneven ``torch.chunk`` shards (zero-padded for the
    collective, trimmed after) along ``dim``."""
    if sizes is None:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)
    full = max(sizes)
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, full - x.shape[dim]]
    xp = F.pad(x, pad).contiguous()
    parts = [torch.empty_like(xp) for _ in sizes]
    dist.all_gather(parts, xp, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def _rs(g: Tensor, dim: int, group, sizes=None) -> Tensor:
    """Reduce-scatter (sum): the backward of ``_ag``."""
    if sizes is None:
        chunks = [c.contiguous() for c in g.chunk(dist.get_world_size(group), dim=dim)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=group)
        return out
    full = max(sizes)
    chunks = []
    for c in g.split(list(sizes), dim=dim):
        pad = [0, 0] * (g.dim() - 1 - dim) + [0, full - c.shape[dim]]
        chunks.append(F.pad(c, pad).contiguous())
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=group)
    return out.narrow(dim, 0, sizes[dist.get_rank(group)])


@attrs.frozen
class _Step:
    """One collective of a parameter's gather: ``gather`` (all-gather along ``dim``; backward reduce-scatter) or
    ``sum`` (identity; backward all-reduce, for a dim the parameter is replicated on)."""

    kind: str
    group: object
    dim: int = 0
    sizes: tuple | None = None  # uneven torch.chunk sizes, None when even
    name: str = ""  # the mesh dim


def _gather_forward(x: Tensor, steps: tuple, dtype, prefetched=None) -> Tensor:
    """The compute form of a local shard: cast to ``dtype`` first (gathers move ``dtype`` bytes), then gather."""
    y = x.to(dtype)
    for st in steps:
        if st.kind != "gather":
            continue
        if prefetched is not None:  # the first gather was started early (MeshParallel.prefetch)
            work, parts = prefetched
            prefetched = None
            work.wait()
            y = torch.cat(parts, dim=st.dim)
        else:
            y = _ag(y, st.dim, st.group, st.sizes)
    return y


class _GatherParam(torch.autograd.Function):
    """A parameter shard → its compute form, as FSDP2's mixed-precision policy does it: the fp32 master shard is cast
    to ``param_dtype`` *before* the gathers; backward casts the gradient to ``reduce_dtype`` and runs the
    reduce-scatters / all-reduces in reverse order, returning the shard's gradient in the master dtype. Nothing
    is saved for backward (the gathered tensor is not kept by this function)."""

    @staticmethod
    def forward(ctx, x, steps, param_dtype, reduce_dtype, prefetched):
        ctx.steps, ctx.reduce_dtype, ctx.in_dtype = steps, reduce_dtype, x.dtype
        y = _gather_forward(x, steps, param_dtype, prefetched)
        return x.view_as(x) if y is x else y

    @staticmethod
    def backward(ctx, g):
        g = g.to(ctx.reduce_dtype)
        for st in reversed(ctx.steps):
            if st.kind == "gather":
                g = _rs(g, st.dim, st.group, st.sizes)
            else:
                g = g.contiguous().clone()
                dist.all_reduce(g, group=st.group)
        return g.to(ctx.in_dtype), None, None, None, None


class _Regather:
    """How to rebuild one gathered parameter for backward (reshard-after-forward): its local shard and steps.
    The rebuilt tensor is shared by every saved view of it while it is alive."""

    def __init__(self, shard: Tensor, steps: tuple, dtype, gathered: Tensor):
        from torch.multiprocessing.reductions import StorageWeakRef

        self.shard, self.steps, self.dtype = shard, steps, dtype
        self.storage = StorageWeakRef(gathered.untyped_storage())
        self.nbytes = gathered.untyped_storage().nbytes()
        self.cached = None
        self.regathers = 0

    def alive(self) -> bool:
        return not self.storage.expired()

    def full(self) -> Tensor:
        t = self.cached() if self.cached is not None else None
        if t is None:
            with torch.no_grad():
                t = _gather_forward(self.shard, self.steps, self.dtype)
            self.cached = weakref.ref(t)
            self.regathers += 1
        return t


@attrs.frozen
class _Resharded:
    """What a saved gathered parameter (or a view of it) is packed into: the recipe and the view's geometry."""

    src: _Regather
    size: tuple
    stride: tuple
    offset: int



class _AllGather(torch.autograd.Function):
    """Forward: concatenate every rank's equal-size shard along ``dim``. Backward: reduce-scatter (sum).

    Used for CP activation gathers (each rank gets back the summed gradient of its own slice) and for the EP
    balance copies of expert weights; parameters go through ``_GatherParam``."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _ag(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _rs(g, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """Uneven ``all_to_all_single`` whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty((sum(ctx.in_splits), *g.shape[1:]))
        dist.all_to_all_single(out, g.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


@functools.lru_cache(maxsize=16)
def _keep_local_dims(layout: Layout, sizes: tuple, shapes: tuple) -> tuple[frozenset, ...]:
    """Per leaf, the mesh dims that stay sharded in compute form. Resolved once per (layout, mesh, shapes), not on
    every step."""
    pl = layout.placements_of_shapes(list(shapes), dict(sizes))
    names = [n for n, _ in sizes]
    return tuple(
        frozenset(n for n, d in zip(names, pl[path].shard_dims(compute=True)) if d is not None) for path, _ in shapes
    )


def _chunk_sizes(n: int, k: int) -> list[int]:
    """``torch.chunk`` sizes of ``n`` rows over ``k`` parts (DTensor ``Shard``): ceil-sized, trailing may be 0."""
    full = -(-n // k)
    return [max(0, min(n, full * (c + 1)) - full * c) for c in range(k)]


# ---- the mesh ----------------------------------------------------------------------------------------------------


@attrs.frozen
class Mesh:
    """A q38 mesh: the DeviceMesh, its layout and the runtime ``train_step`` uses (``mesh.parallel``)."""

    device_mesh: DeviceMesh
    layout: Layout
    sizes: dict

    @property
    def parallel(self) -> "MeshParallel":
        return MeshParallel(self)

    def runtime(self, train_config=None) -> "MeshParallel":
        """The runtime for one step; EP balance options come from the train config."""
        if train_config is None:
            return MeshParallel(self)
        tc = train_config
        return MeshParallel(self, tc.enable_ep_balance, tc.max_dup_experts_num, getattr(tc, "fsdp_prefetch", None),
                            param_dtype=tc.torch_param_dtype, reduce_dtype=tc.torch_reduce_dtype,
                            reshard_after_forward=tc.reshard_after_forward)

    def group(self, name: str):
        return self.device_mesh.get_group(name)

    def size(self, name: str) -> int:
        return self.sizes.get(name, 1)

    def local_rank(self, name: str) -> int:
        return self.device_mesh.get_local_rank(name) if self.size(name) > 1 else 0


def make_mesh(layout: Layout, world_size: int | None = None, device_type: str = "cpu") -> Mesh:
    """``init_device_mesh`` over the layout's mesh dims (sizes resolved against ``world_size``)."""
    world_size = world_size if world_size is not None else dist.get_world_size()
    sizes = layout.resolve_mesh(world_size)
    names = tuple(sizes)
    dm = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    return Mesh(dm, layout, dict(sizes))


def _placements(mesh: Mesh, params) -> dict:
    return mesh.layout.placements(params, mesh.sizes)


def _param_suffix(path: str) -> str | None:
    """The parameter path a leaf path ends in (``exp_avg.layers.0.moe.we_down`` → ``layers.0.moe.we_down``), or
    None when no layer declares such a parameter (a step count, a router bias)."""
    from q38.model import declared_params, generic_path

    parts = path.split(".")
    for i in range(len(parts)):
        cand = ".".join(parts[i:])
        if generic_path(cand) in declared_params():
            return cand
    return None


def shard(tree, mesh: Mesh, layout: Layout | None = None):
    """Place every leaf of ``tree`` whose path ends in a parameter path (the parameters, the optimizer moments, any
    tree keyed by parameter path) as a DTensor per the layout; values are the unsharded ones. Other leaves (the step
    count, the router bias: identical on every rank) are left as they are."""
    import torch.utils._pytree as pytree

    if layout is not None and layout != mesh.layout:
        mesh = Mesh(mesh.device_mesh, layout, dict(layout.resolve_mesh(mesh.device_mesh.size())))
        if tuple(mesh.sizes) != tuple(mesh.device_mesh.mesh_dim_names or ()):
            raise ValueError(
                f"layout {layout.name!r} has mesh dims {tuple(mesh.sizes)} but the mesh was built with "
                f"{mesh.device_mesh.mesh_dim_names}; build the mesh from this layout (make_mesh(layout, world))"
            )
    named = named_leaves(tree)
    params = {}
    for path, t in named:
        q = _param_suffix(path)
        if q is not None:
            params.setdefault(q, tuple(t.shape))
    pl = mesh.layout.placements_of_shapes(list(params.items()), mesh.sizes)
    flat, spec = pytree.tree_flatten(tree)
    out = []
    for (path, _), t in zip(named, flat):
        q = _param_suffix(path)
        out.append(t if q is None else distribute_tensor(t, mesh.device_mesh, pl[q].dtensor_placements()))
    return pytree.tree_unflatten(out, spec)


def init_sharded(model_config, mesh: Mesh, *, seed: int = 0, device=None, dtype=None):
    """Fresh parameters whose every rank materialises only its own shards (never the full model): values equal
    ``shard(init_params(...))`` because initial values are drawn per parameter path and row block."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from q38.layers.common import materialize
    from q38.model import abstract_params, is_param_info
    from q38.pytree import tree_map_with_path

    abstract = abstract_params(model_config)
    pl = mesh.layout.placements(abstract, mesh.sizes)

    def make(path, info):
        placements = pl[path].dtensor_placements()
        shape, offset = compute_local_shape_and_global_offset(info.shape, mesh.device_mesh, placements)
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        local = materialize(info, path, seed=seed, device=device, dtype=dtype, index=index)
        return DTensor.from_local(
            local, mesh.device_mesh, placements, run_check=False, shape=torch.Size(info.shape),
            stride=torch.empty(info.shape, device="meta").stride(),
        )

    return tree_map_with_path(make, abstract, is_leaf=is_param_info)


def unshard(tree):
    """Every DTensor leaf of ``tree`` as a full tensor on every rank (for checks and Hugging Face export)."""
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, tree)


def shard_batch(batch: dict, mesh: Mesh, mtp_depths: int, *, local_rows: bool = False) -> StepBatch:
    """This rank's part of a global batch (the same on every rank): rows split over the batch dims, the sequence
    over ``cp`` (contiguous). Shifts and positions are computed on whole rows first, so they cross CP borders.
    ``local_rows``: ``batch`` already holds only this rank's rows (``batch_row_rank``); only the sequence is split."""
    import torch.utils._pytree as pytree

    from q38.batch import prepare_batch

    full = prepare_batch(batch["input_ids"], batch["labels"], batch.get("doc_ids"), mtp_depths,
                         batch.get("attention_mask"))
    b, s = full.input_ids.shape
    row_dims = [d for d in mesh.layout.batch_mesh_dims if mesh.size(d) > 1]
    n_rows, r = 1, 0
    for d in row_dims:
        r = r * mesh.size(d) + mesh.local_rank(d)
        n_rows *= mesh.size(d)
    if b % n_rows and not local_rows:
        raise ValueError(f"global batch of {b} rows does not split over {n_rows} data-parallel ranks ({row_dims})")
    cp = mesh.size("cp")
    if s % cp:
        raise ValueError(f"sequence length {s} is not divisible by the cp size {cp}")
    rows = slice(None) if local_rows else slice(r * (b // n_rows), (r + 1) * (b // n_rows))
    c = mesh.local_rank("cp")
    cols = slice(c * (s // cp), (c + 1) * (s // cp))

    return pytree.tree_map(lambda t: t[rows, cols].contiguous(), full)


def batch_row_rank(mesh: Mesh) -> tuple[int, int]:
    """(this rank's index, count) over the batch mesh dims: the data-parallel row group ``shard_batch`` keeps."""
    n_rows, r = 1, 0
    for d in mesh.layout.batch_mesh_dims:
        if mesh.size(d) > 1:
            r = r * mesh.size(d) + mesh.local_rank(d)
            n_rows *= mesh.size(d)
    return r, n_rows


# ---- CP exchanges ----------------------------------------------------------------------------------------------


class CPComm:
    """Sequence exchanges over the ``cp`` group (contiguous split, rank order = sequence order)."""

    is_local = False

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def all_gather_seq(self, x: Tensor, dim: int) -> Tensor:
        if x.is_floating_point() and x.requires_grad:
            return _AllGather.apply(x, dim, self.group)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def prev_tail(self, x: Tensor, n: int, dim: int) -> Tensor:
        tail = x.narrow(dim, x.shape[dim] - n, n)
        tails = self.all_gather_seq(tail, dim).chunk(self.size, dim=dim)
        if self.rank == 0:  # `* 0` keeps the gather in this rank's graph: its backward is a collective every rank joins
            return tails[0] * 0
        return tails[self.rank - 1]

    def gdn_carry(self, state_zero: Tensor, transition: Tensor, doc_ids: Tensor) -> Tensor:
        s_all = self.all_gather_seq(state_zero[None], 0)  # [cp, b, h, a, p]
        t_all = self.all_gather_seq(transition[None], 0)  # [cp, b, h, a, a]
        ends = torch.stack([doc_ids[:, 0], doc_ids[:, -1]], dim=0)[None]  # [1, 2, b]
        ends_all = self.all_gather_seq(ends, 0)  # [cp, 2, b]
        # Every rank's graph must use the gathered tensors (their backward is a collective): start from an exact 0
        # that depends on them.
        init = (s_all.sum() + t_all.sum()) * 0 * state_zero.new_zeros(state_zero.shape)
        for r in range(1, self.rank + 1):
            cont = (ends_all[r - 1, 1] == ends_all[r, 0]).to(init.dtype)[:, None, None, None]
            init = cont * (t_all[r - 1] @ init + s_all[r - 1])
        return init


# ---- EP dispatch -----------------------------------------------------------------------------------------------


def plan_ep_balance(load_e: list[float], ep: int, e_local: int, max_dup: int) -> dict[int, list[tuple[int, float]]]:
    """Greedy EP balance plan (deterministic, identical on every rank).

    Repeatedly copies the hottest expert replica of the most loaded rank into a spare slot of the least loaded rank
    (at most ``max_dup`` copies per rank), moving as much of its load as evens the two ranks out. Returns, for every
    expert with copies, its replicas ``[(rank, share of the expert's tokens)]`` with the owner first.
    """
    rank_load = [sum(load_e[r * e_local : (r + 1) * e_local]) for r in range(ep)]
    replicas: dict[int, list[list]] = {e: [[e // e_local, float(load_e[e])]] for e in range(len(load_e))}
    used = [0] * ep
    for _ in range(ep * max_dup):
        hot = max(range(ep), key=lambda r: (rank_load[r], -r))
        spare = [r for r in range(ep) if used[r] < max_dup and r != hot]
        if not spare:
            break
        cold = min(spare, key=lambda r: (rank_load[r], r))
        cands = [(rep[1], e, i) for e, reps in replicas.items() for i, rep in enumerate(reps)
                 if rep[0] == hot and all(x[0] != cold for x in reps)]
        if not cands:
            break
        cur, e, i = max(cands, key=lambda c: (c[0], -c[1]))
        move = min(cur / 2, (rank_load[hot] - rank_load[cold]) / 2)
        if move < 1:
            break
        replicas[e][i][1] -= move
        replicas[e].append([cold, move])
        rank_load[hot] -= move
        rank_load[cold] += move
        used[cold] += 1
    return {
        e: [(r, ld / max(float(load_e[e]), 1e-9)) for r, ld in reps]
        for e, reps in replicas.items() if len(reps) > 1
    }


class EPDispatch:
    """Send each routed slot to the rank owning its expert (uneven all-to-all), run local experts, send back.

    With ``balance`` (EP balance), hot experts are copied into up to ``max_dup`` spare slots per rank from the
    layer's global load; the copies' weights come through an autograd all-gather, so their gradients are summed
    back into the originals by its reduce-scatter. Only where the work runs changes, not the math.
    """

    def __init__(self, group, rank: int, size: int, balance: bool = False, max_dup: int = 2):
        self.group, self.rank, self.size = group, rank, size
        self.balance, self.max_dup = balance, max_dup
        self.loads: list[int] = []  # max per-rank received slots, one entry per call (for reports and tests)
        self.copies: list[int] = []  # with balance: expert copies the plan made, one entry per call

    def __call__(self, x_md, expert_m, p, cfg):
        e_local = p.we_gate_up.shape[0]
        w_gu, w_dn = p.we_gate_up, p.we_down
        dest = torch.div(expert_m, e_local, rounding_mode="floor")
        local_idx = expert_m - dest * e_local
        if self.balance:
            dest, local_idx, w_gu, w_dn = self._balance(expert_m, dest, local_idx, w_gu, w_dn, cfg.num_experts)
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=self.size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        load = torch.tensor(sum(recv_l), device=x_md.device)
        dist.all_reduce(load, op=dist.ReduceOp.MAX, group=self.group)
        self.loads.append(int(load))
        x_recv = _AllToAll.apply(x_md[order], recv_l, send_l, self.group)
        e_recv = torch.empty(sum(recv_l), dtype=expert_m.dtype, device=expert_m.device)
        dist.all_to_all_single(e_recv, local_idx[order].contiguous(), recv_l, send_l, group=self.group)
        o = torch.argsort(e_recv, stable=True)
        counts = torch.bincount(e_recv, minlength=w_gu.shape[0])
        y = swiglu_grouped(x_recv[o], counts, w_gu, w_dn, cfg.use_grouped_expert_matmul)
        y_recv = torch.empty_like(y).index_copy(0, o, y)
        y_sorted = _AllToAll.apply(y_recv, send_l, recv_l, self.group)
        return torch.empty_like(y_sorted).index_copy(0, order, y_sorted)

    def _balance(self, expert_m, dest, local_idx, w_gu, w_dn, num_experts):
        e_local = w_gu.shape[0]
        load = torch.bincount(expert_m, minlength=num_experts).float()
        dist.all_reduce(load, group=self.group)
        plan = plan_ep_balance(load.tolist(), self.size, e_local, self.max_dup)
        self.copies.append(sum(len(reps) - 1 for reps in plan.values()))
        if not plan:
            return dest, local_idx, w_gu, w_dn
        # Copies: which experts each owner sends, and where each copy lands in its host's weight table.
        sent = {o: sorted(e for e, reps in plan.items() if reps[0][0] == o) for o in range(self.size)}
        width = max(len(v) for v in sent.values())
        mine = sent[self.rank]
        pad = width - len(mine)
        idx = torch.tensor([e - self.rank * e_local for e in mine], dtype=torch.long, device=w_gu.device)
        gu_send = torch.cat([w_gu.index_select(0, idx), w_gu.new_zeros(pad, *w_gu.shape[1:])])
        dn_send = torch.cat([w_dn.index_select(0, idx), w_dn.new_zeros(pad, *w_dn.shape[1:])])
        gu_all = _AllGather.apply(gu_send, 0, self.group)  # backward: copies' grads reduce-scattered to owners
        dn_all = _AllGather.apply(dn_send, 0, self.group)
        host_slot: dict[tuple[int, int], int] = {}
        extra = {r: [] for r in range(self.size)}
        for e in sorted(plan):
            for r, _ in plan[e][1:]:
                host_slot[(e, r)] = e_local + len(extra[r])
                extra[r].append(plan[e][0][0] * width + sent[plan[e][0][0]].index(e))
        if extra[self.rank]:
            pick = torch.tensor(extra[self.rank], dtype=torch.long, device=w_gu.device)
            w_gu = torch.cat([w_gu, gu_all.index_select(0, pick)])
            w_dn = torch.cat([w_dn, dn_all.index_select(0, pick)])
        else:  # keep the gathered copies in this rank's graph: their backward is a collective every rank joins
            w_gu = w_gu + gu_all.sum() * 0
            w_dn = w_dn + dn_all.sum() * 0
        # Route this rank's slots of each copied expert to its replicas in proportion to the plan's shares.
        dest, local_idx = dest.clone(), local_idx.clone()
        for e, reps in plan.items():
            pos = torch.nonzero(expert_m == e).flatten()
            n = pos.numel()
            if n == 0:
                continue
            bounds, acc = [0], 0.0
            for _, share in reps:
                acc += share
                bounds.append(min(n, round(acc * n)))
            bounds[-1] = n
            for j, (r, _) in enumerate(reps[1:], start=1):
                sl = pos[bounds[j] : bounds[j + 1]]
                dest[sl] = r
                local_idx[sl] = host_slot[(e, r)]
        return dest, local_idx, w_gu, w_dn


# ---- the runtime -----------------------------------------------------------------------------------------------


class MeshParallel:  # implements q38.layers.context.StepRuntime
    is_local = False

    def __init__(self, mesh: Mesh, ep_balance: bool = False, max_dup_experts: int = 2, prefetch: bool | None = None,
                 *, param_dtype=torch.float32, reduce_dtype=torch.float32, reshard_after_forward: bool = True):
        self.mesh = mesh
        # Prefetch the next layer's FSDP gathers on accelerators (overlap); on CPU only when asked (tests).
        self.prefetch_enabled = mesh.device_mesh.device_type != "cpu" if prefetch is None else prefetch
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        dt = mesh.device_mesh.device_type
        self.device = torch.device(dt) if dt == "cpu" else torch.device(dt, getattr(torch, dt).current_device())
        self.reshard_after_forward = reshard_after_forward
        names = list(mesh.sizes)
        self.dims = [(i, n, mesh.sizes[n]) for i, n in enumerate(names)]
        self.ep_size = mesh.size("ep")
        self.dispatch = (
            EPDispatch(mesh.group("ep"), mesh.local_rank("ep"), self.ep_size, ep_balance, max_dup_experts)
            if self.ep_size > 1 else None
        )
        cp = mesh.size("cp")
        self.comm = CPComm(mesh.group("cp"), mesh.local_rank("cp"), cp) if cp > 1 else None
        self._keep_local: dict[int, set] = {}
        self._pending: dict[int, tuple] = {}  # id(leaf) -> (mesh dim name, work, parts) of a prefetched gather
        self.prefetched = 0  # prefetched gathers consumed (reported in Gradients, checked by the tests)
        # Every compute-form tensor made by gather() in this step (storage weak refs): what reshard-after-forward
        # frees and rebuilds, and what tests measure (live_gathered_bytes).
        self.gathered: list[_Regather] = []
        self._by_storage: dict[int, _Regather] = {}

    def bind(self, params) -> None:
        """Record, per parameter leaf, the mesh dims that stay sharded in compute form (the layout's ``compute``
        map, e.g. experts on ``ep``); every other sharded dim is all-gathered just in time."""
        self._pending.clear()
        leaves = named_leaves(params)
        shapes = tuple((path, tuple(leaf.shape)) for path, leaf in leaves)
        keep = _keep_local_dims(self.mesh.layout, tuple(self.mesh.sizes.items()), shapes)
        for (path, leaf), dims in zip(leaves, keep):
            self._keep_local[id(leaf)] = dims

    def seq_info(self, mb: StepBatch) -> SeqInfo:
        from q38.layers.context import LocalSeqComm

        s = mb.doc_ids.shape[1]
        packed = bool((mb.doc_ids[:, 1:] != mb.doc_ids[:, :-1]).any()) if s > 1 else False
        return SeqInfo(mb.doc_ids, mb.positions, mb.seq_idx, packed, self.comm or LocalSeqComm())

    def _gather_dims(self, t) -> list[tuple[str, int]]:
        """(mesh dim, tensor dim) pairs this leaf all-gathers, innermost mesh dim first."""
        keep = self._keep_local[id(t)]
        return [
            (name, pl.dim) for (i, name, size), pl in reversed(list(zip(self.dims, t.placements)))
            if size > 1 and isinstance(pl, Shard) and name not in keep
        ]

    def prefetch(self, tree) -> None:
        """Start the all-gathers of ``tree`` (the next layer) now, so they overlap the current layer's compute
        (on accelerators the collective runs on its own stream). Leaves gathered over one mesh dim are prefetched
        (cast to ``param_dtype`` first, like every gather); the gather that consumes them waits, and its backward
        is the usual reduce-scatter."""
        import torch.utils._pytree as pytree

        for t in pytree.tree_leaves(tree):
            if not isinstance(t, DTensor) or id(t) in self._pending or id(t) not in self._keep_local:
                continue
            dims = self._gather_dims(t)
            if len(dims) != 1 or t.shape[dims[0][1]] % self.mesh.sizes[dims[0][0]]:
                continue
            name, dim = dims[0]
            x = t.to_local().detach().to(self.param_dtype).contiguous()
            parts = [torch.empty_like(x) for _ in range(self.mesh.sizes[name])]
            work = dist.all_gather(parts, x, group=self.mesh.group(name), async_op=True)
            self._pending[id(t)] = (name, work, parts)

    def _steps(self, t) -> tuple:
        """The collectives that bring leaf ``t`` into compute form, innermost mesh dim first: gather its sharded
        dims (except the compute-local ones), sum its gradient over the dims it is replicated on."""
        keep = self._keep_local[id(t)]
        steps = []
        for i, name, size in reversed(self.dims):
            if size == 1:
                continue
            pl = t.placements[i]
            if isinstance(pl, Shard) and name in keep:
                continue
            if isinstance(pl, Shard):
                total = self._level_size(t, i, pl.dim)
                sizes = None if total % size == 0 else tuple(_chunk_sizes(total, size))
                steps.append(_Step("gather", self.mesh.group(name), pl.dim, sizes, name))
            else:
                steps.append(_Step("sum", self.mesh.group(name), name=name))
        return tuple(steps)

    def _gather_one(self, t):
        if not isinstance(t, DTensor):
            return t.to(self.param_dtype) if t.is_floating_point() else t
        if id(t) not in self._keep_local:
            raise RuntimeError("MeshParallel.gather: parameter not bound; call bind(params) first")
        x = t.to_local(grad_placements=t.placements)
        steps = self._steps(t)
        prefetched = None
        pending = self._pending.get(id(t))
        first = next((st for st in steps if st.kind == "gather"), None)
        if pending is not None and first is not None and first.name == pending[0]:
            del self._pending[id(t)]
            self.prefetched += 1
            prefetched = (pending[1], pending[2])
        if not steps:
            y = x.to(self.param_dtype)
        else:
            y = _GatherParam.apply(x, steps, self.param_dtype, self.reduce_dtype, prefetched)
        if y is not x and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            entry = _Regather(x.detach(), steps, self.param_dtype, y)
            self.gathered.append(entry)
            self._by_storage[y.untyped_storage().data_ptr()] = entry
        return y

    # -- reshard after forward: saved gathered parameters are dropped and rebuilt for backward -----------------

    def _pack(self, t: Tensor):
        try:
            entry = self._by_storage.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return t
        if entry is None or not entry.alive() or t.dtype != entry.dtype:
            return t
        return _Resharded(entry, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    @staticmethod
    def _unpack(h):
        if isinstance(h, _Resharded):
            return h.src.full().as_strided(h.size, h.stride, h.offset)
        return h

    def ep_stats(self) -> tuple[tuple, tuple]:
        d = self.dispatch
        return (tuple(d.loads), tuple(d.copies)) if d is not None else ((), ())

    def saved_tensor_hooks(self):
        """A context for one layer's forward (no recompute): tensors saved for backward that are (views of) a
        gathered parameter are kept as their shard and re-gathered when backward needs them, so each gathered
        layer is freed after its forward (FSDP reshard-after-forward). None when ``reshard_after_forward`` is off
        or nothing is gathered on this mesh."""
        if not self.reshard_after_forward:
            return None
        return functools.partial(torch.autograd.graph.saved_tensors_hooks, self._pack, self._unpack)

    def live_gathered_bytes(self) -> int:
        """Bytes of compute-form (gathered / cast) parameters of this step that are still allocated."""
        return sum(e.nbytes for e in self.gathered if e.alive())

    def regathers(self) -> int:
        return sum(e.regathers for e in self.gathered)

    def _level_size(self, t, mesh_i: int, dim: int) -> int:
        """Size of tensor dim ``dim`` before splitting over mesh dim ``mesh_i`` (DTensor splits mesh dims in order,
        each by ``torch.chunk`` of what the previous ones left on this rank)."""
        n = t.shape[dim]
        for j, (_, name, size) in enumerate(self.dims):
            if j == mesh_i:
                return n
            pl = t.placements[j]
            if size > 1 and isinstance(pl, Shard) and pl.dim == dim:
                n = _chunk_sizes(n, size)[self.mesh.local_rank(name)]
        return n

    def gather(self, tree):
        import torch.utils._pytree as pytree

        return pytree.tree_map(self._gather_one, tree)

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        t = torch.as_tensor(t, device=self.device).detach().clone()
        dist.all_reduce(t)
        return t

    def seq_all_reduce_sum(self, t: Tensor) -> Tensor:
        """Sum over the CP group (the ranks holding other parts of the same rows); identity without CP."""
        t = torch.as_tensor(t).detach().clone()
        if self.comm is not None:
            dist.all_reduce(t, group=self.comm.group)
        return t

    def grad_sq_norm(self, grads) -> Tensor:
        total = torch.zeros((), device=self.device)
        for g in grads:
            if isinstance(g, DTensor):
                local = g.to_local().float().pow(2).sum()
                # each distinct shard is held by the ranks along replicated dims: count it once
                reps = 1
                for (i, name, size), pl in zip(self.dims, g.placements):
                    if not isinstance(pl, Shard):
                        reps *= size
                total = total + local / reps
            else:
                total = total + g.float().pow(2).sum() / dist.get_world_size()
        return self.all_reduce_sum(total)
