"""What ``q38 eval`` and ``q38 generate`` run (and ``evaluate``, the ``q38 eval`` command): a model source (a q38 run / checkpoint, full or LoRA, or a Hugging Face
directory) opened as the run config and train state a training run would resume it with, on any layout.

A q38 checkpoint is loaded exactly as a resumed run loads it (``trainer._build_state``: the same template, the
same LoRA base check), so its evaluation sees the parameters training saw; a Hugging Face directory is loaded as
``init_from``.
"""

import sys
from pathlib import Path
from typing import Any, Mapping

import attrs

from q38.errors import ConfigError
from q38.train.run.run_config import RunConfig


class _NoIterator:
    """Stands in for the train iterator a resumed run restores (evaluation has none)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


@attrs.frozen
class Source:
    """An opened model source: the run config it runs under, and the checkpoint (None: a Hugging Face directory)
    with its ``meta.json``."""

    cfg: RunConfig
    checkpoint: Path | None
    meta: dict | None

    @property
    def step(self) -> int | None:
        return None if self.meta is None else int(self.meta["step"])


def open_source(source: str, overrides: Mapping[str, Any] | None = None, *, world_size: int = 1) -> Source:
    """``source``: a q38 run directory, its ``checkpoints`` directory or one checkpoint (the newest that verifies),
    or a Hugging Face directory (``config.json`` + safetensors). The run config is the checkpoint's own (its model,
    train settings, kernels, LoRA setting and base) with ``layout: single`` on one process (the saved layout under
    torchrun); a Hugging Face directory runs under the defaults, with its tokenizer when it ships one. ``overrides``:
    ``SECTION.KEY`` values (``--set``), applied last."""
    from q38.train.io.checkpoint import read_meta, resolve_checkpoint

    p = Path(source)
    if not p.exists():
        raise FileNotFoundError(f"{source}: not found; name a q38 run or checkpoint directory, or a Hugging Face "
                                "checkpoint directory")
    hf = (p / "config.json").is_file() and not (p / "meta.json").is_file() and not (p / "checkpoints").is_dir()
    if hf:
        tok = str(p) if (p / "tokenizer.json").is_file() else "byte"
        raw: dict = {"model": str(p), "init_from": str(p), "data": {"tokenizer": tok}}
        return Source(RunConfig.from_dict(raw, source=str(p), overrides=overrides), None, None)
    ck = resolve_checkpoint(p, on_skip=lambda line: print(f"q38: note: {line}", file=sys.stderr))
    meta = read_meta(ck)
    raw = dict(meta.get("run_config") or {})
    raw.pop("source", None)
    if not raw:
        raise ConfigError(f"{ck}/meta.json has no run_config (not written by q38 train); convert it with "
                          "`q38 convert --to-hf` and evaluate the Hugging Face directory")
    raw["model"] = meta["model_config"]
    if world_size == 1:
        raw["layout"] = "single"
    raw["run"] = {k: v for k, v in (raw.get("run") or {}).items()
                  if k in ("seed", "device", "backend", "dtype", "timeout_s")}  # what the state depends on
    return Source(RunConfig.from_dict(raw, source=f"{ck}/meta.json", overrides=overrides), ck, meta)


def load_state(src: Source, world, device: str, plan, mesh):
    """The train state of ``src`` on ``mesh`` (None: one process), each rank reading only its shards."""
    from q38.train.run.trainer import _Resume, _build_state

    resume = _Resume(latest=src.checkpoint, meta=src.meta, metrics_path=Path("/nonexistent"), old_metrics=[],
                     torn=None)
    state, _ = _build_state(src.cfg, resume, mesh, device, plan, _NoIterator(), world.rank == 0)
    return state


def device_room(device: str) -> tuple[str, int | None]:
    """What ``device`` can still allocate, in words and bytes (None: unknown): the host's memory for ``cpu``, a CUDA
    device's free memory."""
    if device.startswith("cuda"):
        import torch

        return f"free memory of {device}", torch.cuda.mem_get_info(torch.device(device))[0]
    if device == "cpu":
        from q38.model import host_memory_available

        return "host memory", host_memory_available()
    return device, None


EVAL_BYTES_PER_TOKEN = 3 * 8  # a batch's input ids, labels and document ids: int64 on the host


