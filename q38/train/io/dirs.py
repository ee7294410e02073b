"""Output and input directory checks shared by the run, data preparation and Hugging Face export.

Each check runs before anything is written and ends in one ``ConfigError`` naming the path and the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Sequence

from q38.model_config import ConfigError

LOCK_FILE = ".q38.lock"  # the fcntl (flock) advisory lock of a run directory


def _check_writable_dir(d: Path, what: str) -> None:
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{what} {d} exists and is not a directory; move it away or choose another run.out_dir")
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".q38-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{what} {d} is not writable ({e.strerror or e}); fix its permissions or choose another "
                          "run.out_dir") from None


def check_out_dir(out_dir: str | os.PathLike) -> None:
    """``out_dir`` and ``out_dir/checkpoints`` are (or can be made) writable directories."""
    from q38.train.io.checkpoint import CHECKPOINTS

    out = Path(out_dir)
    _check_writable_dir(out, "run.out_dir")
    _check_writable_dir(out / CHECKPOINTS, "checkpoints directory")


def check_safetensors_dir(path: str | os.PathLike, what: str) -> None:
    """A Hugging Face directory's ``config.json`` parses and every ``*.safetensors`` header is readable."""
    from q38.files import check_config_bounds, inside, load_json

    p = Path(path)
    cfg = p / "config.json"
    if not cfg.exists() and not cfg.is_symlink():
        raise ConfigError(f"{what}: {p} has no config.json (not a Hugging Face checkpoint directory)")
    check_config_bounds(load_json(inside(p, "config.json", what, follow=True), f"{what}: {cfg}", follow=True),
                        f"{what}: {cfg}")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{what}: {p} holds no *.safetensors file")
    from safetensors import safe_open

    for f in files:
        inside(p, f.name, what, follow=True)  # a regular file (a HF cache links to blobs), not a FIFO or device
        try:
            _check_safetensors_extent(f, f.stat().st_size)  # the header can be intact while the data is cut short
            with safe_open(str(f), framework="pt") as fh:
                fh.keys()
        except ConfigError:
            raise
        except Exception as e:  # SafetensorError, OSError: a truncated or corrupt file
            raise ConfigError(f"{what}: {f} is not a readable safetensors file ({' '.join(str(e).split())})") \
                from None


def _check_safetensors_extent(f: Path, size: int) -> None:
    """The header's data offsets fit in the file (a truncated file fails here, before any tensor is read)."""
    import struct

    from q38.files import MAX_JSON_BYTES, open_regular

    from q38.train.io.untrusted import MAX_NDIM, MAX_TENSOR_ELEMENTS

    with open_regular(f, str(f), follow=True) as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, shorter than a safetensors header")
        n = struct.unpack("<Q", head)[0]
        if n > MAX_JSON_BYTES:
            raise ConfigError(f"{f}: a header of {n} bytes, more than the limit {MAX_JSON_BYTES}")
        if 8 + n > size:
            raise ConfigError(f"{f} is truncated: {size} bytes, its header alone needs {8 + n}")
        try:
            header = json.loads(fh.read(n))
        except RecursionError:
            raise ConfigError(f"{f}: the header nests deeper than a safetensors header does") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{f}: the header is not a JSON object")
    end = 0
    for k, v in header.items():  # every tensor's shape x dtype is exactly its byte range, inside the file
        if k == "__metadata__":
            continue
        try:
            shape, (a, b), dt = v["shape"], v["data_offsets"], v["dtype"]
            ok = (isinstance(shape, list) and len(shape) <= MAX_NDIM and
                  all(type(d) is int and d >= 0 for d in shape) and type(a) is int and type(b) is int and 0 <= a <= b)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ConfigError(f"{f}: tensor {str(k)[:80]!r} has a malformed header entry")
        numel = 1
        for d in shape:
            numel *= d
        if numel > MAX_TENSOR_ELEMENTS:
            raise ConfigError(f"{f}: tensor {str(k)[:80]!r} has shape {shape} ({numel} elements), more than the "
                              f"limit {MAX_TENSOR_ELEMENTS}")
        item = _ST_ITEMSIZE.get(dt)
        if item is None:
            raise ConfigError(f"{f}: tensor {str(k)[:80]!r} has dtype {str(dt)[:20]!r}, not one q38 reads")
        if (b - a) * 8 != numel * item:
            raise ConfigError(f"{f}: tensor {str(k)[:80]!r} of shape {shape} {dt} needs {numel * item // 8} "
                              f"bytes, its header gives it {b - a}")
        end = max(end, b)
    if 8 + n + end > size:
        raise ConfigError(f"{f} is truncated: {size} bytes, its header needs {8 + n + end}")


_ST_ITEMSIZE = {  # safetensors dtype -> bits per element
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U8": 8, "BOOL": 8,
    "U16": 16, "U32": 32, "U64": 64, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
    "F6_E3M2": 6,
}


# ---- where a command may write -------------------------------------------------------------------------------------

METRICS_FILE = "metrics.jsonl"  # the run log of ``q38 train`` (trainer.py writes it under this name)


