"""Typed config loading: YAML / ``--set`` values → the attrs config classes, every field checked by its type and range.

``structure(cls, mapping, section)`` goes through a strict ``cattrs`` converter, so a field's annotation is its
whole type declaration and an optional validator from here (``ge``, ``gt``, ``in_range``, ``one_of``) its range. Only
the conversions YAML 1.1 makes ambiguous are made; anything else of the wrong type is refused in one line naming the
key, the value and what is expected (docs/configuration.md#typed-fields).
"""

from __future__ import annotations

import math
import re
import typing
from typing import Any, Mapping

import attrs
import cattrs
from cattrs.errors import ClassValidationError

from q38.errors import ConfigError, check_keys

# A YAML 1.2 / JSON number written with an exponent or a dot, which PyYAML (YAML 1.1) leaves as a string.
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class _Bad(TypeError):
    """A value of the wrong type (the message is built by ``structure`` from the field's annotation)."""


def _float(v: Any, _t=None) -> float:
    if isinstance(v, bool):
        raise _Bad()
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and _FLOAT_RE.match(v.strip()):
        return float(v)
    raise _Bad()


def _int(v: Any, _t=None) -> int:
    if isinstance(v, bool):
        raise _Bad()
    if isinstance(v, int):
        return v
    if isinstance(v, (float, str)):
        f = _float(v)
        if math.isfinite(f) and f.is_integer():
            return int(f)
    raise _Bad()


def _bool(v: Any, _t=None) -> bool:
    if isinstance(v, bool):
        return v
    raise _Bad()


def _str(v: Any, _t=None) -> str:
    if isinstance(v, str):
        return v
    raise _Bad()


def _make_converter() -> cattrs.Converter:
    c = cattrs.Converter(detailed_validation=True, forbid_extra_keys=True)
    for t, hook in ((int, _int), (float, _float), (bool, _bool), (str, _str)):
        c.register_structure_hook(t, hook)

    def is_str_tuple(t) -> bool:
        return typing.get_origin(t) is tuple and typing.get_args(t) in ((str, Ellipsis),)

    def str_tuple(v, _t):
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
            raise _Bad()
        return tuple(v)

    c.register_structure_hook_func(is_str_tuple, str_tuple)
    return c


CONVERTER = _make_converter()


def describe(t) -> str:
    """``"an integer"``, ``"a number or null"``, ... for an annotation."""
    args = typing.get_args(t)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " or ".join(describe(a) for a in rest) + " or null"
    if typing.get_origin(t) is tuple:
        return "a list of strings"
    if typing.get_origin(t) is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(t, str(t))


def _prefix(msg: str, section: str, names) -> str:
    """``"lr must be > 0"`` → ``"train.lr must be > 0"`` when the message starts with a field name."""
    if not section:
        return msg
    first = re.split(r"[\s:(]", msg, maxsplit=1)[0]
    return f"{section}.{msg}" if first in names else msg


def structure(cls, d: Mapping[str, Any], section: str, *, where: str | None = None):
    """``cls`` from ``d``; unknown keys (with the closest valid one), wrong types and out-of-range values end in one
    ``ConfigError`` naming ``section.key``. ``where``: the source shown with unknown keys (default ``section``)."""
    fields = attrs.fields_dict(attrs.resolve_types(cls))
    if not isinstance(d, Mapping):
        raise ConfigError(f"{section} must be a mapping of keys, got {type(d).__name__}")
    check_keys(d, list(fields), f"unknown key(s) in section {where or section!r}")
    try:
        return CONVERTER.structure(dict(d), cls)
    except ClassValidationError as e:
        typed, other = e.group_exceptions()
        for exc in other:  # raised by a range validator or __attrs_post_init__ while building the instance
            if isinstance(exc, ConfigError):
                raise ConfigError(_prefix(str(exc), section, fields)) from None
        for exc, note in typed:
            name = getattr(note, "name", None)
            if name in fields:
                if isinstance(exc, ConfigError):
                    raise ConfigError(_prefix(str(exc), section, fields)) from None
                inner = _nested_error(exc, f"{section}.{name}")  # a section inside the section (run.profile)
                if inner is not None:
                    raise inner from None
                raise ConfigError(
                    f"{section}.{name} must be {describe(fields[name].type)}, got {d[name]!r}"
                ) from None
        for exc in other:  # not a config problem (e.g. the layer kinds not loaded): its own message, not cattrs'
            raise exc from None
        raise ConfigError(f"{section}: {' '.join(str(e).split())}") from None
    except ConfigError as e:  # a range validator or __attrs_post_init__ rule
        raise ConfigError(_prefix(str(e), section, fields)) from None


def _nested_error(exc: BaseException, where: str) -> ConfigError | None:
    """The first ``ConfigError`` (or unknown key) inside a nested class's structuring error, or None."""
    from cattrs.errors import ForbiddenExtraKeysError

    stack = [exc]
    while stack:
        e = stack.pop(0)
        if isinstance(e, ConfigError):
            return ConfigError(str(e))
        if isinstance(e, ForbiddenExtraKeysError):
            valid = ", ".join(a.name for a in attrs.fields(e.cl))
            return ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, sorted(e.extra_fields)))}; valid keys: "
                               f"{valid}")
        stack.extend(getattr(e, "exceptions", ()))
    return None


# ---- range validators (attrs validators raising ConfigError; None passes, for optional fields) ---------------------


def _fmt(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def in_range(lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False):
    """``lo <= v <= hi`` (``<`` where open); either bound may be None."""

    def check(inst, a, v) -> None:
        if v is None:
            return
        ok = (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or (v < hi if hi_open else v <= hi))
        if not ok or (isinstance(v, float) and math.isnan(v)):
            if lo is not None and hi is not None:
                rng = f"in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"
            elif lo is not None:
                rng = f"{'>' if lo_open else '>='} {_fmt(lo)}"
            else:
                rng = f"{'<' if hi_open else '<='} {_fmt(hi)}"
            raise ConfigError(f"{a.name} must be {rng}, got {_fmt(v)}")

    return check


def ge(lo):
    return in_range(lo)


def gt(lo):
    return in_range(lo, lo_open=True)


def finite(inst, a, v) -> None:
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{a.name} must be a finite number, got {v!r}")


def boolean(inst, a, v) -> None:
    """``True`` or ``False`` (for a config built in Python; YAML values are typed by the converter already)."""
    if not isinstance(v, bool):
        raise ConfigError(f"{a.name} must be true or false, got {v!r}")


def one_of(*choices):
    def check(inst, a, v) -> None:
        if v is not None and v not in choices:
            raise ConfigError(f"{a.name} must be one of {', '.join(map(str, choices))}, got {v!r}")

    return check
