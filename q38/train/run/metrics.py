"""What a run reports: throughput and MFU (``q38.flops``), the progress line, ``metrics.jsonl``."""

import json
import math
import re
import os
from pathlib import Path

import torch

from q38.model_config import ModelConfig



# ---- metrics --------------------------------------------------------------------------------------------------------


class Throughput:
    """Tokens/s and MFU over a window: the steps since the last progress line (``reset``), after the first ``warmup``
    steps of this process, which are reported one by one instead (compilation, caches). Tokens are the step's target
    tokens (labels counted in the main loss) over all ranks. Never divides by zero."""

    def __init__(self, warmup: int, flops_per_token: float, peak_flops: float | None, devices: int = 1):
        self.warmup, self.flops_per_token, self.peak, self.devices = warmup, flops_per_token, peak_flops, devices
        self.seen = 0
        self.reset()

    def reset(self) -> None:
        """Start a new window (after a progress line has reported this one)."""
        self.steps = self.tokens = 0
        self.seconds = 0.0
        self.first = self.last = None  # the window's first and last step

    @property
    def warming(self) -> bool:
        """Whether the last step was one of this process's warm-up steps (left out of the window)."""
        return self.seen <= self.warmup

    def update(self, step: int, tokens: int, seconds: float) -> None:
        """``tokens``: the step's target tokens over all ranks. Steps are counted from this process's first one, so a
        resumed run has warm-up steps of its own."""
        self.seen += 1
        if not self.warming and seconds > 0:
            self.steps += 1
            self.tokens += tokens
            self.seconds += seconds
            self.first = step if self.first is None else self.first
            self.last = step

    @property
    def seconds_per_step(self) -> float | None:
        return self.seconds / self.steps if self.steps else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def mfu_of(self, tokens_per_s: float | None) -> float | None:
        if tokens_per_s is None or not self.peak or self.devices < 1:
            return None
        return tokens_per_s * self.flops_per_token / (self.peak * self.devices)

    @property
    def mfu(self) -> float | None:
        return self.mfu_of(self.tokens_per_s)


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


PROGRESS_LEGEND = ("progress lines: loss, mtp_<d>, aux = the objective's terms; gnorm = gradient norm; lr = learning "
                   "rate; load = the busiest expert's tokens over the mean (worst MoE layer), idle = experts that got "
                   "no token; s/step, tok/s, mfu = mean wall time per step, target tokens (labels in the loss, all "
                   "ranks) per second and model FLOPs utilisation over the steps named before them (those since the "
                   "previous line); the first steps of a process (run.warmup_log_steps: compilation, caches) are logged one by "
                   "one as warm-up and left out of those means")
SLOW_RANK = 1.2  # the progress line names the slowest rank when it is busy this much longer than the median


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def format_metrics(step: int, m: dict, tput: Throughput, step_time: float | None = None,
                   terms: list[str] | None = None, warmup: bool = False) -> str:
    """One progress line: the objective's terms by name (default: loss, mtp_<d>, aux), grad norm, LR, the worst
    MoE layer's max/mean expert load and the count of idle experts; then time and throughput over ``tput``'s window
    (``warmup``: this warm-up step's own time instead; no window: ``step_time`` alone)."""
    if terms is None:
        terms = ["loss", *sorted(k for k in m if re.fullmatch(r"mtp_\d+", k)), "aux"]
    parts = [f"step {step}", *(f"{k} {m[k]:.4f}" for k in terms)]
    parts += [f"gnorm {m['grad_norm']:.3f}", f"lr {m['lr']:.2e}"]
    if "router_max_mean" in m:
        parts.append(f"load {m['router_max_mean']:.2f}x idle {m['router_idle']}")
    if warmup:
        parts.append(f"{step_time:.2f} s/step warm-up" if step_time is not None else "warm-up")
    elif tput.steps:
        parts.append(f"{_steps(tput.first, tput.last)}: {tput.seconds_per_step:.2f} s/step, tok/s "
                     f"{tput.tokens_per_s:,.0f}" + (f", mfu {100 * tput.mfu:.1f}%" if tput.mfu is not None else ""))
    elif step_time is not None:
        parts.append(f"{step_time:.2f} s/step")
    if m.get("eval_loss") is not None:
        parts.append(f"eval loss {m['eval_loss']:.4f}")
        parts += [f"eval {k[5:]} {m[k]:.4f}" for k in sorted(m) if k.startswith("eval_mtp_")]
    if m.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    if m.get("busy_median") and m["busy_max"] > SLOW_RANK * m["busy_median"]:
        parts.append(f"slowest rank {m['slowest_rank']}: busy {m['busy_max']:.2f}s (median {m['busy_median']:.2f}s)")
    return " | ".join(parts)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    from q38.train.run.safety import load_metrics

    return load_metrics(path)[0]  # a torn last line is left out; any other malformed line is an error


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the records of steps <= ``last_step`` (a resumed run rewrites the steps after its checkpoint)."""
    recs = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    os.replace(tmp, path)


def isfinite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))


