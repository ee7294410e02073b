"""Launching a run: the device and process-group backend, the world (``torchrun`` environment), and the pre-flight
check of the layout against the world size, the kernels against the device (``check_run``)."""

import contextlib
import ctypes
import math
import os
import sys
from typing import Any, Iterator, Mapping

import attrs
import torch

from q38.model_config import ConfigError, ModelConfig
from q38.kernels import DEFAULT_KERNELS, KernelConfig
from q38.train.core.step_config import validate_run

from q38.errors import need
from q38.train.run.run_config import RunConfig


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


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def tune_cpu_allocator() -> str | None:
    """Keep freed memory in the process on CPU (glibc only): large tensors come from the heap instead of fresh
    ``mmap`` pages, and the heap is not trimmed back to the OS after every step.

    PyTorch has no caching allocator on CPU, so every activation-sized tensor otherwise costs page faults when first
    written (the torch GDN core's fwd+bwd takes 0.69x the time with this setting: benchmarks/cpu_effects.py); the
    price is that the resident size stays at the step's peak. Returns what was set (for the run log), or None where it does not apply."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    except (OSError, AttributeError):  # not glibc
        return None
    return "glibc malloc: mmap threshold 32 MiB, trim threshold 1 GiB (CPU: fewer page faults)" if ok else None


BACKEND_DEVICE = {"nccl": "cuda", "hccl": "npu"}  # the device kind each accelerator backend moves tensors of


def pick_backend(device: str, name: str = "auto") -> str:
    """The process-group backend of ``run.backend`` on ``device`` (auto: nccl on CUDA, hccl on NPU, else gloo);
    nccl or hccl asked for on a device of another kind is refused in one line (they move only their device's
    tensors: a CPU process would fail at its first collective)."""
    kind = device.split(":")[0]
    if name == "auto":
        return {"cuda": "nccl", "npu": "hccl"}.get(kind, "gloo")
    need(BACKEND_DEVICE.get(name, kind) == kind,
         f"run.backend is {name} but this process runs on {kind} ({name} needs {BACKEND_DEVICE.get(name)} devices); "
         "set run.backend: auto (or gloo), or run.device to a device of that kind")
    return name


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
        need(w.world_size >= 1 and 0 <= w.rank < w.world_size,
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
    memory: str | None = None  # on an accelerator: the predicted peak against the device's memory (check_memory)


def check_run(cfg: RunConfig, world_size: int = 1, device: str = "cpu") -> RunPlan:
    """Every up-front check that needs no data, weights or process group: the layout against ``world_size``,
    kernels against the device, EP balance against the layout, seq_len against CP. Raises ConfigError / LayoutError."""
    from q38.parallel.layout import Layout, LayoutError

    layout = Layout.load(cfg.layout)
    if cfg.peft is not None and cfg.train.master_dtype == "bfloat16_remainder":
        from q38.train.core.state import LORA_REFUSAL

        raise ConfigError(LORA_REFUSAL)
    if cfg.peft is not None and cfg.train.offload_optimizer:
        from q38.train.core.state import OFFLOAD_LORA_REFUSAL

        raise ConfigError(OFFLOAD_LORA_REFUSAL)
    try:
        sizes = layout.resolve_mesh(world_size)
    except LayoutError as e:
        raise LayoutError(
            f"{e}. Launch a fitting number of processes with `torchrun --nproc_per_node N q38 train CONFIG`, or "
            f"choose another layout (layout: single runs on one process)"
        ) from None
    layout.placements(abstract_params_of(cfg.model), sizes)  # every parameter placed and divisible (or uneven)
    if sizes.get("pp", 1) > 1:  # the stage split against the model, the schedule against the micro-batches
        from q38.parallel.pipeline import check_micro_batches, check_model

        check_model(layout, cfg.model)
        check_micro_batches(layout, cfg.train.micro_batches)
        if cfg.data.eval_split or cfg.data.eval_path is not None:
            from q38.train.run.evaluate import PP_EVAL_REFUSAL

            raise ConfigError(PP_EVAL_REFUSAL)
    ep, cp = sizes.get("ep", 1), sizes.get("cp", 1)
    dp = math.prod(sizes.get(d, 1) for d in layout.batch_mesh_dims)
    kernels = validate_run(cfg.model, cfg.train, device=device, ep_size=ep, kernels=cfg.kernels, cp_size=cp)
    need(cfg.data.seq_len % cp == 0,
          f"data.seq_len {cfg.data.seq_len} must be divisible by the layout's cp size {cp} (the sequence is split "
          f"over cp ranks); change seq_len or the layout")
    plan = RunPlan(layout, dict(sizes), dp, ep, cp, kernels)
    return attrs.evolve(plan, memory=check_memory(cfg, plan, world_size, device))


def device_memory(device: str) -> tuple[str, int] | None:
    """``(name, bytes)`` of the accelerator ``device`` (``cuda[:i]`` / ``npu[:i]``); None for the CPU and for a device
    that is not there (``safety.check_device`` reports that one)."""
    kind, _, index = str(device).partition(":")
    mod = getattr(torch, kind, None) if kind in ("cuda", "npu") else None
    if mod is None or not mod.is_available() or int(index or 0) >= mod.device_count():
        return None
    props = mod.get_device_properties(int(index or 0))
    return props.name, int(props.total_memory)


def check_memory(cfg: RunConfig, plan: RunPlan, world_size: int, device: str) -> str | None:
    """On an accelerator: ``q38 plan``'s predicted per-rank peak of this run (q38/parallel/budget.py: the same
    settings ``q38 plan --train`` reads, with the run's resolved GDN kernel and chunk) against the device's memory.
    Raises ``ConfigError`` when the peak exceeds it (``run.memory_check: false`` starts anyway); returns the verdict
    line for the run log (None on the CPU, whose memory the plan does not model; there a model whose parameters alone
    exceed the host memory left is refused)."""
    dev = device_memory(device)
    if dev is None:
        if str(device).split(":")[0] == "cpu" and cfg.run.memory_check:  # the parameters alone, 2 bytes each
            from q38.model import check_host_memory

            local = min(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), world_size)  # ranks on this host (torchrun sets it)
            check_host_memory(cfg.model, bytes_per_param=2, share=local / world_size, what="run.device cpu",
                              fix="choose a smaller model, more hosts, or set run.memory_check: false to start anyway")
        return None
    from q38.parallel.budget import estimate, recompute_mode
    from q38.parallel.search import budget_kwargs
    from q38.train.core.optim import default_impl

    train = cfg.train.to_dict()
    b = estimate(cfg.model, plan.layout, world_size, seq_len=cfg.data.seq_len, rows_per_rank=cfg.data.batch_size,
                 micro_batches=cfg.train.micro_batches, recompute=recompute_mode(train), hardware=None,
                 adamw_impl=default_impl(torch.device(device)), peft=cfg.peft,
                 **budget_kwargs(train, gdn=plan.kernels.gdn, chunk=int(plan.kernels.gdn_chunk_size)))
    b = attrs.evolve(b, hardware=dev[0], hbm_bytes=dev[1])
    line = b.fit_line(fixes="set train.recompute: true (without skip_gdn_recompute on the torch GDN kernel), more "
                            "ranks or a smaller data.batch_size / seq_len, or kernels.gdn: fla where it is allowed; "
                            "`q38 plan --search` ranks the layouts that fit")
    if b.peak_bytes > dev[1] and cfg.run.memory_check:
        raise ConfigError(f"memory: {line}. The prediction is q38 plan's (within 15 % of measured peaks on CPU; "
                          "tests/test_plan_budget.py); set run.memory_check: false to start anyway")
    return f"memory (q38 plan): {line}"


def abstract_params_of(model: ModelConfig):
    from q38.model import abstract_params

    return abstract_params(model)


def _init_process_group(device: str, backend: str, world: WorldInfo, timeout_s: float | None = None) -> bool:
    """Initialise the default process group for a torchrun launch; True if this call created it. ``timeout_s``:
    how long the rendezvous and every collective may wait (None: torch's default)."""
    import datetime

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
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, rank=world.rank, world_size=world.world_size, timeout=timeout)
    return True


