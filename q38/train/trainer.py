"""The training run behind ``q38 train``: config file → model, data, state → steps with logs and checkpoints.

A run config is YAML with sections ``model``, ``init_from``, ``layout``, ``data``, ``train`` (a ``TrainConfig``),
``run`` and ``kernels`` (a ``q38.kernels.KernelConfig``: a run setting, so any checkpoint loads under any kernels). One process or ``torchrun --nproc_per_node N``: the device and process-group backend are chosen
automatically (Ascend NPU + hccl, CUDA + nccl, CPU + gloo; ``run.device`` / ``run.backend`` override), and the
layout's mesh is checked against ``WORLD_SIZE`` before anything is allocated.
"""

import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
import torch

from q38.config import SPECS_DIR, ConfigError, ModelConfig, check_keys
from q38.kernels import DEFAULT_KERNELS, OPS as KERNEL_OPS, KernelConfig, use_kernels
from q38.train.config import TrainConfig, validate_run
from q38.typed_config import structure

DEFAULT_CONFIG = SPECS_DIR / "train" / "tiny.yaml"
DEVICES = ("auto", "cpu", "cuda", "npu")
BACKENDS = ("auto", "gloo", "nccl", "hccl")
DTYPES = ("float32", "bfloat16", "float16")


def _check_keys(section: str, d: Mapping[str, Any], cls) -> None:
    check_keys(d, [a.name for a in attrs.fields(cls)], f"unknown key(s) in section {section!r}")


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@attrs.frozen(kw_only=True)
class DataConfig:
    path: Any = "builtin:tiny"  # JSONL, builtin:NAME, a prepared directory, or a list of {path, weight}
    tokenizer: str = "byte"
    seq_len: int = 256
    batch_size: int = 8  # rows per data-parallel rank per step
    overlong: str = "truncate"  # samples longer than seq_len: truncate | error | split
    shuffle: bool = True
    train_on: str = "assistant"  # chat records' targets: assistant | all | last_assistant (q38.train.chat)
    eval_split: float = 0.0  # fraction of each source's rows held out for evaluation (its last rows)
    eval_path: str | None = None  # or a separate eval set (JSONL or a prepared directory)

    def __attrs_post_init__(self) -> None:
        from q38.train.chat import TRAIN_ON
        from q38.train.data import OVERLONG_MODES

        _need(isinstance(self.eval_split, (int, float)) and not isinstance(self.eval_split, bool)
              and 0 <= self.eval_split < 1, f"data.eval_split must be a fraction in [0, 1), got {self.eval_split!r}")
        _need(not (self.eval_split and self.eval_path is not None),
              "data.eval_split and data.eval_path are both set; hold out a fraction or name an eval set, not both")

        _need(_is_int(self.seq_len) and self.seq_len > 0, f"data.seq_len must be a positive integer, got {self.seq_len!r}")
        _need(_is_int(self.batch_size) and self.batch_size > 0,
              f"data.batch_size must be a positive integer, got {self.batch_size!r}")
        _need(self.overlong in OVERLONG_MODES,
              f"data.overlong must be one of {', '.join(OVERLONG_MODES)}, got {self.overlong!r}")
        _need(self.train_on in TRAIN_ON, f"data.train_on must be one of {', '.join(TRAIN_ON)}, got {self.train_on!r}")


