"""The configuration reference (docs/reference.md), generated from the classes the run-config loader structures.

``python -m q38.config_reference > docs/reference.md`` writes the page; ``tests/test_config_reference.py`` fails when
the page is not what this prints, or names a key the loader refuses, or misses one it accepts.

Each row comes from one attrs field of a section class (``sections()``), so a new field appears on the next
regeneration with no edit here:

- **type** and **default**: the field's annotation and default;
- **bounds**: what the loader itself refuses for this key alone (the other keys at their defaults), found by asking
  it (``RunConfig.from_dict`` with ``--set section.key=value``, ``ModelConfig.from_dict`` for model keys): the lowest
  integer accepted among -1, 0, 1; the interval of -1, 0, 0.5, 1, 2 accepted for a number; the choices the loader's
  own message lists for a string it refuses. Rules between keys are on docs/configuration.md;
- **description**: the field's ``metadata={"doc": ...}`` if it has one, else its comment: the comment at the end of
  its line, or the comment lines directly above it (a first comment line of at most five words
  without `:`, `,` or `.` heads a group of fields and is left out).
"""

from __future__ import annotations

import inspect
import io
import re
import tokenize
import typing
import warnings
from typing import Any

import attrs

SECTIONS_DOC = {
    "model": "the model (a preset under `specs/models/`, a model YAML file or an inline mapping of these keys; a Hugging "
             "Face directory's `config.json` is read by its own names, docs/hf_checkpoints.md)",
    "data": "what the run reads (docs/data.md)",
    "train": "optimizer, schedule, losses, recompute, precision (`TrainConfig`)",
    "run": "steps, output, logging, checkpoints, evaluation, devices (docs/operations.md)",
    "run.profile": "a `torch.profiler` trace of some steps (`run.profile: {start: 5}`)",
    "kernels": "one implementation per op, or `auto` (docs/kernels.md)",
    "peft": "LoRA on a frozen base; without this section a run is a full fine-tune (docs/finetuning.md#lora)",
}
TOP_LEVEL = (
    ("model", "str or mapping", "`init_from`'s model", "a preset name, a model YAML file, a Hugging Face directory, or "
     "the `model` keys below inline"),
    ("init_from", "str or null", "`null`", "the starting weights: a q38 checkpoint (or run directory) or a Hugging "
     "Face directory; null: a fresh init"),
    ("layout", "str", "`single`", "a layout name under `specs/parallel/` or a layout YAML path (docs/parallel.md)"),
)
_NO_CHOICES = "__not_a_choice__"


def sections() -> dict[str, type]:
    """Section name → the attrs class its keys are structured into."""
    from q38.kernels import KernelConfig
    from q38.lora import PeftConfig
    from q38.model_config import ModelConfig
    from q38.train.core.step_config import TrainConfig
    from q38.train.run.profile import ProfileOptions
    from q38.train.run.run_config import DataConfig, RunOptions

    return {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "run": RunOptions,
            "run.profile": ProfileOptions, "kernels": KernelConfig, "peft": PeftConfig}


def extra_model_keys() -> dict[str, str]:
    """Model keys the loader accepts beyond ``ModelConfig``'s fields, with what it does with each."""
    from q38.model_config import LEGACY_KEYS

    out = {"full_attention_interval": "every n-th layer is full attention, the rest GDN (used when `layer_types` "
                                      "is not given)"}
    for old, new in LEGACY_KEYS.items():
        out[old] = f"older name, read as `kernels.{new}` with a note"
    return out


# ---- descriptions ------------------------------------------------------------------------------------------------


