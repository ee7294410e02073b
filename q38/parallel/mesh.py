"""The mesh: ``make_mesh``, placing any tree keyed by parameter path (``shard`` / ``unshard``), sharded init, and
each rank's part of a batch (``shard_batch``)."""


import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from q38.batch import StepBatch
from q38.parallel.layout import Layout
from q38.parallel.links import Topology, current_topology
from q38.pytree import named_leaves

# ---- the mesh ----------------------------------------------------------------------------------------------------


@attrs.frozen
class Mesh:
    """A q38 mesh: the DeviceMesh, its layout and the size of each mesh dim (``q38.parallel.runtime.mesh_runtime``
    builds the runtime a step runs on it)."""

    device_mesh: DeviceMesh
    layout: Layout
    sizes: dict
    topology: Topology = attrs.field(factory=current_topology)  # which ranks share a node
    # pp: the stage chunks (q38.parallel.pipeline.Chunk), from make_mesh(..., model=cfg); () without a pipeline axis
    chunks: tuple = ()
    _groups: dict = attrs.field(factory=dict, init=False, eq=False, repr=False)  # group_of's cache

    @property
    def pp(self) -> int:
        return self.size("pp")

    @property
    def pp_rank(self) -> int:
        return self.local_rank("pp")

    @property
    def stage(self) -> "Mesh":
        """The mesh of this rank's pipeline stage: the mesh dims other than ``pp`` (the ranks that share this
        rank's ``pp`` coordinate), with the layout's stage placements. ``self`` without a pipeline axis."""
        if "pp" not in self.sizes:
            return self
        if "stage" not in self._groups:
            names = tuple(n for n in self.sizes if n != "pp")
            self._groups["stage"] = Mesh(self.device_mesh[names], self.layout.stage_layout(),
                                         {n: self.sizes[n] for n in names}, self.topology)
        return self._groups["stage"]

    def owns(self, path: str) -> bool:
        """Whether this rank holds parameter ``path`` (always, without a pipeline axis)."""
        if self.pp <= 1:
            return True
        from q38.parallel.pipeline import owns

        return owns(self.chunks, self.pp_rank, path)

    def spans(self, names) -> tuple[int, int]:
        """(nodes, ranks per node) of the groups over mesh dims ``names`` (every group has the shape of this
        rank's: ranks are numbered row-major over the mesh)."""
        coords = self.device_mesh.get_coordinate() or [0] * len(self.sizes)
        mesh = self.device_mesh.mesh
        idx = tuple(slice(None) if n in names else c for n, c in zip(self.sizes, coords))
        return self.topology.group_shape(mesh[idx].flatten().tolist())

    def describe_links(self) -> str:
        """``fsdp=2 (across nodes) × ep=2 (inside a node)``: where each mesh dim's collectives travel."""
        parts = []
        for n, s in self.sizes.items():
            if s > 1:
                nodes, _ = self.spans([n])
                parts.append(f"{n}={s} ({'inside a node' if nodes == 1 else f'across {nodes} nodes'})")
        return " × ".join(parts) + f"; {self.topology.ranks_per_node} ranks per node"

    def group(self, name: str):
        return self.device_mesh.get_group(name)

    def size(self, name: str) -> int:
        return self.sizes.get(name, 1)

    def local_rank(self, name: str) -> int:
        return self.device_mesh.get_local_rank(name) if self.size(name) > 1 else 0

    def group_of(self, names: tuple[str, ...]):
        """The process group over the mesh dims ``names`` together (one collective instead of one per dim): their
        flattened sub-mesh, group ranks in mesh order, so an all-gather's parts in group-rank order are DTensor's
        chunk order when those dims shard one tensor dim evenly. Collective on first use (every rank must ask for
        the same groups in the same order); cached, ``names`` taken in mesh order."""
        order = tuple(n for n in self.sizes if n in names)
        if len(order) == 1:
            return self.group(order[0])
        if order not in self._groups:
            self._groups[order] = self._flat_group(order)
        return self._groups[order]

    def _flat_group(self, order: tuple[str, ...]):
        sub = self.device_mesh[order]
        # DeviceMesh._flatten is how torch builds a group over several mesh dims (torchtitan uses it the same way)
        group = sub._flatten("_".join(order)).get_group()
        want = sub.mesh.flatten().tolist()
        if dist.get_process_group_ranks(group) != want:
            raise RuntimeError(f"flattened group over {order} has ranks {dist.get_process_group_ranks(group)}, "
                               f"expected the sub-mesh order {want}")
        return group


