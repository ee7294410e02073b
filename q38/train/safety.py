"""Operator safety for ``q38 train``: pre-flight checks, one run per out_dir, checkpoint choice, metrics repair.

Everything here runs before the first step and changes nothing on disk except creating ``out_dir`` /
``checkpoints`` and the lock; every failure is one ``ConfigError`` (one line through the CLI) naming the file or key.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from q38.config import ConfigError

LOCK_FILE = ".q38.lock"  # the fcntl (flock) advisory lock of a run directory
HOLDER_FILE = ".q38.lock.holder"  # beside it: "host pid start-time" of the process holding it


class SaveError(OSError):
    """Saving a checkpoint failed; the previous checkpoint is intact (the message says which)."""


def note(msg: str) -> None:
    print(f"q38 train: note: {msg}", file=sys.stderr, flush=True)


# ---- pre-flight ---------------------------------------------------------------------------------------------------


def check_device(device: str) -> None:
    """The requested device exists in this torch build / on this machine."""
    import torch

    kind, _, idx = device.partition(":")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"run.device: {device} requested but CUDA is not available (torch {torch.__version__}, "
                f"CUDA build: {torch.version.cuda or 'none'}); set run.device: auto or cpu, or run on a CUDA machine"
            )
        n = torch.cuda.device_count()
        if idx and int(idx) >= n:
            raise ConfigError(f"run.device: {device} requested but this machine has {n} CUDA device(s)")
    elif kind == "npu":
        try:
            import torch_npu  # noqa: F401

            ok = torch.npu.is_available()  # type: ignore[attr-defined]
        except ImportError:
            ok = False
        if not ok:
            raise ConfigError(f"run.device: {device} requested but no Ascend NPU is available (torch_npu missing or "
                              "no device); set run.device: auto or cpu")


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
    from q38.train.checkpoint import CHECKPOINTS

    out = Path(out_dir)
    _check_writable_dir(out, "run.out_dir")
    _check_writable_dir(out / CHECKPOINTS, "checkpoints directory")


def check_safetensors_dir(path: str | os.PathLike, what: str) -> None:
    """A Hugging Face directory's ``config.json`` parses and every ``*.safetensors`` header is readable."""
    from q38.train.untrusted import check_config_bounds, inside, load_json

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

    from q38.train.untrusted import MAX_JSON_BYTES, MAX_NDIM, MAX_TENSOR_ELEMENTS, open_regular

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
    from q38.train.checkpoint import META_FILE, is_checkpoint

    return is_checkpoint(d) or ((d / META_FILE).is_file() and (d / ".metadata").is_file())


def _run_like(d: Path) -> str | None:
    """What makes ``d`` a run directory of ``q38 train`` (its checkpoints, metrics log or lock), or None."""
    from q38.train.checkpoint import CHECKPOINTS

    for name, is_it in ((CHECKPOINTS, Path.is_dir), (METRICS_FILE, Path.exists), (LOCK_FILE, Path.exists)):
        if is_it(d / name):
            return name
    return None


def check_output_dir(out: str | os.PathLike, inputs: Sequence[str | os.PathLike] = (), *, what: str,
                     own: Callable[[Path], bool] | None = None, overwrite: bool = False, role: str = "input") -> None:
    """The one rule of every command that writes a directory (``prepare-data --out``, ``convert``, ``init-hf``,
    ``plan --search --out``): ``out`` may be new, empty, a non-empty directory for which ``own(out)`` says it is this
    command's earlier output, or any other non-empty directory (or a file) with ``overwrite``. Refused always, also
    with ``overwrite``: ``out`` is, contains or lies inside one of ``inputs``; it is a run directory (checkpoints/,
    metrics.jsonl or a run lock), a checkpoint directory or inside one, or a directory of checkpoints. ``what`` names
    the argument in the one-line ``ConfigError`` (e.g. ``--out``); ``role`` names the inputs (``input``, ``source``).
    Nothing is created or changed."""
    out = Path(out)
    o = out.resolve()
    always = "(--overwrite does not change this)"
    for src in inputs:
        s = Path(src).resolve()
        if o == s or s in o.parents:
            raise ConfigError(f"{what} {out} is the {role} {src} or inside it; writing there would change the {role}; "
                              f"point {what} outside it {always}")
        if o in s.parents:
            raise ConfigError(f"{what} {out} contains the {role} {src}; writing there could replace it; point {what} "
                              f"outside it {always}")
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


# ---- one run per out_dir ------------------------------------------------------------------------------------------


def _holder_text() -> str:
    return f"{socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}"


