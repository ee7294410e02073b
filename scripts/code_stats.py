"""The longest modules and docstrings of q38 (lines), for keeping modules to one job and docstrings short.

    python scripts/code_stats.py [q38]
"""

import ast
import pathlib
import sys


def main(root: str = "q38", top: int = 6) -> None:
    mods, docs = [], []
    for p in sorted(pathlib.Path(root).rglob("*.py")):
        src = p.read_text()
        mods.append((len(src.splitlines()), str(p)))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                d = ast.get_docstring(node, clean=False)
                if d:
                    docs.append((len(d.splitlines()), f"{p}:{getattr(node, 'name', '<module>')}"))
    mods.sort(reverse=True)
    docs.sort(reverse=True)
    print("longest modules (lines):", *(f"{n:5d}  {f}" for n, f in mods[:top]), sep="\n  ")
    print("longest docstrings (lines):", *(f"{n:5d}  {f}" for n, f in docs[:top]), sep="\n  ")
    print(f"{len(mods)} modules, {sum(n for n, _ in mods):,} lines")


if __name__ == "__main__":
    main(*sys.argv[1:2])
