"""The run config of ``q38 train`` (``RunConfig``: ``model``, ``init_from``, ``layout``, ``data``, ``train``, ``run``,
``kernels``, ``peft``), read from YAML with ``--set`` overrides and checked up front."""

import os
import re
from pathlib import Path
from typing import Any, Mapping

import attrs

from q38.hf_config import load_model_config
from q38.model_config import SPECS_DIR, ModelConfig
from q38.errors import ConfigError, check_filled, check_keys, need, unfilled
from q38.kernels import KernelConfig
from q38.lora import PeftConfig
from q38.train.core.step_config import TrainConfig
from q38.train.run.profile import ProfileOptions
from q38.schema import structure



DEFAULT_CONFIG = SPECS_DIR / "train" / "tiny.yaml"
DEVICES = ("auto", "cpu", "cuda", "npu")
BACKENDS = ("auto", "gloo", "nccl", "hccl")
DTYPES = ("float32", "bfloat16", "float16")
EVAL_BATCHES = 16  # run.eval_batches default: a bounded eval (16 global batches: seconds for the default run)


def _check_keys(section: str, d: Mapping[str, Any], cls) -> None:
    check_keys(d, [a.name for a in attrs.fields(cls)], f"unknown key(s) in section {section!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@attrs.frozen(kw_only=True)
class DataConfig:
    path: Any = "builtin:tiny"  # JSONL, builtin:NAME, a prepared dir, a Megatron PREFIX, or a list of {path, weight}
    tokenizer: str = "byte"  # byte, or a directory / tokenizer.json of a Hugging Face tokenizer
    seq_len: int = 256  # tokens per packed row
    batch_size: int = 8  # rows per data-parallel rank per step
    overlong: str = "truncate"  # samples longer than seq_len: truncate | error | split
    shuffle: bool = True  # shuffle rows each epoch (seeded by run.seed)
    train_on: str = "assistant"  # chat records' targets: assistant | all | last_assistant (q38.train.data.chat)
    eval_split: float = 0.0  # fraction of each source's rows held out for evaluation (its last rows)
    eval_path: str | None = None  # or a separate eval set (JSONL or a prepared directory)
    eval_batch_size: int | None = None  # rows per data-parallel rank per eval batch (None: batch_size)
    prefetch: int = 1  # batches read ahead on a background thread while the step runs (0: read in the step)

    def __attrs_post_init__(self) -> None:
        from q38.train.data.chat import TRAIN_ON
        from q38.train.data.loader import OVERLONG_MODES

        need(isinstance(self.eval_split, (int, float)) and not isinstance(self.eval_split, bool)
              and 0 <= self.eval_split < 1, f"data.eval_split must be a fraction in [0, 1), got {self.eval_split!r}")
        need(not (self.eval_split and self.eval_path is not None),
              "data.eval_split and data.eval_path are both set; hold out a fraction or name an eval set, not both")

        need(_is_int(self.prefetch) and self.prefetch >= 0,
             f"data.prefetch must be an integer >= 0 (batches read ahead), got {self.prefetch!r}")
        need(_is_int(self.seq_len) and self.seq_len > 0, f"data.seq_len must be a positive integer, got {self.seq_len!r}")
        need(_is_int(self.batch_size) and self.batch_size > 0,
              f"data.batch_size must be a positive integer, got {self.batch_size!r}")
        need(self.eval_batch_size is None or _is_int(self.eval_batch_size) and self.eval_batch_size > 0,
             f"data.eval_batch_size must be a positive integer or null (data.batch_size), got "
             f"{self.eval_batch_size!r}")
        need(self.overlong in OVERLONG_MODES,
              f"data.overlong must be one of {', '.join(OVERLONG_MODES)}, got {self.overlong!r}")
        need(self.train_on in TRAIN_ON, f"data.train_on must be one of {', '.join(TRAIN_ON)}, got {self.train_on!r}")


SEED_MAX = (1 << 63) - 1  # torch.Generator.manual_seed takes a 64-bit seed; q38 derives per-leaf seeds from it


@attrs.frozen(kw_only=True)
class RunOptions:
    steps: int = 300  # total optimizer steps of the run (a resumed run continues up to this step)
    seed: int = 0  # seed of the init and the data order
    out_dir: str = "runs/tiny"  # metrics.jsonl, checkpoints and exports go here
    log_every: int = 10  # steps between progress lines
    save_every: int = 0  # 0: only at the end (and on SIGTERM / SIGINT)
    keep_last: int = 3  # checkpoints kept in out_dir/checkpoints (0: all)
    save_hf: bool = False  # also export the final state as a Hugging Face directory out_dir/hf/step_<n> (all ranks)
    save_hf_every: int = 0  # with save_hf: also export at every checkpoint whose step is a multiple (0: final only)
    device: str = "auto"  # auto | cpu | cuda | npu
    backend: str = "auto"  # process-group backend: auto | gloo | nccl | hccl
    dtype: str = "float32"  # alias of train.param_dtype (bfloat16: the bf16 policy); masters and moments stay fp32
    warmup_log_steps: int = 2  # steps excluded from throughput (compile / cache warm-up)
    peak_flops: float | None = None  # per device, for MFU; None: known devices only
    progress: bool = True  # a progress bar on a terminal
    tensorboard: bool = False  # the same as listing tensorboard in run.trackers
    # where each step's record goes besides metrics.jsonl (always written): tensorboard, wandb, swanlab
    trackers: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    tracker_project: str = "q38"  # the wandb / SwanLab project
    tracker_mode: str = "online"  # online | offline (wandb / SwanLab write locally, to sync later)
    resume: bool = True  # continue from the latest checkpoint in out_dir
    # continue from this checkpoint (must verify; needs resume: true); None: the newest in out_dir
    resume_from: str | None = None
    eval_every: int = 0  # steps between held-out evaluations (0: only after the last step, when there is eval data)
    # global batches per evaluation (at most: fewer when the eval split is smaller); 0: the whole eval split
    eval_batches: int = EVAL_BATCHES
    # keep the checkpoint of the best evaluation so far in out_dir/best (null: none; true: eval_loss): an evaluation
    # metric (eval_loss, eval_ppl, eval_mtp_<k>, eval_aux: lower is better; eval_accuracy, the MTP heads'
    # acceptance eval_accept_<d> and eval_accept_len_<k>: higher is better)
    keep_best: Any = None
    # stop the run after this many evaluations in a row that do not improve run.keep_best's metric by more than
    # run.early_stop_min_delta (0: never stop early)
    early_stop_patience: int = 0
    early_stop_min_delta: float = 0.0  # the least change of the metric that counts as an improvement for the patience
    # on an accelerator: refuse to start when q38 plan's predicted per-rank peak exceeds the device's memory
    memory_check: bool = True
    # write checkpoints between run.save_every steps in the background (staged to host memory first; the final one
    # and one on a stop signal are written in the step)
    async_save: bool = False
    # a torch.profiler trace per rank of some steps ({start, steps, memory}; q38.train.run.profile); None: no profiling
    profile: ProfileOptions | None = None
    # seconds a process-group rendezvous or a collective may wait before it fails (torch's own default: 30 min for
    # gloo, 10 min for NCCL)
    timeout_s: float = 1800.0
    # a train step running longer than this ends the run with a stack dump per rank and one line naming the rank that
    # holds it up (q38.train.run.watchdog); "auto": max(step_timeout_floor_s, 10 x the slowest of the last 100
    # steps), run.timeout_s for a run's first step; 0 or None: no step timeout
    step_timeout_s: Any = "auto"  # "auto", a number of seconds, or 0 / None
    # the least bound of step_timeout_s: auto (data waits, a recompile and a slow host stay below it)
    step_timeout_floor_s: float = 300.0

    def __attrs_post_init__(self) -> None:
        for k in ("eval_every", "eval_batches", "early_stop_patience"):
            v = getattr(self, k)
            need(_is_int(v) and v >= 0, f"run.{k} must be an integer >= 0, got {v!r}")
        need(self.keep_best in (None, False, True) or isinstance(self.keep_best, str) and best_metric_known(
            self.keep_best), f"run.keep_best must be null, true (eval_loss) or an evaluation metric "
             f"({', '.join(BEST_METRICS)}, eval_mtp_<k>, eval_accept_<d>, eval_accept_len_<k>), got {self.keep_best!r}")
        need(isinstance(self.early_stop_min_delta, (int, float)) and not isinstance(self.early_stop_min_delta, bool)
             and 0 <= self.early_stop_min_delta < float("inf"),
             f"run.early_stop_min_delta must be a number >= 0, got {self.early_stop_min_delta!r}")
        need(self.best_metric is None or self.eval_every > 0,
             f"run.keep_best is {self.keep_best!r} but run.eval_every is 0: the best checkpoint is chosen among the "
             "periodic evaluations; set run.eval_every (e.g. 100)")
        need(not self.early_stop_patience or self.best_metric is not None,
             f"run.early_stop_patience is {self.early_stop_patience} but run.keep_best is not set: early stopping "
             "watches run.keep_best's metric; set run.keep_best: eval_loss (or another metric)")
        need(self.resume or self.resume_from is None,
              f"run.resume_from is {self.resume_from!r} but run.resume is false; set run.resume: true to continue "
              "from that checkpoint, or drop run.resume_from to start fresh")
        for k in ("steps", "log_every"):
            v = getattr(self, k)
            need(_is_int(v) and v > 0, f"run.{k} must be a positive integer, got {v!r}")
        need(_is_int(self.seed) and 0 <= self.seed <= SEED_MAX,
             f"run.seed must be an integer from 0 to {SEED_MAX} (2**63 - 1), got {self.seed!r}")
        need(isinstance(self.save_hf, bool), f"run.save_hf must be true or false, got {self.save_hf!r}")
        need(not self.save_hf_every or self.save_hf, "run.save_hf_every is set but run.save_hf is false; set "
              "run.save_hf: true to export Hugging Face directories, or run.save_hf_every: 0")
        for k in ("save_every", "keep_last", "warmup_log_steps", "save_hf_every"):
            v = getattr(self, k)
            need(_is_int(v) and v >= 0, f"run.{k} must be an integer >= 0, got {v!r}")
        need(isinstance(self.out_dir, str) and self.out_dir.strip() != "",
              "run.out_dir must be a non-empty path (where metrics and checkpoints go)")
        need(str(self.device).split(":")[0] in DEVICES, f"run.device must be one of {', '.join(DEVICES)} "
              f"(optionally with :index), got {self.device!r}")
        need(self.backend in BACKENDS, f"run.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        from q38.train.run.trackers import MODES, check_trackers

        check_trackers(self.trackers)
        need(self.tracker_mode in MODES, f"run.tracker_mode must be one of {', '.join(MODES)}, got "
             f"{self.tracker_mode!r}")
        need(self.dtype in DTYPES, f"run.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for k in ("timeout_s", "step_timeout_floor_s"):
            v = getattr(self, k)
            need(_is_seconds(v), f"run.{k} must be a positive number of seconds, got {v!r}")
        v = self.step_timeout_s
        need(v is None or v == "auto" or v == 0 and not isinstance(v, bool) or _is_seconds(v),
             f"run.step_timeout_s must be auto, a positive number of seconds, or 0 / null (off), got {v!r}")
        need(self.peak_flops is None or (isinstance(self.peak_flops, (int, float)) and self.peak_flops > 0),
              f"run.peak_flops must be a positive number (FLOP/s per device) or null, got {self.peak_flops!r}")

    @property
    def best_metric(self) -> str | None:
        """The evaluation metric ``run.keep_best`` watches (None: no best checkpoint is kept)."""
        if self.keep_best is None or self.keep_best is False:
            return None
        return "eval_loss" if self.keep_best is True else self.keep_best


BEST_METRICS = ("eval_loss", "eval_ppl", "eval_accuracy", "eval_aux")  # and eval_mtp_<k>, eval_accept[_len]_<k>
_DEPTH_METRIC = re.compile(r"eval_(mtp|accept|accept_len)_([1-9][0-9]{0,3})")


def best_metric_known(name: str) -> bool:
    """Whether ``name`` is an evaluation metric ``run.keep_best`` can watch."""
    return name in BEST_METRICS or _DEPTH_METRIC.fullmatch(name) is not None


def best_metric_depth(name: str) -> int:
    """The MTP depth a metric needs (``eval_mtp_2``, ``eval_accept_2``, ``eval_accept_len_2``: 2), else 0."""
    m = _DEPTH_METRIC.fullmatch(name)
    return int(m.group(2)) if m else 0


def higher_is_better(name: str) -> bool:
    """Accuracy and the MTP heads' acceptance grow as the model improves; the losses shrink."""
    return name == "eval_accuracy" or name.startswith("eval_accept")


def _is_seconds(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")


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
    peft: PeftConfig | None = None  # LoRA (q38.lora; docs/finetuning.md#lora); None: a full fine-tune

    def __attrs_post_init__(self) -> None:
        metric = self.run.best_metric
        need(metric is None or best_metric_depth(metric) <= self.model.mtp_num_layers,
             f"run.keep_best is {metric} but the model has {self.model.mtp_num_layers} MTP depth(s); watch eval_loss"
             + (f" or eval_mtp_1..eval_mtp_{self.model.mtp_num_layers}" if self.model.mtp_num_layers else ""))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None, *,
                  placeholders: str = "refuse") -> "RunConfig":
        from q38.errors import read_yaml_file

        path = Path(path) if path is not None else DEFAULT_CONFIG
        if not path.is_file():
            raise ConfigError(f"train config not found: {path} (pass a YAML file, or no argument for the default)")
        raw = read_yaml_file(path, "train config") or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping with sections model, layout, data, train, run")
        bad = next((k for k in raw if not isinstance(k, str)), None)
        if bad is not None:
            raise ConfigError(f"{path}: top-level key {bad!r} is not a section name; valid sections: model, "
                              "init_from, layout, data, train, run, kernels")
        return cls.from_dict(raw, source=str(path), overrides=overrides, base_dir=path.parent,
                             placeholders=placeholders)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config", overrides=None, base_dir=None,
                  placeholders: str = "refuse") -> "RunConfig":
        """The checked run config of ``raw`` with ``overrides`` (``--set``) applied. ``placeholders``: ``refuse``
        (one ``ConfigError`` naming every required key ``q38 plan --out`` left unfilled) or ``ignore`` (those keys
        are dropped: ``q38 plan --train`` prices a written run before it is filled)."""
        import difflib

        raw = dict(raw)
        sections = ("model", "init_from", "layout", "data", "train", "run", "kernels", "peft")
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
            if not isinstance(k, str):
                raise ConfigError(f"{source}: top-level key {k!r} is not a section name; valid sections: "
                                  f"{', '.join(sections)}")
            if k not in sections:
                close = difflib.get_close_matches(k, sections, n=1)
                raise ConfigError(
                    f"{source}: unknown top-level key {k!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                    + f"; valid sections: {', '.join(sections)}"
                )
        for sec in ("data", "train", "run", "kernels", "peft"):
            if raw.get(sec) is not None and not isinstance(raw[sec], dict):
                raise ConfigError(f"{source}: section {sec!r} must be a mapping, got {type(raw[sec]).__name__}")
        if placeholders == "ignore":
            raw = _drop_keys(raw, [k for k, _ in unfilled(raw)])
        else:  # before any path is resolved or read
            check_filled(raw, source)
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
        from q38.parallel.plan_out import layout_beside

        train = TrainConfig.from_dict(_train_with_run_dtype(raw.get("train") or {}, run, source),
                                      source=f"{source}: train")
        peft = None if raw.get("peft") is None else PeftConfig.from_dict(dict(raw["peft"]), source=source)
        check_peft_combinations(peft, train, kernels, source)
        return cls(
            model=model, model_source=str(model_src), init_from=init_from,
            layout=layout_beside(str(raw.get("layout", "single")), base_dir),
            data=structure(DataConfig, data, "data"), train=train, run=structure(RunOptions, run, "run"),
            source=source, kernels=kernels, peft=peft,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_source, "init_from": self.init_from, "layout": self.layout,
            "data": attrs.asdict(self.data), "train": self.train.to_dict(), "run": attrs.asdict(self.run),
            "source": self.source, "kernels": self.kernels.to_dict(),
            **({"peft": self.peft.to_dict()} if self.peft is not None else {}),
        }


def check_peft_combinations(peft: PeftConfig | None, train: TrainConfig, kernels: KernelConfig, source: str) -> None:
    """What a LoRA run (a ``peft`` section, either base dtype) does not run, refused when the config is read, before
    any weight: the trainer would otherwise meet each at its first step, after every rank has loaded its base."""
    if peft is None:
        return
    need(not train.enable_ep_balance,
         f"{source}: train.enable_ep_balance with a peft section (LoRA, base_dtype {peft.base_dtype}) is not "
         "implemented (the expert copies would have to carry the adapters and the FP8 scales); set "
         "train.enable_ep_balance: false")
    need(kernels.block != "compiled",
         f"{source}: kernels.block: compiled with a peft section (LoRA) is not implemented (adapters beside their "
         "frozen weights); set kernels.block: eager (or auto)")


def _drop_keys(raw: Mapping[str, Any], keys: list[str]) -> dict:
    """``raw`` without the dotted ``keys`` (``init_from``, ``data.path``)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for k in keys:
        sec, _, key = k.partition(".")
        if key:
            out[sec].pop(key, None)
        else:
            out.pop(sec, None)
    return out


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
    if base_dir is not None and not os.path.isabs(p) and (Path(base_dir) / (p + ".idx")).exists():
        return str(Path(base_dir) / p)  # a Megatron corpus PREFIX (PREFIX.idx + PREFIX.bin)
    return p


def _load_model_config(src: str, kernels_out: dict | None = None) -> ModelConfig:
    """A preset name, a model YAML, a Hugging Face directory / config.json, or a q38 checkpoint (its meta.json)."""
    from q38.train.io.checkpoint import is_checkpoint, latest_checkpoint, read_meta

    p = Path(src)
    ck = p if is_checkpoint(p) else (latest_checkpoint(p / "checkpoints") if p.is_dir() else None)
    if ck is not None:
        # a checkpoint's kernel keys (older meta.json) do not bind this run: dropped, not mapped
        return ModelConfig.from_dict(read_meta(ck)["model_config"], source=str(ck))
    if p.is_dir() and not (p / "config.json").is_file():
        raise ConfigError(f"model: {p} is a directory without config.json (not a Hugging Face checkpoint) and "
                          "without a q38 checkpoint; name a preset, a model YAML or a checkpoint directory")
    return load_model_config(src, kernels_out=kernels_out)


