"""flash-linear-attention's Triton kernels on the CPU, through Triton's interpreter (``TRITON_INTERPRET=1``), for the
slow tests that check how q38 wires FLA (packed rows, the CP state carry, the compile custom op) without a device.

``fla_gdn()`` returns FLA's ``chunk_gated_delta_rule`` ready to run here, or skips the test naming what is missing
(install with ``pip install -e '.[fla-cpu]'``; ``.ci/run`` does before the slow suite). Two small patches of Triton
make the interpreter run FLA, applied once before FLA is imported:

1. the autotuner keeps only its first config: choosing one benchmarks every config through the GPU driver, which
   the interpreter does not have ("0 active drivers");
2. the interpreter's AST rewrite wraps every ``for`` loop variable as a Triton tensor (as it already wraps every
   assigned value): FLA writes ``i_t.to(tl.int64)`` on loop indices, which the interpreter yields as Python ints.

What this does not check: the other autotune configs, GPU code generation, bf16 numerics (the device script's)."""

import ast
import importlib.util
import os
import warnings

import pytest

_READY = False


def _patch_triton() -> None:
    from triton.runtime import autotuner, interpreter

    run = autotuner.Autotuner.run

    def first_config_only(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    autotuner.Autotuner.run = first_config_only

    def visit_For(self, node):  # noqa: N802 (ast.NodeTransformer's naming)
        node = self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            name = node.target.id
            wrap = ast.Assign(
                targets=[ast.Name(id=name, ctx=ast.Store())],
                value=ast.Call(func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                                  attr="to_tensor", ctx=ast.Load()),
                               args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)], keywords=[]))
            node.body.insert(0, ast.fix_missing_locations(ast.copy_location(wrap, node)))
        return node

    interpreter.ASTTransformer.visit_For = visit_For


def fla_gdn():
    """FLA's ``chunk_gated_delta_rule`` under the Triton interpreter (skips when FLA or Triton is not installed)."""
    global _READY
    for module, pkg in (("triton", "triton"), ("fla", "flash-linear-attention")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{pkg} is not installed (pip install -e '.[fla-cpu]' runs FLA's kernels on the CPU)")
    if not _READY:
        # Triton picks the interpreter as it defines each kernel (tests/conftest.py sets the switch before anything
        # imports Triton)
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.fail("TRITON_INTERPRET=1 must be set before Triton is imported (tests/conftest.py does on a "
                        "machine without CUDA)")
        _patch_triton()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Triton is not supported on current platform, roll back to CPU"
            import fla.ops.gated_delta_rule  # noqa: F401
        _READY = True
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule
