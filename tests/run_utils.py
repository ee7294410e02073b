"""Small run configs and helpers shared by the trainer, checkpoint and CLI tests."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from q38.model_config import ModelConfig

REPO = Path(__file__).resolve().parents[1]


def small_model_dict() -> dict:
    """The tiny preset cut to one GDN and one attention layer (MTP kept): fast CPU steps."""
    d = ModelConfig.preset("tiny").to_dict()
    d.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return d


def run_dict(out_dir, *, steps: int = 6, **sections) -> dict:
    d = {
        "model": small_model_dict(),
        "layout": "single",
        "data": {"path": "builtin:tiny", "tokenizer": "byte", "seq_len": 32, "batch_size": 2},
        "train": {"lr": 3e-3, "warmup_steps": 2, "total_steps": 20, "loss_chunk_size": 64},
        "run": {"steps": steps, "out_dir": str(out_dir), "log_every": 1, "progress": False},
    }
    for sec, vals in sections.items():
        if isinstance(vals, dict):
            d[sec] = {**(d.get(sec) or {}), **vals}
        else:
            d[sec] = vals
    return d


def run_config(out_dir, **kw):
    from q38.train.run.trainer import RunConfig

    return RunConfig.from_dict(run_dict(out_dir, **kw), source="test")


def write_config(path: Path, d: dict) -> Path:
    path.write_text(yaml.safe_dump(d))
    return path


def losses(records) -> list[float]:
    return [r["loss"] for r in records]


def metrics(out_dir) -> list[dict]:
    p = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def q38(*args, env=None, timeout=120, cwd=None) -> subprocess.CompletedProcess:
    """Run the installed CLI as a real subprocess (``python -m q38.cli``)."""
    e = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "q38.cli", *map(str, args)], capture_output=True, text=True,
                          env=e, timeout=timeout, cwd=cwd or REPO)
