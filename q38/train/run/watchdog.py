"""Hang diagnosis: a step that runs past ``run.step_timeout_s`` ends the run with one line naming the rank that
holds it up, after every rank has written its Python stacks (and, on NCCL, its flight recorder) to
``out_dir/hangs/``.

A thread per rank watches the step; on overrun it dumps the stacks, reads from its main thread's innermost frame
whether this rank is *waiting* in ``torch.distributed`` or *busy* elsewhere, swaps that verdict with the other ranks
through the rendezvous store (a rank that is busy or never answers is the culprit), prints the line and ends the
process with ``os._exit`` (the main thread is stuck). No checkpoint is touched. With ``run.step_timeout_s: auto`` (the
default) the bound is ``max(run.step_timeout_floor_s, AUTO_FACTOR x the slowest of the last AUTO_WINDOW steps)``, and
``run.timeout_s`` for the first step of a run (compilation, warm-up), measured on each rank. A rank blocked in a C++
op that waits on another rank outside ``torch.distributed`` reads as busy. docs/operations.md says how to read the
output and size the bound.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import sysconfig
import threading
import time
from collections import deque
from pathlib import Path

HANGS = "hangs"
ANSWER_S = 5.0  # how long a rank waits for the others' verdicts
AUTO_FACTOR = 10.0  # run.step_timeout_s: auto is this many times the slowest recent step (at least the floor)
AUTO_WINDOW = 100  # the recent steps it looks at


_STDLIB = sysconfig.get_paths()["stdlib"]


def where(frame) -> tuple[bool, str]:
    """``(waiting, place)`` for a thread's stack (its innermost frame): waiting when that frame is a
    ``torch.distributed`` collective, barrier or store call (DTensor's own dispatch, ``torch/distributed/tensor``,
    is compute). The place of a busy rank is its innermost frame outside the standard library (a ``threading``
    wait names its caller)."""
    if frame is None:
        return False, "an unknown place"
    path = frame.f_code.co_filename.replace("\\", "/")
    if "/torch/distributed/" in path and "/torch/distributed/tensor/" not in path:
        return True, f"{frame.f_code.co_name} ({Path(path).name}:{frame.f_lineno})"
    f = frame
    while f.f_back is not None and f.f_code.co_filename.startswith(_STDLIB):
        f = f.f_back
    return False, f"{Path(f.f_code.co_filename).name}:{f.f_lineno} ({f.f_code.co_name})"


class StepWatchdog:
    """``with watchdog.step(n): ...`` runs step ``n`` under the timeout; ``close()`` stops the thread. ``timeout_s``:
    seconds, ``"auto"`` (``max(floor_s, AUTO_FACTOR x`` the slowest of the last ``AUTO_WINDOW`` steps), ``first_s``
    before any step was measured), or None / 0: it does nothing. ``on_bound(seconds)`` is called with each bound it
    arms (the trainer bounds the collectives by it)."""

    def __init__(self, timeout_s: float | int | str | None, out_dir: str | os.PathLike, rank: int, world: int,
                 store=None, exit=os._exit, *, floor_s: float = 300.0, first_s: float = 1800.0, on_bound=None) -> None:
        timeout_s = timeout_s or None  # 0: off
        self.timeout_s, self.rank, self.world, self.store = timeout_s, rank, world, store
        self.auto, self.floor_s, self.first_s, self.on_bound = timeout_s == "auto", floor_s, first_s, on_bound
        self.times: deque[float] = deque(maxlen=AUTO_WINDOW)  # seconds of the recent armed steps
        self.dir = Path(out_dir) / HANGS
        self._exit = exit
        self._main = threading.main_thread().ident if threading.current_thread() is threading.main_thread() \
            else threading.get_ident()
        self._lock = threading.Condition()
        self._step: int | None = None
        self._deadline = 0.0
        self._what = ("step", "run.step_timeout_s", self.bound())  # the armed phase, for the line
        self._closed = False
        self._thread = None
        if timeout_s is not None:
            self._thread = threading.Thread(target=self._watch, name="q38-step-watchdog", daemon=True)
            self._thread.start()

    def bound(self) -> float | None:
        """The seconds a step may take now (None: off)."""
        if not self.auto:
            return self.timeout_s
        if not self.times:
            return max(self.floor_s, self.first_s)
        return max(self.floor_s, AUTO_FACTOR * max(self.times))

    def step(self, n: int):
        """Arm for step ``n``: everything from reading its batch to the small all-reduce after it (the one every rank
        joins each step), under ``run.step_timeout_s``; its time counts towards the automatic bound."""
        return _Armed(self, n, "step", "run.step_timeout_s=auto" if self.auto else "run.step_timeout_s", self.bound())

    def phase(self, n: int, what: str, setting: str, timeout_s: float):
        """Arm for a longer phase after step ``n`` (an evaluation, a checkpoint save) under its own bound, so that no
        part of the loop where ranks wait for each other goes unwatched. Does nothing when the step timeout is
        off."""
        return _Armed(self, n, what, setting, timeout_s)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=1)

    def _watch(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (self._step is None or time.monotonic() < self._deadline):
                    self._lock.wait(None if self._step is None else max(self._deadline - time.monotonic(), 0))
                if self._closed:
                    return
                step, what = self._step, self._what
            self._report(step, what)
            return

    def _report(self, step: int, what: tuple) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            dump = self.dir / f"step_{step}_rank{self.rank}.txt"
            with open(dump, "w") as f:
                f.write(f"rank {self.rank} of {self.world}: {_title(step, *what)}\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            _dump_nccl_trace(self.dir / f"step_{step}_rank{self.rank}.nccl_trace.pickle")
        except OSError as e:  # a full or read-only disk: the line below still ends the run
            print(f"q38 train [rank {self.rank}]: note: could not write the stacks to {self.dir} ({e})",
                  file=sys.stderr, flush=True)
        waiting, place = where(sys._current_frames().get(self._main))
        verdicts = self._exchange_bounded(f"{step}/{what[0]}", f"{'waiting' if waiting else 'busy'} in {place}")
        line = summary(step, what[2], verdicts, self.world, what=what[0], setting=what[1])
        print(f"q38 train [rank {self.rank}]: error: {line}; stacks in {self.dir}", file=sys.stderr, flush=True)
        self._exit(1)

    def _exchange_bounded(self, key: str, mine: str) -> dict[int, str | None]:
        """``_exchange`` on a thread of its own, given ``ANSWER_S`` + 1 s: a store call that blocks (its host is
        the stopped rank, or the network is gone) cannot keep this rank from ending the run."""
        box: dict[int, str | None] = {self.rank: mine}
        t = threading.Thread(target=lambda: box.update(self._exchange(key, mine)), name="q38-hang-exchange",
                             daemon=True)
        t.start()
        t.join(ANSWER_S + 1.0)
        return dict(box)

    def _exchange(self, step, mine: str) -> dict[int, str | None]:
        """Every rank's verdict (None: no answer within ``ANSWER_S``); without a store (one process) only mine."""
        if self.store is None or self.world == 1:
            return {self.rank: mine}
        key = f"q38/hang/{step}/"
        self.store.set(key + str(self.rank), mine)
        out: dict[int, str | None] = {}
        deadline = time.monotonic() + ANSWER_S
        for r in range(self.world):
            while True:
                try:
                    if self.store.check([key + str(r)]):
                        out[r] = self.store.get(key + str(r)).decode()
                        break
                except Exception:  # the store went away with its host: nothing more to learn
                    out[r] = None
                    break
                if time.monotonic() > deadline:
                    out[r] = None
                    break
                time.sleep(0.05)
        return out