COLLECTIVE_MARGIN_S = 60.0  # a collective in a step may wait this much longer than the step's watchdog bound


class CollectiveTimeout:
    """Bounds every collective of the process groups by the watchdog's bound of the phase it runs in (plus
    ``COLLECTIVE_MARGIN_S``, so that the watchdog names the rank first), never more than ``run.timeout_s``: a hung
    collective errors even where the watchdog is gone. Called by ``StepWatchdog`` with each bound it arms; a no-op on
    one process. The groups in ``skip`` keep ``run.timeout_s`` (a background checkpoint write's own group: its
    collectives wait for the slowest rank's write, beside the steps)."""

    def __init__(self, timeout_s: float, skip=()) -> None:
        self.timeout_s, self.now = timeout_s, timeout_s  # init_process_group set run.timeout_s
        self.skip = [g for g in skip if g is not None]

    def __call__(self, bound_s: float) -> None:
        import datetime

        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        want = min(self.timeout_s, bound_s + COLLECTIVE_MARGIN_S)
        if want == self.now or not (dist.is_available() and dist.is_initialized()):
            return
        for group in list(c10d._world.pg_map):
            if any(group is g for g in self.skip):
                continue
            try:
                c10d._set_pg_timeout(datetime.timedelta(seconds=want), group)
            except (ValueError, AssertionError, RuntimeError):  # a group this rank is not in, or another backend
                continue
        self.now = want




