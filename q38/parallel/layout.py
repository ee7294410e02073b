"""Parallel layouts: the spec tables of ``specs/parallel/*.yaml`` read, validated and turned into placements.

Parameters declare logical axes and an FSDP dim; a layout is data about the mesh only (``fsdp``, ``rules``,
``compute``, ``activations``, ``uneven``: docs/parallel.md#what-a-layout-is). :func:`logical_to_spec` turns one
parameter's axes into a tensor-dim-indexed spec, converted to DTensor placements in one place
(:meth:`ParamPlacement.dtensor_placements`). Anything wrong is refused with a message naming the layout, parameter,
tensor dim, mesh dim and sizes. Mesh dim names are data; the ones with runtime behaviour are :data:`MESH_DIM_ROLES`.
"""

import difflib
import fnmatch
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

from q38.model_config import SPECS_DIR, ModelConfig

# Mesh dims with behaviour in the runtime (q38/parallel/runtime.py); every other name is plain data (shards the
# parameters its rules name and splits the batch), e.g. ``dp_replicate``, ``fsdp`` or a new ``tp``.
MESH_DIM_ROLES = {
    "ep": "expert parallel: routed tokens travel to the experts' ranks by all-to-all; experts stay local",
    "cp": "context parallel: the sequence is split; attention gathers K/V, the conv takes a halo, GDN carries state",
    "pp": "pipeline parallel: each stage owns a range of layers; micro-batches flow through the stages point to point",
}
PIPELINE_DIM = "pp"
PIPELINE_KEYS = ("schedule", "virtual_stages", "stages")
# Schedules the runtime runs (q38.parallel.pipeline); zero-bubble / DualPipeV are named so the refusal can say so.
PIPELINE_SCHEDULES = ("1f1b", "interleaved_1f1b")
UNSUPPORTED_SCHEDULES = ("gpipe", "zero_bubble", "zbv", "dualpipev", "interleaved_zero_bubble")
_MESH_DIM_RE = re.compile(r"^[a-z][a-z0-9_]*$")
ACTIVATION_AXES = ("batch", "sequence")
LAYOUT_KEYS = ("name", "include", "mesh", "fsdp", "rules", "compute", "activations", "uneven", "pipeline")
LAYOUTS_DIR = SPECS_DIR / "parallel"

MeshItems = tuple[tuple[str, int], ...]
AxisMap = tuple[tuple[str, tuple[str, ...]], ...]


class LayoutError(ValueError):
    """A layout is illegal for this model or world size; the message names what, where, and the fix."""


# ---- YAML -------------------------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys (PyYAML keeps the last one silently)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise LayoutError(f"duplicate key {key!r} in {node.start_mark.name} line {key_node.start_mark.line + 1}")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise LayoutError(f"layout file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            d = yaml.load(f, Loader=_StrictLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        from q38.errors import yaml_problem

        raise LayoutError(f"layout {path}: not valid YAML ({yaml_problem(e)}); fix the file") from None
    except RecursionError:
        raise LayoutError(f"layout {path}: nested too deeply to read; fix the file") from None
    if d is None:
        raise LayoutError(f"layout {path} is empty; write its mesh and fsdp keys there, or name a preset")
    if not isinstance(d, dict):
        raise LayoutError(f"{path}: expected a mapping with keys {', '.join(LAYOUT_KEYS)}, got {type(d).__name__}")
    return d


def _find_include(name: str, base_dir: Path | None) -> Path:
    """An ``include:`` target: relative to the including file, else among the shipped layouts."""
    p = Path(name)
    candidates = [p] if p.is_absolute() else [*([base_dir / p] if base_dir else []), LAYOUTS_DIR / p]
    for c in candidates:
        if c.is_file():
            return c
    raise LayoutError(f"include {name!r} not found (looked in: {', '.join(str(c) for c in candidates)})")


_MERGED_KEYS = ("rules", "compute", "activations")  # merged key by key; the rest is replaced whole


def _resolve_includes(d: Mapping[str, Any], base_dir: Path | None, stack: tuple[str, ...] = ()) -> dict:
    d = dict(d)
    inc = d.pop("include", None)
    if inc is None:
        return d
    path = _find_include(str(inc), base_dir).resolve()
    if str(path) in stack:
        raise LayoutError(f"include cycle: {' → '.join([*stack, str(path)])}")
    base = _resolve_includes(_read_yaml(path), path.parent, (*stack, str(path)))
    base.pop("name", None)
    out = dict(base)
    for k, v in d.items():
        if k in _MERGED_KEYS and isinstance(v, Mapping) and isinstance(base.get(k), Mapping):
            out[k] = {**base[k], **v}
        else:
            out[k] = v
    return out


