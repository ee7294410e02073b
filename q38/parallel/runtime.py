"""The mesh runtime ``train_step`` uses (``MeshRuntime``, a ``q38.layers.context.StepRuntime``): FSDP gathers just in
time (prefetched a layer early, gradients reduced async: docs/parallel.md#communication-overlap), composed with the pieces in their own files by role:
``collectives`` (differentiable collectives, the mixed-precision gather), ``mesh`` (meshes, ``shard`` / ``unshard``,
``shard_batch``), ``ep`` (expert dispatch and balance), ``cp`` (sequence exchanges). ``mesh_runtime(mesh,
train_config)`` builds the runtime of one step; a ``Mesh`` is plain data and knows nothing of it.

Every mesh dim splits the data (``fsdp``, ``ep``, ``dp_replicate`` split the batch rows, ``cp`` the sequence), so a
parameter's gradient is the *sum* over every rank of its local contribution: gathered and replicated dims reduce
(reduce-scatter / all-reduce) in backward, EP-local expert dims keep their shard.
"""

import functools

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from q38.layers.context import SeqInfo
from q38.parallel.layout import Layout
from q38.pytree import named_leaves
from q38.batch import StepBatch

from q38.parallel import links
from q38.parallel.collectives import _chunk_sizes, _gather_forward, _GatherParam, _Reductions, _Regather, _Resharded, _Step
from q38.parallel.cp import CPComm
from q38.parallel.ep import EPDispatch
from q38.parallel.mesh import Mesh


@functools.lru_cache(maxsize=16)
def _keep_local_dims(layout: Layout, sizes: tuple, shapes: tuple) -> tuple[frozenset, ...]:
    """Per leaf, the mesh dims that stay sharded in compute form. Resolved once per (layout, mesh, shapes), not on
    every step."""
    pl = layout.placements_of_shapes(list(shapes), dict(sizes))
    names = [n for n, _ in sizes]
    return tuple(
        frozenset(n for n, d in zip(names, pl[path].shard_dims(compute=True)) if d is not None) for path, _ in shapes
    )


# ---- the runtime -----------------------------------------------------------------------------------------------


