"""Experiment trackers: where a run's records go. ``run.trackers`` names them (``jsonl`` always runs: it is the
run's own ``metrics.jsonl``, which a resume reads back); only rank 0 opens any.

A tracker is one file here and one line in ``TRACKERS``: a class built from a ``TrackerRun`` with ``log(record)``
(one step's record, the same dict ``metrics.jsonl`` gets), ``close()`` and ``run_id`` (kept in each checkpoint's
metadata, so a resumed run continues the same tracker run). Optional packages (wandb, swanlab) are imported only
when their tracker is named; a missing one is one line naming the extra to install.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import attrs

from q38.errors import ConfigError

# name -> "module:class", imported when named
TRACKERS = {
    "jsonl": "q38.train.run.trackers.jsonl:JSONLTracker",
    "tensorboard": "q38.train.run.trackers.tensorboard:TensorBoardTracker",
    "wandb": "q38.train.run.trackers.wandb:WandbTracker",
    "swanlab": "q38.train.run.trackers.swanlab:SwanLabTracker",
}
MODES = ("online", "offline")


@attrs.frozen(kw_only=True)
class TrackerRun:
    """What every tracker is opened with."""

    out_dir: Path
    name: str  # the run's name (its out_dir's name)
    project: str  # run.tracker_project
    mode: str  # run.tracker_mode: online | offline (write locally; wandb/swanlab sync later)
    config: Mapping[str, Any]  # logged once: the run config, the resolved kernels, the layout and mesh
    run_id: str | None = None  # this tracker's run id from the checkpoint being resumed (None: a new run)
    start: int = 0  # the step the run resumes from (a tracker may drop its records after it)


@runtime_checkable  # the test-time beartype hook checks `-> dict[str, Tracker]` with isinstance
class Tracker(Protocol):
    run_id: str | None

    def log(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a step record under their tracker names: ``train/<key>``, ``eval/<key>`` for ``eval_*``
    (``step`` and booleans are not scalars)."""
    return {(f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"): v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def check_trackers(names) -> None:
    """Unknown tracker names and a bad mode are refused with the valid ones (before the run starts)."""
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise ConfigError(f"run.trackers: unknown tracker(s) {bad}; choose from {', '.join(TRACKERS)}")


def open_trackers(names, run: TrackerRun, run_ids: Mapping[str, str] | None = None) -> dict[str, Tracker]:
    """Every named tracker (``jsonl`` first, always), opened for ``run``; ``run_ids``: the ids a checkpoint kept."""
    check_trackers(names)
    opened: dict[str, Tracker] = {}
    try:
        for name in dict.fromkeys(("jsonl", *names)):
            module, cls = TRACKERS[name].split(":")
            opened[name] = getattr(importlib.import_module(module), cls)(
                attrs.evolve(run, run_id=(run_ids or {}).get(name)))
    except BaseException:
        for t in opened.values():
            t.close()
        raise
    return opened


def missing_extra(package: str, tracker: str) -> ConfigError:
    return ConfigError(f"run.trackers names {tracker}, but the {package} package is not installed; install it with "
                       f"pip install 'q38[trackers]' (or pip install {package}), or drop {tracker} from run.trackers")
