"""The project stands alone: every doc a tracked file mentions exists in the repository, with the section it names.

Scanned: every tracked ``.py``, ``.md``, ``.yaml``, ``.sh`` and ``.toml`` file. Checked:

- ``docs/<page>.md`` (and any other ``path/<name>.md``) exists, relative to the repository root or to the
  mentioning file; a markdown link ``[text](page.md)`` is resolved relative to the file it is in;
- a bare ``<name>.md`` is a tracked file somewhere in the repository;
- ``<page>.md#section`` names a heading of that page (GitHub's anchor of the heading);
- ``<page>.md §…`` section references are refused (the docs use ``#section`` anchors);
- no file names the developers' private notes, which live outside the repository.
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTENSIONS = (".py", ".md", ".yaml", ".sh", ".toml")
# The developers' private notes (outside the repository); spelled in pieces so this file does not mention them.
OUTSIDE = tuple(stem + ".md" for stem in ("architecture", "losses_and_kernels", "qwen3_8_2_4T", "DESIGN", "STYLE"))
OUTSIDE_PATHS = ("shared" + "/reference", "/work/" + "shared", "reference" + "/parallel.md")

_URL = re.compile(r"[a-z]+://\S+")
_LINK = re.compile(r"\]\(([^)\s#]+\.md)(?:#([^)\s]+))?\)")
_MENTION = re.compile(r"(?<![\w./-])((?:\.\./|\./)?(?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+))?(?![\w])")
_SECTION = re.compile(r"[\w-]+\.md`{0,2}\s*§")


def tracked_files(root: Path = ROOT) -> list[Path]:
    """The repository's tracked text files of the scanned kinds (every such file outside hidden dirs and .venv when
    git is not available)."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
        paths = [root / p for p in out.splitlines()]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in root.rglob("*") if not any(part.startswith(".") for part in p.relative_to(root).parts)]
    return sorted(p for p in paths if p.suffix in EXTENSIONS and p.is_file())


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of a markdown page's headings (lowercase, punctuation dropped, spaces to hyphens, ``-1``,
    ``-2`` … for repeats); lines inside code fences are not headings."""
    anchors, seen, fenced = set(), {}, False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def problems(root: Path, files: list[Path]) -> list[str]:
    """``file:line: reference: what is wrong`` for every bad doc reference in ``files`` (paths under ``root``)."""
    names = {p.name for p in files}
    out = []

    def check(src: Path, lineno: int, ref: str, anchor: str | None, relative_first: bool) -> None:
        where = f"{src.relative_to(root)}:{lineno}: {ref}{'#' + anchor if anchor else ''}"
        if "/" in ref:
            bases = [src.parent, root] if relative_first else [root, src.parent]
            target = next((b / ref for b in bases if (b / ref).is_file()), None)
            if target is None:
                out.append(f"{where}: no such file in the repository")
                return
        else:
            target = src.parent / ref if (src.parent / ref).is_file() else None
            if target is None and ref not in names:
                if f"docs/{ref}" not in PENDING:
                    out.append(f"{where}: no file of that name in the repository")
                return
            if target is None:
                target = next((p for p in files if p.name == ref), None)
        if anchor and target is not None and anchor not in heading_anchors(target):
            out.append(f"{where}: {target.relative_to(root)} has no heading with that anchor")

    for src in files:
        text = src.read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), start=1):
            for bad in OUTSIDE + OUTSIDE_PATHS:
                if bad in line:
                    out.append(f"{src.relative_to(root)}:{lineno}: names {bad!r}, a file outside the repository")
            if _SECTION.search(line):
                out.append(f"{src.relative_to(root)}:{lineno}: a '§' section reference; use page.md#anchor")
            line = _URL.sub("", line)
            linked = set()
            if src.suffix == ".md":
                for m in _LINK.finditer(line):
                    check(src, lineno, m.group(1), m.group(2), relative_first=True)
                    linked.add(m.start(1))
            for m in _MENTION.finditer(line):
                if m.start(1) not in linked and m.group(1) not in OUTSIDE:
                    check(src, lineno, m.group(1), m.group(2), relative_first=False)
    return out


def test_every_doc_reference_exists():
    # this file is left out: the checker's own test below writes deliberately bad references
    found = problems(ROOT, [p for p in tracked_files() if p != Path(__file__).resolve()])
    assert not found, "references to docs that are not in the repository:\n  " + "\n  ".join(found)


def test_the_checker_flags_missing_pages_sections_and_outside_notes(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "model.md").write_text("# Model\n\n## The chunked form\n\n```\n# not a heading\n```\n")
    good = tmp_path / "good.py"
    good.write_text('"""See docs/model.md#the-chunked-form and docs/model.md."""\n')
    page = tmp_path / "docs" / "index.md"
    page.write_text("[model](model.md#the-chunked-form), [up](../good.py)\n")
    assert problems(tmp_path, [good, page, tmp_path / "docs" / "model.md"]) == []

    bad = tmp_path / "bad.py"
    bad.write_text(
        "# docs/nope.md\n# docs/model.md#no-such-section\n# docs/model.md#not-a-heading\n"
        f"# {OUTSIDE[0]} and {OUTSIDE_PATHS[0]}\n# model.md §3\n"
    )
    found = problems(tmp_path, [bad, tmp_path / "docs" / "model.md"])
    assert any("bad.py:1: docs/nope.md: no such file" in p for p in found), found
    assert any("bad.py:2: docs/model.md#no-such-section: docs/model.md has no heading" in p for p in found), found
    assert any("bad.py:3:" in p and "has no heading" in p for p in found), found
    assert sum("bad.py:4:" in p and "outside the repository" in p for p in found) == 2, found
    assert any("bad.py:5:" in p and "section reference" in p for p in found), found
