"""q38.parallel: the only code that reads the spec tables (``specs/parallel``), builds meshes, places DTensors
and performs collectives."""

from q38.parallel.layout import (
    ACTIVATION_AXES,
    MESH_DIM_ROLES,
    Layout,
    LayoutError,
    ParamPlacement,
    logical_to_spec,
)
from q38.parallel.plan import PlanReport, format_plan, plan

_MESH = ("Mesh", "make_mesh", "shard", "unshard", "shard_batch", "init_sharded")
_RUNTIME = (*_MESH, "MeshRuntime")


def __getattr__(name):
    """The mesh runtime (torch.distributed.tensor) is imported on first use, so `q38 plan` stays light."""
    if name in _RUNTIME:
        import importlib

        return getattr(importlib.import_module("q38.parallel.mesh" if name in _MESH else "q38.parallel.runtime"), name)
    raise AttributeError(f"module 'q38.parallel' has no attribute {name!r}")


__all__ = [*_RUNTIME,
    "ACTIVATION_AXES", "MESH_DIM_ROLES", "Layout", "LayoutError", "ParamPlacement", "PlanReport",
    "format_plan", "logical_to_spec", "plan",
]