def make_mesh(layout: Layout, world_size: int | None = None, device_type: str = "cpu",
              topology: Topology | None = None, *, model=None) -> Mesh:
    """``init_device_mesh`` over the layout's mesh dims (sizes resolved against ``world_size``); ``topology``: the
    ranks per node (default: the launcher's, ``links.launcher_topology``, or a simulation's). ``model``: the
    ``ModelConfig``, needed by a layout with ``pp`` (its stage split depends on the layers)."""
    world_size = world_size if world_size is not None else dist.get_world_size()
    sizes = layout.resolve_mesh(world_size)
    chunks = ()
    if sizes.get("pp", 1) > 1:
        from q38.parallel.pipeline import check_model

        if model is None:
            raise ValueError(f"layout {layout.name!r} has a pipeline axis: make_mesh(layout, world, model=cfg) "
                             "needs the model config (the stage split depends on its layers)")
        chunks = check_model(layout, model)
    names = tuple(sizes)
    dm = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    return Mesh(dm, layout, dict(sizes), topology or current_topology(), chunks)


def prune(tree, mesh: Mesh):
    """``tree`` (parameters, a train state, any tree keyed by parameter path) with the leaves this rank's pipeline
    stage does not own set to None; ``tree`` itself without a pipeline axis."""
    if mesh.pp <= 1:
        return tree
    from q38 import qmoment
    from q38.pytree import tree_map_with_path

    def keep(path, t):
        q = _param_suffix(path)
        return t if q is None or mesh.owns(q) else None

    return tree_map_with_path(keep, tree, is_leaf=qmoment.is_int8_moment)


def _placements(mesh: Mesh, params) -> dict:
    return mesh.layout.placements(params, mesh.sizes)


def _param_suffix(path: str) -> str | None:
    """The parameter path a leaf path ends in (``exp_avg.layers.0.moe.we_down`` → ``layers.0.moe.we_down``), or
    None when no layer declares such a parameter (a step count, a router bias)."""
    from q38.lora import split_path
    from q38.model import declared_params, generic_path

    parts = path.split(".")
    for i in range(len(parts)):
        cand = ".".join(parts[i:])
        if generic_path(split_path(cand)[0]) in declared_params():  # a LoRA leaf: its weight's declaration
            return cand
    return None