# ---- small helpers ----------------------------------------------------------------------------------------------


def _mesh_dims_of(value: Any, where: str) -> tuple[str, ...]:
    """A rule value (``null`` | mesh dim | list of mesh dims) as a tuple of names."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise LayoutError(f"{where}: expected null, a mesh dim name or a list of them, got {value!r}")


def format_mesh(mesh: Sequence[tuple[str, int]]) -> str:
    """``fsdp=8 × cp=2 × ep=64``."""
    return " × ".join(f"{n}={s}" for n, s in mesh) if mesh else "(no mesh dims)"


def _suggest(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def chunk_size(n: int, k: int, c: int) -> int:
    """Size of chunk ``c`` of ``n`` split into ``k`` with ``torch.chunk`` semantics (DTensor ``Shard``)."""
    full = -(-n // k)
    return max(0, min(n, full * (c + 1)) - full * c)


# How to fix each kind of placement problem; said once per kind in an error message.
_HINTS = {
    "undeclared": "declare it with a ParamInfo (axes=..., fsdp_dim=...) in its layer's abstract_* function",
    "twice": "a mesh dim can shard only one tensor dim: change one of the two rules",
    "divide": "change the rule or the mesh sizes, or list the parameter under 'uneven' to accept torch.chunk shards",
}
_MAX_SHOWN = 4  # problems of one kind spelled out in an error message


# ---- logical axes → mesh spec ---------------------------------------------------------------------------------


class AxisCollision(ValueError):
    """One mesh dim would shard two dims of one tensor (``A[I_X, J_X]`` is not a sharding)."""

    def __init__(self, mesh_dim: str, dims: tuple[int, int]):
        super().__init__(f"mesh dim {mesh_dim!r} shards both dim {dims[0]} and dim {dims[1]}")
        self.mesh_dim, self.dims = mesh_dim, dims


def logical_to_spec(
    axes: Sequence[str | None],
    rules: Mapping[str, Sequence[str]],
    fsdp: Sequence[str] = (),
    fsdp_dim: int | None = None,
    mesh_order: Sequence[str] | None = None,
) -> tuple[tuple[str, ...], ...]:
    """One parameter's tensor-dim-indexed mesh spec (a JAX ``PartitionSpec``).

    Dim ``i`` gets ``rules[axes[i]]`` (no rule: replicated). The FSDP dim ``fsdp_dim`` also gets every ``fsdp``
    mesh dim that no dim of this tensor already uses (so routed experts on ``ep`` take the FSDP role over the rest).
    Mesh dims on one tensor dim are kept in ``mesh_order``. Raises :class:`AxisCollision` if a mesh dim would
    shard two tensor dims.
    """
    spec = [tuple(rules.get(a, ())) if a is not None else () for a in axes]
    seen: dict[str, int] = {}
    for i, dims in enumerate(spec):
        for m in dims:
            if m in seen:
                raise AxisCollision(m, (seen[m], i))
            seen[m] = i
    if fsdp_dim is not None and fsdp:
        extra = tuple(m for m in fsdp if m not in seen)
        merged = spec[fsdp_dim] + extra
        if mesh_order is not None:
            merged = tuple(sorted(merged, key=list(mesh_order).index))
        spec[fsdp_dim] = merged
    return tuple(spec)


# ---- per-parameter result -----------------------------------------------------------------------------------------


@attrs.frozen
class ParamPlacement:
    """Where one parameter lives on the mesh.

    ``mesh_axes_per_dim`` is tensor-dim-indexed like a JAX ``PartitionSpec``: entry ``i`` names the mesh dims that
    shard tensor dim ``i``, major → minor (always in mesh order). ``compute_axes_per_dim`` is the same for the
    compute form: what stays sharded after the FSDP all-gather (EP-local expert dims). ``mesh`` is the resolved
    mesh, in order, with sizes.
    """

    path: str
    shape: tuple[int, ...]
    pattern: str  # the parameter's kind (its generic path, ``layers.*.mixer.w_q``): rows of the plan
    logical_axes: tuple[str | None, ...]
    mesh_axes_per_dim: tuple[tuple[str, ...], ...]
    compute_axes_per_dim: tuple[tuple[str, ...], ...]
    mesh: MeshItems
    uneven: bool = False

    def _spec(self, compute: bool) -> tuple[tuple[str, ...], ...]:
        return self.compute_axes_per_dim if compute else self.mesh_axes_per_dim

    def shard_dims(self, compute: bool = False) -> list[int | None]:
        """Per mesh dim (mesh order): the tensor dim it shards, or ``None`` (replicated; size-1 mesh dims always
        are). The mesh-dim-indexed transpose of ``mesh_axes_per_dim``; DTensor placements are built from it."""
        where = {m: i for i, dims in enumerate(self._spec(compute)) for m in dims}
        return [where.get(name) if size > 1 else None for name, size in self.mesh]

    def dtensor_placements(self, *, compute: bool = False) -> list:
        """DTensor placements, one per mesh dim in the layout's mesh order: ``Shard(d)`` or ``Replicate()``.

        A tensor dim sharded by several mesh dims gets ``Shard(d)`` on each; DTensor applies them in mesh order,
        which the layout guarantees is the rule's major → minor order.
        """
        from torch.distributed.tensor import Replicate, Shard

        return [Replicate() if d is None else Shard(d) for d in self.shard_dims(compute)]

    def placement_strs(self, *, compute: bool = False) -> list[str]:
        """``dtensor_placements`` as strings (``"Shard(0)"``, ``"Replicate()"``), without importing DTensor."""
        return ["Replicate()" if d is None else f"Shard({d})" for d in self.shard_dims(compute)]

    def local_shape(self, coord: Sequence[int], *, compute: bool = False) -> tuple[int, ...]:
        """The local shard shape at mesh coordinate ``coord`` (DTensor's nested ``torch.chunk`` split)."""
        shape = list(self.shape)
        for (_, size), c, d in zip(self.mesh, coord, self.shard_dims(compute)):
            if d is not None:
                shape[d] = chunk_size(shape[d], size, c)
        return tuple(shape)

    @property
    def shard_factor(self) -> int:
        """How many distinct shards the parameter has (product of the sizes of the mesh dims sharding it)."""
        sizes = dict(self.mesh)
        return math.prod(sizes[m] for dims in self.mesh_axes_per_dim for m in dims)

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "spec": [list(dims) for dims in self.mesh_axes_per_dim],
            "placements": self.placement_strs(),
        }


