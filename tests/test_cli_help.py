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