def _comments(cls: type) -> tuple[dict[str, str], list[str]]:
    """``{field: description}`` from the comments of ``cls``'s source, and the source lines."""
    lines, _ = inspect.getsourcelines(cls)
    src = "".join(lines)
    trailing: dict[int, str] = {}  # line index → the comment ending a line with code
    whole: dict[int, str] = {}  # line index → a comment-only line
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0] - 1
            text = tok.string.lstrip("#").strip()
            (whole if lines[row].lstrip().startswith("#") else trailing)[row] = text
    docs = {}
    for a in attrs.fields(cls):
        row = next((i for i, ln in enumerate(lines) if re.match(rf"\s+{a.name}\s*:", ln)), None)
        if row is None:
            continue
        if row in trailing:
            docs[a.name] = trailing[row]
            continue
        above, i = [], row - 1
        while i >= 0 and i in whole:
            above.insert(0, whole[i])
            i -= 1
        if above and _is_heading(above[0]):
            above = above[1:]
        if above:
            docs[a.name] = " ".join(above)
    return docs, lines


def _is_heading(line: str) -> bool:
    """A comment line naming a group of fields (``# losses``, ``# optimizer (AdamW) and schedule``), not one field:
    at most five words, without ``:``, ``,`` or ``.``."""
    return len(line.split()) <= 5 and not re.search(r"[:,.]", line)


def descriptions(cls: type) -> dict[str, str]:
    """Each field's one-line description (``metadata["doc"]``, else its comment; empty when it has neither)."""
    comments, _ = _comments(cls)
    return {a.name: a.metadata.get("doc") or comments.get(a.name, "") for a in attrs.fields(cls)}


# ---- types and defaults --------------------------------------------------------------------------------------------


def type_name(t: Any) -> str:
    """``int``, ``float or null``, ``list of str`` ... for an annotation."""
    if t is Any:
        return "any"
    args = typing.get_args(t)
    origin = typing.get_origin(t)
    if origin is tuple:
        return "list of " + type_name(args[0])
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    if args:  # a union
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    return getattr(t, "__name__", str(t))


def yaml_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(yaml_value(x) for x in v) + "]"
    return str(v)


def default_of(a: attrs.Attribute) -> str:
    d = a.default
    if d is attrs.NOTHING:
        return "required"
    if isinstance(d, attrs.Factory):  # type: ignore[arg-type]
        d = d.factory()
    if attrs.has(type(d)):
        return "defaults"
    return f"`{yaml_value(d)}`"


# ---- bounds, asked of the loader --------------------------------------------------------------------------------


def _tiny_model() -> dict:
    import yaml

    from q38.model_config import SPECS_DIR

    return yaml.safe_load((SPECS_DIR / "models" / "tiny.yaml").read_text())


def try_key(section: str, key: str, value: Any) -> str | None:
    """None when the loader accepts ``section.key = value`` (the other keys at their defaults), else its message."""
    import q38  # noqa: F401  (loads the layer-kind table ModelConfig checks against)
    from q38.errors import ConfigError
    from q38.model_config import ModelConfig
    from q38.train.run.run_config import RunConfig

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if section == "model":
                ModelConfig.from_dict({**_tiny_model(), key: value}, source="model")
            elif section == "run.profile":
                RunConfig.from_dict({"model": "tiny"}, overrides={"run.profile": {"start": 1, key: value}})
            else:
                RunConfig.from_dict({"model": "tiny"}, overrides={f"{section}.{key}": value})
    except ConfigError as e:
        return str(e)
    except (TypeError, ValueError) as e:  # a class built without the schema's converter
        return str(e)
    return None


def _num(x: float) -> str:
    return f"{x:g}"


