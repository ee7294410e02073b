"""SwanLab (common on Ascend clusters): one SwanLab experiment per q38 run, files under ``out_dir/swanlog``;
``offline`` writes them for ``swanlab sync``. The experiment id is kept in the checkpoint metadata, so a resume
continues the same experiment."""

from __future__ import annotations

import secrets
import string
from typing import Any, Mapping

from q38.train.run.trackers import TrackerRun, missing_extra, scalars


class SwanLabTracker:
    def __init__(self, run: TrackerRun) -> None:
        try:
            import swanlab
        except ImportError:
            raise missing_extra("swanlab", "swanlab") from None
        # SwanLab ids are 21 lower-case letters and digits
        alphabet = string.ascii_lowercase + string.digits
        self.run_id = run.run_id or "".join(secrets.choice(alphabet) for _ in range(21))
        self.swanlab = swanlab
        self.run = swanlab.init(project=run.project, name=run.name, id=self.run_id, resume="allow",
                                log_dir=str(run.out_dir / "swanlog"), mode=run.mode, config=dict(run.config))

    def log(self, record: Mapping[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()