# ---- the pipeline section ------------------------------------------------------------------------------------------


@attrs.frozen
class PipelineSpec:
    """A layout's ``pipeline:`` section (docs/parallel.md#the-pipeline-axis): the ``schedule`` (``1f1b`` or
    ``interleaved_1f1b``), ``virtual_stages`` (model chunks per ``pp`` rank: 1 for 1F1B, >= 2 interleaved) and the
    split of the layers into ``pp × virtual_stages`` chunks in pipeline order: ``"auto"`` (balanced by per-layer
    cost, ``q38.parallel.pipeline.stage_split``) or explicit inclusive ``(first, last)`` layer ranges."""

    schedule: str = "1f1b"
    virtual_stages: int = 1
    stages: str | tuple[tuple[int, int], ...] = "auto"

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "PipelineSpec":
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise LayoutError(f"{where}: 'pipeline' must be a mapping with keys {', '.join(PIPELINE_KEYS)}, "
                              f"got {type(d).__name__}")
        unknown = [k for k in d if k not in PIPELINE_KEYS]
        if unknown:
            raise LayoutError(f"{where}: unknown pipeline key(s) "
                              f"{', '.join(repr(k) + _suggest(str(k), PIPELINE_KEYS) for k in unknown)}; "
                              f"known: {', '.join(PIPELINE_KEYS)}")
        schedule = str(d.get("schedule", "1f1b")).lower()
        v = d.get("virtual_stages", 2 if schedule == "interleaved_1f1b" else 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LayoutError(f"{where}: pipeline.virtual_stages must be an integer >= 1, got {v!r}")
        stages = d.get("stages", "auto")
        if stages != "auto":
            ok = isinstance(stages, (list, tuple)) and all(
                isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(i, int) and not isinstance(i, bool)
                                                                     for i in r) for r in stages)
            if not ok:
                raise LayoutError(f"{where}: pipeline.stages must be 'auto' or a list of [first, last] layer ranges "
                                  f"(inclusive, one per stage chunk in pipeline order), got {stages!r}")
            stages = tuple((int(a), int(b)) for a, b in stages)
        return cls(schedule=schedule, virtual_stages=v, stages=stages)

    def check(self, where: str, pp: int) -> None:
        """Static checks against the ``pp`` size (no model): schedule, virtual stages, the number of ranges."""
        if self.schedule == "gpipe":
            raise LayoutError(f"{where}: pipeline.schedule 'gpipe' is not run by q38 (all forwards, then all "
                              "backwards: 1f1b's bubble with every micro-batch's activations held); use 1f1b")
        if self.schedule in UNSUPPORTED_SCHEDULES:
            raise LayoutError(f"{where}: pipeline.schedule {self.schedule!r} is not run by q38 (it splits each "
                              "backward into input and weight halves, which q38's step cannot: "
                              "docs/parallel.md#the-pipeline-axis); use interleaved_1f1b with virtual_stages >= 2 "
                              "to shrink the bubble, or 1f1b")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise LayoutError(f"{where}: pipeline.schedule {self.schedule!r} is unknown; use one of "
                              f"{', '.join(PIPELINE_SCHEDULES)}")
        if self.schedule == "1f1b" and self.virtual_stages != 1:
            raise LayoutError(f"{where}: pipeline.schedule 1f1b runs one chunk per rank, but virtual_stages="
                              f"{self.virtual_stages}; set schedule: interleaved_1f1b or virtual_stages: 1")
        if self.schedule == "interleaved_1f1b" and self.virtual_stages < 2:
            raise LayoutError(f"{where}: pipeline.schedule interleaved_1f1b needs virtual_stages >= 2 (chunks per "
                              f"rank), got {self.virtual_stages}; set virtual_stages: 2 or use schedule: 1f1b")
        if self.stages != "auto" and len(self.stages) != pp * self.virtual_stages:
            raise LayoutError(f"{where}: pipeline.stages lists {len(self.stages)} layer ranges, but pp={pp} × "
                              f"virtual_stages={self.virtual_stages} = {pp * self.virtual_stages} stage chunks need one "
                              f"each; list {pp * self.virtual_stages} ranges or write stages: auto")

    @property
    def chunks_per_rank(self) -> int:
        return self.virtual_stages


