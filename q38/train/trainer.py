"""The training run behind ``q38 train``: config file → model, data, state → steps with logs and checkpoints.

A run config is YAML with sections ``model``, ``init_from``, ``layout``, ``data``, ``train`` (a ``TrainConfig``),
``run`` and ``kernels`` (a ``q38.kernels.KernelConfig``: a run setting, so any checkpoint loads under any kernels). One process or ``torchrun --nproc_per_node N``: the device and process-group backend are chosen
automatically (Ascend NPU + hccl, CUDA + nccl, CPU + gloo; ``run.device`` / ``run.backend`` override), and the
layout's mesh is checked against ``WORLD_SIZE`` before anything is allocated.
"""

import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from q38.config import ConfigError, ModelConfig
from q38.kernels import describe_kernels

from q38.train.launch import (  # noqa: F401  (re-exported: the run's pieces by role)
    RunPlan, WorldInfo, _init_process_group, abstract_params_of, check_run, pick_backend, pick_device,
    tune_cpu_allocator,
)
from q38.train.metrics import (  # noqa: F401
    Throughput, _truncate_metrics, flops_per_token, format_metrics, isfinite, known_peak_flops, read_metrics,
    write_jsonl,
)
from q38.train.run_config import (  # noqa: F401
    BACKENDS, DEFAULT_CONFIG, DEVICES, DTYPES, DataConfig, RunConfig, RunOptions, _check_keys, _is_int,
    _load_model_config, _need, _resolve, _train_with_run_dtype,
)


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


def _initial_params(cfg: RunConfig, device: str, dtype: torch.dtype, mesh=None):
    """Parameters from ``init_from`` (a Hugging Face directory or a q38 checkpoint), checked against the run's model
    config, or freshly initialised. With ``mesh`` they are DTensors and each rank reads or draws only its shards."""
    from q38.model import init_params
    from q38.train.checkpoint import (
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
        from q38.train.safety import check_safetensors_dir

        check_safetensors_dir(src, "init_from")  # config.json parses, every safetensors file is whole
        got = ModelConfig.from_hf(src)
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
        from q38.train.hf_io import load_hf_sharded

        return load_hf_sharded(src, mesh, dtype=dtype, device=device)[1]
    from q38.hf import load_hf

    return load_hf(src, dtype=dtype, device=device)[1]


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
    if world.world_size > 1:
        from q38.train.launch import die_with_launcher

        die_with_launcher()  # a worker never outlives its torchrun agent
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
    if cfg.run.save_hf and cfg.train.aux_loss_free:
        raise ConfigError("run.save_hf with train.aux_loss_free: the Hugging Face format has no router bias, so the "
                          "export would route by the plain top-k; set run.save_hf: false and export with "
                          "`q38 convert --to-hf --drop-router-bias` if that is what you want")
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
    else:
        meta = None
    mesh = None
    if world.world_size > 1:
        from q38.parallel.runtime import make_mesh, shard_batch

        mesh = make_mesh(plan.layout, world.world_size, device.split(":")[0])
    # Each rank reads only its own rows of every global batch (batch_size rows per data-parallel rank).
    dp_rank = 0
    if mesh is not None:
        from q38.parallel.runtime import batch_row_rank

        dp_rank = batch_row_rank(mesh)[0]
    batches, evals = data.iterators(cfg.data.batch_size, dp_rank=dp_rank, dp_size=plan.dp_size, seed=cfg.run.seed,
                                    shuffle=cfg.data.shuffle, eval_batches=cfg.run.eval_batches)
    # Every rank allocates, draws or reads only its own shards: the full model never exists on one rank (a
    # resume loads into an empty sharded template; DCP reshards from any saved layout and world size).
    if latest is not None:
        params = empty_params(cfg.model, device=device, dtype=dtype, mesh=mesh)
    else:
        params = _initial_params(cfg, device, dtype, mesh)
    state = state_from_params(params, cfg.model, cfg.train, kernels=plan.kernels)  # what the steps' layers run
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
    tuned = tune_cpu_allocator() if device == "cpu" else None
    if lead and tuned:
        log(tuned)
    if lead:
        log(describe_kernels(cfg.kernels, plan.kernels, device=device, cp=plan.cp_size > 1,
                             dtype=cfg.train.param_dtype))
        if plan.memory:
            log(plan.memory)
    saved_at = None

    def save() -> Path:
        try:
            path = save_checkpoint(ck_root, state, _meta(cfg, state, batches, plan, world),
                                   keep_last=cfg.run.keep_last)
            _export_hf(cfg, path, int(state.step), log)
            return path
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if interrupted(e):
                raise KeyboardInterrupt from e
            raise save_error(e, int(state.step), ck_root) from e

    try:
        with StopSignal() as stop:
            for step in range(start + 1, cfg.run.steps + 1):
                lb = {k: v.to(device) for k, v in next(batches).items()}
                batch = shard_batch(lb, mesh, depths, local_rows=True) if mesh is not None else lb
                t0 = time.perf_counter()
                state, metrics = train_step(state, batch, mesh)
                dt = time.perf_counter() - t0
                m = metrics.as_dict()
                if evals is not None and ((cfg.run.eval_every and step % cfg.run.eval_every == 0)
                                          or step == cfg.run.steps):
                    m.update(eval_losses(state, evals, mesh, device, progress=cfg.run.progress and lead))
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


def _export_hf(cfg: RunConfig, ck: Path, step: int, log) -> None:
    """``run.save_hf``: the checkpoint just saved, exported as ``out_dir/hf/step_<n>`` by every rank at once (each
    writes its share of the files, reading only those tensors back from the checkpoint) at the last step and at
    multiples of ``run.save_hf_every``."""
    every = cfg.run.save_hf_every
    if not cfg.run.save_hf or not (step == cfg.run.steps or (every and step % every == 0)):
        return
    from q38.train.checkpoint import step_dir_name
    from q38.train.hf_io import export_checkpoint

    out = Path(cfg.run.out_dir) / "hf" / step_dir_name(step)
    export_checkpoint(ck, out, dtype=cfg.train.torch_param_dtype)
    log(f"step {step}: Hugging Face export written to {out}")


def _tensorboard(cfg: RunConfig, out: Path):
    if not cfg.run.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("run.tensorboard: true needs the tensorboard package (pip install tensorboard); "
                          "or set run.tensorboard: false (metrics.jsonl is always written)") from None
    return SummaryWriter(str(out / "tensorboard"))
