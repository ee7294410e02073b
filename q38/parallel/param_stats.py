"""The parameter side of the budget, shared by the plan of a full run (``q38.parallel.budget``) and of a LoRA run
(``q38.parallel.lora_budget``): one memory item (``Item``) and each rank's parameter statistics under a layout
(``ParamStats``: local elements, the largest gathered layer, the gathers and reductions per collective)."""

import math
from typing import Mapping

import attrs
import torch

from q38.parallel.plan import local_numel_grid


@attrs.frozen
class Item:
    """One line of the memory budget. Items of a ``transient`` group are alive at different moments of the step
    (the loss backward, one layer's backward): the phase total counts only the largest group."""

    name: str
    bytes: float
    note: str = ""
    transient: str = ""


def phase_total(items) -> float:
    groups: dict[str, float] = {}
    for it in items:
        if it.transient:
            groups[it.transient] = groups.get(it.transient, 0.0) + it.bytes
    return sum(it.bytes for it in items if not it.transient) + max(groups.values(), default=0.0)


@attrs.frozen
class ParamStats:
    """What the parameters cost on a mesh, independent of batch, recompute and hardware (computed once per mesh).
    Gathers are keyed by the mesh dims of one collective (``("cp", "ep")``: one all-gather over their flattened
    group), as ``MeshRuntime`` runs them."""

    numel: int  # parameters on the fullest rank
    largest_shard: int
    largest_layer: int  # compute-form elements of the largest layer (fullest rank)
    largest_layer_local: int  # stored elements of the largest layer (fullest rank)
    gathered_layers: int  # compute − local elements over all layers
    gather_group: dict  # mesh dims of one collective → elements received per forward gather
    gather_prefetchable: dict
    layer_gather: dict
    allreduce_dim: dict
    recompute_prefetchable: dict = attrs.field(factory=dict)  # layer gathers prefetched behind the next recompute
    largest_edge: int = 0  # compute-form elements of the largest gathered leaf outside the layers (embed, lm_head)


_STATS_CACHE: dict = {}


def gather_collectives(pp, names: list[str], mesh: Mapping[str, int]) -> list[tuple[str, ...]]:
    """The collectives that gather one parameter (``pp``: its placement) into compute form, in the order they run:
    each is the tuple of mesh dims it spans. As ``MeshRuntime`` runs them: the gathered mesh dims that all shard the
    same tensor dim into even chunks are one all-gather over their flattened group (``Mesh.group_of``); otherwise one
    per mesh dim, innermost first."""
    sd, sdc = pp.shard_dims(False), pp.shard_dims(True)
    gathered = [n for n, a, b in zip(names, sd, sdc) if a is not None and b is None and mesh[n] > 1]
    if not gathered:
        return []
    dims = {sd[names.index(n)] for n in gathered}
    if len(gathered) > 1 and len(dims) == 1:
        tdim = dims.pop()
        split = math.prod(mesh[n] for n, a in zip(names, sd) if a == tdim)
        if pp.shape[tdim] % split == 0:
            return [tuple(gathered)]
    return [(n,) for n in reversed(gathered)]