class MeshRuntime:  # implements q38.layers.context.StepRuntime
    is_local = False

    def __init__(self, mesh: Mesh, ep_balance: bool = False, max_dup_experts: int = 2, prefetch: bool | None = None,
                 *, param_dtype=torch.float32, reduce_dtype=torch.float32, reshard_after_forward: bool = True,
                 overlap: bool = True, ep_dispatch: str = "flat", ep_overlap: bool = True, compute_dtype=None):
        self.mesh = mesh
        # the ranks all_reduce_sum and grad_sq_norm sum over: every rank (None), or a pipeline stage's ranks
        self.group = None
        # compute_dtype(path): a leaf's compute dtype (train.fp32_params keeps some fp32); None: param_dtype for all
        self._compute_dtype = compute_dtype
        self._dtype_of: dict[int, torch.dtype] = {}
        # Communication overlap (train.overlap_comm): prefetch the next layer's gathers, and reduce gradients async
        # when the caller takes them through grad() (bind(..., defer_reductions=True)). ``prefetch`` None follows it.
        self.overlap = overlap
        self.prefetch_enabled = overlap if prefetch is None else prefetch
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        dt = mesh.device_mesh.device_type
        self.device = torch.device(dt) if dt == "cpu" else torch.device(dt, getattr(torch, dt).current_device())
        self.reshard_after_forward = reshard_after_forward
        names = list(mesh.sizes)
        self.dims = [(i, n, mesh.sizes[n]) for i, n in enumerate(names)]
        ep_size = mesh.size("ep")
        self.dispatch = (
            EPDispatch(mesh.group("ep"), mesh.local_rank("ep"), ep_size, ep_balance, max_dup_experts,
                       hierarchical=ep_dispatch == "hierarchical", overlap=ep_overlap)
            if ep_size > 1 else None
        )
        cp = mesh.size("cp")
        self.comm = CPComm(mesh.group("cp"), mesh.local_rank("cp"), cp, overlap) if cp > 1 else None
        self._keep_local: dict[int, frozenset] = {}
        self._steps_of: dict[int, tuple] = {}  # id(leaf) -> its collectives (``collectives(leaf)``)
        self._pending: dict[int, tuple] = {}  # id(leaf) -> (work, parts, when) of a prefetched gather
        # Prefetched gathers consumed (reported in Gradients, checked by the tests): started in forward a layer
        # ahead, and in backward as the recompute of the layer after it began.
        self.prefetched = 0
        self.prefetched_backward = 0
        self._reductions = _Reductions()
        self._reduce_bytes = 0  # the most input bytes of async reduce-scatters in flight at once, earlier binds
        self._anchor: Tensor | None = None  # set by bind(defer_reductions=True) when overlapping
        self._gather_calls = 0
        # Every compute-form tensor made by gather() in this step (storage weak refs): what reshard-after-forward
        # frees and rebuilds, and what tests measure (live_gathered_bytes).
        self.gathered: list[_Regather] = []
        self._by_storage: dict[int, _Regather] = {}

    def bind(self, params, defer_reductions: bool = False) -> None:
        """Record, per parameter leaf, the mesh dims that stay sharded in compute form (the layout's ``compute``
        map, e.g. experts on ``ep``; every other sharded dim is all-gathered just in time) and its collectives
        (the flattened groups they use are created here, in leaf order, the same on every rank).
        ``defer_reductions``: the caller takes gradients with ``grad()``, so with overlap on, backward issues the
        gradient reductions async and ``grad()`` waits them (a caller of plain ``autograd.grad`` leaves it off)."""
        self._pending.clear()
        leaves = named_leaves(params)
        shapes = tuple((path, tuple(leaf.shape)) for path, leaf in leaves)
        keep = _keep_local_dims(self.mesh.layout, tuple(self.mesh.sizes.items()), shapes)
        for (path, leaf), dims in zip(leaves, keep):
            self._keep_local[id(leaf)] = dims
            if self._compute_dtype is not None:
                self._dtype_of[id(leaf)] = self._compute_dtype(path)
            self._steps_of[id(leaf)] = self._steps(leaf) if isinstance(leaf, DTensor) else ()
        self._reduce_bytes = self.async_reduce_bytes
        self._reductions = _Reductions()
        defer = self.overlap and defer_reductions
        self._anchor = torch.zeros((), device=self.device, requires_grad=True) if defer else None

    @property
    def async_reductions(self) -> int:
        """Gradient reductions issued async from backward and waited after it (reported in Gradients)."""
        return self._reductions.issued

    @property
    def async_reduce_bytes(self) -> int:
        """The most bytes the async reduce-scatters in flight held at once in their input buffers (the full-size
        gradients awaiting their reduction), over the step's micro-batches (reported in Gradients)."""
        return max(self._reduce_bytes, self._reductions.most_bytes)

    @property
    def cp_early(self) -> int:
        """CP exchanges started async and waited where used (reported in Gradients; 0 without CP)."""
        return self.comm.early if self.comm is not None else 0

    def collectives(self, leaf) -> tuple[_Step, ...]:
        """The collectives that bring bound ``leaf`` into compute form (what the gathers run; tests and the plan)."""
        return self._steps_of[id(leaf)]

    def seq_info(self, mb: StepBatch) -> SeqInfo:
        from q38.layers.context import LocalSeqComm, is_packed

        return SeqInfo(mb.doc_ids, mb.positions, mb.seq_idx, is_packed(mb.doc_ids), self.comm or LocalSeqComm())

    def prefetch(self, tree, when: str = "ahead") -> None:
        """Start the all-gathers of ``tree`` (the next layer) now, so they overlap the current layer's compute
        (async: gloo runs it on its own thread, NCCL on its own stream). Each leaf's first gather is prefetched
        (cast to ``param_dtype`` first, like every gather): the whole gather when it is one collective (one mesh
        dim, or even shards of several mesh dims flattened into one group). Uneven (``torch.chunk``) gathers stay
        unprefetched (their padded parts are trimmed per mesh dim in ``_ag``). The gather that consumes a prefetch
        waits for it; its backward is the usual reduction. ``when`` says what the consumer is, for the counters:
        ``ahead`` (forward: the next layer; ``prefetched``), ``behind`` (backward, as a layer's recompute begins:
        the layer recomputed next; ``prefetched_backward``) or ``now`` (the layer about to run; not an overlap,
        not counted: see ``q38.model._checkpoint_prefetches``)."""
        import torch.utils._pytree as pytree

        for t in pytree.tree_leaves(tree):
            if not isinstance(t, DTensor) or id(t) in self._pending or id(t) not in self._steps_of:
                continue
            first = next((st for st in self._steps_of[id(t)] if st.kind == "gather"), None)
            if first is None or first.sizes is not None:
                continue
            x = t.to_local().detach().to(self._dt(t)).contiguous()
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size(first.group))]
            work = links.all_gather(parts, x, first.group, async_op=True)
            self._pending[id(t)] = (work, parts, when)

    def _steps(self, t) -> tuple:
        """The collectives that bring leaf ``t`` into compute form: gather its sharded dims (except the
        compute-local ones), innermost mesh dim first, then sum its gradient over the dims it is replicated on.
        Gathers of one tensor dim with even shards on every mesh dim run as one all-gather over their flattened
        group (the concatenation in group-rank order is DTensor's chunk order); uneven ones keep one step per
        mesh dim. The replicated dims' all-reduces run as one over their flattened group."""
        keep = self._keep_local[id(t)]
        gathers, summed = [], []
        for i, name, size in reversed(self.dims):
            if size == 1:
                continue
            pl = t.placements[i]
            if isinstance(pl, Shard) and name in keep:
                continue
            if isinstance(pl, Shard):
                total = self._level_size(t, i, pl.dim)
                sizes = None if total % size == 0 else tuple(_chunk_sizes(total, size))
                gathers.append(_Step("gather", self.mesh.group(name), pl.dim, sizes, (name,)))
            else:
                summed.append(name)
        if len(gathers) > 1 and all(st.sizes is None and st.dim == gathers[0].dim for st in gathers):
            names = tuple(n for st in reversed(gathers) for n in st.names)  # mesh order
            gathers = [_Step("gather", self.mesh.group_of(names), gathers[0].dim, None, names)]
        if summed:
            names = tuple(reversed(summed))
            gathers.append(_Step("sum", self.mesh.group_of(names), names=names))
        return tuple(gathers)

    def _take_prefetch(self, t) -> tuple | None:
        """The ``(work, parts)`` of ``t``'s prefetched first gather (None if it was not prefetched), counted as
        consumed by what it was started for (``prefetch``'s ``when``)."""
        pending = self._pending.pop(id(t), None)
        if pending is None:
            return None
        work, parts, when = pending
        self.prefetched += when == "ahead"
        self.prefetched_backward += when == "behind"
        return work, parts

    def _dt(self, t) -> torch.dtype:
        """The dtype bound leaf ``t`` is gathered in (``param_dtype`` unless ``compute_dtype`` keeps it fp32; an
        integer leaf, e.g. the e4m3 bits of a block-FP8 base, as it is stored)."""
        if not t.is_floating_point():
            return t.dtype
        return self._dtype_of.get(id(t), self.param_dtype)

    def _gather_one(self, t):
        dt = self._dt(t)
        if not isinstance(t, DTensor):
            return t.to(dt) if t.is_floating_point() else t
        if id(t) not in self._keep_local:
            raise RuntimeError("MeshRuntime.gather: parameter not bound; call bind(params) first")
        steps = self._steps_of[id(t)]
        pending = self._take_prefetch(t)
        if not t.requires_grad:  # a frozen leaf (a LoRA run's base): gathered outside autograd, never reduced
            x = t.to_local().detach()
            with torch.no_grad():
                y = _gather_forward(x, steps, dt, pending)
        elif not steps:
            x = t.to_local(grad_placements=t.placements)
            y = x.to(dt)
        elif self._anchor is not None:  # the shard leaves autograd; its reduced gradient comes back through grad()
            x = t.to_local().detach()
            y = _GatherParam.apply(self._anchor, x, steps, dt, self.reduce_dtype, pending,
                                   self._reductions, (id(t), self._gather_calls))
        else:
            x = t.to_local(grad_placements=t.placements)
            y = _GatherParam.apply(None, x, steps, dt, self.reduce_dtype, pending, None, None)
        if y is not x and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            entry = _Regather(x.detach(), steps, dt, y)
            self.gathered.append(entry)
            self._by_storage[y.untyped_storage().data_ptr()] = entry
        return y

    def grad(self, loss: Tensor | list, leaves: list, grad_outputs: list | None = None) -> tuple:
        """``autograd.grad(loss, leaves)`` (None for a leaf without gradient); ``loss`` may be a list of outputs
        with their ``grad_outputs`` (a pipeline chunk: its losses and the gradients of the activations it sent on). With deferred reductions, backward
        has only issued each gathered leaf's reduction: they are waited here, after the whole backward, in issue
        order, and added to their leaf's gradient (a leaf gathered twice, e.g. a tied embedding, sums its
        contributions in that order)."""
        if self._anchor is None:
            return tuple(torch.autograd.grad(loss, leaves, grad_outputs, allow_unused=True))
        *g, _ = torch.autograd.grad(loss, [*leaves, self._anchor], grad_outputs, allow_unused=True)
        at = {id(t): j for j, t in enumerate(leaves)}
        sums: dict[int, Tensor] = {}
        for key, local in self._reductions.drain():
            j = at[key]
            sums[j] = local if j not in sums else sums[j] + local
        for j, local in sums.items():
            t = leaves[j]
            d = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                   stride=t.stride())
            g[j] = d if g[j] is None else g[j] + d
        return tuple(g)

    # -- reshard after forward: saved gathered parameters are dropped and rebuilt for backward -----------------

    def _pack(self, t: Tensor):
        try:
            entry = self._by_storage.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return t
        if entry is None or not entry.alive() or t.dtype != entry.dtype:
            return t
        entry.packed += 1
        return _Resharded(entry, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    @staticmethod
    def _unpack(h):
        if isinstance(h, _Resharded):
            return h.src.unpack().as_strided(h.size, h.stride, h.offset)
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

        self._gather_calls += 1  # one call per layer: how backward's async reductions are grouped
        return pytree.tree_map(self._gather_one, tree)

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        t = torch.as_tensor(t, device=self.device).detach().clone()
        links.all_reduce(t, self.group)
        return t

    def all_reduce_max(self, t: Tensor) -> Tensor:
        """Elementwise max over the ranks ``all_reduce_sum`` sums over (every rank, or a pipeline stage's)."""
        t = torch.as_tensor(t, device=self.device).detach().clone()
        links.all_reduce(t, self.group, op=dist.ReduceOp.MAX)
        return t

    def seq_all_reduce_sum(self, t: Tensor) -> Tensor:
        """Sum over the CP group (the ranks holding other parts of the same rows); identity without CP."""
        t = torch.as_tensor(t).detach().clone()
        if self.comm is not None:
            links.all_reduce(t, self.comm.group)
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
                total = total + g.float().pow(2).sum() / dist.get_world_size(self.group)
        return self.all_reduce_sum(total)


def mesh_runtime(mesh: Mesh, train_config=None) -> MeshRuntime:
    """The runtime of one step on ``mesh``; EP balance, dispatch and overlap, communication overlap
    (``overlap_comm``, ``fsdp_prefetch``) and the mixed-precision policy come from the train config (None: the
    defaults, fp32 throughout)."""
    if mesh.pp > 1:  # a pipeline stage: the runtime of its own ranks, whose sums stay inside the stage
        rt = mesh_runtime(mesh.stage, train_config)
        rt.group = mesh.stage.group_of(tuple(mesh.stage.sizes))
        return rt
    if train_config is None:
        return MeshRuntime(mesh)
    tc = train_config
    return MeshRuntime(mesh, tc.enable_ep_balance, tc.max_dup_experts_num, tc.fsdp_prefetch,
                       param_dtype=tc.torch_param_dtype, reduce_dtype=tc.torch_reduce_dtype,
                       reshard_after_forward=tc.reshard_after_forward, overlap=tc.overlap_comm,
                       ep_dispatch=tc.ep_dispatch, ep_overlap=tc.ep_overlap, compute_dtype=tc.compute_dtype)
