"""q38.parallel: the only code that reads the spec tables (``specs/parallel``), builds meshes, places DTensors
and performs collectives."""

from q38.parallel.layout import (
    ACTIVATION_AXES,
    MESH_DIM_NAMES,
    Layout,
    LayoutError,
    ParamPlacement,
)
from q38.parallel.plan import PlanReport, format_plan, plan, plan_cli

__all__ = [
    "ACTIVATION_AXES", "MESH_DIM_NAMES", "Layout", "LayoutError", "ParamPlacement", "PlanReport", "format_plan",
    "plan", "plan_cli",
]
