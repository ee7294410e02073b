"""``q38 --help`` stays current: every option a subcommand's parser accepts is named on that command's lines of the
top-level usage (the text a new user reads first)."""

import re

import pytest

from q38.cli import COMMANDS, main, usage


def _options(cmd: str, capsys) -> set[str]:
    assert main([cmd, "--help"]) == 0
    usage = capsys.readouterr().out.split("\n\n")[0]  # argparse's usage block lists every option
    return set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", usage)) - {"--help"}


def _usage_lines(cmd: str) -> str:
    """The top-level usage lines that describe ``cmd`` (a command's entry, and its continuation lines)."""
    out, mine = [], False
    for line in usage().splitlines()[1:]:
        if re.match(r"  \S", line):
            mine = line.split()[:2] == ["q38", cmd]
        if mine:
            out.append(line)
    return "\n".join(out)


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_top_level_usage_names_every_option(cmd, capsys):
    text = _usage_lines(cmd)
    assert text, f"q38 --help has no line for the {cmd!r} command"
    missing = sorted(o for o in _options(cmd, capsys) if not re.search(re.escape(o) + r"(?![\w-])", text))
    assert not missing, f"q38 --help does not mention {missing} of `q38 {cmd}`"


NO_TORCH = r"""
import contextlib, io, json, sys
from q38.cli import COMMANDS, main
codes = {}
for argv in (["--help"], *([c, "--help"] for c in COMMANDS), ["generate"], ["eval", "RUN"], ["plan", "--world", "1"],
             ["train", "--bogus"], ["prepare-data"], ["launch", "--standalone"], ["convert", "a", "b"],
             ["generate", "RUN", "--prompt", "x", "--top-k", "-1"], ["nosuchcommand"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        codes[" ".join(argv)] = main(list(argv))
print(json.dumps({"codes": codes, "heavy": sorted(m for m in ("torch", "numpy", "transformers", "tokenizers")
                                                  if m in sys.modules)}))
"""


def test_help_and_usage_errors_do_not_import_torch():
    """`q38 --help`, every command's --help and usage errors answer before torch (or numpy) is imported: the
    commands import what they run only after their arguments parse (benchmarks/cli_start.py times it)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", NO_TORCH], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    assert rec["heavy"] == [], f"imported {rec['heavy']} to answer {list(rec['codes'])}"
    helps = {k: v for k, v in rec["codes"].items() if k.endswith("--help")}
    assert set(helps.values()) == {0}, helps
    errors = {k: v for k, v in rec["codes"].items() if not k.endswith("--help")}
    assert set(errors.values()) == {2}, errors


def test_plan_dtype_names_are_the_plans():
    """`q38 plan --dtype` lists its names without importing the plan (torch): the list is the plan's own."""
    from q38.cli import PLAN_DTYPES
    from q38.parallel.plan import DTYPES

    assert sorted(PLAN_DTYPES) == sorted(DTYPES)
