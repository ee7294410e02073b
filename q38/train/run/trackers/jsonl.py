"""``metrics.jsonl``: one JSON object per step, every tracker's source of truth (a resume cuts it to the step)."""

from __future__ import annotations

import json
from typing import Any, Mapping

from q38.train.run.trackers import TrackerRun


class JSONLTracker:
    run_id = None

    def __init__(self, run: TrackerRun) -> None:
        self.path = run.out_dir / "metrics.jsonl"

    def log(self, record: Mapping[str, Any]) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(dict(record)) + "\n")
        except OSError as e:  # a full disk fails the buffered write at close, with no file name: add it
            if e.filename is not None:
                raise
            raise OSError(e.errno, f"{e.strerror or e}; the records up to the last whole line are kept (a torn "
                          "last line is cut off on resume)", str(self.path)) from None

    def close(self) -> None:
        pass