# ---- the layout ---------------------------------------------------------------------------------------------------


@attrs.frozen
class Layout:
    """A parallel layout (one ``specs/parallel/*.yaml``), immutable and checked on construction.

    Build it with :meth:`preset`, :meth:`from_yaml`, :meth:`from_dict` or :meth:`load`; every mapping is stored
    as a tuple of pairs in file order.
    """

    name: str
    mesh: tuple[tuple[str, int], ...]
    rules: AxisMap
    fsdp: tuple[str, ...] = ()
    compute: AxisMap = ()
    activations: AxisMap = ()
    uneven: tuple[str, ...] = ()
    pipeline: PipelineSpec | None = None  # the ``pipeline:`` section (set whenever the mesh has ``pp``)
    source: str | None = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        self._check_static()

    # ---- constructors ------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, base_dir: str | os.PathLike | None = None,
                  source: str | None = None) -> "Layout":
        """Build from a parsed table; ``include:`` resolves relative to ``base_dir``, then ``specs/parallel``."""
        where = source or "layout"
        d = _resolve_includes(d, Path(base_dir) if base_dir is not None else None)
        unknown = [k for k in d if k not in LAYOUT_KEYS and k != "params"]
        if unknown:
            raise LayoutError(
                f"{where}: unknown key(s) {', '.join(repr(k) + _suggest(k, LAYOUT_KEYS) for k in unknown)}; "
                f"known keys: {', '.join(LAYOUT_KEYS)}"
            )
        name = d.get("name") or (Path(source).stem if source else "layout")

        def mapping(key: str) -> Mapping:
            v = d.get(key) or {}
            if not isinstance(v, Mapping):
                raise LayoutError(f"{where}: '{key}' must be a mapping, got {type(v).__name__}")
            return v

        mesh = []
        for k, v in mapping("mesh").items():
            if isinstance(v, bool) or not isinstance(v, int):
                raise LayoutError(f"layout {name!r}: mesh size of {k!r} must be an integer (or -1), got {v!r}")
            mesh.append((str(k), v))
        if "params" in d:
            raise LayoutError(
                f"{where}: a layout no longer lists parameters ('params'): each parameter declares its logical axes "
                "and FSDP dim in its layer (ParamInfo axes=..., fsdp_dim=...); keep only mesh, fsdp, rules, "
                "compute, activations and uneven"
            )
        fsdp = _mesh_dims_of(d.get("fsdp"), f"layout {name!r}: fsdp")
        rules = tuple((str(k), _mesh_dims_of(v, f"layout {name!r}: rules[{k!r}]")) for k, v in mapping("rules").items())
        compute = tuple(
            (str(k), _mesh_dims_of(v, f"layout {name!r}: compute[{k!r}]")) for k, v in mapping("compute").items()
        )
        activations = tuple(
            (str(k), _mesh_dims_of(v, f"layout {name!r}: activations[{k!r}]"))
            for k, v in mapping("activations").items()
        )
        uneven = d.get("uneven") or []
        if isinstance(uneven, str) or not all(isinstance(u, str) for u in uneven):
            raise LayoutError(f"layout {name!r}: 'uneven' must be a list of parameter patterns, got {uneven!r}")
        pipeline = None
        if "pipeline" in d or any(k == PIPELINE_DIM for k, _ in mesh):
            pipeline = PipelineSpec.from_dict(d.get("pipeline"), f"layout {name!r}")
        return cls(
            name=str(name), mesh=tuple(mesh), fsdp=fsdp, rules=rules, compute=compute,
            activations=activations, uneven=tuple(uneven), pipeline=pipeline, source=source,
        )

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "Layout":
        path = Path(path)
        return cls.from_dict(_read_yaml(path), base_dir=path.parent, source=str(path))

    @classmethod
    def presets(cls) -> list[str]:
        return sorted(p.stem for p in LAYOUTS_DIR.glob("*.yaml"))

    @classmethod
    def preset(cls, name: str) -> "Layout":
        path = LAYOUTS_DIR / f"{name}.yaml"
        if not path.is_file():
            raise LayoutError(
                f"unknown parallel layout {name!r}{_suggest(name, cls.presets())}; "
                f"known layouts: {', '.join(cls.presets())} (or pass a path to a .yaml file)"
            )
        return cls.from_yaml(path)

    @classmethod
    def load(cls, name_or_path: str | os.PathLike) -> "Layout":
        """A preset name or a path to a layout YAML file."""
        p = Path(name_or_path)
        if p.suffix in (".yaml", ".yml") or p.is_file():
            return cls.from_yaml(p)
        return cls.preset(str(name_or_path))

    def with_mesh(self, **sizes: int) -> "Layout":
        """The same layout with some mesh sizes replaced (e.g. ``ep=8``); the mesh order is unchanged."""
        names = self.mesh_dim_names
        bad = [k for k in sizes if k not in names]
        if bad:
            raise LayoutError(
                f"layout {self.name!r} has no mesh dim {', '.join(map(repr, bad))}; "
                f"its mesh is {format_mesh(self.mesh)}"
            )
        return attrs.evolve(self, mesh=tuple((n, sizes.get(n, s)) for n, s in self.mesh))

    # ---- accessors ---------------------------------------------------------------------------------------------
    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.mesh)

    @property
    def rule_map(self) -> dict[str, tuple[str, ...]]:
        return dict(self.rules)

    @property
    def compute_map(self) -> dict[str, tuple[str, ...]]:
        return dict(self.compute)

    @property
    def logical_axes(self) -> list[str]:
        """Every logical axis the layers declare, in first-use order (rules may name only these)."""
        from q38.model import declared_params

        return list(dict.fromkeys(a for info in declared_params().values() for a in info.axes if a is not None))

    @property
    def batch_mesh_dims(self) -> tuple[str, ...]:
        """Mesh dims the batch is split over (data parallel), major → minor."""
        return dict(self.activations).get("batch", ())

    @property
    def seq_mesh_dims(self) -> tuple[str, ...]:
        """Mesh dims the sequence is split over (context parallel), major → minor."""
        return dict(self.activations).get("sequence", ())

    # ---- static checks (no model, no world size) ---------------------------------------------------------------
    def _check_static(self) -> None:
        name, mesh_names = self.name, self.mesh_dim_names
        known = f"the mesh is {format_mesh(self.mesh)}"
        for dim, size in self.mesh:
            if not isinstance(dim, str) or not _MESH_DIM_RE.match(dim):
                raise LayoutError(
                    f"layout {name!r}: mesh dim name {dim!r} must be a lowercase identifier (e.g. fsdp, ep, cp, tp)"
                )
            if size != -1 and size < 1:
                raise LayoutError(f"layout {name!r}: mesh size {dim}={size} must be >= 1, or -1 for the rest")
        if sum(s == -1 for _, s in self.mesh) > 1:
            raise LayoutError(
                f"layout {name!r}: at most one mesh dim may be -1 (the rest), got {format_mesh(self.mesh)}"
            )
        tables = (("fsdp", self.fsdp),) if self.fsdp else ()
        for table, key in ((tables, "fsdp"), (self.rules, "rules"), (self.compute, "compute"),
                           (self.activations, "activations")):
            for axis, dims in table:
                for m in dims:
                    if m not in mesh_names:
                        where = key if key == "fsdp" else f"{key}[{axis!r}]"
                        raise LayoutError(
                            f"layout {name!r}: {where} names mesh dim {m!r}, which the mesh does not "
                            f"have ({known}); add {m!r} to mesh or change the rule"
                        )
                if len(set(dims)) != len(dims):
                    raise LayoutError(f"layout {name!r}: {key}[{axis!r}] = {list(dims)} repeats a mesh dim")
                order = sorted(dims, key=mesh_names.index)
                if list(dims) != order:
                    what = key if key == "fsdp" else f"{key}[{axis!r}]"
                    raise LayoutError(
                        f"layout {name!r}: {what} = {list(dims)} lists mesh dims out of mesh order "
                        f"({', '.join(mesh_names)}); DTensor applies repeated Shard placements in mesh order, so "
                        f"write {order} or reorder the mesh"
                    )
        used = self.logical_axes
        for axis, _ in self.rules:
            if axis not in used:
                raise LayoutError(
                    f"layout {name!r}: rules[{axis!r}] is for a logical axis no parameter declares"
                    f"{_suggest(axis, used)}; logical axes: {', '.join(used)}"
                )
        rule_map = self.rule_map
        for axis, dims in self.compute:
            storage = rule_map.get(axis)
            if storage is None:
                raise LayoutError(f"layout {name!r}: compute[{axis!r}] has no matching entry under rules")
            if storage[: len(dims)] != dims:
                raise LayoutError(
                    f"layout {name!r}: compute[{axis!r}] = {list(dims)} must be a leading part of rules[{axis!r}] "
                    f"= {list(storage)}: the compute form is reached by all-gathering the remaining (minor) mesh dims"
                )
        for key, _ in self.activations:
            if key not in ACTIVATION_AXES:
                raise LayoutError(
                    f"layout {name!r}: unknown activation axis {key!r}{_suggest(key, ACTIVATION_AXES)}; "
                    f"known: {', '.join(ACTIVATION_AXES)}"
                )
        act = [m for _, dims in self.activations for m in dims]
        twice = sorted({m for m in act if act.count(m) > 1})
        if twice:
            raise LayoutError(f"layout {name!r}: mesh dim(s) {twice} split both the batch and the sequence")
        seq_roles = [m for m in self.seq_mesh_dims if m != "cp"]
        if seq_roles:
            raise LayoutError(
                f"layout {name!r}: activations.sequence names {seq_roles}; the runtime splits the sequence only over "
                f"the mesh dim named 'cp' ({MESH_DIM_ROLES['cp']}); rename the mesh dim to cp"
            )
        self._check_pipeline()
        idle = [m for m in mesh_names if m not in act and m != PIPELINE_DIM]
        if idle:
            raise LayoutError(
                f"layout {name!r}: mesh dim(s) {idle} carry no activations (every rank of a mesh dim must see "
                f"different tokens); add them to activations.batch or activations.sequence"
            )

    def _check_pipeline(self) -> None:
        name, sizes = self.name, dict(self.mesh)
        if PIPELINE_DIM not in sizes:
            if self.pipeline is not None:
                raise LayoutError(f"layout {name!r}: a pipeline section needs a {PIPELINE_DIM!r} mesh dim; add "
                                  f"{PIPELINE_DIM}: <stages> to mesh or remove the pipeline section")
            return
        where = f"layout {name!r}"
        if sizes[PIPELINE_DIM] == -1:
            raise LayoutError(f"{where}: mesh size {PIPELINE_DIM}=-1; the number of pipeline stages must be stated "
                              f"(e.g. {PIPELINE_DIM}: 2), let another mesh dim take the rest")
        for key, table in (("fsdp", (("fsdp", self.fsdp),)), ("rules", self.rules), ("compute", self.compute),
                           ("activations", self.activations)):
            for axis, dims in table:
                if PIPELINE_DIM in dims:
                    what = key if key == "fsdp" else f"{key}[{axis!r}]"
                    raise LayoutError(f"{where}: {what} names {PIPELINE_DIM!r}; the pipeline axis splits the layers "
                                      f"(pipeline.stages), never a tensor or the batch: remove it there")
        if len(self.mesh) == 1:
            raise LayoutError(f"{where}: the mesh has only {PIPELINE_DIM!r}; add a data dim for the stage's ranks "
                              f"(e.g. fsdp: -1 with activations.batch: [fsdp])")
        (self.pipeline or PipelineSpec()).check(where, sizes[PIPELINE_DIM])

    @property
    def pp(self) -> int:
        """Pipeline stages (the ``pp`` mesh size; 1 without a pipeline axis)."""
        return dict(self.mesh).get(PIPELINE_DIM, 1)

    def stage_layout(self) -> "Layout":
        """This layout without its pipeline axis: how a stage places its parameters on its own ranks."""
        if PIPELINE_DIM not in self.mesh_dim_names:
            return self
        return attrs.evolve(self, mesh=tuple((n, s) for n, s in self.mesh if n != PIPELINE_DIM), pipeline=None,
                            name=f"{self.name}/stage")

    # ---- mesh --------------------------------------------------------------------------------------------------
    def resolve_mesh(self, world_size: int) -> dict[str, int]:
        """Mesh dim → size for ``world_size`` ranks, filling the ``-1`` dim with the rest."""
        fixed = math.prod(s for _, s in self.mesh if s != -1)
        rest = [n for n, s in self.mesh if s == -1]
        if world_size < 1:
            raise LayoutError(f"WORLD_SIZE must be >= 1, got {world_size}")
        if rest:
            if world_size % fixed:
                raise LayoutError(
                    f"layout {self.name!r}: mesh {format_mesh(self.mesh)} needs a world size divisible by {fixed} "
                    f"(the product of its fixed sizes; {rest[0]} takes the rest), but WORLD_SIZE={world_size}"
                )
            return {n: (world_size // fixed if s == -1 else s) for n, s in self.mesh}
        if fixed != world_size:
            raise LayoutError(
                f"layout {self.name!r}: mesh {format_mesh(self.mesh)} has {fixed} ranks, but WORLD_SIZE={world_size}; "
                f"set one mesh size to -1 to absorb the world size, or launch {fixed} ranks"
            )
        return {n: s for n, s in self.mesh}

    def _mesh_items(self, mesh: Mapping[str, int] | int) -> MeshItems:
        if isinstance(mesh, int):
            return tuple(self.resolve_mesh(mesh).items())
        if set(mesh) != set(self.mesh_dim_names):
            raise LayoutError(
                f"layout {self.name!r}: mesh sizes {dict(mesh)} must name exactly the mesh dims "
                f"{list(self.mesh_dim_names)}"
            )
        for n, s in mesh.items():
            if s < 1:
                raise LayoutError(f"layout {self.name!r}: mesh size {n}={s} must be >= 1")
        return tuple((n, int(mesh[n])) for n in self.mesh_dim_names)

    # ---- placements --------------------------------------------------------------------------------------------
    def placements(self, params: Any, mesh: Mapping[str, int] | int) -> dict[str, ParamPlacement]:
        """Placement of every parameter of ``params`` (a tree of ``ParamInfo`` or tensors) on ``mesh``.

        ``mesh`` is a world size or a resolved ``{mesh dim: size}``. A ``ParamInfo`` brings its own logical axes;
        a tensor leaf takes them from its layer's declaration (:func:`q38.lora.declared_info`). Raises
        :class:`LayoutError` listing every problem found (one line, grouped by kind).
        """
        from q38.model import is_param_info
        from q38.pytree import named_leaves

        leaves = [(p, x if is_param_info(x) else tuple(int(s) for s in x.shape))
                  for p, x in named_leaves(params, is_leaf=is_param_info)]
        return self.placements_of_shapes(leaves, mesh)

    def placements_of_shapes(
        self, leaves: Sequence[tuple[str, Any]], mesh: Mapping[str, int] | int
    ) -> dict[str, ParamPlacement]:
        """:meth:`placements` over ``[(dotted path, global shape or ParamInfo)]``."""
        from q38.lora import declared_info
        from q38.model import generic_path

        mesh_items = self._mesh_items(mesh)
        sizes = dict(mesh_items)
        order = [n for n, _ in mesh_items]
        where = f"layout {self.name!r} on mesh {format_mesh(mesh_items)}"
        rule_map, compute_map = self.rule_map, self.compute_map
        uneven_res = [re.compile(fnmatch.translate(p)) for p in self.uneven]
        # (kind, grouping key) → [message naming the first parameter, further parameter paths]
        errors: dict[tuple, list[str]] = {}

        def err(kind: tuple, path: str, msg: str) -> None:
            if kind in errors:
                errors[kind].append(path)
            else:
                errors[kind] = [msg]

        out = {}
        specs: dict = {}
        for path, leaf in leaves:
            kind = generic_path(path)
            if isinstance(leaf, tuple):
                shape = leaf
                try:
                    info = declared_info(path)
                except KeyError:
                    err(("undeclared", kind), path, f"parameter {path!r} {list(shape)} has no layer declaration")
                    continue
            else:
                info, shape = leaf, tuple(int(n) for n in leaf.shape)
            axes = info.axes
            if len(axes) != len(shape):
                err(("undeclared", kind), path,
                    f"parameter {path!r} has rank {len(shape)} but its declaration has axes {list(axes)}")
                continue
            try:
                sk = (tuple(axes), info.fsdp_dim)  # the specs depend on the axes only: once per kind of leaf
                if sk not in specs:
                    specs[sk] = (logical_to_spec(axes, rule_map, self.fsdp, info.fsdp_dim, order),
                                 logical_to_spec(axes, compute_map, (), None, order))
                spec, cspec = specs[sk]
            except AxisCollision as e:
                err(("twice", kind, e.mesh_dim), path,
                    f"parameter {path!r} ({kind}): mesh dim {e.mesh_dim!r} shards both dim {e.dims[0]} "
                    f"({axes[e.dims[0]]}) and dim {e.dims[1]} ({axes[e.dims[1]]})")
                continue
            # block-FP8 scales (q38.fp8.Fp8Weight): a weight's grid of 128 x 128 blocks need not split evenly
            is_uneven = any(rx.match(path) for rx in uneven_res) or path.endswith(".scale_inv")
            ok = True
            for i, dims in enumerate(spec):
                k = math.prod(sizes[m] for m in dims)
                if dims and shape[i] % k and not is_uneven:
                    err(("divide", axes[i], shape[i]), path,
                        f"parameter {path!r} dim {i} ({axes[i]}, size {shape[i]}) is sharded over mesh dims "
                        f"{' × '.join(f'{m}={sizes[m]}' for m in dims)} = {k} ranks, and {shape[i]} is not "
                        f"divisible by {k}")
                    ok = False
            if ok:
                out[path] = ParamPlacement(
                    path=path, shape=shape, pattern=kind, logical_axes=tuple(axes), mesh_axes_per_dim=spec,
                    compute_axes_per_dim=cspec, mesh=mesh_items, uneven=is_uneven,
                )
        msgs = []
        for kind, hint in _HINTS.items():
            group = [(first, more) for key, (first, *more) in errors.items() if key[0] == kind]
            for first, more in group[:_MAX_SHOWN]:
                msgs.append(first + (f" (and {len(more)} more alike, e.g. {more[0]!r})" if more else ""))
            if len(group) > _MAX_SHOWN:
                msgs.append(f"{len(group) - _MAX_SHOWN} more problem(s) of this kind")
            if group:
                msgs[-1] += f" ({hint})"
        if msgs:
            raise LayoutError(f"{where}: " + "; ".join(msgs))
        return out

    def validate(
        self, cfg: ModelConfig, world_size: int | Mapping[str, int] | None = None
    ) -> dict[str, ParamPlacement]:
        """Check this layout against ``cfg``'s abstract parameters; returns the placements.

        ``world_size`` defaults to the smallest world the mesh allows (the ``-1`` dim of size 1).
        """
        from q38.model import abstract_params

        if world_size is None:
            world_size = math.prod(s for _, s in self.mesh if s != -1)
        return self.placements(abstract_params(cfg), world_size)

    def describe(self) -> str:
        """One line: name, mesh, activation split."""
        return (
            f"{self.name}: mesh {format_mesh(self.mesh)}; batch over {list(self.batch_mesh_dims)}, "
            f"sequence over {list(self.seq_mesh_dims)}"
        )
