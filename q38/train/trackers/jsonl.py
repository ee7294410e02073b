"""``metrics.jsonl``: one JSON object per step, every tracker's source of truth (a resume cuts it to the step)."""

from __future__ import annotations

import json
from typing import Any, Mapping

from q38.train.trackers import TrackerRun


class JSONLTracker:
    run_id = None

    def __init__(self, run: TrackerRun) -> None:
        self.path = run.out_dir / "metrics.jsonl"

    def log(self, record: Mapping[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(dict(record)) + "\n")

    def close(self) -> None:
        pass