def shard(tree, mesh: Mesh, layout: Layout | None = None):
    """Place every leaf of ``tree`` whose path ends in a parameter path (the parameters, the optimizer moments, any
    tree keyed by parameter path) as a DTensor per the layout; values are the unsharded ones. Other leaves (the step
    count, the router bias: identical on every rank) are left as they are."""
    import torch.utils._pytree as pytree

    if mesh.pp > 1:  # a pipeline stage holds its own layers only, placed on its stage's ranks
        if layout is not None and layout != mesh.layout:
            raise ValueError("shard(tree, mesh, layout): a pipelined mesh places by its own layout; build the mesh "
                             "from the layout you want (make_mesh(layout, world, model=cfg))")
        return shard(prune(tree, mesh), mesh.stage)
    if layout is not None and layout != mesh.layout:
        mesh = Mesh(mesh.device_mesh, layout, dict(layout.resolve_mesh(mesh.device_mesh.size())), mesh.topology)
        if tuple(mesh.sizes) != tuple(mesh.device_mesh.mesh_dim_names or ()):
            raise ValueError(
                f"layout {layout.name!r} has mesh dims {tuple(mesh.sizes)} but the mesh was built with "
                f"{mesh.device_mesh.mesh_dim_names}; build the mesh from this layout (make_mesh(layout, world))"
            )
    from q38 import qmoment

    named = named_leaves(tree, is_leaf=qmoment.is_int8_moment)
    params = {}
    for path, t in named:
        q = _param_suffix(path)
        if q is not None:
            params.setdefault(q, tuple((t.codes if qmoment.is_int8_moment(t) else t).shape))
    pl = mesh.layout.placements_of_shapes(list(params.items()), mesh.sizes)
    flat, spec = pytree.tree_flatten(tree, is_leaf=qmoment.is_int8_moment)
    out = []
    for (path, _), t in zip(named, flat):
        q = _param_suffix(path)
        if q is not None and qmoment.is_int8_moment(t):  # 8-bit moment: its values placed, requantized per shard
            d = distribute_tensor(qmoment.load(t), mesh.device_mesh, pl[q].dtensor_placements())
            out.append(qmoment.stored(qmoment.zeros_like(d, t.signed), d.to_local()))
            continue
        if q is not None and t.dtype == torch.int16:  # a master's remainder (q38.remainder): gloo and NCCL have no
            # int16, so its bits travel as bf16 (a scatter copies bytes) and are read back as int16
            d = distribute_tensor(t.view(torch.bfloat16), mesh.device_mesh, pl[q].dtensor_placements())
            out.append(DTensor.from_local(d.to_local().view(torch.int16), mesh.device_mesh, d.placements,
                                          run_check=False, shape=d.shape, stride=d.stride()))
            continue
        out.append(t if q is None else distribute_tensor(t, mesh.device_mesh, pl[q].dtensor_placements()))
    # offloaded optimizer state (q38.offload): a host master and its moments stay on the host, placed like the weight
    host = {_param_suffix(p) for p, t in named if p.startswith("host_master.")}
    if host and mesh.device_mesh.device_type != "cpu":
        out = [pytree.tree_map(_on_host, t) if p.split(".", 1)[0] in ("host_master", "exp_avg", "exp_avg_sq")
               and _param_suffix(p) in host else t for (p, _), t in zip(named, out)]
    return pytree.tree_unflatten(out, spec)