def param_stats(placements, mesh: Mapping[str, int], prefetch: bool) -> ParamStats:
    ck = (id(placements), tuple(mesh.items()), prefetch)
    hit = _STATS_CACHE.get(ck)
    if hit is not None and hit[0] is placements:
        return hit[1]
    sizes = list(mesh.values())
    names = list(mesh)
    cache: dict = {}

    def grid(pp, compute):
        key = (pp.shape, tuple(pp.shard_dims(compute)))
        if key not in cache:
            cache[key] = local_numel_grid(pp.shape, key[1], sizes)
        return cache[key]

    layer_compute: dict[str, int] = {}
    layer_local: dict[str, int] = {}
    gather_group: dict = {}  # elements received per forward gather, per collective's mesh dims (fullest rank)
    gather_prefetchable: dict = {}
    recompute_prefetchable: dict = {}
    layer_gather: dict = {}  # elements of layer params only (recompute re-gathers these)
    allreduce_dim: dict = {}  # replicated mesh dims of one all-reduce → elements it reduces (ring-weighted)
    # What a leaf costs depends on its shape and specs only, not its path: computed once per kind of leaf (the
    # search prices thousands of layouts of models whose layers repeat), the path deciding where it is counted.
    per_sig: dict = {}
    count: dict = {}
    largest_edge = 0
    for path, pp in placements.items():
        sig = (pp.shape, pp.mesh_axes_per_dim, pp.compute_axes_per_dim)
        m = per_sig.get(sig)
        if m is None:
            local, comp = grid(pp, False), grid(pp, True)
            lmax = int(local.max())
            sd = pp.shard_dims(False)
            steps, cur = [], lmax  # each collective multiplies what the rank holds
            for g in gather_collectives(pp, names, mesh):
                n = math.prod(mesh[x] for x in g)
                steps.append((g, cur * (n - 1), all(pp.shape[sd[names.index(x)]] % mesh[x] == 0 for x in g)))
                cur *= n
            sharding = {n for n, a in zip(names, sd) if a is not None}
            rep = tuple(n for n in names if n not in sharding and mesh[n] > 1)
            k = math.prod(mesh[n] for n in rep)
            m = per_sig[sig] = (local, lmax, int(comp.max()), steps, rep, 2 * (k - 1) / k * lmax if rep else 0.0)
        count[sig] = count.get(sig, 0) + 1
        _, lmax, cmax, steps, rep, reduced = m
        in_layer = ".layers." in f".{path}"
        if not in_layer and steps:
            largest_edge = max(largest_edge, cmax)
        if in_layer:
            key = _layer_key(path)
            layer_compute[key] = layer_compute.get(key, 0) + cmax
            layer_local[key] = layer_local.get(key, 0) + lmax
        # MeshRuntime.prefetch starts the first gather of every leaf of the next layer when its chunks are even:
        # layers after the first, and the MTP block (before the last layer); the edges are gathered when used
        ahead = prefetch and (path.startswith("mtp.") or (in_layer and not path.startswith("layers.0.")))
        for i, (g, recv, even) in enumerate(steps):
            gather_group[g] = gather_group.get(g, 0.0) + recv
            if in_layer:
                layer_gather[g] = layer_gather.get(g, 0.0) + recv
            if ahead and i == 0 and even:
                gather_prefetchable[g] = gather_prefetchable.get(g, 0.0) + recv
            # in backward, layer i-1's gathers start when layer i's recompute begins (layer L-1's behind the MTP
            # block's); the first layer backward recomputes (the last MTP depth) gathers its own
            if prefetch and i == 0 and even and in_layer and not path.startswith("mtp."):
                recompute_prefetchable[g] = recompute_prefetchable.get(g, 0.0) + recv
        if rep:  # replicated dims: one ring all-reduce of the reduce-scattered shard over their flattened group
            allreduce_dim[rep] = allreduce_dim.get(rep, 0.0) + reduced
    held = torch.zeros(sizes, dtype=torch.int64)
    for sig, c in count.items():
        held += per_sig[sig][0] * c
    numel = int(held.max())
    largest_layer = max(layer_compute.values(), default=0)
    gathered_layers = sum(layer_compute[k] - layer_local[k] for k in layer_compute)

    stats = ParamStats(numel, max((m[1] for m in per_sig.values()), default=0),
                       largest_layer, max(layer_local.values(), default=0), gathered_layers, gather_group,
                       gather_prefetchable, layer_gather, allreduce_dim, recompute_prefetchable, largest_edge)
    if len(_STATS_CACHE) > 64:
        _STATS_CACHE.clear()
    _STATS_CACHE[ck] = (placements, stats)
    return stats


def _layer_key(path: str) -> str:
    parts = path.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return path