def _checkpoint_like(d: Path) -> bool:
    """A q38 checkpoint directory, complete (``is_checkpoint``) or not yet verified (``meta.json`` + ``.metadata``)."""
    from q38.train.io.checkpoint import META_FILE, is_checkpoint

    return is_checkpoint(d) or ((d / META_FILE).is_file() and (d / ".metadata").is_file())


def _run_like(d: Path) -> str | None:
    """What makes ``d`` a run directory of ``q38 train`` (its checkpoints, metrics log or lock), or None."""
    from q38.train.io.checkpoint import CHECKPOINTS

    for name, is_it in ((CHECKPOINTS, Path.is_dir), (METRICS_FILE, Path.exists), (LOCK_FILE, Path.exists)):
        if is_it(d / name):
            return name
    return None


def _identity(p: Path) -> tuple[int, int] | None:
    """What ``p`` is (``st_dev``, ``st_ino``, symlinks followed), or None when nothing is there."""
    try:
        st = os.stat(p)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _chain(p: Path) -> list[tuple[Path, tuple[int, int]]]:
    """``(path, identity)`` of ``p`` (resolved) and of each of its existing ancestors, nearest first."""
    r = p.resolve()
    return [(q, i) for q in (r, *r.parents) if (i := _identity(q)) is not None]


MAX_SHARED_FILES = 100_000  # entries of a directory compared file by file (a HF export holds a few dozen)


def _files(p: Path) -> dict[tuple[int, int], Path]:
    """The regular files ``p`` is (a file) or holds directly (a directory), by identity; at most
    ``MAX_SHARED_FILES`` entries are looked at."""
    if p.is_file():
        i = _identity(p)
        return {i: p} if i is not None else {}
    out: dict[tuple[int, int], Path] = {}
    try:
        with os.scandir(p) as it:
            for n, e in enumerate(it):
                if n >= MAX_SHARED_FILES:
                    break
                if e.is_file():
                    st = e.stat()
                    out[(st.st_dev, st.st_ino)] = Path(e.path)
    except OSError:
        pass
    return out


def same_or_inside(out: Path, src: Path) -> tuple[str, Path] | None:
    """How ``out`` overlaps ``src``, compared by what the directories and files are (device and inode), not by their
    names, so a second name (a symlink, a bind mount, a hard link) cannot hide it: ``("inside", q)`` when ``out``
    is ``src`` or lies inside it (``q``: the directory of ``out``'s path that is ``src``), ``("contains", q)`` when
    ``src`` lies inside ``out`` (``q``: the directory of ``src``'s path that is ``out``), ``("shares", f)`` when a file
    ``f`` of ``out`` is a file of ``src`` (or ``src`` itself) under another name; None otherwise."""
    s = _identity(src)
    if s is None:
        return None
    o_chain = _chain(out)
    hit = next((q for q, i in o_chain if i == s), None)
    if hit is not None:
        return "inside", hit
    o = _identity(out)
    if o is None:
        return None
    hit = next((q for q, i in _chain(src) if i == o), None)
    if hit is not None:
        return "contains", hit
    if out.is_dir():
        shared = _files(src).keys() & _files(out).keys()
        if shared:
            return "shares", _files(out)[next(iter(sorted(shared)))]
    return None


def check_output_dir(out: str | os.PathLike, inputs: Sequence[str | os.PathLike] = (), *, what: str,
                     own: Callable[[Path], bool] | None = None, overwrite: bool = False, role: str = "input") -> None:
    """The one rule of every command that writes a directory (``prepare-data --out``, ``convert``, ``init-hf``,
    ``plan --search --out``): ``out`` may be new, empty, a non-empty directory for which ``own(out)`` says it is this
    command's earlier output, or any other non-empty directory (or a file) with ``overwrite``. Refused always, also
    with ``overwrite``: ``out`` is, contains or lies inside one of ``inputs``, or holds one of their files under
    another name (compared by device and inode: ``same_or_inside``, so a symlink, bind mount or hard link is seen);
    it is a run directory (checkpoints/, metrics.jsonl or a run lock), a checkpoint directory or inside one, or a
    directory of checkpoints. ``what`` names the argument in the one-line ``ConfigError`` (e.g. ``--out``); ``role``
    names the inputs (``input``, ``source``). Nothing is created or changed."""
    out = Path(out)
    o = out.resolve()
    always = "(--overwrite does not change this)"
    for src in inputs:
        overlap = same_or_inside(out, Path(src))
        if overlap is None:
            continue
        how, where = overlap
        alias = "" if where in (o, Path(src).resolve()) else f" (as {where})"
        if how == "inside":
            raise ConfigError(f"{what} {out} is the {role} {src} or inside it{alias}; writing there would change the "
                              f"{role}; point {what} outside it {always}")
        if how == "contains":
            raise ConfigError(f"{what} {out} contains the {role} {src}{alias}; writing there could replace it; point "
                              f"{what} outside it {always}")
        raise ConfigError(f"{what} {out} holds {where.name}, a second name (hard link) of a file of the {role} {src}; "
                          f"writing there could change it; point {what} elsewhere {always}")
    always = f"choose another directory {always}"
    ck = next((p for p in (o, *o.parents) if p.is_dir() and _checkpoint_like(p)), None)
    if ck is not None:
        raise ConfigError(f"{what} {out} is a q38 checkpoint directory{'' if ck == o else f' ({ck})'} or inside one; "
                          f"writing there would break the checkpoint; {always}")
    if not out.exists():
        return
    if not out.is_dir():
        if not overwrite:
            raise ConfigError(f"{what} {out} exists and is a file; choose a new directory, or pass --overwrite")
        return
    marker = _run_like(out)
    if marker is not None:
        raise ConfigError(f"{what} {out} is a q38 train run directory (it holds {marker}); writing there could "
                          f"destroy the run; {always}")
    entries = list(out.iterdir())
    held = next((e for e in entries if e.is_dir() and _checkpoint_like(e)), None)
    if held is not None:
        raise ConfigError(f"{what} {out} holds q38 checkpoints ({held.name}); writing there could destroy them; "
                          f"{always}")
    if entries and not overwrite and not (own is not None and own(out)):
        raise ConfigError(f"{what} {out} exists and is not empty; choose a new or empty directory, or pass "
                          "--overwrite")


