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


PROGRESS_LEGEND = ("progress lines: loss, mtp_<d>, aux = the objective's terms; gnorm = gradient norm; lr = learning "
                   "rate; load = the busiest expert's tokens over the mean (worst MoE layer), idle = experts that got "
                   "no token; s/step = wall time of the step; tok/s = trained tokens per second")
SLOW_RANK = 1.2  # the progress line names the slowest rank when it is busy this much longer than the median


def format_metrics(step: int, m: dict, tput: Throughput, step_time: float | None = None,
                   terms: list[str] | None = None) -> str:
    """One progress line: the objective's terms by name (default: loss, mtp_<d>, aux), grad norm, LR, the worst
    MoE layer's max/mean expert load and the count of idle experts, time, throughput."""
    if terms is None:
        terms = ["loss", *sorted(k for k in m if re.fullmatch(r"mtp_\d+", k)), "aux"]
    parts = [f"step {step}", *(f"{k} {m[k]:.4f}" for k in terms)]
    parts += [f"gnorm {m['grad_norm']:.3f}", f"lr {m['lr']:.2e}"]
    if "router_max_mean" in m:
        parts.append(f"load {m['router_max_mean']:.2f}x idle {m['router_idle']}")
    if step_time is not None:
        parts.append(f"{step_time:.2f} s/step")
    tps = tput.tokens_per_s
    parts.append(f"tok/s {tps:,.0f}" if tps is not None else "tok/s n/a")
    if tput.mfu is not None:
        parts.append(f"mfu {100 * tput.mfu:.1f}%")
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