class _Armed:
    def __init__(self, dog: StepWatchdog, n: int, what: str, setting: str, timeout_s: float | None) -> None:
        self.dog, self.n, self.what = dog, n, (what, setting, timeout_s)

    def __enter__(self):
        d = self.dog
        if d.timeout_s is not None:
            if d.on_bound is not None:
                d.on_bound(self.what[2])
            with d._lock:
                self.t0 = time.monotonic()
                d._step, d._what, d._deadline = self.n, self.what, self.t0 + self.what[2]
                d._lock.notify()
        return self

    def __exit__(self, *exc) -> None:
        d = self.dog
        if d.timeout_s is not None:
            with d._lock:
                d._step = None
                if self.what[0] == "step":
                    d.times.append(time.monotonic() - self.t0)
                d._lock.notify()


def _title(step: int, what: str, setting: str, timeout_s: float) -> str:
    head = f"step {step}" if what == "step" else f"the {what} after step {step}"
    if "=" in setting:  # run.step_timeout_s=auto: the bound it came to
        return f"{head} ran past {setting} ({timeout_s:g} s)"
    return f"{head} ran past {setting}={timeout_s:g} s"


def summary(step: int, timeout_s: float, verdicts: dict[int, str | None], world: int, *, what: str = "step",
            setting: str = "run.step_timeout_s") -> str:
    """The one line: the ranks that hold the step up (busy, or silent), then the ones waiting for them."""
    busy = [f"rank {r} is {v}" for r, v in sorted(verdicts.items()) if v is not None and v.startswith("busy")]
    silent = [r for r in range(world) if verdicts.get(r) is None]
    waiting = [r for r, v in sorted(verdicts.items()) if v is not None and v.startswith("waiting")]
    parts = busy + ([f"rank(s) {', '.join(map(str, silent))} did not answer (stopped, dead or hung outside Python)"]
                    if silent else [])
    if waiting:
        parts.append(f"rank(s) {', '.join(map(str, waiting))} wait in a collective")
    return f"{_title(step, what, setting, timeout_s)}: " + "; ".join(parts)


def _dump_nccl_trace(path: Path) -> None:
    """The NCCL flight recorder (the collectives each rank issued and which finished), when NCCL is in use."""
    try:
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_backend() == "nccl"):
            return
        import torch

        trace = torch._C._distributed_c10d._dump_nccl_trace()
    except Exception:  # no flight recorder in this build: the Python stacks are still written
        return
    path.write_bytes(trace)