def check_eval_batch(rows: int, cfg: RunConfig, device: str, what: str) -> None:
    """Refuse, before any data or weight is read, eval batches of ``rows`` rows (per data-parallel rank) that cannot
    fit: a batch holds ``rows × data.seq_len`` tokens as three int64 tensors on the host, and at least one hidden
    state (``[rows, seq_len, hidden_size]``, 2 bytes an element at the least) on the device. That lower bound is
    held against what this process can still allocate (the host's memory; a CUDA device's free memory); ``what``
    names the setting (``--batch-size``, ``data.eval_batch_size``) in the one-line error, with the largest value that
    passes the bound."""
    from q38.model import host_memory_available

    tokens = rows * cfg.data.seq_len
    hidden = 2 * cfg.model.hidden_size
    on_host = EVAL_BYTES_PER_TOKEN + (hidden if device == "cpu" else 0)
    checks = [("host memory", on_host, host_memory_available())]
    if device != "cpu":
        where, room = device_room(device)
        checks.append((where, hidden, room))
    for where, per_token, room in checks:
        if room is not None and tokens * per_token > room:
            most = max(room // (per_token * cfg.data.seq_len), 0)
            raise ConfigError(f"{what} {rows:,}: one eval batch of {rows:,} rows of {cfg.data.seq_len:,} tokens needs "
                              f"at least {tokens * per_token / 2**30:,.1f} GiB of {where} (its token ids and one "
                              f"hidden state), more than the {room / 2**30:,.1f} GiB this process can still allocate; "
                              f"give {what} {most:,} or less")


def evaluate(source: str, data_path: str, *, batch_size: int | None = None, max_batches: int = 0,
             overrides: dict | None = None, progress: bool = True) -> dict:
    """``q38 eval``: the terms and statistics of ``source`` (``open_source``) on the held-out
    ``data_path`` (a JSONL / chat file, ``builtin:NAME``, a prepared directory or a Megatron prefix, read with the
    source's tokenizer, ``data.seq_len``, ``data.train_on`` and ``data.overlong``), in global batches of
    ``batch_size`` rows per data-parallel rank (default ``data.eval_batch_size``, else ``data.batch_size``); the
    last batch is padded (every row is evaluated); ``max_batches`` (> 0) stops early. One process, or every rank
    under torchrun on the source's layout (or ``--set layout=...``). Returns the record (``step``, ``source``,
    ``data`` and the ``eval_*`` values), the same on every rank."""
    from q38.train.data.shards import EvalRows
    from q38.train.data.sources import open_source as open_data
    from q38.train.data.tokenizer import load_tokenizer
    from q38.train.run.evaluate import eval_losses
    from q38.train.run.launch import WorldInfo, _init_process_group, check_run, pick_backend, pick_device
    from q38.train.run.trainer import _make_mesh, _source_precision

    world = WorldInfo.from_env()
    src = open_source(source, overrides, world_size=world.world_size)
    cfg = src.cfg if src.checkpoint is not None else _source_precision(src.cfg)
    src = attrs.evolve(src, cfg=cfg)
    rows = batch_size or cfg.data.eval_batch_size or cfg.data.batch_size
    device = pick_device(cfg.run.device, world.local_rank)
    check_eval_batch(rows, cfg, device, "--batch-size" if batch_size else
                     "data.eval_batch_size" if cfg.data.eval_batch_size else "data.batch_size")
    plan = check_run(cfg, world.world_size, device)
    tok = load_tokenizer(cfg.data.tokenizer)
    created = world.world_size > 1 and _init_process_group(device, pick_backend(device, cfg.run.backend), world,
                                                           cfg.run.timeout_s)
    try:
        ds = open_data(str(data_path), tok, cfg.data.seq_len, cfg.model.vocab_size, cfg.data.overlong,
                       cfg.data.train_on)
        mesh, dp_rank = _make_mesh(plan, world, device, cfg.model)
        state = load_state(src, world, device, plan, mesh)
        evals = EvalRows([ds], rows, dp_rank=dp_rank, dp_size=plan.dp_size, max_batches=max_batches)
        out = eval_losses(state, evals, mesh, device, progress=progress)
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()
    return {"source": str(src.checkpoint or source), "step": src.step, "data": str(data_path),
            "eval_batch_size": rows, "eval_batches": len(evals), **out}
