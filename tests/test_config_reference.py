"""docs/reference.md, the configuration reference: generated from the loader's classes, and naming exactly the keys the
loader accepts. The accepted keys are read from the loader's own refusal of an unknown key ("valid keys: ..."), not
from the generator."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference.md"
REGENERATE = "python -m q38.config_reference > docs/reference.md"


@pytest.fixture(scope="module")
def generated() -> str:
    from q38.config_reference import generate

    return generate()


def loader_keys(section: str) -> set[str]:
    """The keys of ``section`` the loader lists when it refuses an unknown one."""
    from q38.config_reference import try_key

    msg = try_key(section, "no_such_key_xyz", 1) if section != "run.profile" else try_key("run.profile",
                                                                                          "no_such_key_xyz", 1)
    assert msg is not None and "no_such_key_xyz" in msg, msg
    m = re.search(r"valid keys: (.+)$", msg)
    assert m, msg
    return {f"{section}.{k.strip()}" for k in m.group(1).split(",")}


def loader_sections() -> set[str]:
    from q38.errors import ConfigError
    from q38.train.run.run_config import RunConfig

    with pytest.raises(ConfigError, match="valid sections") as e:
        RunConfig.from_dict({"model": "tiny", "no_such_section": {}})
    return {s.strip() for s in str(e.value).split("valid sections: ")[1].split(",")}


def key_problems(text: str) -> list[str]:
    """What is wrong with a reference page's keys: one the loader accepts that it misses, one it names that the
    loader refuses as unknown, a section the loader has that it has no heading for."""
    from q38.config_reference import page_keys, sections, try_key

    out = []
    named = page_keys(text)
    headings = set(re.findall(r"^## `([\w.]+)`", text, re.M))
    for s in loader_sections() - {"model", "init_from", "layout"}:
        if s not in headings:
            out.append(f"section {s!r} has no table on the page")
    for section in sections():
        out += [f"{k}: accepted by the loader, missing from the page" for k in sorted(loader_keys(section) - named)]
    for key in sorted(named):
        section, _, name = key.rpartition(".")
        msg = try_key(section, name, None) if section in sections() else f"unknown section {section!r}"
        if msg is not None and ("unknown" in msg or "no_such" in msg):
            out.append(f"{key}: on the page, refused by the loader ({msg})")
    return out


def test_reference_page_is_generated_from_the_schema(generated):
    assert PAGE.read_text(encoding="utf-8") == generated, f"docs/reference.md is out of date: run `{REGENERATE}`"


def test_reference_page_names_exactly_the_keys_the_loader_accepts():
    found = key_problems(PAGE.read_text(encoding="utf-8"))
    assert not found, "\n".join(found) + f"\n(add the field to the section class, then `{REGENERATE}`)"


def test_every_key_has_a_description(generated):
    rows = [r for r in generated.splitlines() if re.match(r"\| `[\w]+\.[\w.]+` \|", r)]
    assert len(rows) > 100, len(rows)
    bare = [r.split("|")[1].strip() for r in rows if r.rstrip().endswith("|  |")]
    assert not bare, (f"keys without a description: {bare}; add a comment at the end of the field's line (or "
                      "metadata={'doc': ...})")


def test_the_key_check_flags_a_missing_and_an_unknown_key():
    text = PAGE.read_text(encoding="utf-8")
    lr = next(r for r in text.splitlines() if r.startswith("| `train.lr` |"))
    broken = text.replace(lr + "\n", "").replace("## `peft`", "## `pefts`")
    broken += "| `train.no_such_key` | int | `1` | | a key the loader does not have |\n"
    found = key_problems(broken)
    assert "train.lr: accepted by the loader, missing from the page" in found, found
    assert any(p.startswith("train.no_such_key: on the page, refused by the loader") for p in found), found
    assert "section 'peft' has no table on the page" in found, found


def test_bounds_and_descriptions_come_from_the_fields():
    """Independent of the generator's probing: what the loader's messages say about three keys, and the comment
    at the end of a field's line."""
    from q38.config_reference import generate, try_key

    text = generate()
    row = {r.split("|")[1].strip(" `"): [c.strip() for c in r.split("|")[2:-1]] for r in text.splitlines()
           if r.startswith("| `")}
    assert row["train.beta1"][2] == "[0, 1)" and "must be in [0, 1)" in try_key("train", "beta1", 1.0)
    assert row["train.schedule"][2] == "cosine, linear, constant"
    assert row["data.prefetch"][1:3] == ["`1`", "≥ 0"] and try_key("data", "prefetch", 0) is None
    assert row["run.steps"][2] == "≥ 1" and try_key("run", "steps", 0) is not None
    assert row["peft.dropout"][2] == "0 only"
    assert row["data.batch_size"][3] == "rows per data-parallel rank per step"
    assert row["model.num_attention_heads"][3] == "query heads of a full-attention layer"  # not its group's heading