def _on_host(t):
    """DTensor ``t`` with its local shard moved to the host (an offloaded master or moment on a CUDA mesh)."""
    if not isinstance(t, DTensor):
        return t.cpu()
    return DTensor.from_local(t.to_local().cpu(), t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def local_index(shape, mesh: Mesh, placements) -> tuple[slice, ...]:
    """The block of a tensor of global ``shape`` that this rank holds under DTensor ``placements`` on ``mesh``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(tuple(shape), mesh.device_mesh, placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local))


def build_sharded(model_config, mesh: Mesh, make_local):
    """The model's parameters as DTensors whose every rank builds only its own shard: ``make_local(path, info,
    index)`` returns the block ``index`` (a tuple of slices of ``info.shape``) of parameter ``path``. The full
    parameter never exists on any rank; this is the one way fresh init, empty load targets and Hugging Face slices
    are placed."""
    from q38.model import abstract_params, is_param_info
    from q38.pytree import tree_map_with_path

    abstract = prune(abstract_params(model_config), mesh)
    mesh = mesh.stage
    pl = mesh.layout.placements(abstract, mesh.sizes)

    def make(path, info):
        placements = pl[path].dtensor_placements()
        index = local_index(info.shape, mesh, placements)
        local = make_local(path, info, index)
        want = tuple(sl.stop - sl.start for sl in index)
        if tuple(local.shape) != want:
            raise AssertionError(f"{path}: built a local block of shape {tuple(local.shape)}, expected {want}")
        return DTensor.from_local(
            local, mesh.device_mesh, placements, run_check=False, shape=torch.Size(info.shape),
            stride=_contiguous_strides(info.shape),
        )

    return tree_map_with_path(make, abstract, is_leaf=is_param_info)


def _contiguous_strides(shape) -> tuple[int, ...]:
    out, n = [], 1
    for s in reversed(tuple(shape)):
        out.append(n)
        n *= max(int(s), 1)
    return tuple(reversed(out))


def init_sharded(model_config, mesh: Mesh, *, seed: int = 0, device=None, dtype=None):
    """Fresh parameters whose every rank materialises only its own shards (never the full model): values equal
    ``shard(init_params(...))`` because initial values are drawn per parameter path and row block."""
    from q38.layers.common import materialize

    return build_sharded(model_config, mesh, lambda path, info, index: materialize(
        info, path, seed=seed, device=device, dtype=dtype, index=index))


def adapter_maker(mesh: Mesh, *, seed: int = 0, device=None, empty: bool = False):
    """``make(path, info, like)`` for ``q38.lora.add_adapters`` on ``mesh``: the adapter matrix ``path`` (declared
    ``info``) as an fp32 DTensor placed by the layout on its own logical axes, each rank drawing (or, ``empty``,
    allocating) only its shard. On a pipelined mesh the adapter lives on its weight's stage (the caller adds adapters
    to the stage's own weights only), placed on that stage's ranks."""
    from q38.layers.common import materialize

    mesh = mesh.stage

    def make(path, info, like):
        placements = mesh.layout.placements_of_shapes([(path, info)], mesh.sizes)[path].dtensor_placements()
        index = local_index(info.shape, mesh, placements)
        if empty:
            local = torch.empty(tuple(sl.stop - sl.start for sl in index), device=device, dtype=torch.float32)
        else:
            local = materialize(info, path, seed=seed, device=device, dtype=torch.float32, index=index)
        return DTensor.from_local(local, mesh.device_mesh, placements, run_check=False,
                                  shape=torch.Size(info.shape), stride=_contiguous_strides(info.shape))

    return make


def empty_sharded(model_config, mesh: Mesh, *, device=None, dtype=None):
    """Uninitialised sharded parameters (each rank allocates only its shards): the target a checkpoint loads into."""
    return build_sharded(model_config, mesh, lambda path, info, index: torch.empty(
        tuple(sl.stop - sl.start for sl in index), device=device, dtype=dtype or torch.float32))


def unshard(tree):
    """Every DTensor leaf of ``tree`` as a full tensor on every rank (for checks and Hugging Face export)."""
    import torch.utils._pytree as pytree

    def full(t):
        if not isinstance(t, DTensor):
            return t
        if t.to_local().device.type != t.device_mesh.device_type:  # a host shard (offloaded) on a CUDA mesh:
            dev = t.to_local().device  # gathered on the mesh's device, returned to the host
            return full(DTensor.from_local(t.to_local().to(t.device_mesh.device_type), t.device_mesh, t.placements,
                                           run_check=False, shape=t.shape, stride=t.stride())).to(dev)
        if t.dtype == torch.int16:  # a master's remainder: gathered as bf16 bits (no int16 in gloo / NCCL)
            local = t.to_local().view(torch.bfloat16)
            return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride()).full_tensor().view(torch.int16)
        return t.full_tensor()

    return pytree.tree_map(full, tree)


def shard_batch(batch: dict, mesh: Mesh, mtp_depths: int, *, local_rows: bool = False) -> StepBatch:
    """This rank's part of a global batch (the same on every rank): rows split over the batch dims, the sequence
    over ``cp`` (contiguous). Shifts and positions are computed on whole rows first, so they cross CP borders.
    ``local_rows``: ``batch`` already holds only this rank's rows (``batch_row_rank``); only the sequence is split."""
    import torch.utils._pytree as pytree

    from q38.batch import TOKEN_VALUE_KEYS, prepare_batch

    values = {k: batch[k] for k in TOKEN_VALUE_KEYS if batch.get(k) is not None}
    full = prepare_batch(batch["input_ids"], batch["labels"], batch.get("doc_ids"), mtp_depths,
                         batch.get("attention_mask"), values, batch.get("routes"))
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


