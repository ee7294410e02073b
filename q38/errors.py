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
    odd = [k for k in keys if not isinstance(k, str)]
    if odd:  # YAML turns `1:`, `null:`, `? [a]` into keys of other types
        raise ConfigError(f"{what}: {', '.join(repr(k) for k in odd)} (keys must be names); valid keys: "
                          f"{', '.join(valid)}")
    unknown = [k for k in keys if k not in valid]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, valid, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"{what}: {', '.join(hints)}; valid keys: {', '.join(valid)}")


def yaml_problem(e: BaseException) -> str:
    """What a ``yaml.YAMLError`` (or a decode error of the file) says went wrong, and where, in one line."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    why = getattr(e, "problem", None) or " ".join(str(e).split())
    return f"{why}{where}"


def read_yaml_file(path, what: str):
    """The parsed YAML document of ``path`` (``yaml.safe_load``, but a key given twice is refused: PyYAML would keep
    the last one silently); a file that does not decode or parse is one ``ConfigError`` naming ``what``, the file
    and the place."""
    import yaml

    class Strict(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:  # an unhashable key: SafeLoader itself refuses it below
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice", key_node.start_mark)
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=Strict)  # noqa: S506 (a SafeLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {path}: not valid YAML ({yaml_problem(e)}); fix the file") from None
    except RecursionError:
        raise ConfigError(f"{what} {path}: nested too deeply to read; fix the file") from None


@contextlib.contextmanager
def reading(option: str, value) -> Iterator[None]:
    """A YAML file named by ``option`` that does not parse is one line naming the option, the file and the place."""
    import yaml

    try:
        yield
    except yaml.YAMLError as e:
        raise ValueError(f"{option} {value}: not valid YAML ({yaml_problem(e)}); fix the file") from None
    except RecursionError:
        raise ValueError(f"{option} {value}: nested too deeply to read; fix the file") from None
    except ValueError as e:  # the loader's own line for a file that does not parse: name the option too
        if "not valid YAML" in str(e) or "nested too deeply" in str(e):
            raise type(e)(f"{option}: {e}") from None
        raise


# ---- required placeholders (what `q38 plan --out` leaves for the user to fill) ----------------------------------

PLACEHOLDER = "<fill in: "  # a run-config value that starts so is a required key not yet filled (docs/plan.md)


def placeholder(what: str) -> str:
    """The value ``q38 plan --out`` writes for a required key it cannot know: ``<fill in: WHAT>``."""
    return f"{PLACEHOLDER}{what}>"


def unfilled(raw) -> list[tuple[str, str]]:
    """``(key, what)`` of every placeholder left in a run-config mapping: top-level values and the values of its
    sections (``init_from``, ``data.path``, ...), in file order."""
    out: list[tuple[str, str]] = []

    def look(key: str, v) -> None:
        if isinstance(v, str) and v.startswith(PLACEHOLDER):
            out.append((key, v[len(PLACEHOLDER):].rstrip(">").strip()))

    for k, v in (raw or {}).items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                look(f"{k}.{kk}", vv)
        else:
            look(str(k), v)
    return out


def check_filled(raw, source: str) -> None:
    """One ``ConfigError`` naming every placeholder left in ``raw`` and how to fill it (edit the file, or
    ``--set KEY=VALUE`` on the command line)."""
    left = unfilled(raw)
    if left:
        keys = "; ".join(f"{k} ({what})" for k, what in left)
        sets = " ".join(f"--set {k}=..." for k, _ in left)
        raise ConfigError(f"{source}: fill in the required key(s) q38 plan left as placeholders: {keys}; edit them in "
                          f"the file, or pass {sets}")
