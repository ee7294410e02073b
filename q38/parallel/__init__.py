"""q38.parallel: the only code that reads the spec tables (``specs/parallel``), builds meshes, places DTensors
and performs collectives."""

from q38.parallel.layout import (
    ACTIVATION_AXES,
    MESH_DIM_NAMES,
    MESH_DIM_ROLES,
    Layout,
    LayoutError,
    ParamPlacement,
    logical_to_spec,
)
from q38.parallel.plan import PlanReport, format_plan, plan, plan_cli

_RUNTIME = ("Mesh", "make_mesh", "shard", "unshard", "shard_batch", "init_sharded", "MeshParallel")


def __getattr__(name):
    """The mesh runtime (torch.distributed.tensor) is imported on first use, so `q38 plan` stays light."""
    if name in _RUNTIME:
        from q38.parallel import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'q38.parallel' has no attribute {name!r}")


__all__ = [*_RUNTIME,
    "ACTIVATION_AXES", "MESH_DIM_NAMES", "MESH_DIM_ROLES", "Layout", "LayoutError", "ParamPlacement", "PlanReport",
    "format_plan", "logical_to_spec", "plan", "plan_cli",
]
