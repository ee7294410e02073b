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


# ---- command blocks: every one runs here or is marked illustrative (docs/testing.md#command-blocks-in-the-docs) ----

import os  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

COMMAND_INFOS = ("bash", "sh", "shell", "console", "python")
_MARK = re.compile(r"^<!--\s*(illustrative|test)\s*:\s*(.*?)\s*-->\s*$")
_NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"  # one way to read each number (no backtracking blow-up on long lines)
_FENCE = re.compile(r"^(\s*)(```+)\s*([\w-]*)")


def doc_pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def command_blocks(page: Path) -> list[dict]:
    """The page's command blocks: fences whose info is a shell or python, or whose first line is a ``$ `` prompt.
    Each: ``line`` (of the fence), ``info``, ``text``, ``mark`` (``illustrative``, ``test`` or None, from an HTML
    comment on the line before the fence) and ``args`` (the comment's text: the reason, or ``quick`` / ``slow`` with
    an optional ``tol=0.02``)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(m.group(2)):
            j += 1
        indent = len(m.group(1))
        body = [ln[indent:] for ln in lines[i + 1:j]]
        info = m.group(3)
        if info in COMMAND_INFOS or (body and body[0].startswith("$ ")):
            mark = _MARK.match(lines[i - 1].strip()) if i > 0 else None
            out.append({"page": page, "line": i + 1, "info": info or "console", "text": "\n".join(body) + "\n",
                        "mark": mark.group(1) if mark else None, "args": mark.group(2) if mark else ""})
        i = j + 1
    return out


def block_problems(blocks: list[dict]) -> list[str]:
    out = []
    for b in blocks:
        where = f"{b['page'].name}:{b['line']}"
        if b["mark"] is None:
            out.append(f"{where}: a command block neither tested nor marked illustrative (put "
                       "`<!-- test: quick -->`, `<!-- test: slow -->` or `<!-- illustrative: why -->` on the line "
                       "before the fence)")
        elif b["mark"] == "illustrative" and not b["args"]:
            out.append(f"{where}: `illustrative:` needs a reason")
        elif b["mark"] == "test" and b["args"].split(",")[0].strip() not in ("quick", "slow"):
            out.append(f"{where}: `test:` takes quick or slow, got {b['args']!r}")
    return out


def _tolerance(b: dict) -> float:
    m = re.search(r"tol=([\d.eE-]+)", b["args"])
    return float(m.group(1)) if m else 0.02


def transcript_problems(expected: list[str], output: str, tol: float) -> list[str]:
    """Each expected line (``...`` anywhere: any text) must match a line of ``output`` with its words as written and
    each number within ``tol`` (relative) of the one printed."""
    got = output.splitlines()
    out = []
    for line in expected:
        if not line.strip() or line.strip() == "...":
            continue
        parts = re.split(rf"(\.\.\.|{_NUMBER})", line.strip())
        pattern, numbers = "", []
        for k, p in enumerate(parts):
            if k % 2 == 0:
                words = r"\s+".join(re.escape(w) for w in p.split())  # runs of spaces: one \s+ (never \s+\s+)
                pattern += (r"\s+" if p[:1].isspace() else "") + words + (r"\s+" if p[-1:].isspace() and words else "")
            elif p == "...":
                pattern += ".*"
            else:
                pattern += f"({_NUMBER})"
                numbers.append(float(p.replace(",", "")))
        hits = [m for g in got if (m := re.search(pattern, g))]
        if not hits:
            out.append(f"not printed: {line.strip()!r}")
            continue
        good = any(all(abs(float(v.replace(",", "")) - n) <= tol * max(abs(n), 1e-12)
                       for v, n in zip(h.groups(), numbers)) for h in hits)
        if not good:
            out.append(f"figures differ: doc {line.strip()!r}, printed {hits[0].group(0)!r}")
    return out


def run_block(b: dict, cwd: Path, timeout: float) -> list[str]:
    """Run one block in ``cwd``; what went wrong (exit status, or the transcript's figures), or []."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               Q38_DOCS_TEST="1", PYTHONWARNINGS="ignore")
    lines = b["text"].splitlines()
    if b["info"] == "python":
        cmd, expected = [sys.executable, "-c", b["text"]], []
    elif lines and lines[0].startswith("$ "):
        script = "\n".join(ln[2:] for ln in lines if ln.startswith("$ "))
        cmd, expected = ["bash", "-eo", "pipefail", "-c", script], [ln for ln in lines if not ln.startswith("$ ")]
    else:
        cmd, expected = ["bash", "-eo", "pipefail", "-c", b["text"]], []
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    where = f"{b['page'].relative_to(ROOT)}:{b['line']}"
    if r.returncode != 0:
        return [f"{where}: exit {r.returncode}\n{(r.stdout + r.stderr)[-3000:]}"]
    return [f"{where}: {p}" for p in transcript_problems(expected, r.stdout + r.stderr, _tolerance(b))]


def _speed(b: dict) -> str:
    return b["args"].split(",")[0].strip()


def _pages_with(kind: str) -> list[Path]:
    """Pages with at least one block tested at ``kind`` (quick or slow)."""
    return [p for p in doc_pages() if any(b["mark"] == "test" and _speed(b) == kind for b in command_blocks(p))]


def test_every_command_block_is_tested_or_illustrative():
    found = block_problems([b for p in doc_pages() for b in command_blocks(p)])
    assert not found, "\n".join(found)


def _run_page(page: Path, tmp_path: Path, speeds: tuple[str, ...]) -> None:
    """The page's tested blocks of these speeds, in order, in one directory (a block may use what an earlier one
    made: the slow run of a page runs its quick blocks too)."""
    found = []
    for b in command_blocks(page):
        if b["mark"] == "test" and _speed(b) in speeds and not found:
            found += run_block(b, tmp_path, timeout=900 if _speed(b) == "slow" else 300)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("page", _pages_with("quick"), ids=lambda p: str(p.relative_to(ROOT)))
def test_quick_command_blocks_run(page, tmp_path):
    _run_page(page, tmp_path, ("quick",))


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with("slow"), ids=lambda p: str(p.relative_to(ROOT)))
def test_slow_command_blocks_run(page, tmp_path):
    _run_page(page, tmp_path, ("quick", "slow"))


def test_the_block_checker_flags_unmarked_blocks_and_wrong_figures(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n\n```bash\nq38 train\n```\n\n<!-- illustrative: needs a cluster -->\n```bash\nq38 x\n```\n"
                    "\n```yaml\nrun: {}\n```\n\n<!-- test: fast -->\n```\n$ echo 1\n1\n```\n")
    blocks = command_blocks(page)
    assert [b["line"] for b in blocks] == [3, 8, 17]
    found = block_problems(blocks)
    assert len(found) == 2 and "p.md:3: a command block neither" in found[0] and "quick or slow" in found[1], found

    printed = "step time on h200: 16.49 s = compute 10.83 s\n  508,603 tokens/s; MFU 32.5%\n"
    assert transcript_problems(["step time on h200: 16.5 s = ...", "508,000 tokens/s; MFU 32.6%"], printed, 0.02) == []
    bad = transcript_problems(["step time on h200: 20.88 s = ...", "MFU 25.7%", "nothing like this"], printed, 0.02)
    assert len(bad) == 3 and bad[0].startswith("figures differ") and bad[2].startswith("not printed"), bad