def run_inputs(run_config: dict | None, meta: dict | None = None) -> list[tuple[str, Path]]:
    """``(role, path)`` of every file or directory a run reads (docs/checkpoints.md#what-a-run-references): its
    ``init_from`` (the base of a LoRA run), the model source, the data (``data.path``, each path of a mixture, a
    Megatron prefix's ``.bin`` / ``.idx``), ``data.eval_path`` and the tokenizer, from a run config's ``to_dict()``
    (or a checkpoint's ``meta["run_config"]``); ``meta``: a checkpoint's, whose recorded LoRA base is one too. Builtin
    names and missing entries are skipped. No q38 command writes into any of them (``check_output_dir``)."""
    def table(x) -> dict:  # a checkpoint's meta.json is read as untrusted: a key of the wrong type names nothing
        return x if isinstance(x, dict) else {}

    rc = table(run_config)
    data = table(rc.get("data"))
    out: list[tuple[str, str]] = [("base (init_from)", rc.get("init_from")), ("model source", rc.get("model"))]
    base = table(table(table(meta).get("peft")).get("base"))
    out.append(("base (init_from)", base.get("init_from")))
    paths = data.get("path")
    for e in paths if isinstance(paths, list) else [paths]:
        out.append(("data", e.get("path") if isinstance(e, dict) else e))
    out += [("eval data", data.get("eval_path")), ("tokenizer", data.get("tokenizer"))]
    found: list[tuple[str, Path]] = []
    for role, v in out:
        if not isinstance(v, str) or not v or v.startswith("builtin:") or v == "byte":
            continue
        if len(v) > 4096 or "\x00" in v:  # not a path (a checkpoint's meta.json is read as untrusted)
            continue
        for q in (Path(v), Path(f"{v}.bin"), Path(f"{v}.idx")):  # a Megatron corpus is named by its prefix
            try:
                there = q.exists() or q.is_symlink()
            except OSError:  # e.g. a name too long: nothing is there
                there = False
            if there and (role, q) not in found:
                found.append((role, q))
    return found


def _real(p: Path, what: str) -> Path:
    """``p`` with its symlinks resolved; a symlink loop (or a link chain the system will not follow) is one line."""
    try:
        return p.resolve()
    except (RuntimeError, OSError) as e:
        raise ConfigError(f"{what} {p} cannot be resolved ({' '.join(str(e).split())[:200]}): a symbolic link that "
                          "points at itself or a loop of links; point it at a real file or directory") from None


def check_run_out_dir(out_dir: str | os.PathLike, inputs: Sequence[tuple[str, Path]]) -> None:
    """``q38 train``'s ``run.out_dir`` never is nor lies inside a path the run reads (``run_inputs``), and none of
    them lies where the run writes (``out_dir/checkpoints``, ``out_dir/hf``, ``metrics.jsonl``, the run lock), real
    paths compared (symlinks resolved), and ``run.out_dir`` is none of them under a second name (a bind mount:
    ``same_or_inside``); checked before anything is created."""
    from q38.train.io.checkpoint import CHECKPOINTS

    o = _real(Path(out_dir), "run.out_dir")
    written = [o / CHECKPOINTS, o / "hf", o / METRICS_FILE, o / LOCK_FILE]
    for role, src in inputs:
        s = _real(src, f"the run's {role}")
        overlap = same_or_inside(Path(out_dir), src)
        if o == s or s in o.parents or (overlap is not None and overlap[0] == "inside"):
            raise ConfigError(f"run.out_dir {out_dir} is the run's {role} {src} or inside it; the run would write "
                              "into what it reads; choose a run.out_dir outside it")
        w = next((w for w in written if s == w or w in s.parents), None)
        if w is not None:
            raise ConfigError(f"the run's {role} {src} lies in {w}, which the run writes (and prunes); move it out "
                              "of run.out_dir or choose another run.out_dir")


# ---- one run per out_dir ------------------------------------------------------------------------------------------
