"""The package's boundaries, read from the source: the top-level (model) modules import no parallel/train code;
layers import no parallel/train code and no torch.distributed;
q38.parallel imports nothing from q38.train or q38.cli; the rooms of q38.train import one way; nothing imports q38.cli; the module import graph has no
circle; both runtimes implement the one StepRuntime protocol."""

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


# The rooms of q38.train, each importing only the rooms before it: core (the step's math) <- io (checkpoints and
# files) <- data <- run (the trainer loop, which puts the others together).
TRAIN_ROOMS = ("core", "io", "data", "run")


@pytest.mark.parametrize("i", range(len(TRAIN_ROOMS)))
def test_train_rooms_import_only_the_rooms_before_them(i):
    later = tuple(f"q38.train.{r}" for r in TRAIN_ROOMS[i + 1:])
    assert _violations(f"train/{TRAIN_ROOMS[i]}", later) == []


def test_train_has_only_its_rooms():
    """A new train module goes into one of the rooms (and this test's order says what it may import)."""
    loose = sorted(f.name for f in (ROOT / "train").glob("*.py") if f.name != "__init__.py")
    rooms = sorted(d.name for d in (ROOT / "train").iterdir() if d.is_dir() and d.name != "__pycache__")
    assert (loose, rooms) == ([], sorted(TRAIN_ROOMS))


# The command-line modules: the only top-level files that put the floors together.
CLI_MODULES = ("cli.py", "config_reference.py")


def test_the_model_floor_imports_no_floor_above_it():
    """The top-level modules (config, model, HF I/O, the file rules of ``q38.files``) are the floor the layers, the
    parallel runtime and the trainer stand on: none imports ``q38.train`` or ``q38.parallel`` (an arrow back up)."""
    bad = [f"q38/{f.name} imports {m}" for f in sorted(ROOT.glob("*.py")) if f.name not in CLI_MODULES
           for m in sorted(_imports(f)) if m.split(".")[:2] in (["q38", "train"], ["q38", "parallel"])]
    assert bad == []


def test_the_file_rules_are_a_bottom_floor_module():
    """``q38.files`` imports nothing of q38 but the errors, and not torch: every reader can import it."""
    assert sorted(m for m in _imports(ROOT / "files.py") if m.startswith(("q38", "torch"))) == ["q38.errors"]


def test_parallel_imports_nothing_from_the_cli():
    assert _violations("parallel", ("q38.cli",)) == []


def test_nothing_imports_the_cli():
    bad = [f"{f.relative_to(ROOT.parent)} imports {m}" for f in sorted(ROOT.rglob("*.py")) if f.name != "cli.py"
           for m in sorted(_imports(f)) if m == "q38.cli" or m.startswith("q38.cli.")]
    assert bad == []


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(root: Path) -> dict[str, set[str]]:
    """q38 module -> the q38 modules it imports (``from a import b`` counts as ``a.b`` when that is a module)."""
    files = {_module_name(f, root): f for f in root.rglob("*.py")}
    out = {}
    for name, f in files.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for m in found:
                while m and m not in files:  # a name inside a module: the module
                    m = m.rpartition(".")[0]
                if m and m != name:
                    deps.add(m)
        out[name] = deps
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each holds an import circle)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circle():
    graph = _graph(ROOT)
    assert len(graph) > 40 and "q38.train.core.step" in graph["q38.train.run.trainer"]  # the graph is read, not empty
    assert _circles(graph) == []


def test_the_circle_check_can_fail(tmp_path):
    """Two modules that import each other (one inside a function, one through a package attribute) are a circle."""
    pkg = tmp_path / "q38"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from q38.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def thing():\n    from q38.sub import a\n")
    (pkg / "c.py").write_text("import q38.sub.a\n")
    assert _circles(_graph(pkg)) == [["q38.sub.a", "q38.sub.b"]]


def test_the_import_check_can_fail(tmp_path, monkeypatch):
    """The checker sees a function-level import (so the tests above could fail)."""
    (tmp_path / "layers").mkdir()
    (tmp_path / "layers" / "x.py").write_text("def f():\n    from q38.train.core.step import train_step\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    bad = _violations("layers", ("q38.train",))
    assert len(bad) == 1 and bad[0].endswith("layers/x.py imports q38.train.core.step")


@pytest.mark.parametrize("cls_path", ["q38.parallel.local.LocalRuntime", "q38.parallel.runtime.MeshRuntime"])
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
