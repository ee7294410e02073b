"""The training run behind ``q38 train``: config file → model, data, state → steps with logs.

A run config is YAML with sections ``model``, ``layout``, ``data``, ``train`` (a ``TrainConfig``) and ``run``.
"""

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch

from q38.config import SPECS_DIR, ConfigError, ModelConfig
from q38.train.config import TrainConfig, validate_run

DEFAULT_CONFIG = SPECS_DIR / "train" / "tiny.yaml"


def _check_keys(section: str, d: Mapping[str, Any], cls) -> None:
    import difflib

    names = [a.name for a in attrs.fields(cls)]
    for k in d:
        if k not in names:
            close = difflib.get_close_matches(k, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown key {k!r} in section {section!r}{hint}")


@attrs.frozen(kw_only=True)
class DataConfig:
    path: str = "builtin:tiny"
    tokenizer: str = "byte"
    seq_len: int = 256
    batch_size: int = 8  # rows per data-parallel rank per step
    overlong: str = "truncate"
    shuffle: bool = True


@attrs.frozen(kw_only=True)
class RunOptions:
    steps: int = 300
    seed: int = 0
    out_dir: str = "runs/tiny"
    log_every: int = 10
    save_every: int = 0  # 0: only at the end (and on SIGTERM / SIGINT)
    keep_last: int = 3
    device: str = "auto"  # auto | cpu | cuda | npu
    backend: str = "auto"  # process-group backend: auto | gloo | nccl | hccl
    dtype: str = "float32"
    warmup_log_steps: int = 2  # steps excluded from throughput (compile / cache warm-up)
    peak_flops: float | None = None  # per device, for MFU; None: known devices only
    progress: bool = True
    tensorboard: bool = False
    resume: bool = True


@attrs.frozen(kw_only=True)
class RunConfig:
    model: ModelConfig
    model_source: str
    init_from: str | None
    layout: str
    data: DataConfig
    train: TrainConfig
    run: RunOptions
    source: str

    @classmethod
    def from_yaml(cls, path: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None) -> "RunConfig":
        import yaml

        path = Path(path) if path is not None else DEFAULT_CONFIG
        if not path.is_file():
            raise ConfigError(f"train config not found: {path} (pass a YAML file, or no argument for the default)")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping with sections model, layout, data, train, run")
        return cls.from_dict(raw, source=str(path), overrides=overrides, base_dir=path.parent)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config", overrides=None, base_dir=None) -> "RunConfig":
        import difflib

        raw = dict(raw)
        for k, v in (overrides or {}).items():
            sec, _, key = k.partition(".")
            if not key:
                raw[sec] = v
            else:
                raw.setdefault(sec, {})
                raw[sec] = dict(raw[sec] or {}, **{key: v})
        sections = ("model", "init_from", "layout", "data", "train", "run")
        for k in raw:
            if k not in sections:
                close = difflib.get_close_matches(k, sections, n=1)
                raise ConfigError(
                    f"{source}: unknown top-level key {k!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                    + f"; valid sections: {', '.join(sections)}"
                )
        model_src = raw.get("model")
        if model_src is None:
            raise ConfigError(f"{source}: the 'model' key is required (a preset name, a YAML file or a HF directory)")
        init_from = raw.get("init_from")
        if isinstance(model_src, dict):
            model = ModelConfig.from_dict(model_src, source=f"{source}: model")
            model_src = "inline"
        else:
            model_path = _resolve(model_src, base_dir)
            model = ModelConfig.load(model_path if Path(model_path).exists() else model_src)
        data = dict(raw.get("data") or {})
        _check_keys("data", data, DataConfig)
        run = dict(raw.get("run") or {})
        _check_keys("run", run, RunOptions)
        train = TrainConfig.from_dict(raw.get("train") or {}, source=f"{source}: train")
        return cls(
            model=model, model_source=str(model_src), init_from=init_from, layout=str(raw.get("layout", "single")),
            data=DataConfig(**data), train=train, run=RunOptions(**run), source=source,
        )


def _resolve(p: str, base_dir) -> str:
    if base_dir is not None and not os.path.isabs(p) and (Path(base_dir) / p).exists():
        return str(Path(base_dir) / p)
    return p


def pick_device(name: str) -> str:
    if name != "auto":
        return name
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():  # type: ignore[attr-defined]
            return "npu"
    except ImportError:
        pass
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_backend(device: str, name: str = "auto") -> str:
    if name != "auto":
        return name
    return {"cuda": "nccl", "npu": "hccl"}.get(device.split(":")[0], "gloo")


class Throughput:
    """Tokens/s and MFU over the steps after ``warmup`` (never divides by zero)."""

    def __init__(self, warmup: int, flops_per_token: float, peak_flops: float | None):
        self.warmup, self.flops_per_token, self.peak = warmup, flops_per_token, peak_flops
        self.steps = self.tokens = 0
        self.seconds = 0.0

    def update(self, step: int, tokens: int, seconds: float) -> None:
        if step > self.warmup and seconds > 0:
            self.steps += 1
            self.tokens += tokens
            self.seconds += seconds

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def mfu(self) -> float | None:
        tps = self.tokens_per_s
        if tps is None or not self.peak:
            return None
        return tps * self.flops_per_token / self.peak


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 · active params (+ MTP) + attention score FLOPs (12 · layers · heads · head_dim · seq / 2 causal)."""
    from q38.model import count_params

    c = count_params(cfg)
    attn = 12 * (cfg.num_full_layers + cfg.mtp_num_layers) * cfg.num_attention_heads * cfg.head_dim * seq_len / 2
    return 6 * (c.active + c.mtp_active) + attn


def format_metrics(step: int, m: dict, tput: Throughput) -> str:
    parts = [f"step {step}", f"loss {m['loss']:.4f}"]
    parts += [f"{k} {m[k]:.4f}" for k in sorted(m) if k.startswith("mtp_")]
    parts += [f"aux {m['aux']:.4f}", f"gnorm {m['grad_norm']:.3f}", f"lr {m['lr']:.2e}"]
    tps = tput.tokens_per_s
    parts.append(f"tok/s {tps:,.0f}" if tps is not None else "tok/s n/a")
    if tput.mfu is not None:
        parts.append(f"mfu {100 * tput.mfu:.1f}%")
    return " | ".join(parts)


def write_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def isfinite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))


def train(cfg: RunConfig) -> list[dict]:
    """Run the training loop on one process; returns the per-step metric records."""
    from tqdm import tqdm

    from q38.train.data import BatchIterator, build_dataset, load_tokenizer
    from q38.train.state import init_state, state_from_params
    from q38.train.step import train_step

    device = pick_device(cfg.run.device)
    validate_run(cfg.model, cfg.train, device=device)
    torch.manual_seed(cfg.run.seed)
    tok = load_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {cfg.model.vocab_size}; "
            "use a model whose vocab covers the tokenizer"
        )
    dataset = build_dataset(cfg.data.path, tok, cfg.data.seq_len, overlong=cfg.data.overlong)
    batches = BatchIterator(dataset, cfg.data.batch_size, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    dtype = getattr(torch, cfg.run.dtype)
    if cfg.init_from:
        from q38.hf import load_hf

        hf_cfg, params = load_hf(cfg.init_from, dtype=dtype, device=device)
        state = state_from_params(params, hf_cfg, cfg.train)
    else:
        state = init_state(cfg.model, cfg.train, seed=cfg.run.seed, device=device, dtype=dtype)
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    tput = Throughput(cfg.run.warmup_log_steps, flops_per_token(cfg.model, cfg.data.seq_len), cfg.run.peak_flops)
    records = []
    bar = tqdm(total=cfg.run.steps, disable=not cfg.run.progress, dynamic_ncols=True, desc="q38 train")
    it = iter(batches)
    for step in range(1, cfg.run.steps + 1):
        batch = {k: v.to(device) for k, v in next(it).items()}
        t0 = time.perf_counter()
        state, metrics = train_step(state, batch)
        dt = time.perf_counter() - t0
        m = metrics.as_dict()
        tput.update(step, m["tokens"], dt)
        rec = dict(m, step=step, step_time=dt, tokens_per_s=tput.tokens_per_s, mfu=tput.mfu)
        records.append(rec)
        write_jsonl(metrics_path, rec)
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.3f}", aux=f"{m['aux']:.3f}")
        if step % cfg.run.log_every == 0 or step == 1 or step == cfg.run.steps:
            bar.write(format_metrics(step, m, tput))
    bar.close()
    return records