@attrs.frozen(kw_only=True)
class RunOptions:
    steps: int = 300  # total optimizer steps of the run (a resumed run continues up to this step)
    seed: int = 0
    out_dir: str = "runs/tiny"
    log_every: int = 10
    save_every: int = 0  # 0: only at the end (and on SIGTERM / SIGINT)
    keep_last: int = 3  # checkpoints kept in out_dir/checkpoints (0: all)
    device: str = "auto"  # auto | cpu | cuda | npu
    backend: str = "auto"  # process-group backend: auto | gloo | nccl | hccl
    dtype: str = "float32"  # alias of train.param_dtype (bfloat16: the bf16 policy); masters and moments stay fp32
    warmup_log_steps: int = 2  # steps excluded from throughput (compile / cache warm-up)
    peak_flops: float | None = None  # per device, for MFU; None: known devices only
    progress: bool = True
    tensorboard: bool = False
    resume: bool = True  # continue from the latest checkpoint in out_dir
    resume_from: str | None = None  # continue from this checkpoint (must verify); None: the newest in out_dir
    eval_every: int = 0  # steps between held-out evaluations (0: only after the last step, when there is eval data)
    eval_batches: int = 0  # global batches per evaluation (0: the whole eval split)

    def __attrs_post_init__(self) -> None:
        for k in ("eval_every", "eval_batches"):
            v = getattr(self, k)
            _need(_is_int(v) and v >= 0, f"run.{k} must be an integer >= 0, got {v!r}")
        for k in ("steps", "log_every"):
            v = getattr(self, k)
            _need(_is_int(v) and v > 0, f"run.{k} must be a positive integer, got {v!r}")
        for k in ("save_every", "keep_last", "warmup_log_steps"):
            v = getattr(self, k)
            _need(_is_int(v) and v >= 0, f"run.{k} must be an integer >= 0, got {v!r}")
        _need(isinstance(self.out_dir, str) and self.out_dir.strip() != "",
              "run.out_dir must be a non-empty path (where metrics and checkpoints go)")
        _need(str(self.device).split(":")[0] in DEVICES, f"run.device must be one of {', '.join(DEVICES)} "
              f"(optionally with :index), got {self.device!r}")
        _need(self.backend in BACKENDS, f"run.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        _need(self.dtype in DTYPES, f"run.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _need(self.peak_flops is None or (isinstance(self.peak_flops, (int, float)) and self.peak_flops > 0),
              f"run.peak_flops must be a positive number (FLOP/s per device) or null, got {self.peak_flops!r}")


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
    kernels: KernelConfig = KernelConfig()  # a run setting, not model identity (q38.kernels)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None) -> "RunConfig":
        import yaml

        path = Path(path) if path is not None else DEFAULT_CONFIG
        if not path.is_file():
            raise ConfigError(f"train config not found: {path} (pass a YAML file, or no argument for the default)")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping with sections model, layout, data, train, run")
        return cls.from_dict(raw, source=str(path), overrides=overrides, base_dir=path.parent)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config", overrides=None, base_dir=None) -> "RunConfig":
        import difflib

        raw = dict(raw)
        sections = ("model", "init_from", "layout", "data", "train", "run", "kernels")
        for k, v in (overrides or {}).items():
            sec, _, key = k.partition(".")
            if not key:
                raw[sec] = v
            else:
                cur = raw.get(sec) or {}
                if not isinstance(cur, dict):
                    raise ConfigError(f"--set {k}: section {sec!r} is not a mapping in {source}")
                raw[sec] = dict(cur, **{key: v})
        for k in raw:
            if k not in sections:
                close = difflib.get_close_matches(k, sections, n=1)
                raise ConfigError(
                    f"{source}: unknown top-level key {k!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                    + f"; valid sections: {', '.join(sections)}"
                )
        for sec in ("data", "train", "run", "kernels"):
            if raw.get(sec) is not None and not isinstance(raw[sec], dict):
                raise ConfigError(f"{source}: section {sec!r} must be a mapping, got {type(raw[sec]).__name__}")
        init_from = raw.get("init_from")
        if init_from is not None:
            init_from = _resolve(str(init_from), base_dir)
        model_src = raw.get("model")
        if model_src is None and init_from is not None:
            model_src = init_from  # the model of the checkpoint the run starts from
        if model_src is None:
            raise ConfigError(
                f"{source}: the 'model' key is required (a preset name, a YAML file or a Hugging Face directory)"
            )
        legacy: dict = {}  # pre-KernelConfig kernel keys in the model section / model YAML, mapped with a note
        if isinstance(model_src, dict):
            model = ModelConfig.from_dict(model_src, source=f"{source}: model", kernels_out=legacy)
            model_src = "inline"
        else:
            model = _load_model_config(_resolve(str(model_src), base_dir), kernels_out=legacy)
        kernels = KernelConfig.from_dict({**legacy, **(raw.get("kernels") or {})}, source=f"{source}: kernels")
        data = dict(raw.get("data") or {})
        _check_keys("data", data, DataConfig)
        if "path" in data and isinstance(data["path"], list):
            data["path"] = [dict(e, path=_resolve(str(e["path"]), base_dir)) if isinstance(e, dict) and "path" in e
                            else e for e in data["path"]]
        elif "path" in data and not isinstance(data["path"], str):
            raise ConfigError(f"data.path must be a string (a JSONL file, a prepared directory or builtin:NAME) or a "
                              f"list of {{path, weight}}, got {data['path']!r}")
        elif "path" in data and not str(data["path"]).startswith("builtin:"):
            data["path"] = _resolve(str(data["path"]), base_dir)
        if data.get("eval_path") is not None and not str(data["eval_path"]).startswith("builtin:"):
            data["eval_path"] = _resolve(str(data["eval_path"]), base_dir)
        run = dict(raw.get("run") or {})
        _check_keys("run", run, RunOptions)
        train = TrainConfig.from_dict(_train_with_run_dtype(raw.get("train") or {}, run, source),
                                      source=f"{source}: train")
        return cls(
            model=model, model_source=str(model_src), init_from=init_from, layout=str(raw.get("layout", "single")),
            data=structure(DataConfig, data, "data"), train=train, run=structure(RunOptions, run, "run"),
            source=source, kernels=kernels,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_source, "init_from": self.init_from, "layout": self.layout,
            "data": attrs.asdict(self.data), "train": self.train.to_dict(), "run": attrs.asdict(self.run),
            "source": self.source, "kernels": self.kernels.to_dict(),
        }


def _train_with_run_dtype(train: Mapping[str, Any], run: Mapping[str, Any], source: str) -> dict:
    """``run.dtype: bfloat16`` means the bf16 mixed-precision policy: ``train.param_dtype: bfloat16`` (compute and
    gathers), fp32 master weights and moments. It may not contradict an explicit ``train.param_dtype``."""
    train = dict(train)
    dt = run.get("dtype")
    if dt is None or dt == "float32":
        return train
    if train.get("param_dtype", dt) != dt:
        raise ConfigError(f"{source}: run.dtype {dt!r} and train.param_dtype {train['param_dtype']!r} disagree; "
                          "run.dtype is an alias of train.param_dtype: drop run.dtype or make them equal")
    train["param_dtype"] = dt
    return train


def _resolve(p: str, base_dir) -> str:
    """A relative path names a file next to the config when one exists there, else it is relative to the CWD."""
    if base_dir is not None and not os.path.isabs(p) and (Path(base_dir) / p).exists():
        return str(Path(base_dir) / p)
    return p


def _load_model_config(src: str, kernels_out: dict | None = None) -> ModelConfig:
    """A preset name, a model YAML, a Hugging Face directory / config.json, or a q38 checkpoint (its meta.json)."""
    from q38.train.checkpoint import is_checkpoint, latest_checkpoint, read_meta

    p = Path(src)
    ck = p if is_checkpoint(p) else (latest_checkpoint(p / "checkpoints") if p.is_dir() else None)
    if ck is not None:
        # a checkpoint's kernel keys (older meta.json) do not bind this run: dropped, not mapped
        return ModelConfig.from_dict(read_meta(ck)["model_config"], source=str(ck))
    if p.is_dir() and not (p / "config.json").is_file():
        raise ConfigError(f"model: {p} is a directory without config.json (not a Hugging Face checkpoint) and "
                          "without a q38 checkpoint; name a preset, a model YAML or a checkpoint directory")
    return ModelConfig.load(src, kernels_out=kernels_out)


# ---- devices, processes, layout -------------------------------------------------------------------------------------


def pick_device(name: str, local_rank: int = 0) -> str:
    """``auto``: an Ascend NPU (torch_npu), else CUDA, else CPU; with ``local_rank`` as the index on accelerators."""
    if name == "auto":
        name = "cpu"
        try:
            import torch_npu  # noqa: F401

            if torch.npu.is_available():  # type: ignore[attr-defined]
                name = "npu"
        except ImportError:
            pass
        if name == "cpu" and torch.cuda.is_available():
            name = "cuda"
    if name in ("cuda", "npu"):
        return f"{name}:{local_rank}"
    return name


def pick_backend(device: str, name: str = "auto") -> str:
    if name != "auto":
        return name
    return {"cuda": "nccl", "npu": "hccl"}.get(device.split(":")[0], "gloo")


@attrs.frozen
class WorldInfo:
    """What torchrun tells this process (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``); 1 / 0 / 0 without it."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "WorldInfo":
        env = os.environ if env is None else env

        def get(k: str, default: int) -> int:
            v = env.get(k, "")
            try:
                return int(v) if v != "" else default
            except ValueError:
                raise ConfigError(f"environment variable {k}={v!r} is not an integer (torchrun sets it)") from None

        w = cls(get("WORLD_SIZE", 1), get("RANK", 0), get("LOCAL_RANK", 0))
        _need(w.world_size >= 1 and 0 <= w.rank < w.world_size,
              f"RANK={w.rank} does not fit WORLD_SIZE={w.world_size}; launch with torchrun")
        return w


@attrs.frozen
class RunPlan:
    """The checked shape of a run: mesh sizes, data-parallel size, EP size."""

    layout: Any
    mesh_sizes: dict
    dp_size: int
    ep_size: int
    cp_size: int
    kernels: KernelConfig = DEFAULT_KERNELS  # resolved: what this run's layers execute


def check_run(cfg: RunConfig, world_size: int = 1, device: str = "cpu") -> RunPlan:
    """Every up-front check that needs no data, weights or process group: the layout against ``world_size``,
    kernels against the device, EP balance against the layout, seq_len against CP. Raises ConfigError / LayoutError."""
    from q38.parallel.layout import Layout, LayoutError

    layout = Layout.load(cfg.layout)
    try:
        sizes = layout.resolve_mesh(world_size)
    except LayoutError as e:
        raise LayoutError(
            f"{e}. Launch a fitting number of processes with `torchrun --nproc_per_node N q38 train CONFIG`, or "
            f"choose another layout (layout: single runs on one process)"
        ) from None
    layout.placements(abstract_params_of(cfg.model), sizes)  # every parameter placed and divisible (or uneven)
    ep, cp = sizes.get("ep", 1), sizes.get("cp", 1)
    dp = math.prod(sizes.get(d, 1) for d in layout.batch_mesh_dims)
    kernels = validate_run(cfg.model, cfg.train, device=device, ep_size=ep, kernels=cfg.kernels, cp_size=cp)
    _need(cfg.data.seq_len % cp == 0,
          f"data.seq_len {cfg.data.seq_len} must be divisible by the layout's cp size {cp} (the sequence is split "
          f"over cp ranks); change seq_len or the layout")
    return RunPlan(layout, dict(sizes), dp, ep, cp, kernels)


def abstract_params_of(model: ModelConfig):
    from q38.model import abstract_params

    return abstract_params(model)


def _init_process_group(device: str, backend: str, world: WorldInfo) -> bool:
    """Initialise the default process group for a torchrun launch; True if this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if device.startswith("cuda"):
        torch.cuda.set_device(world.local_rank)
    elif device.startswith("npu"):
        torch.npu.set_device(world.local_rank)  # type: ignore[attr-defined]
    if "MASTER_ADDR" not in os.environ:
        raise ConfigError(f"WORLD_SIZE={world.world_size} but MASTER_ADDR is not set; launch with "
                          "`torchrun --nproc_per_node N q38 train CONFIG` (it sets the rendezvous variables)")
    dist.init_process_group(backend=backend, rank=world.rank, world_size=world.world_size)
    return True


# ---- metrics --------------------------------------------------------------------------------------------------------


class Throughput:
    """Tokens/s and MFU over the steps after the first ``warmup`` of this process (never divides by zero)."""

    def __init__(self, warmup: int, flops_per_token: float, peak_flops: float | None, devices: int = 1):
        self.warmup, self.flops_per_token, self.peak, self.devices = warmup, flops_per_token, peak_flops, devices
        self.seen = self.steps = self.tokens = 0
        self.seconds = 0.0

    def update(self, step: int, tokens: int, seconds: float) -> None:
        """``tokens``: the step's tokens over all ranks. Steps are counted from this process's first one, so a
        resumed run skips its own warm-up steps too."""
        self.seen += 1
        if self.seen > self.warmup and seconds > 0:
            self.steps += 1
            self.tokens += tokens
            self.seconds += seconds

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def mfu(self) -> float | None:
        tps = self.tokens_per_s
        if tps is None or not self.peak or self.devices < 1:
            return None
        return tps * self.flops_per_token / (self.peak * self.devices)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (MFU's numerator): q38.flops, the formula ``q38 plan`` predicts step time with
    (matmuls of every layer, causal attention, the GDN chunk algorithm and the LM head per depth; fwd + bwd)."""
    from q38.flops import train_flops_per_token

    return train_flops_per_token(cfg, seq_len)


# Dense bf16 / fp16 peak FLOP/s per device (vendor datasheets); MFU is shown only for these, or with run.peak_flops.
PEAK_FLOPS_16BIT = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}


def known_peak_flops(device: str, dtype: str) -> float | None:
    if dtype not in ("bfloat16", "float16") or not device.startswith("cuda"):
        return None
    try:
        name = torch.cuda.get_device_name(torch.device(device))
    except Exception:  # no driver / no device: no MFU
        return None
    return next((v for k, v in PEAK_FLOPS_16BIT.items() if k in name), None)


def format_metrics(step: int, m: dict, tput: Throughput, step_time: float | None = None,
                   terms: list[str] | None = None) -> str:
    """One progress line: the objective's terms by name (default: loss, mtp_<d>, aux), grad norm, LR, the worst
    MoE layer's max/mean expert load and the count of idle experts, time, throughput."""
    if terms is None:
        terms = ["loss", *sorted(k for k in m if k.startswith("mtp_")), "aux"]
    parts = [f"step {step}", *(f"{k} {m[k]:.4f}" for k in terms)]
    parts += [f"gnorm {m['grad_norm']:.3f}", f"lr {m['lr']:.2e}"]
    if "router_max_mean" in m:
        parts.append(f"load {m['router_max_mean']:.2f}x idle {m['router_idle']}")
    if step_time is not None:
        parts.append(f"{step_time:.2f}s")
    tps = tput.tokens_per_s
    parts.append(f"tok/s {tps:,.0f}" if tps is not None else "tok/s n/a")
    if tput.mfu is not None:
        parts.append(f"mfu {100 * tput.mfu:.1f}%")
    if m.get("eval_loss") is not None:
        parts.append(f"eval loss {m['eval_loss']:.4f}")
        parts += [f"eval {k[5:]} {m[k]:.4f}" for k in sorted(m) if k.startswith("eval_mtp_")]
    if m.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return " | ".join(parts)


def write_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    from q38.train.safety import load_metrics

    return load_metrics(path)[0]  # a torn last line is left out; any other malformed line is an error


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the records of steps <= ``last_step`` (a resumed run rewrites the steps after its checkpoint)."""
    recs = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    os.replace(tmp, path)


def isfinite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))


# ---- signals --------------------------------------------------------------------------------------------------------


class StopSignal:
    """SIGTERM / SIGINT set a flag; the loop finishes its step, saves and exits. A second SIGINT aborts at once
    (KeyboardInterrupt); SIGTERM never escalates (torchrun may forward it twice)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> "StopSignal":
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


def _any_rank(flag: int, device: str) -> int:
    """The max of ``flag`` over ranks (one process: ``flag``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    dev = device if dist.get_backend() in ("nccl", "hccl") else "cpu"
    t = torch.tensor([flag], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# ---- the run --------------------------------------------------------------------------------------------------------


def _initial_params(cfg: RunConfig, device: str, dtype: torch.dtype):
    """Parameters from ``init_from`` (a Hugging Face directory or a q38 checkpoint), checked against the run's model
    config, or freshly initialised."""
    from q38.model import init_params
    from q38.train.checkpoint import CheckpointMismatch, config_diff, is_checkpoint, load_params

    if not cfg.init_from:
        return init_params(cfg.model, seed=cfg.run.seed, device=device, dtype=dtype)
    src = Path(cfg.init_from)
    if not src.exists():
        raise FileNotFoundError(f"init_from: {src} not found; expected a Hugging Face checkpoint directory "
                                "(config.json + *.safetensors) or a q38 checkpoint directory")
    if (src / "config.json").is_file() and not is_checkpoint(src):
        from q38.hf import load_hf
        from q38.train.safety import check_safetensors_dir

        check_safetensors_dir(src, "init_from")  # config.json parses, every safetensors file is whole
        got, params = load_hf(src, dtype=dtype, device=device)
    else:
        got, params, _ = load_params(src, device=device, dtype=dtype)
    diff = config_diff(got.to_dict(), cfg.model.to_dict())
    if diff:
        raise CheckpointMismatch(
            f"init_from {src} holds another model than the config names ({'; '.join(diff[:6])}); set model: to "
            f"{src} or to the matching preset"
        )
    return params


def _meta(cfg: RunConfig, state, batches, plan: RunPlan, world: WorldInfo) -> dict:
    import q38

    return {
        "step": int(state.step),
        "model_config": cfg.model.to_dict(),
        "train_config": cfg.train.to_dict(),
        "param_dtype": "float32",  # stored dtype: fp32 masters (train_config.param_dtype is the compute dtype)
        "data": {"iterator": batches.state_dict(), "path": str(cfg.data.path), "tokenizer": str(cfg.data.tokenizer),
                 "seq_len": cfg.data.seq_len, "batch_size": cfg.data.batch_size, "dp_size": plan.dp_size,
                 "seed": cfg.run.seed, "shuffle": cfg.data.shuffle},
        "layout": cfg.layout,
        "kernels": plan.kernels.to_dict(),  # what ran (a run setting: a run with other kernels may load this)
        "mesh": plan.mesh_sizes,
        "world_size": world.world_size,
        "run_config": cfg.to_dict(),
        "q38_version": q38.__version__,
        "torch_version": torch.__version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _changes(meta: Mapping[str, Any], cfg: RunConfig, plan: RunPlan) -> list[str]:
    """Data and train settings that differ from the checkpoint's (allowed, e.g. more steps; reported)."""
    d = meta.get("data") or {}
    now = {"path": str(cfg.data.path), "seq_len": cfg.data.seq_len, "dp_size": plan.dp_size,
           "batch_size": cfg.data.batch_size, "seed": cfg.run.seed, "shuffle": cfg.data.shuffle}
    out = [f"data.{k}: {d.get(k)!r} -> {v!r}" for k, v in now.items() if k in d and d[k] != v]
    old_train = meta.get("train_config") or {}
    out += [f"train.{k}: {old_train[k]!r} -> {v!r}" for k, v in cfg.train.to_dict().items()
            if k in old_train and old_train[k] != v]
    old_k = meta.get("kernels") or {}
    out += [f"kernels.{k}: {old_k[k]!r} -> {v!r}" for k, v in plan.kernels.to_dict().items()
            if k in old_k and old_k[k] != v]
    return out


def train(cfg: RunConfig, *, on_step: Callable[[dict], None] | None = None) -> list[dict]:
    """Run (or resume) the training loop; returns this process's per-step metric records.

    ``on_step(record)`` is called after each step (tests use it to stop a run). Under torchrun every rank calls
    ``train``; rank 0 logs and writes metrics."""
    world = WorldInfo.from_env()
    device = pick_device(cfg.run.device, world.local_rank)
    plan = check_run(cfg, world.world_size, device)  # before any allocation or process group
    from q38.train.safety import check_device, check_out_dir, run_lock

    check_device(device)
    check_out_dir(cfg.run.out_dir)
    created_pg = False
    if world.world_size > 1:
        created_pg = _init_process_group(device, pick_backend(device, cfg.run.backend), world)
    try:
        with run_lock(cfg.run.out_dir, lead=world.rank == 0):  # one run per out_dir
            return _train(cfg, world, device, plan, on_step)
    finally:
        if created_pg:
            import torch.distributed as dist

            dist.destroy_process_group()


def _train(cfg: RunConfig, world: WorldInfo, device: str, plan: RunPlan, on_step) -> list[dict]:
    from tqdm import tqdm

    from q38.train.checkpoint import (
        CHECKPOINTS,
        check_model_config,
        empty_params,
        load_checkpoint,
        read_meta,
        save_checkpoint,
    )
    from q38.train.data import load_tokenizer
    from q38.train.evaluate import eval_losses
    from q38.train.safety import choose_checkpoint, interrupted, load_metrics, note, save_error
    from q38.train.shards import TrainData
    from q38.train.state import state_from_params
    from q38.train.step import train_step

    lead = world.rank == 0
    torch.manual_seed(cfg.run.seed)
    tok = load_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {cfg.model.vocab_size}; "
            "use a model whose vocab covers the tokenizer"
        )
    data = TrainData(cfg.data.path, tok, seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size,
                     overlong=cfg.data.overlong, eval_split=cfg.data.eval_split, eval_path=cfg.data.eval_path,
                     train_on=cfg.data.train_on)
    if cfg.run.eval_every and not data.eval:
        raise ConfigError(f"run.eval_every is {cfg.run.eval_every} but there is no eval data; set data.eval_split "
                          "(e.g. 0.05) or data.eval_path, or run.eval_every: 0")
    dtype = torch.float32  # master weights (the mixed-precision policy computes in train.param_dtype)
    out = Path(cfg.run.out_dir)
    ck_root = out / CHECKPOINTS
    notes: list[str] = []  # verified before use; nothing is deleted or truncated until the run starts
    latest = choose_checkpoint(out, cfg.run.resume, cfg.run.resume_from, notes)
    metrics_path = out / "metrics.jsonl"
    old_metrics, torn = load_metrics(metrics_path)  # every rank: a malformed log stops all of them
    for line in notes if lead else []:
        note(line)
    if latest is not None:
        meta = read_meta(latest)
        check_model_config(meta, cfg.model, str(latest))  # before allocating anything
        params = empty_params(cfg.model, device=device, dtype=dtype)
    else:
        meta = None
    mesh = None
    if world.world_size > 1:
        from q38.parallel.runtime import init_sharded, make_mesh, shard, shard_batch

        mesh = make_mesh(plan.layout, world.world_size, device.split(":")[0])
    # Each rank reads only its own rows of every global batch (batch_size rows per data-parallel rank).
    dp_rank = 0
    if mesh is not None:
        from q38.parallel.runtime import batch_row_rank

        dp_rank = batch_row_rank(mesh)[0]
    batches, evals = data.iterators(cfg.data.batch_size, dp_rank=dp_rank, dp_size=plan.dp_size, seed=cfg.run.seed,
                                    shuffle=cfg.data.shuffle, eval_batches=cfg.run.eval_batches)
    if mesh is not None and latest is None and not cfg.init_from:
        # each rank draws only its own shards: the full model never exists on one rank
        state = state_from_params(init_sharded(cfg.model, mesh, seed=cfg.run.seed, device=device, dtype=dtype),
                                  cfg.model, cfg.train)
    else:
        if latest is None:
            params = _initial_params(cfg, device, dtype)
        state = state_from_params(params, cfg.model, cfg.train)
        if mesh is not None:
            state = shard(state, mesh)
    start = 0
    if latest is not None:
        state, meta = load_checkpoint(latest, state)
        start = int(meta["step"])
        changes = _changes(meta, cfg, plan)
        if changes and lead:
            print(f"q38 train: note: settings changed since {latest}: {'; '.join(changes)}", file=sys.stderr)
        batches.load_state_dict(meta["data"]["iterator"])
    if start >= cfg.run.steps:
        if lead:
            print(f"q38 train: {latest} is at step {start} >= run.steps {cfg.run.steps}: nothing to train "
                  "(raise run.steps to continue, or use a new run.out_dir)")
        return []

    if lead:
        out.mkdir(parents=True, exist_ok=True)
        if torn:
            note(f"{metrics_path}:{torn}: cut off a torn last line (a partial write, e.g. on a full disk)")
        if start:
            _truncate_metrics(metrics_path, start)
        else:
            if old_metrics:
                note(f"starting fresh: {metrics_path} ({len(old_metrics)} records, no checkpoint to resume) "
                     "is replaced")
            metrics_path.write_text("")
    tb = _tensorboard(cfg, out) if lead else None
    peak = cfg.run.peak_flops or known_peak_flops(device, cfg.train.param_dtype)
    tput = Throughput(cfg.run.warmup_log_steps, flops_per_token(cfg.model, cfg.data.seq_len), peak,
                      world.world_size)
    depths = cfg.model.mtp_num_layers
    records: list[dict] = []
    # The bar only on a terminal (tqdm's disable=None); the log lines and metrics.jsonl always.
    bar = tqdm(total=cfg.run.steps, initial=start, disable=None if (cfg.run.progress and lead) else True,
               dynamic_ncols=True, desc="q38 train", file=sys.stdout)
    log = bar.write if lead else (lambda s: None)
    if start and lead:
        log(f"resumed from {latest} (step {start})")
    if lead:
        log("kernels: " + ", ".join(f"{op}={getattr(plan.kernels, op)}" + (" (auto)" if getattr(cfg.kernels, op) == "auto"
                                                                             else "") for op in KERNEL_OPS))
    saved_at = None

    def save() -> Path:
        try:
            return save_checkpoint(ck_root, state, _meta(cfg, state, batches, plan, world),
                                   keep_last=cfg.run.keep_last)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if interrupted(e):
                raise KeyboardInterrupt from e
            raise save_error(e, int(state.step), ck_root) from e

    try:
        with StopSignal() as stop, use_kernels(plan.kernels):
            for step in range(start + 1, cfg.run.steps + 1):
                lb = {k: v.to(device) for k, v in next(batches).items()}
                batch = shard_batch(lb, mesh, depths, local_rows=True) if mesh is not None else lb
                t0 = time.perf_counter()
                state, metrics = train_step(state, batch, mesh)
                dt = time.perf_counter() - t0
                m = metrics.as_dict()
                if evals is not None and ((cfg.run.eval_every and step % cfg.run.eval_every == 0)
                                          or step == cfg.run.steps):
                    m.update(eval_losses(state, (evals.batch(k) for k in range(evals.num_batches)), mesh, device))
                tput.update(step, m["tokens"], dt)
                rec = dict(m, step=step, step_time=dt, tokens_per_s=tput.tokens_per_s, mfu=tput.mfu)
                records.append(rec)
                if lead:
                    write_jsonl(metrics_path, rec)
                    if tb is not None:  # every number of the record, under the same names as metrics.jsonl
                        for k, v in rec.items():
                            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                                tb.add_scalar(f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}", v, step)
                    bar.update(1)
                    bar.set_postfix(loss=f"{m['loss']:.3f}", aux=f"{m['aux']:.3f}",
                                    **({"load": f"{m['router_max_mean']:.2f}x"} if "router_max_mean" in m else {}),
                                    **({"eval": f"{m['eval_loss']:.3f}"} if "eval_loss" in m else {}))
                    if m["skipped"]:
                        log(f"step {step}: non-finite loss or gradient (loss={m['loss']}, grad_norm="
                            f"{m['grad_norm']}); update skipped (train.nan_policy: skip)")
                    if step % cfg.run.log_every == 0 or step == start + 1 or step == cfg.run.steps or "eval_loss" in m:
                        log(format_metrics(step, m, tput, dt, terms=list(metrics.terms) or None))
                if on_step is not None:
                    on_step(rec)
                stopping = _any_rank(int(stop.signum or 0), device)
                if stopping or step == cfg.run.steps or (cfg.run.save_every and step % cfg.run.save_every == 0):
                    saved_at = save()
                if stopping:
                    name = signal.Signals(stopping).name
                    if lead:
                        bar.close()
                        print(f"q38 train: stopped by {name} at step {step}; checkpoint saved to {saved_at} "
                              f"(run the same command again to resume)")
                    break
            else:
                if lead:
                    bar.close()
                    print(f"q38 train: done, step {cfg.run.steps}; checkpoint saved to {saved_at}")
    finally:
        bar.close()
        if tb is not None:
            tb.close()
    return records


def _tensorboard(cfg: RunConfig, out: Path):
    if not cfg.run.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("run.tensorboard: true needs the tensorboard package (pip install tensorboard); "
                          "or set run.tensorboard: false (metrics.jsonl is always written)") from None
    return SummaryWriter(str(out / "tensorboard"))
