"""TensorBoard event files under ``out_dir/tensorboard`` (``train/<key>`` and ``eval/<key>`` scalars)."""

from __future__ import annotations

from typing import Any, Mapping

from q38.train.run.trackers import TrackerRun, missing_extra, scalars


class TensorBoardTracker:
    run_id = None

    def __init__(self, run: TrackerRun) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise missing_extra("tensorboard", "tensorboard") from None
        self.writer = SummaryWriter(str(run.out_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + "\n".join(f"{k}: {v}" for k, v in run.config.items()) + "\n```")

    def log(self, record: Mapping[str, Any]) -> None:
        for k, v in scalars(record).items():
            self.writer.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.writer.close()
