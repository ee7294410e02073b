"""The errors every layer of q38 raises for bad input, the unknown-key check and the YAML-file guard: a leaf module (it imports nothing
of q38), so config, kernels, typed config loading and the data pipeline share them without importing each other.

Each error's message names the problem and the fix in one line; ``q38.cli.main`` prints it as
``q38 <command>: error: <message>`` with exit code 2.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Iterator


class ConfigError(ValueError):
    """A configuration value is illegal; the message names the field and the fix."""


class DataError(ValueError):
    """Bad data, tokenizer or loader settings; the message names the file/line or setting and the fix."""


class RunError(RuntimeError):
    """The run cannot go on (out of device memory, an unusable profile setting); the message says why and what to
    change."""


def need(cond: bool, msg: str) -> None:
    """A config rule: ``ConfigError(msg)`` unless ``cond``."""
    if not cond:
        raise ConfigError(msg)


def check_keys(keys, valid, what: str) -> None:
    """Refuse unknown config keys, naming the closest valid key for each (one ``ConfigError``)."""
    valid = list(valid)
    unknown = [k for k in keys if k not in valid]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, valid, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"{what}: {', '.join(hints)}; valid keys: {', '.join(valid)}")


@contextlib.contextmanager
def reading(option: str, value) -> Iterator[None]:
    """A YAML file named by ``option`` that does not parse is one line naming the option, the file and the place."""
    import yaml

    try:
        yield
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        why = getattr(e, "problem", None) or " ".join(str(e).split())
        raise ValueError(f"{option} {value}: not valid YAML ({why}{where}); fix the file") from None
