"""The training run behind ``q38 train``: config file → model, data, state → steps with logs and checkpoints.

A run config is YAML with sections ``model``, ``init_from``, ``layout``, ``data``, ``train`` (a ``TrainConfig``),
``run`` and ``kernels`` (a ``q38.kernels.KernelConfig``: a run setting, so any checkpoint loads under any kernels). One process or ``torchrun --nproc_per_node N``: the device and process-group backend are chosen
automatically (Ascend NPU + hccl, CUDA + nccl, CPU + gloo; ``run.device`` / ``run.backend`` override), and the
layout's mesh is checked against ``WORLD_SIZE`` before anything is allocated.
"""

import contextlib
import fnmatch
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
import torch

from q38.hf_config import config_from_hf
from q38.model_config import ConfigError, ModelConfig
from q38.kernels import describe_kernels

from q38.train.run.launch import RunPlan, WorldInfo, _init_process_group, check_run, pick_backend, pick_device, \
    tune_cpu_allocator
from q38.train.run.metrics import PROGRESS_LEGEND, Throughput, _truncate_metrics, flops_per_token, format_metrics, known_peak_flops
from q38.train.run.run_config import RunConfig, higher_is_better


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


def _any_rank(flags: list[float], device: str) -> list[float]:
    """The max of each value over ranks, in one all-reduce (one process: ``flags``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return list(flags)
    dev = device if dist.get_backend() in ("nccl", "hccl") else "cpu"
    t = torch.tensor(flags, dtype=torch.float32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def step_times(busy: list[float]) -> dict:
    """Each rank's busy seconds (data wait + step - waiting in collectives) -> the slowest rank, its busy time and
    the median over ranks."""
    import statistics

    slow = max(range(len(busy)), key=lambda r: busy[r])
    return {"busy_max": busy[slow], "busy_median": statistics.median(busy), "slowest_rank": slow}


def _store():
    """The rendezvous store of the default process group (None on one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


# ---- the run --------------------------------------------------------------------------------------------------------


def _initial_params(cfg: RunConfig, device: str, dtype: torch.dtype | Callable[[str], torch.dtype], mesh=None):
    """Parameters from ``init_from`` (a Hugging Face directory or a q38 checkpoint), checked against the run's model
    config, or freshly initialised. With ``mesh`` they are DTensors and each rank reads or draws only its shards."""
    from q38.model import init_params
    from q38.train.io.checkpoint import (
        CheckpointMismatch, config_diff, is_checkpoint, load_params, read_meta, resolve_checkpoint,
    )

    if not cfg.init_from:
        if mesh is not None:
            from q38.parallel.mesh import init_sharded

            return init_sharded(cfg.model, mesh, seed=cfg.run.seed, device=device, dtype=dtype)
        return init_params(cfg.model, seed=cfg.run.seed, device=device, dtype=dtype)
    src = Path(cfg.init_from)
    if not src.exists():
        raise FileNotFoundError(f"init_from: {src} not found; expected a Hugging Face checkpoint directory "
                                "(config.json + *.safetensors) or a q38 checkpoint directory")
    hf_dir = (src / "config.json").is_file() and not is_checkpoint(src)
    if hf_dir:
        from q38.train.io.dirs import check_safetensors_dir

        check_safetensors_dir(src, "init_from")  # config.json parses, every safetensors file is whole
        got = config_from_hf(src)
        mtp = {}
        if cfg.model.mtp_shared_layer and not got.mtp_shared_layer and got.mtp_num_layers == 1:
            # a checkpoint with one MTP layer, run at every depth (as vLLM / SGLang draft with it)
            mtp = dict(mtp_num_layers=cfg.model.mtp_num_layers, mtp_shared_layer=True)
            got = got.replace(**mtp)
    else:
        src = resolve_checkpoint(src)
        got = ModelConfig.from_dict(read_meta(src)["model_config"], source=f"{src}/meta.json")
    diff = config_diff(got.to_dict(), cfg.model.to_dict())
    if diff:  # before anything is read
        raise CheckpointMismatch(
            f"init_from {src} holds another model than the config names ({'; '.join(diff[:6])}); set model: to "
            f"{src} or to the matching preset"
        )
    if not hf_dir:
        return load_params(src, device=device, dtype=dtype, mesh=mesh)[1]
    if mesh is not None:
        from q38.train.io.hf_io import load_hf_sharded

        return load_hf_sharded(src, mesh, dtype=dtype, device=device, **mtp)[1]
    from q38.hf import load_hf

    return load_hf(src, dtype=dtype, device=device, **mtp)[1]


def _meta(cfg: RunConfig, state, batches, plan: RunPlan, world: WorldInfo, tracker_ids: dict,
          best: dict | None = None) -> dict:
    import q38

    return {
        "step": int(state.step),
        "model_config": cfg.model.to_dict(),
        "train_config": cfg.train.to_dict(),
        # stored dtype: fp32 masters (train_config.param_dtype is the compute dtype); bf16 + remainder masters are
        # saved as their two halves and loaded as fp32 (load_params joins them); offloaded masters (host_master) are
        # saved as the fp32 masters they are
        "param_dtype": "float32",
        "source_format": _SOURCE_FORMAT.get(str(cfg.init_from)),  # what `q38 convert --to-hf` writes by default
        "data": {"iterator": batches.state_dict(), "path": str(cfg.data.path), "tokenizer": str(cfg.data.tokenizer),
                 "seq_len": cfg.data.seq_len, "batch_size": cfg.data.batch_size, "dp_size": plan.dp_size,
                 "seed": cfg.run.seed, "shuffle": cfg.data.shuffle},
        "layout": cfg.layout,
        "kernels": plan.kernels.to_dict(),  # what ran (a run setting: a run with other kernels may load this)
        "mesh": plan.mesh_sizes,
        "world_size": world.world_size,
        "run_config": cfg.to_dict(),
        **_peft_meta(cfg),
        "trackers": tracker_ids,  # each tracker's run id: a resume continues the same tracker runs
        "best": best,  # run.keep_best: the best evaluation so far (metric, value, step, evaluations since, stopped)
        "q38_version": q38.__version__,
        "torch_version": torch.__version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _peft_meta(cfg: RunConfig) -> dict:
    """A LoRA run's ``peft`` entry: the setting and the reference to its base (``q38.train.io.peft``)."""
    if cfg.peft is None:
        return {}
    return {"peft": dict(cfg.peft.to_dict(), base=_base_ref(cfg))}


_BASE_REFS: dict = {}  # (init_from, seed) -> the base reference, computed once per run (on every rank: collective)


def _base_ref(cfg: RunConfig) -> dict:
    from q38.train.io.peft import base_reference

    key = (cfg.init_from, cfg.run.seed)
    if key not in _BASE_REFS:
        _BASE_REFS[key] = base_reference(cfg.init_from, cfg.run.seed)
    return _BASE_REFS[key]


def _check_int8_layout(path, moment_dtype: str, layout, mesh) -> None:
    """8-bit moments are quantized in blocks of each rank's local shard (q38.qmoment): they resume only
    on the layout and mesh they were saved with."""
    from q38.train.io.checkpoint import read_meta

    meta = read_meta(path)
    if (meta.get("train_config") or {}).get("moment_dtype") != "int8" or moment_dtype != "int8":
        return
    saved, now = (meta.get("layout"), meta.get("mesh")), (layout, mesh)
    if saved != now:
        raise ConfigError(f"checkpoint {path} holds int8 moments quantized per shard of layout {saved[0]!r} mesh "
                          f"{saved[1]}; resume it with that layout and mesh (this run: {now[0]!r} {now[1]})")


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
    if world.world_size > 1:
        from q38.train.run.launch import die_with_launcher

        die_with_launcher()  # a worker never outlives its torchrun agent
    device = pick_device(cfg.run.device, world.local_rank)
    plan = check_run(cfg, world.world_size, device)  # before any allocation or process group
    backend = pick_backend(device, cfg.run.backend)  # refused here when it cannot move this device's tensors
    from q38.train.io.dirs import check_out_dir, check_run_out_dir, run_inputs
    from q38.train.run.safety import check_device, run_lock

    check_device(device)
    check_run_out_dir(cfg.run.out_dir, run_inputs(cfg.to_dict()))  # before anything is created there
    check_out_dir(cfg.run.out_dir)
    created_pg = False
    if world.world_size > 1:
        created_pg = _init_process_group(device, backend, world, cfg.run.timeout_s)
    try:
        with run_lock(cfg.run.out_dir, lead=world.rank == 0):  # one run per out_dir
            return _train(cfg, world, device, plan, on_step)
    finally:
        if created_pg:
            import torch.distributed as dist

            dist.destroy_process_group()


def _train(cfg: RunConfig, world: WorldInfo, device: str, plan: RunPlan, on_step) -> list[dict]:
    """The run in its steps: data, the checkpoint to resume, the mesh, the state, the logs, then the loop."""
    lead = world.rank == 0
    if cfg.run.save_hf and cfg.train.aux_loss_free:
        raise ConfigError("run.save_hf with train.aux_loss_free: the Hugging Face format has no router bias, so the "
                          "export would route by the plain top-k; set run.save_hf: false and export with "
                          "`q38 convert --to-hf --drop-router-bias` if that is what you want")
    cfg = _source_precision(cfg)
    if cfg.run.save_hf and cfg.peft is not None:
        raise ConfigError("run.save_hf with a peft section: a LoRA checkpoint holds adapters, not a model; set "
                          "run.save_hf: false and export with `q38 convert CHECKPOINT --to-peft OUT` (the adapters) "
                          "or `--to-hf OUT` (the merged model)")
    from q38.lora import check_rank, check_runnable

    check_runnable(cfg.peft, cfg.init_from)
    check_rank(cfg.peft, cfg.model)  # before any adapter (or the base) is allocated
    torch.manual_seed(cfg.run.seed)
    data = _open_data(cfg)
    resume = _find_resume(cfg, lead)
    mesh, dp_rank = _make_mesh(plan, world, device, cfg.model)
    batches, evals = data.iterators(cfg.data.batch_size, dp_rank=dp_rank, dp_size=plan.dp_size, seed=cfg.run.seed,
                                    shuffle=cfg.data.shuffle, eval_batches=cfg.run.eval_batches,
                                    eval_batch_size=cfg.data.eval_batch_size)
    if cfg.data.prefetch:
        from q38.train.data.prefetch import Prefetch

        batches = Prefetch(batches, cfg.data.prefetch)
    state, start = _build_state(cfg, resume, mesh, device, plan, batches, lead)
    if start >= cfg.run.steps:
        if lead:
            print(f"q38 train: {resume.latest} is at step {start} >= run.steps {cfg.run.steps}: nothing to train "
                  "(raise run.steps to continue, or use a new run.out_dir; to evaluate it: `q38 eval "
                  f"{resume.latest} --data FILE`)")
        return []
    best = _Best.resumed(cfg, resume.meta if start else None)
    if best.stopped:
        if lead:
            print(f"q38 train: {resume.latest} stopped early at step {start} ({best.metric} best {best.value:.4f} at "
                  f"step {best.step}, in {Path(cfg.run.out_dir) / BEST_DIR}): nothing to train (set "
                  "run.early_stop_patience: 0 or raise it to continue, or use a new run.out_dir)")
        return []
    if lead:
        _start_metrics_log(resume, start)
    logs = RunLog(cfg, start, lead, plan, run_ids=(resume.meta or {}).get("trackers") if start else None)
    try:
        logs.startup(resume.latest if start else None, device, plan)
        return _loop(cfg, world, device, plan, mesh, state, start, batches, evals, logs, on_step, best)
    finally:
        logs.close()
        if hasattr(batches, "close"):
            batches.close()


def _source_precision(cfg: RunConfig) -> RunConfig:
    """``init_from`` a checkpoint that stores some leaves in fp32 beside 16-bit weights (a released Qwen3.5: A_log and
    the GDN norm): those leaf kinds join ``train.fp32_params`` (computed in fp32 under the bf16 policy); the source's
    dtypes and FP8 format are kept for the metadata (``source_format``: exports write them again)."""
    from q38.train.io.hf_io import init_source_format, source_fp32_params

    fmt = init_source_format(cfg.init_from) if cfg.init_from and Path(cfg.init_from).exists() else None
    _SOURCE_FORMAT[str(cfg.init_from)] = fmt
    have = cfg.train.fp32_params  # a kind an existing pattern covers already (layers.0.mixer.A_log) is not added
    extra = [p for p in source_fp32_params(fmt) if not any(fnmatch.fnmatchcase(p.replace("*", "0"), h) for h in have)]
    if not extra:
        return cfg
    return attrs.evolve(cfg, train=cfg.train.replace(fp32_params=(*cfg.train.fp32_params, *extra)))


_SOURCE_FORMAT: dict = {}  # init_from -> its source_format (read once per run)


def _open_data(cfg: RunConfig):
    """The tokenizer and the run's ``TrainData``, checked against the model's vocab and the eval settings."""
    from q38.train.data.sources import TrainData
    from q38.train.data.tokenizer import load_tokenizer

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
    return data


@attrs.frozen
class _Resume:
    """What the run starts from: the newest verified checkpoint (None: a fresh run) and its metrics log."""

    latest: Path | None
    meta: dict | None
    metrics_path: Path
    old_metrics: list
    torn: int | None  # the line number of a torn last record, cut off when the run starts


def _find_resume(cfg: RunConfig, lead: bool) -> _Resume:
    """The checkpoint to resume (verified; its model config checked before anything is allocated) and the metrics
    log. Nothing is deleted or truncated here: a bad checkpoint or log stops the run with everything intact."""
    from q38.train.io.checkpoint import check_model_config, read_meta
    from q38.train.run.safety import choose_checkpoint, load_metrics, note

    out = Path(cfg.run.out_dir)
    notes: list[str] = []
    latest = choose_checkpoint(out, cfg.run.resume, cfg.run.resume_from, notes)
    metrics_path = out / "metrics.jsonl"
    old_metrics, torn = load_metrics(metrics_path)  # every rank: a malformed log stops all of them
    for line in notes if lead else []:
        note(line)
    meta = None
    if latest is not None:
        meta = read_meta(latest)
        check_model_config(meta, cfg.model, str(latest))
    return _Resume(latest, meta, metrics_path, old_metrics, torn)


def _make_mesh(plan: RunPlan, world: WorldInfo, device: str, model=None):
    """The layout's mesh (None on one process) and this rank's data-parallel row rank: each rank reads only its
    own rows of every global batch (``batch_size`` rows per data-parallel rank)."""
    if world.world_size == 1:
        return None, 0
    from q38.parallel.mesh import batch_row_rank, make_mesh

    mesh = make_mesh(plan.layout, world.world_size, device.split(":")[0], model=model)
    if world.rank == 0:
        print(f"q38 train: mesh {mesh.describe_links()}", file=sys.stderr)
    return mesh, batch_row_rank(mesh)[0]


def _build_state(cfg: RunConfig, resume: _Resume, mesh, device: str, plan: RunPlan, batches, lead: bool):
    """The train state and the step it is at. Every rank allocates, draws or reads only its own shards: the full
    model never exists on one rank (a resume loads into an empty sharded template; DCP reshards from any saved
    layout and world size)."""
    from q38.train.io.checkpoint import empty_params, load_checkpoint
    from q38.train.core.state import state_from_params

    dtype = torch.float32  # master weights (the mixed-precision policy computes in train.param_dtype)
    if cfg.peft is not None:
        return _build_lora_state(cfg, resume, mesh, device, plan, batches, lead)
    if resume.latest is None:
        return state_from_params(_initial_params(cfg, device, dtype, mesh), cfg.model, cfg.train,
                                 kernels=plan.kernels), 0  # the kernels the steps' layers run
    _check_int8_layout(resume.latest, cfg.train.moment_dtype, cfg.layout, plan.mesh_sizes)
    params = empty_params(cfg.model, device=device, dtype=dtype, mesh=mesh)
    state, meta = load_checkpoint(resume.latest, state_from_params(params, cfg.model, cfg.train, kernels=plan.kernels))
    changes = _changes(meta, cfg, plan)
    if changes and lead:
        print(f"q38 train: note: settings changed since {resume.latest}: {'; '.join(changes)}", file=sys.stderr)
    batches.load_state_dict(meta["data"]["iterator"])
    return state, int(meta["step"])


def _build_lora_state(cfg: RunConfig, resume: _Resume, mesh, device: str, plan: RunPlan, batches, lead: bool):
    """A LoRA run's state: the base (``init_from``, or the seed's fresh init) read straight into the compute dtype,
    adapters added; on resume, the adapters, their moments and the step loaded from the checkpoint, after checking
    that it was trained on this base."""
    from q38.train.io.checkpoint import load_checkpoint, read_meta
    from q38.train.io.peft import check_base, lora_state

    _BASE_REFS.pop((cfg.init_from, cfg.run.seed), None)  # the base as it is now (every rank hashes its share)
    ref = _base_ref(cfg)
    if resume.latest is not None:  # before the base is read
        note = check_base(read_meta(resume.latest), ref, str(resume.latest))
        if note and lead:
            print(f"q38 train: note: {note}", file=sys.stderr)
    if cfg.peft.base_dtype == "fp8":  # projections in block-FP8 (each rank reads or draws only its blocks)
        from q38.train.io.peft import fp8_base

        base = fp8_base(cfg.model, cfg.init_from, seed=cfg.run.seed, dtype=cfg.train.compute_dtype, mesh=mesh,
                        device=device)
    else:
        base = _initial_params(cfg, device, cfg.train.compute_dtype, mesh)  # fp32_params leaves stay fp32
    state = lora_state(base, cfg.model, cfg.train, cfg.peft, seed=cfg.run.seed, mesh=mesh, device=device,
                       kernels=plan.kernels, empty=resume.latest is not None)
    if resume.latest is None:
        return state, 0
    state, meta = load_checkpoint(resume.latest, state)
    changes = _changes(meta, cfg, plan)
    if changes and lead:
        print(f"q38 train: note: settings changed since {resume.latest}: {'; '.join(changes)}", file=sys.stderr)
    batches.load_state_dict(meta["data"]["iterator"])
    return state, int(meta["step"])


def _start_metrics_log(resume: _Resume, start: int) -> None:
    """``metrics.jsonl`` as the run continues it: cut to the resumed step (and a torn last line cut off), or
    emptied for a fresh run."""
    from q38.train.run.safety import note

    path = resume.metrics_path
    path.parent.mkdir(parents=True, exist_ok=True)
    if resume.torn:
        note(f"{path}:{resume.torn}: cut off a torn last line (a partial write, e.g. on a full disk)")
    if start:
        _truncate_metrics(path, start)
        return
    if resume.old_metrics:
        note(f"starting fresh: {path} ({len(resume.old_metrics)} records, no checkpoint to resume) is replaced")
    path.write_text("")


class RunLog:
    """Where a run reports (rank 0 only; the other ranks' calls do nothing): its trackers (``metrics.jsonl``
    always; TensorBoard, wandb, SwanLab when ``run.trackers`` names them), the progress bar (on a terminal) and the
    log lines."""

    def __init__(self, cfg: RunConfig, start: int, lead: bool, plan: RunPlan, run_ids=None) -> None:
        from tqdm import tqdm

        from q38.train.run.trackers import TrackerRun, open_trackers

        self.cfg, self.lead, self.start = cfg, lead, start
        self.trackers = {}
        if lead:
            out = Path(cfg.run.out_dir)
            names = (*cfg.run.trackers, *(("tensorboard",) if cfg.run.tensorboard else ()))
            run = TrackerRun(out_dir=out, name=out.resolve().name, project=cfg.run.tracker_project,
                             mode=cfg.run.tracker_mode, start=start,
                             config={"run_config": cfg.to_dict(), "kernels": plan.kernels.to_dict(),
                                     "layout": cfg.layout, "mesh": plan.mesh_sizes})
            self.trackers = open_trackers(names, run, run_ids)
        # The bar only on a terminal (tqdm's disable=None); the log lines and metrics.jsonl always.
        self.bar = tqdm(total=cfg.run.steps, initial=start, disable=None if (cfg.run.progress and lead) else True,
                        dynamic_ncols=True, desc="q38 train", file=sys.stdout)

    def run_ids(self) -> dict[str, str]:
        """Each tracker's run id (kept in the checkpoint metadata, so a resume continues the same runs)."""
        return {n: t.run_id for n, t in self.trackers.items() if t.run_id is not None}

    def line(self, text: str) -> None:
        if self.lead:
            self.bar.write(text)

    def startup(self, resumed_from: Path | None, device: str, plan: RunPlan) -> None:
        if resumed_from is not None:
            self.line(f"resumed from {resumed_from} (step {self.start}); training steps {self.start + 1}-"
                      f"{self.cfg.run.steps}")
        if device == "cpu":
            tune_cpu_allocator()  # internal (docs/operations.md): not worth a line of the run's output
        self.line(describe_kernels(self.cfg.kernels, plan.kernels, device=device, cp=plan.cp_size > 1,
                                   dtype=self.cfg.train.param_dtype))
        if plan.memory:
            self.line(plan.memory)
        self.line(PROGRESS_LEGEND)

    def step(self, rec: dict, tput: Throughput, terms: list[str] | None) -> None:
        """One step's record: to every tracker; the bar's figures; a log line every ``run.log_every``."""
        if not self.lead:
            return
        step, cfg = rec["step"], self.cfg
        for t in self.trackers.values():
            t.log(rec)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", **({"aux": f"{rec['aux']:.3f}"} if "aux" in rec else {}),
                             **({"load": f"{rec['router_max_mean']:.2f}x"} if "router_max_mean" in rec else {}),
                             **({"eval": f"{rec['eval_loss']:.3f}"} if "eval_loss" in rec else {}))
        if rec["skipped"]:
            self.line(f"step {step}: non-finite loss or gradient (loss={rec['loss']}, grad_norm="
                      f"{rec['grad_norm']}); update skipped (train.nan_policy: skip)")
        first = step == self.start + 1
        if tput.warming or first or step % cfg.run.log_every == 0 or step == cfg.run.steps or "eval_loss" in rec:
            self.line(format_metrics(step, rec, tput, rec["step_time"], terms=terms, warmup=tput.warming))
            if not tput.warming:
                tput.reset()  # the next line reports the steps after this one

    def end(self, text: str) -> None:
        """The run's last line, printed after the bar is closed."""
        if self.lead:
            self.bar.close()
            print(text)

    def close(self) -> None:
        self.bar.close()
        for t in self.trackers.values():
            t.close()


@attrs.define
class _Best:
    """``run.keep_best``: the best evaluation so far (its metric's value and step) and, for
    ``run.early_stop_patience``, how many evaluations in a row have not improved on it by more than
    ``run.early_stop_min_delta``. Saved in every checkpoint's ``meta.json`` (``best``), so a resumed run keeps both."""

    metric: str | None
    value: float | None = None
    step: int | None = None
    since: int = 0
    stopped: bool = False

    @classmethod
    def resumed(cls, cfg: RunConfig, meta: Mapping[str, Any] | None) -> "_Best":
        best = cls(cfg.run.best_metric)
        old = (meta or {}).get("best")
        if best.metric is not None and isinstance(old, dict) and old.get("metric") == best.metric:
            value, step, since = old.get("value"), old.get("step"), old.get("since")
            if isinstance(value, (int, float)) and isinstance(step, int) and isinstance(since, int):
                best.value, best.step, best.since = float(value), step, since
                best.stopped = old.get("stopped") is True
        return best

    def better(self, v: float, by: float = 0.0) -> bool:
        if not math.isfinite(v):
            return False
        if self.value is None:
            return True
        return v > self.value + by if higher_is_better(self.metric) else v < self.value - by

    def update(self, m: Mapping[str, float], step: int, cfg: RunConfig) -> bool:
        """Take this step's evaluation; True when it is the best so far (its checkpoint is then kept)."""
        v = float(m[self.metric])
        improved = self.better(v, cfg.run.early_stop_min_delta)
        new = self.better(v)
        if new:
            self.value, self.step = v, step
        self.since = 0 if improved else self.since + 1
        patience = cfg.run.early_stop_patience
        self.stopped = bool(patience) and self.since >= patience
        return new

    def record(self) -> dict | None:
        if self.metric is None:
            return None
        return {"metric": self.metric, "value": self.value, "step": self.step, "since": self.since,
                "stopped": self.stopped}


BEST_DIR = "best"  # out_dir/best/step_<n>: the checkpoint of the best evaluation (run.keep_best)


def _loop(cfg: RunConfig, world: WorldInfo, device: str, plan: RunPlan, mesh, state, start: int, batches, evals,
          logs: RunLog, on_step, best: _Best) -> list[dict]:
    """Steps ``start + 1 .. run.steps``: step, evaluate, log, save every ``run.save_every`` and at the end (and the
    best evaluation's checkpoint, ``run.keep_best``); SIGTERM / SIGINT, or ``run.early_stop_patience`` evaluations
    without improvement, finish the step, save and stop."""
    from q38.parallel.links import CommClock
    from q38.parallel.mesh import shard_batch
    from q38.train.run.evaluate import eval_losses
    from q38.train.run.profile import StepProfiler, out_of_memory
    from q38.train.core.step import train_step
    from q38.train.run.launch import CollectiveTimeout
    from q38.train.run.watchdog import StepWatchdog

    peak = cfg.run.peak_flops or known_peak_flops(device, cfg.train.param_dtype)
    tput = Throughput(cfg.run.warmup_log_steps, flops_per_token(cfg.model, cfg.data.seq_len), peak,
                      world.world_size)
    records: list[dict] = []
    saved_at = None
    saver = _Saver(cfg, plan, world, device, logs, best)
    save_s = 0.0  # seconds the last save held training up (reported with the next step)

    dog = StepWatchdog(cfg.run.step_timeout_s, cfg.run.out_dir, world.rank, world.world_size, store=_store(),
                       floor_s=cfg.run.step_timeout_floor_s, first_s=cfg.run.timeout_s,
                       on_bound=CollectiveTimeout(cfg.run.timeout_s, skip=(saver.group,)))
    prof = StepProfiler(cfg.run.profile, cfg.run.out_dir, world.rank, device)
    with StopSignal() as stop, contextlib.closing(dog), contextlib.closing(prof):
        for step in range(start + 1, cfg.run.steps + 1):
            prof.begin(step)
            # Armed from the batch to the all-reduce after the step: a rank stopped anywhere in between (also after
            # its step's last collective, where the others wait in that all-reduce) is caught by run.step_timeout_s;
            # evaluations and saves, where the ranks wait for each other too, are watched under run.timeout_s.
            with dog.step(step):
                CommClock.take()  # count this step's waiting in collectives only
                t_data = time.perf_counter()
                lb = {k: v.to(device) for k, v in next(batches).items()}
                batch = shard_batch(lb, mesh, cfg.model.mtp_num_layers, local_rows=True) if mesh is not None else lb
                t0 = time.perf_counter()
                try:
                    state, metrics = train_step(state, batch, mesh, donate=True)  # holds the state once
                except torch.OutOfMemoryError as e:
                    raise out_of_memory(e, step, cfg.run.out_dir, world.rank, device) from e
                m = metrics.as_dict()  # on the host: the step has finished on the device too
                dt = time.perf_counter() - t0
                waited = CommClock.take()
                prof.end(step, logs.line)
            if evals is not None and ((cfg.run.eval_every and step % cfg.run.eval_every == 0)
                                      or step == cfg.run.steps):
                with dog.phase(step, "evaluation", "run.timeout_s", cfg.run.timeout_s):
                    m.update(eval_losses(state, evals, mesh, device, progress=cfg.run.progress and logs.lead))
            new_best = best.metric is not None and best.metric in m and best.update(m, step, cfg)
            with dog.step(step):  # (armed again after an evaluation, which has a bound of its own)
                tput.update(step, m["tokens"], dt)
                wait = t0 - t_data
                tps = None if tput.warming or dt <= 0 else m["tokens"] / dt  # this step's (a warm-up step's: None)
                rec = dict(m, step=step, step_time=dt, tokens_per_s=tps, mfu=tput.mfu_of(tps), time_data=wait,
                           time_optimizer=max(dt - m["time_forward_backward"], 0.0), time_save=save_s,
                           time_comm_wait=waited)
                records.append(rec)
                if on_step is not None:
                    on_step(rec)
                # one small all-reduce: the stop signal, whether a background save still writes, and each rank's
                # busy time (data wait + step - waiting in collectives: the rank the others wait for has the most)
                busy = max(wait + dt - waited, 0.0)
                flags = _any_rank([float(stop.signum or 0), float(saver.running()),
                                   *(busy if r == world.rank else 0.0 for r in range(world.world_size))], device)
            stopping, writing, times = int(flags[0]), flags[1] > 0, flags[2:]
            rec.update(step_times(times))
            logs.step(rec, tput, list(metrics.terms) or None)
            t_save, save_s = time.perf_counter(), 0.0
            with dog.phase(step, "checkpoint save", "run.timeout_s", cfg.run.timeout_s):
                if saver.pending is not None and not writing:  # every rank's background write has finished
                    saved_at = saver.finish()
                    save_s = time.perf_counter() - t_save
                if new_best:  # in the step (never in the background): the best is on disk before training goes on
                    at = saver.save_best(state, batches)
                    save_s = time.perf_counter() - t_save
                    logs.line(f"step {step}: best {best.metric} so far ({best.value:.4f}): checkpoint saved to {at}")
                last = stopping or best.stopped or step == cfg.run.steps
                if last or (cfg.run.save_every and step % cfg.run.save_every == 0):
                    saved_at = saver.save(state, batches, background=not last) or saved_at
                    save_s = time.perf_counter() - t_save
            if stopping:
                logs.end(f"q38 train: stopped by {signal.Signals(stopping).name} at step {step}; checkpoint saved "
                         f"to {saved_at} (run the same command again to resume)")
                return records
            if best.stopped:
                logs.end(f"q38 train: early stop at step {step}: {best.metric} has not improved by more than "
                         f"{cfg.run.early_stop_min_delta} for {best.since} evaluations (run.early_stop_patience); "
                         f"best {best.value:.4f} at step {best.step}, in {saver.best_root}; checkpoint saved to "
                         f"{saved_at}")
                return records
    logs.end(f"q38 train: done, step {cfg.run.steps}; checkpoint saved to {saved_at}")
    return records


class _Saver:
    """The run's checkpoints: written in the step (``save_checkpoint``), or with ``run.async_save`` in the background
    (``AsyncSave``: at most one in flight; the last save of a run, and one on a stop signal, is written in the step
    after the one in flight has finished). A failed save ends the run with one line (``safety.save_error``)."""

    def __init__(self, cfg: RunConfig, plan: RunPlan, world: WorldInfo, device: str, logs: "RunLog",
                 best: _Best) -> None:
        from q38.train.io.checkpoint import CHECKPOINTS

        self.cfg, self.plan, self.world, self.logs, self.best = cfg, plan, world, logs, best
        self.root = Path(cfg.run.out_dir) / CHECKPOINTS
        self.best_root = Path(cfg.run.out_dir) / BEST_DIR
        self.pinned = device.split(":")[0] != "cpu"
        self.pending = None
        self.group = None
        if cfg.run.async_save and world.world_size > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")  # the background write's own collectives

    def running(self) -> int:
        """1 while this rank's background write is going (the trainer takes the max over ranks)."""
        return int(self.pending is not None and self.pending.running())

    def save(self, state, batches, *, background: bool) -> Path | None:
        """Save the state of this step: the path, or None when it is being written in the background."""
        from q38.train.io.checkpoint import AsyncSave, save_checkpoint

        self.finish()  # at most one save in flight
        step = int(state.step)
        meta = _meta(self.cfg, state, batches, self.plan, self.world, self.logs.run_ids(), self.best.record())
        if background and self.cfg.run.async_save:
            self.pending = self._guard(step, lambda: AsyncSave(self.root, state, meta, keep_last=self.cfg.run.keep_last,
                                                                group=self.group, pinned=self.pinned))
            return None
        path = self._guard(step, lambda: save_checkpoint(self.root, state, meta, keep_last=self.cfg.run.keep_last))
        _export_hf(self.cfg, path, step, self.logs.line)
        return path

    def save_best(self, state, batches) -> Path:
        """This step's state as ``out_dir/best/step_<n>``, replacing the previous best (written in the step)."""
        from q38.train.io.checkpoint import save_checkpoint

        self.finish()
        meta = _meta(self.cfg, state, batches, self.plan, self.world, self.logs.run_ids(), self.best.record())
        return self._guard(int(state.step), lambda: save_checkpoint(self.best_root, state, meta, keep_last=1))

    def finish(self) -> Path | None:
        """Publish the save in flight (waiting for its write; collective); None when there is none."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        path = self._guard(pending.step, pending.finish)
        self.logs.line(f"step {pending.step}: checkpoint written in the background to {path}")
        _export_hf(self.cfg, path, pending.step, self.logs.line)
        return path

    def _guard(self, step: int, fn):
        from q38.train.run.safety import interrupted, save_error

        try:
            return fn()
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if interrupted(e):
                raise KeyboardInterrupt from e
            raise save_error(e, step, self.root, rank=self.world.rank) from e


def _export_hf(cfg: RunConfig, ck: Path, step: int, log) -> None:
    """``run.save_hf``: the checkpoint just saved, exported as ``out_dir/hf/step_<n>`` by every rank at once (each
    writes its share of the files, reading only those tensors back from the checkpoint) at the last step and at
    multiples of ``run.save_hf_every``, with the run's tokenizer files and ``generation_config.json``."""
    every = cfg.run.save_hf_every
    if not cfg.run.save_hf or not (step == cfg.run.steps or (every and step % every == 0)):
        return
    from q38.train.io.checkpoint import step_dir_name
    from q38.train.io.hf_io import export_checkpoint

    from q38.train.data.export_files import export_extras

    out = Path(cfg.run.out_dir) / "hf" / step_dir_name(step)
    extras = export_extras(cfg.data.tokenizer, cfg.model.vocab_size, cfg.model.max_position_embeddings)
    # the init_from checkpoint's dtypes, else the compute dtype; the run's tokenizer and where generation stops
    export_checkpoint(ck, out, dtype="source", extras=extras)
    log(f"step {step}: Hugging Face export written to {out}")