def bounds(section: str, a: attrs.Attribute) -> str:
    """What the loader accepts for this key alone: ``≥ 0``, ``(0, 1]``, ``cosine, linear, constant`` ... or ``""``."""
    kinds = set(typing.get_args(a.type) or (a.type,)) - {type(None)}
    if kinds & {int, float} and bool not in kinds:
        probes = (-1, 0, 1) if float not in kinds else (-1, 0, 0.5, 1, 2)
        ok = {v: try_key(section, a.name, v) is None for v in probes}
        if all(ok.values()):
            return ""
        if float not in kinds:
            low = next((v for v in probes if ok[v]), None)
            return f"≥ {low}" if low is not None else "≥ 1"
        if [v for v in probes if ok[v]] == [0]:
            return "0 only"
        lo = None if ok[-1] else ("[0" if ok[0] else "(0" if ok[0.5] else None)
        hi = None if ok[2] else ("1]" if ok[1] else "1)" if ok[0.5] else None)
        if lo and hi:
            return f"{lo}, {hi}"
        if lo:
            return ("≥ " if lo[0] == "[" else "> ") + "0"
        if hi:
            return ("≤ " if hi[-1] == "]" else "< ") + "1"
        return ""
    if str in kinds:
        msg = try_key(section, a.name, _NO_CHOICES) or ""
        m = (re.search(r"must be one of \(?([^()]+?)\)?(?: \([^()]*\))?, got", msg)
             or re.search(r"; known [\w ]+: (.+)$", msg))
        if m:
            return ", ".join(c.strip(" '\"") for c in m.group(1).split(","))
    return ""


# ---- the page --------------------------------------------------------------------------------------------------


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def rows(section: str, cls: type) -> list[tuple[str, str, str, str, str]]:
    """``(key, type, default, bounds, description)`` for each key of ``section``."""
    hints = typing.get_type_hints(cls)
    docs = descriptions(cls)
    out = []
    for a in attrs.fields(cls):
        a = a.evolve(type=hints.get(a.name, a.type))
        if attrs.has(_base(a.type)):  # a nested section (run.profile): its keys have their own table
            kind = "mapping or null" if type(None) in typing.get_args(a.type) else "mapping"
            out.append((f"{section}.{a.name}", kind, default_of(a), "", f"{docs[a.name]} (its keys: below)"))
            continue
        out.append((f"{section}.{a.name}", type_name(a.type), default_of(a), bounds(section, a), docs[a.name]))
    if section == "model":
        out += [(f"model.{k}", "", "", "", doc) for k, doc in extra_model_keys().items()]
    return out


def _base(t: Any) -> Any:
    args = [x for x in typing.get_args(t) if x is not type(None)]
    return args[0] if len(args) == 1 else t


def generate() -> str:
    """The text of docs/reference.md."""
    out = [
        "# Configuration reference",
        "",
        "<!-- generated by `python -m q38.config_reference > docs/reference.md`; do not edit by hand -->",
        "",
        "Every key a run config (`q38 train CONFIG`, `--set section.key=value`) accepts, made from the classes the "
        "loader structures the config into (`q38/config_reference.py`). **type** and **default** are the field's own; "
        "**bounds** is what the loader refuses for that key alone, the other keys at their defaults (rules between "
        "keys, e.g. `warmup_steps ≤ total_steps`, are on [configuration.md](configuration.md)). `null` is YAML's "
        "None. A key not on this page is refused at load time, naming the closest valid key.",
        "",
        "## Top level",
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
        *(f"| `{k}` | {t} | {d} | {_cell(doc)} |" for k, t, d, doc in TOP_LEVEL),
        *(f"| `{s}` | section | | {_cell(doc)} |" for s, doc in SECTIONS_DOC.items() if "." not in s),
    ]
    for section, cls in sections().items():
        out += ["", f"## `{section}`", "", f"{SECTIONS_DOC[section][0].upper()}{SECTIONS_DOC[section][1:]}; "
                f"`{cls.__module__}.{cls.__name__}`.", "",
                "| key | type | default | bounds | description |", "|---|---|---|---|---|"]
        out += [f"| `{k}` | {t} | {d} | {b} | {_cell(doc)} |" for k, t, d, b, doc in rows(section, cls)]
    return "\n".join(out) + "\n"


def page_keys(text: str) -> set[str]:
    """The keys a reference page names (the first cell of each table row, `section.key`)."""
    return {m.group(1) for m in re.finditer(r"^\| `([\w.]+)` \|", text, re.M) if "." in m.group(1)}


def main() -> None:
    import sys

    sys.stdout.write(generate())


if __name__ == "__main__":
    main()

