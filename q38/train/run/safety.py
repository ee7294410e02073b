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
from typing import Iterator

from q38.model_config import ConfigError
from q38.train.io.dirs import LOCK_FILE

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


def _holder_text() -> str:
    return f"{socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}"


@contextmanager
def run_lock(out_dir: str | os.PathLike, *, lead: bool = True) -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``out_dir/.q38.lock`` (only on the lead rank) for the run; the holder's
    host and PID are written to ``.q38.lock.holder``. A second run on the same out_dir refuses naming the holder; a
    lock left by a process that is gone (the kernel released it) is taken over with a note."""
    from q38.train.io.checkpoint import _broadcast

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
        except (ValueError, RecursionError) as e:
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
    from q38.train.io.checkpoint import CHECKPOINTS, newest_verified, step_dirs, verify_checkpoint

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
    from q38.train.io.checkpoint import newest_verified

    prev, _ = newest_verified(ck_root)
    keep = (f"the previous checkpoint {prev} is intact; fix the cause and run the same command to resume from it"
            if prev is not None else "no earlier checkpoint exists; fix the cause and run again")
    ranks = failed_ranks(e)
    who = f" on rank(s) {', '.join(map(str, ranks))}" if ranks else ""
    here = storage_note(ck_root) if not ranks or rank in ranks else ""
    here = f"; rank {rank} sees {here}" if here else ""
    return SaveError(f"saving the checkpoint of step {step} to {ck_root} failed{who} ({_cause(e)}{here}); {keep}")
