"""Differentiable collectives on local tensors (shard_map style): FSDP parameter gathers in the mixed-precision
policy (cast before the gather, reduce in ``reduce_dtype``, reshard after forward), all-gather / all-to-all with
their reverse in backward."""

import weakref

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import record_function

from q38.parallel import links



# ---- differentiable collectives on local tensors ------------------------------------------------------------------


def _ag(x: Tensor, dim: int, group, sizes=None) -> Tensor:
    """All-gather equal shards (``sizes`` None) or DTensor's uneven ``torch.chunk`` shards (zero-padded for the
    collective, trimmed after) along ``dim``."""
    with record_function("q38.gather"):
        return _ag_impl(x, dim, group, sizes)


def _ag_impl(x: Tensor, dim: int, group, sizes) -> Tensor:
    if sizes is None:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        links.all_gather(parts, x.contiguous(), group)
        return torch.cat(parts, dim=dim)
    full = max(sizes)
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, full - x.shape[dim]]
    xp = F.pad(x, pad).contiguous()
    parts = [torch.empty_like(xp) for _ in sizes]
    links.all_gather(parts, xp, group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def _rs(g: Tensor, dim: int, group, sizes=None) -> Tensor:
    """Reduce-scatter (sum): the backward of ``_ag``."""
    with record_function("q38.reduce_scatter"):
        out, chunks = _rs_buffers(g, dim, dist.get_world_size(group), sizes)
        links.reduce_scatter(out, chunks, group)
        return _rs_mine(out, dim, group, sizes)


def _rs_buffers(g: Tensor, dim: int, n: int, sizes) -> tuple[Tensor, list[Tensor]]:
    """The output buffer and the ``n`` input chunks of a reduce-scatter along ``dim`` (uneven ``sizes``: each chunk
    zero-padded to the largest)."""
    if sizes is None:
        chunks = [c.contiguous() for c in g.chunk(n, dim=dim)]
        return torch.empty_like(chunks[0]), chunks
    full = max(sizes)
    chunks = []
    for c in g.split(list(sizes), dim=dim):
        pad = [0, 0] * (g.dim() - 1 - dim) + [0, full - c.shape[dim]]
        chunks.append(F.pad(c, pad).contiguous())
    return torch.empty_like(chunks[0]), chunks


def _storage_bytes(ts) -> int:
    """Bytes of the distinct storages under ``ts`` (chunks that are views of one gradient count it once)."""
    seen = {}
    for t in ts:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _rs_mine(out: Tensor, dim: int, group, sizes) -> Tensor:
    """This rank's reduced chunk: the buffer, trimmed of its padding when uneven."""
    return out if sizes is None else out.narrow(dim, 0, sizes[dist.get_rank(group)])


@attrs.frozen
class _Step:
    """One collective of a parameter's gather: ``gather`` (all-gather along ``dim``; backward reduce-scatter) or
    ``sum`` (identity; backward all-reduce, for dims the parameter is replicated on). ``names``: the mesh dims it
    spans; several when they run as one collective over their flattened group (``Mesh.group_of``)."""

    kind: str
    group: object
    dim: int = 0
    sizes: tuple | None = None  # uneven torch.chunk sizes, None when even
    names: tuple = ()  # the mesh dims, in mesh order


def _gather_forward(x: Tensor, steps: tuple, dtype, prefetched=None) -> Tensor:
    """The compute form of a local shard: cast to ``dtype`` first (gathers move ``dtype`` bytes), then gather."""
    y = x.to(dtype)
    for st in steps:
        if st.kind != "gather":
            continue
        if prefetched is not None:  # the first gather was started early (MeshRuntime.prefetch)
            work, parts = prefetched
            prefetched = None
            work.wait()
            y = torch.cat(parts, dim=st.dim)
        else:
            y = _ag(y, st.dim, st.group, st.sizes)
    return y


def _reduction_order(steps: tuple) -> list[_Step]:
    """The gradient's collectives: the gathers' reduce-scatters in reverse (outermost mesh dim first), then the
    all-reduces of the replicated dims, on the reduced shard (summing in either order is the same sum; reducing
    the shard moves ``1 / gathered ranks`` of the bytes, as FSDP2's HSDP does)."""
    return [st for st in reversed(steps) if st.kind == "gather"] + [st for st in steps if st.kind == "sum"]


class _GatherParam(torch.autograd.Function):
    """A parameter shard → its compute form, as FSDP2's mixed-precision policy does it: the fp32 master shard is cast
    to ``param_dtype`` *before* the gathers; backward casts the gradient to ``reduce_dtype`` and runs the
    reduce-scatters, then the all-reduces, returning the shard's gradient in the master dtype. Nothing is saved for
    backward (the gathered tensor is not kept by this function).

    With ``sink`` (a ``_Reductions``), the shard ``x`` is outside autograd and ``anchor`` (a 0-dim tensor that
    requires grad) connects the output: backward *issues* the first reduction async and hands it to ``sink``
    instead of returning a gradient, so it overlaps the rest of backward; the caller waits and adds it to the
    gradient of the leaf ``ticket`` names after ``autograd.grad`` (``MeshRuntime.grad``)."""

    @staticmethod
    def forward(ctx, anchor, x, steps, param_dtype, reduce_dtype, prefetched, sink, ticket):
        ctx.steps, ctx.reduce_dtype, ctx.in_dtype, ctx.sink, ctx.ticket = steps, reduce_dtype, x.dtype, sink, ticket
        ctx.anchor_dtype = anchor.dtype if anchor is not None else None
        y = _gather_forward(x, steps, param_dtype, prefetched)
        return x.view_as(x) if y is x else y

    @staticmethod
    def backward(ctx, g):
        g = g.to(ctx.reduce_dtype)
        if ctx.sink is not None:
            ctx.sink.issue(ctx.ticket, g, _reduction_order(ctx.steps), ctx.in_dtype)
            return torch.zeros((), dtype=ctx.anchor_dtype, device=g.device), None, None, None, None, None, None, None
        for st in _reduction_order(ctx.steps):
            if st.kind == "gather":
                g = _rs(g, st.dim, st.group, st.sizes)
            else:
                g = g.contiguous().clone()
                links.all_reduce(g, st.group)
        return None, g.to(ctx.in_dtype), None, None, None, None, None, None


class _Reduction:
    """One gradient contribution's reductions, each issued async after the previous one completed: the first from
    backward, the rest when the caller drains (``_Reductions.drain``)."""

    def __init__(self, key: int, g: Tensor, todo: list, in_dtype):
        self.key, self.todo, self.in_dtype = key, list(todo), in_dtype
        self.value, self.work, self._finish, self._keep = g, None, None, None
        self.held = 0  # bytes of the reduce-scatter's input buffers while it is in flight
        self.advance()

    def advance(self) -> bool:
        """Complete the collective in flight (if any) and issue the next one; False when none is left."""
        if self.work is not None:
            self.work.wait()
            self.value, self.work, self._keep, self.held = self._finish(), None, None, 0
        if not self.todo:
            return False
        st = self.todo.pop(0)
        if st.kind == "gather":
            out, chunks = _rs_buffers(self.value, st.dim, dist.get_world_size(st.group), st.sizes)
            with record_function("q38.reduce_scatter"):
                self.work = links.reduce_scatter(out, chunks, st.group, async_op=True)
            self._keep = chunks  # alive until the collective completes
            self._finish = lambda: _rs_mine(out, st.dim, st.group, st.sizes)
        else:
            buf = self.value.contiguous().clone()
            with record_function("q38.all_reduce"):
                self.work = links.all_reduce(buf, st.group, async_op=True)
            self._finish = lambda: buf
        # The collective reads only its own buffers: the gradient they were made from is not held beside them
        # (holding it would keep a non-contiguous full-size gradient, e.g. an expert weight's, alive next to its
        # chunks' contiguous copies: twice its bytes).
        self.value = None
        if self._keep is not None:  # what the reduce-scatter in flight keeps alive (counted by _Reductions)
            self.held = _storage_bytes([t for t in (*self._keep, self.value) if t is not None])
        return True

    def result(self) -> Tensor:
        return self.value.to(self.in_dtype)


class _Reductions:
    """The gradient reductions backward issued async, in issue order (the same on every rank).

    Each is issued with a ticket ``(leaf key, gather call)``: the leaves one ``MeshRuntime.gather`` call brought
    into compute form (one layer) share a gather call. When backward issues the first reduction of a new gather
    call, the reductions of the calls before it complete their collective in flight (and issue the next, e.g. the
    replicated dims' all-reduce of the shard): while a layer's backward computes, only the layer backward finished
    last has its full-size gradients waiting for their reduce-scatter, as FSDP2 keeps one layer's reduce-scatter in
    flight behind the next one's compute (not every layer's until the end of backward).
    ``most_bytes``: the most bytes the reduce-scatters in flight held at once in their input buffers (the full-size
    gradients, chunked; what the plan's "gradients awaiting reduction" item prices)."""

    def __init__(self) -> None:
        self.pending: list[_Reduction] = []
        self.issued = 0  # reductions issued async from backward and waited after it (reported, checked by tests)
        self.in_flight = 0  # bytes of the input buffers of the reduce-scatters issued and not yet completed
        self.most_bytes = 0  # the most of them at once (the plan's "gradients awaiting reduction" item)
        self._calls: list[int] = []  # gather calls in issue order, the newest last
        self._call_of: dict[int, int] = {}  # id(reduction) -> its gather call

    def issue(self, ticket: tuple[int, int], g: Tensor, todo: list, in_dtype) -> None:
        key, call = ticket
        if not self._calls or self._calls[-1] != call:
            self._calls.append(call)
            if len(self._calls) > 1:
                self._settle(set(self._calls[:-1]))
        r = _Reduction(key, g, todo, in_dtype)
        self._call_of[id(r)] = call
        self.pending.append(r)
        self.issued += 1
        self.in_flight += r.held
        self.most_bytes = max(self.most_bytes, self.in_flight)

    def _settle(self, calls: set) -> None:
        """Complete the in-flight collective of every reduction of ``calls`` still waiting on its full gradient."""
        for r in self.pending:
            if self._call_of[id(r)] in calls and r.work is not None and r._keep is not None:
                self.in_flight -= r.held
                r.advance()  # may issue the next reduce-scatter of an uneven gather over several mesh dims
                self.in_flight += r.held
                self.most_bytes = max(self.most_bytes, self.in_flight)

    def drain(self) -> list[tuple[int, Tensor]]:
        """Wait every pending reduction, each rank in the same order; a contribution with more steps (uneven
        per-dim reduce-scatters, then the all-reduces) issues its next step when its previous one completes, all
        contributions stepping together. Returns (leaf key, reduced local gradient in the master dtype)."""
        live, done = list(self.pending), list(self.pending)
        self.pending, self._calls, self._call_of, self.in_flight = [], [], {}, 0
        while live:
            live = [r for r in live if r.advance()]
        return [(r.key, r.result()) for r in done]


class _Regather:
    """How to rebuild one gathered parameter for backward (reshard-after-forward): its local shard and steps.
    The rebuilt tensor is shared by every saved view of it and held until the last of them is unpacked (views saved
    by several calls of one layer, e.g. the two token halves of an overlapped EP exchange, rebuild it once)."""

    def __init__(self, shard: Tensor, steps: tuple, dtype, gathered: Tensor):
        from torch.multiprocessing.reductions import StorageWeakRef

        self.shard, self.steps, self.dtype = shard, steps, dtype
        self.storage = StorageWeakRef(gathered.untyped_storage())
        self.nbytes = gathered.untyped_storage().nbytes()
        self.cached = None
        self.held: Tensor | None = None  # the rebuilt tensor while saved views of it are still to be unpacked
        self.packed = 0  # saved views packed and not yet unpacked
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

    def unpack(self) -> Tensor:
        t = self.full()
        self.packed -= 1
        self.held = t if self.packed > 0 else None
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


class _AllGatherAsync(torch.autograd.Function):
    """Every rank's copy of each of ``xs``, stacked in rank order on a new leading dim (``[n, *x.shape]``), each
    all-gather issued async with its work appended to ``works``: the outputs are valid once those works have been
    waited for, so the caller computes what does not need them meanwhile (CP exchanges, ``q38.parallel.cp``).
    Backward: the reduce-scatter of each gradient, synchronous and in ``xs`` order (one autograd node, so every rank
    runs them together and in the same order). Called as ``apply(group, works, *xs)``; returns a tuple."""

    @staticmethod
    def forward(ctx, group, works, *xs):
        ctx.group = group
        n = dist.get_world_size(group)
        outs = []
        with record_function("q38.gather"):
            for x in xs:
                out = x.new_empty((n, *x.shape))
                works.append(links.all_gather(list(out.unbind(0)), x.contiguous(), group, async_op=True))
                outs.append(out)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        return (None, None, *(_rs(g, 0, ctx.group)[0] for g in gs))


class _AllToAll(torch.autograd.Function):
    """Uneven ``all_to_all_single`` of each of ``xs`` (same splits), whose backward is the reverse exchange of their
    gradients, synchronous and in ``xs`` order: one autograd node per exchange, so every rank runs the reverse
    exchanges of a stage together and in the same order, whichever of its outputs' gradients arrived first. With
    ``works`` (a list) the forward is issued async and its works appended: the outputs are valid once those works
    have been waited for. Called as ``apply(out_splits, in_splits, group, works, *xs)``; returns a tuple."""

    @staticmethod
    def forward(ctx, out_splits, in_splits, group, works, *xs):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        outs = []
        for x in xs:
            out = x.new_empty((sum(out_splits), *x.shape[1:]))
            work = links.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group,
                                           async_op=works is not None)
            if works is not None:
                works.append(work)
            outs.append(out)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        grads = []
        for g in gs:
            out = g.new_empty((sum(ctx.in_splits), *g.shape[1:]))
            links.all_to_all_single(out, g.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group)
            grads.append(out)
        return (None, None, None, None, *grads)


def _chunk_sizes(n: int, k: int) -> list[int]:
    """``torch.chunk`` sizes of ``n`` rows over ``k`` parts (DTensor ``Shard``): ceil-sized, trailing may be 0."""
    full = -(-n // k)
    return [max(0, min(n, full * (c + 1)) - full * c) for c in range(k)]


