"""Profiling on demand (``run.profile``): a ``torch.profiler`` trace per rank of a few chosen steps (Chrome trace
format, with q38's phases named by ``record_function``), device memory snapshots (CUDA), and one snapshot written on
its own when a step runs out of device memory. File names, phase names and viewers: docs/operations.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from q38.errors import ConfigError, RunError

PROFILE = "profile"


@attrs.frozen(kw_only=True)
class ProfileOptions:
    """``run.profile``: which steps to record (``start`` .. ``start + steps - 1``) and whether with memory."""

    start: int  # first step traced
    steps: int = 3  # steps traced
    memory: bool = False  # record memory too (a CUDA allocator snapshot)

    def __attrs_post_init__(self) -> None:
        for k, lo in (("start", 1), ("steps", 1)):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"run.profile.{k} must be an integer >= {lo}, got {v!r}")


def _cuda(device: str) -> bool:
    return str(device).split(":")[0] == "cuda"


def snapshot_writer(device: str):
    """A function ``write(path)`` that dumps the device allocator's snapshot, or None where there is none (CPU)."""
    if not _cuda(device):
        return None
    import torch

    return lambda path: torch.cuda.memory._dump_snapshot(str(path))


class StepProfiler:
    """``begin(step)`` / ``end(step)`` around every step; records the steps ``opts`` names (None: nothing)."""

    def __init__(self, opts: ProfileOptions | None, out_dir: str | os.PathLike, rank: int, device: str) -> None:
        self.opts, self.rank, self.device = opts, rank, device
        self.dir = Path(out_dir) / PROFILE
        self.prof = None

    @property
    def _last(self) -> int:
        return self.opts.start + self.opts.steps - 1

    def begin(self, step: int) -> None:
        if self.opts is None or step != self.opts.start:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda(self.device) else [])
        if self.opts.memory and _cuda(self.device):
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.prof = profile(activities=activities, profile_memory=self.opts.memory, record_shapes=False)
        self.prof.__enter__()

    def end(self, step: int, log=None) -> None:
        if self.prof is not None and step >= self._last:
            self.close(log)

    def close(self, log=None) -> None:
        """Stop recording and write what was recorded (also when the run stops inside the window)."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        span = f"steps{self.opts.start}-{self._last}"
        trace = self.dir / f"trace_rank{self.rank}_{span}.json"
        prof.export_chrome_trace(str(trace))
        written = [trace]
        if self.opts.memory and _cuda(self.device):
            import torch

            snap = self.dir / f"memory_rank{self.rank}_{span}.pickle"
            torch.cuda.memory._dump_snapshot(str(snap))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snap)
        if log is not None:
            log(f"profile of {span.replace('steps', 'steps ')} written to " + ", ".join(map(str, written)))


def out_of_memory(e: BaseException, step: int, out_dir: str | os.PathLike, rank: int, device: str) -> RunError:
    """The one-line error for a step that ran out of device memory, after the allocator's snapshot is written (where
    the device has one)."""
    write = snapshot_writer(device)
    where = ""
    if write is not None:
        path = Path(out_dir) / PROFILE / f"oom_rank{rank}_step{step}.pickle"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write(path)
            where = f"; the allocator's snapshot is in {path} (open it at pytorch.org/memory_viz)"
        except Exception as err:  # the snapshot is a diagnosis: its failure must not hide the OOM itself
            where = f"; writing the memory snapshot failed ({err})"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return RunError(f"step {step} ran out of device memory on rank {rank} ({first}){where}; lower data.batch_size "
                    "or raise train.micro_batches, turn on train.recompute, or plan the layout with q38 plan "
                    "--hardware")
