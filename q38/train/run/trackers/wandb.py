"""Weights & Biases: one wandb run per q38 run, files under ``out_dir/wandb``; ``offline`` writes them for
``wandb sync``. The wandb run id is kept in the checkpoint metadata, so a resume continues the same wandb run."""

from __future__ import annotations

import secrets
from typing import Any, Mapping

from q38.train.run.trackers import TrackerRun, missing_extra, scalars


class WandbTracker:
    def __init__(self, run: TrackerRun) -> None:
        try:
            import wandb
        except ImportError:
            raise missing_extra("wandb", "wandb") from None
        self.run_id = run.run_id or secrets.token_hex(4)
        (run.out_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=run.project, name=run.name, id=self.run_id, resume="allow",
                              dir=str(run.out_dir), mode=run.mode, config=dict(run.config),
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, record: Mapping[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()
