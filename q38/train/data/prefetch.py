"""The next batches read on a background thread while the step runs (``data.prefetch``), so a step does not wait
for its data. The batches and their order are the loader's own; the position a checkpoint records is the one after
the last batch handed to the step, never one the thread read ahead."""

from __future__ import annotations

import queue
import threading
from typing import Any, Mapping


class Prefetch:
    """Wraps a batch iterator with ``state_dict`` / ``load_state_dict`` (``BatchIterator``, ``MixtureIterator``).
    The thread starts at the first ``next``; ``depth`` batches are read ahead."""

    def __init__(self, it, depth: int = 1) -> None:
        self.it, self.depth = it, depth
        self._state = it.state_dict()
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._thread is not None:
            raise RuntimeError("Prefetch.load_state_dict after the first batch was read")
        self.it.load_state_dict(state)
        self._state = self.it.state_dict()

    def state_dict(self) -> dict:
        """The loader's position after the last batch this iterator returned."""
        return dict(self._state)

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self):
        if self._thread is None:
            self._queue = queue.Queue(maxsize=self.depth)
            self._thread = threading.Thread(target=self._read, name="q38-data-prefetch", daemon=True)
            self._thread.start()
        kind, value, state = self._queue.get()
        if kind == "error":
            raise value
        self._state = state
        return value

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                item = ("batch", next(self.it), self.it.state_dict())
            except BaseException as e:  # handed to the step that asks for the batch
                item = ("error", e, None)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] == "error":
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