@contextmanager
def run_lock(out_dir: str | os.PathLike, *, lead: bool = True) -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``out_dir/.q38.lock`` (only on the lead rank) for the run; the holder's
    host and PID are written to ``.q38.lock.holder``. A second run on the same out_dir refuses naming the holder; a
    lock left by a process that is gone (the kernel released it) is taken over with a note."""
    from q38.train.checkpoint import _broadcast

    out = Path(out_dir)
    lock_path, holder_path = out / LOCK_FILE, out / HOLDER_FILE
    fd, refused = None, None
    if lead:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            try:
                holder = holder_path.read_text().strip() or "a process that has not yet recorded itself"
            except OSError:
                holder = "another process (no holder file)"
            refused = (f"run.out_dir {out} is in use by another q38 train run ({holder}; lock {lock_path}); "
                       "wait for it to finish, stop it, or choose another run.out_dir")
    refused = _broadcast(refused)  # every rank stops together (no-op on one process)
    if refused:
        raise ConfigError(refused)
    if not lead:
        yield
        return
    try:
        try:
            stale = holder_path.read_text().strip()
        except OSError:
            stale = ""
        if stale:
            note(f"took over the lock of {out} left by {stale} (that run is no longer running)")
        tmp = holder_path.with_name(f"{HOLDER_FILE}.tmp-{os.getpid()}")
        tmp.write_text(_holder_text() + "\n")
        os.replace(tmp, holder_path)
        try:
            yield
        finally:
            try:
                holder_path.unlink()
            except OSError:
                pass
    finally:
        os.close(fd)  # releases the flock


# ---- metrics.jsonl ------------------------------------------------------------------------------------------------


def load_metrics(path: str | os.PathLike) -> tuple[list[dict], int | None]:
    """``(records, torn_line)``: the records of ``metrics.jsonl`` and the number of a torn last line (a partial
    write, e.g. on a full disk) or None. Any other malformed line is a ``ConfigError`` naming the file and line."""
    p = Path(path)
    if not p.is_file():
        return [], None
    try:
        lines = p.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read the metrics log ({e})") from None
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records, torn = [], None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == last:
                torn = i + 1
                break
            raise ConfigError(f"{p}:{i + 1}: malformed metrics record ({e}); only a torn last line is repaired "
                              "automatically: fix or delete that line") from None
        records.append(rec)
    return records, torn


# ---- which checkpoint a run starts from ---------------------------------------------------------------------------


def choose_checkpoint(out_dir: str | os.PathLike, resume: bool, resume_from: str | None,
                      notes: list[str]) -> Path | None:
    """The checkpoint to resume from (None: start fresh). ``run.resume_from`` must verify; otherwise the newest
    checkpoint in ``out_dir/checkpoints`` that verifies, with one line per newer one skipped appended to ``notes``.
    Refuses (changing nothing) when checkpoints exist but none verifies, or exist with ``run.resume: false``."""
    from q38.train.checkpoint import CHECKPOINTS, newest_verified, step_dirs, verify_checkpoint

    if resume_from:
        p = Path(resume_from)
        why = verify_checkpoint(p)
        if why is not None:
            raise ConfigError(f"run.resume_from: checkpoint {p} does not verify: {why}; point it at a checkpoint "
                              "directory (checkpoints/step_NNNNNN) that does")
        return p
    root = Path(out_dir) / CHECKPOINTS
    dirs = step_dirs(root)
    if not dirs:
        return None
    if not resume:
        raise ConfigError(f"{Path(out_dir)} already holds checkpoints (latest: {dirs[-1][1].name}) and run.resume is "
                          "false; choose a new run.out_dir, or set run.resume: true to continue that run")
    ck, skipped = newest_verified(root)
    if ck is None:
        raise ConfigError(
            f"{root} holds {len(dirs)} checkpoint(s) but none verifies (newest, {dirs[-1][1].name}: "
            f"{verify_checkpoint(dirs[-1][1])}); nothing was changed. Set run.resume_from to a good checkpoint, "
            "move the broken ones away, or choose a new run.out_dir"
        )
    notes += skipped
    return ck


# ---- save failures ------------------------------------------------------------------------------------------------


def _cause(e: BaseException) -> str:
    """The underlying error of a failed save, unwrapping DCP's ``CheckpointException`` (per-rank failures)."""
    for _ in range(8):
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
            inner = inner[0] if isinstance(inner, tuple) and inner else getattr(inner, "exc", inner)
            if isinstance(inner, BaseException):
                e = inner
                continue
        if e.__cause__ is not None:
            e = e.__cause__
            continue
        break
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename + ': ' if e.filename else ''}{e.strerror}"
    return " ".join((str(e) or type(e).__name__).split())


def interrupted(e: BaseException) -> bool:
    """A save failed because of Ctrl-C (DCP wraps the KeyboardInterrupt in its CheckpointException)."""
    for _ in range(8):
        if isinstance(e, KeyboardInterrupt):
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
            e = inner[0] if isinstance(inner, tuple) and inner else inner
        elif e.__cause__ is not None:
            e = e.__cause__
        else:
            return False
        if not isinstance(e, BaseException):
            return False
    return False


def failed_ranks(e: BaseException) -> list[int]:
    """The ranks whose part of a DCP save or load failed (DCP's ``CheckpointException.failures``); [] otherwise."""
    failures = getattr(e, "failures", None)
    return sorted(r for r in failures if isinstance(r, int)) if isinstance(failures, dict) else []


def storage_note(path: Path) -> str:
    """What this process sees of the storage under ``path`` after a failed write: the free space of its file system
    and a file size limit (``ulimit -f``), when one is set. A C++ writer (torch.save inside DCP) reports a full disk
    only as a short write, so this is how the line names it."""
    import resource

    notes = []
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
        notes.append(f"{st.f_bavail * st.f_frsize / (1 << 20):,.1f} MiB free on the file system of {path}")
    except OSError:
        pass
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if soft != resource.RLIM_INFINITY:
        notes.append(f"a file size limit (ulimit -f) of {soft:,} bytes")
    return "; ".join(notes)


def save_error(e: BaseException, step: int, ck_root: Path, rank: int = 0) -> SaveError:
    """One line for a failed save: the cause (with the ranks that failed, and what this rank sees of its storage
    when it is one of them), and the intact checkpoint a rerun resumes from."""
    from q38.train.checkpoint import newest_verified

    prev, _ = newest_verified(ck_root)
    keep = (f"the previous checkpoint {prev} is intact; fix the cause and run the same command to resume from it"
            if prev is not None else "no earlier checkpoint exists; fix the cause and run again")
    ranks = failed_ranks(e)
    who = f" on rank(s) {', '.join(map(str, ranks))}" if ranks else ""
    here = storage_note(ck_root) if not ranks or rank in ranks else ""
    here = f"; rank {rank} sees {here}" if here else ""
    return SaveError(f"saving the checkpoint of step {step} to {ck_root} failed{who} ({_cause(e)}{here}); {keep}")