@contextlib.contextmanager
def cpu_process_group() -> Iterator[WorldInfo]:
    """For commands that only move files (``q38 convert``): under torchrun, a gloo process group for the command's
    duration (destroyed after); one process: nothing."""
    import torch.distributed as dist

    world = WorldInfo.from_env()
    created = world.world_size > 1 and _init_process_group("cpu", "gloo", world)
    try:
        yield world
        if created:  # every rank is done with its collectives before any rank tears its process group down
            dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()


_PR_SET_PDEATHSIG = 1


def die_with_launcher(env: Mapping[str, str] | None = None) -> bool:
    """Under torchrun (its agent sets ``TORCHELASTIC_RUN_ID``), ask the kernel to kill this worker when its launcher
    dies (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``): a worker whose agent was killed (kill -9, an OOM kill) would
    otherwise train on alone, hold the run lock and refuse every relaunch. Killed mid-save, a worker leaves only a
    ``step_*.tmp-*`` directory: the newest complete checkpoint stays as it was. A worker whose launcher is already
    gone (reparented) exits at once. True if armed."""
    import signal

    env = os.environ if env is None else env
    if not env.get("TORCHELASTIC_RUN_ID") or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the launcher died before the request took effect
        raise SystemExit("q38 train: the torchrun agent that launched this worker is gone; stopping")
    return True


# ---- q38 launch: torchrun with the documented stop ------------------------------------------------------------------


def launch(argv: list[str], at: int) -> int:
    """``q38 launch [torchrun options] COMMAND [ARGS]`` (``argv[at]``: the q38 command, which ``q38.cli`` checked):
    ``torchrun [torchrun options] -m q38.cli COMMAND [ARGS]`` (torch's own launcher, in this process), except for how
    it stops.

    torchrun's agent turns SIGTERM / SIGINT into an exception: it signals the workers, waits ``--shutdown-timeout``
    (30 s) for them, SIGKILLs the rest and exits 1 with its traceback, whatever the workers did. Here the first
    SIGTERM or SIGINT is only passed on to the workers as SIGTERM (each finishes its step, saves a checkpoint and
    exits 0) and the agent goes on watching them as usual: every worker exits 0, so the launch exits 0. A second
    signal is torchrun's own stop. A worker that fails ends the launch with that worker's exit code (2 for bad
    input) and one line naming it."""
    import signal

    import torch.distributed.elastic.multiprocessing.api as mp
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args([*argv[:at], "-m", "q38.cli", *argv[at:]])
    contexts: list = []
    signals: list[int] = []
    torch_handler, torch_start = mp._terminate_process_handler, mp.PContext.start

    def start(self) -> None:  # every worker group the agent starts (a restart starts a new one)
        contexts.append(self)
        torch_start(self)

    def on_signal(signum, frame) -> None:
        signals.append(signum)
        if len(signals) > 1 or signum not in (signal.SIGTERM, signal.SIGINT):
            torch_handler(signum, frame)  # raises torchrun's SignalException: its own shutdown
        print(f"q38 launch: {signal.Signals(signum).name}: the workers finish their step, save a checkpoint and "
              "exit (send it again to stop them at once)", file=sys.stderr, flush=True)
        for pc in contexts:
            for pid in pc.pids().values():
                try:
                    os.kill(pid, signal.SIGTERM)  # never SIGINT: a worker reads a second SIGINT as "abort"
                except ProcessLookupError:
                    pass

    mp._terminate_process_handler, mp.PContext.start = on_signal, start
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if 0 < failure.exitcode < 256 else 1
        how = (f"was killed by {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0
               else f"exited with code {failure.exitcode}")
        print(f"q38 launch: worker rank {rank} {how} (its own lines above say why)", file=sys.stderr)
        return code
    finally:
        mp._terminate_process_handler, mp.PContext.start = torch_handler, torch_start
    return 0
