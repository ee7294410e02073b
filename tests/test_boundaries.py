"""The package's boundaries, read from the source (issue #9): layers import no parallel/train code and no
torch.distributed; q38.parallel imports nothing from q38.train; both runtimes implement the one StepRuntime protocol."""

import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "q38"


def _imports(path: Path) -> set[str]:
    """Every module a file imports (top level and inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def _violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for f in sorted((ROOT / folder).rglob("*.py")):
        for mod in sorted(_imports(f)):
            if any(mod == p or mod.startswith(p + ".") for p in forbidden):
                bad.append(f"{f.relative_to(ROOT.parent)} imports {mod}")
    return bad


def test_layers_import_no_parallel_train_or_distributed():
    assert _violations("layers", ("q38.parallel", "q38.train", "torch.distributed")) == []


def test_parallel_imports_nothing_from_train():
    assert _violations("parallel", ("q38.train",)) == []


def test_the_import_check_can_fail(tmp_path, monkeypatch):
    """The checker sees a function-level import (so the tests above could fail)."""
    (tmp_path / "layers").mkdir()
    (tmp_path / "layers" / "x.py").write_text("def f():\n    from q38.train.step import train_step\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    bad = _violations("layers", ("q38.train",))
    assert len(bad) == 1 and bad[0].endswith("layers/x.py imports q38.train.step")


@pytest.mark.parametrize("cls_path", ["q38.parallel.local.LocalParallel", "q38.parallel.runtime.MeshParallel"])
def test_runtimes_implement_the_step_protocol(cls_path):
    import importlib

    from q38.layers.context import StepRuntime

    mod, name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(mod), name)
    members = [m for m in dir(StepRuntime) if not m.startswith("_")] + list(StepRuntime.__annotations__)
    # attributes may be set in __init__: look at the class and at its constructor's assignments
    src = inspect.getsource(cls)
    missing = [m for m in set(members) if not hasattr(cls, m) and f"self.{m} =" not in src]
    assert missing == []
