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
        return _rs_impl(g, dim, group, sizes)


def _rs_impl(g: Tensor, dim: int, group, sizes) -> Tensor:
    if sizes is None:
        chunks = [c.contiguous() for c in g.chunk(dist.get_world_size(group), dim=dim)]
        out = torch.empty_like(chunks[0])
        links.reduce_scatter(out, chunks, group)
        return out
    full = max(sizes)
    chunks = []
    for c in g.split(list(sizes), dim=dim):
        pad = [0, 0] * (g.dim() - 1 - dim) + [0, full - c.shape[dim]]
        chunks.append(F.pad(c, pad).contiguous())
    out = torch.empty_like(chunks[0])
    links.reduce_scatter(out, chunks, group)
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
        if prefetched is not None:  # the first gather was started early (MeshRuntime.prefetch)
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
                links.all_reduce(g, st.group)
        return g.to(ctx.in_dtype), None, None, None, None


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


