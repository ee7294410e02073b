"""A rollout batch larger than memory, refused before any rollout (docs/rl.md#memory-the-rollout-needs): ``q38 rl``
prices its decode batch as ``q38 plan`` does (``q38.parallel.budget_rollout``: the caches, a decode step's logits,
the prefill's working set, a LoRA state's merged copy) and compares the price with the device's free memory."""

import os

import torch

from q38.errors import ConfigError
from q38.parallel.budget_rollout import decode_items
from q38.parallel.param_stats import phase_total

MEMORY_ENV = "Q38_RL_MEMORY_BYTES"  # a byte budget that replaces the device's free memory (tests, shared machines)


def free_memory(device) -> tuple[int, str]:
    """Bytes free for the rollout on ``device`` and where the figure comes from: ``$Q38_RL_MEMORY_BYTES`` when set,
    else ``torch.cuda.mem_get_info`` on CUDA, the available RAM (``/proc/meminfo`` MemAvailable, else psutil) on
    CPU. ``(0, reason)`` when it cannot be read (then nothing is refused)."""
    env = os.environ.get(MEMORY_ENV)
    if env is not None:
        try:
            n = int(env)
        except ValueError:
            n = -1
        if n < 0:
            raise ConfigError(f"${MEMORY_ENV}={env!r} is not a byte count (an integer >= 0); fix or unset it")
        return n, f"${MEMORY_ENV}"
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0]), f"free memory of {dev}"
    if dev.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, "available RAM (/proc/meminfo)"
        except OSError:
            pass
        try:
            import psutil

            return int(psutil.virtual_memory().available), "available RAM (psutil)"
        except ImportError:
            pass
    return 0, f"free memory of {dev} unknown"


def merged_copy_bytes(params) -> int:
    """Bytes of the fp32 weights ``policy_params`` (``q38.lora.merged_params``) builds for a LoRA state's rollout:
    every adapted weight merged, every block-FP8 weight dequantized (0 for a tree with neither)."""
    from q38.fp8 import Fp8Weight
    from q38.lora import _node, is_adapted

    total = 0
    for x in torch.utils._pytree.tree_leaves(params, is_leaf=_node):
        w = x.base if is_adapted(x) else x
        if is_adapted(x) or isinstance(x, Fp8Weight):
            total += 4 * (w.bits.numel() if isinstance(w, Fp8Weight) else w.numel())
    return total


def rollout_price(config, prompts: int, group_size: int, longest_prompt: int, max_new_tokens: int,
                  dtype: torch.dtype, extra: int = 0) -> int:
    """Bytes a one-process rollout of ``prompts × group_size`` rows holds beyond the model: the larger of its
    prefill and decode-step groups (``budget_rollout.decode_items``) plus ``extra`` (a LoRA state's merged copy)."""
    items = decode_items(config, prompts * group_size, longest_prompt, max_new_tokens,
                         torch.tensor([], dtype=dtype).element_size())
    return int(phase_total(items)) + extra


def check_rollout_memory(state, prompt_ids, prompts_per_iteration: int, group_size: int, max_new_tokens: int,
                         device) -> None:
    """Refuse (one ``ConfigError`` line, before any rollout) an iteration whose rollout costs more than the free
    memory of ``device``, naming how many prompts per iteration fit. The longest prompt of the file is priced (any
    iteration may draw it)."""
    free, source = free_memory(device)
    if free == 0 and source.endswith("unknown"):
        return
    mc = state.model_config
    embed = state.params.embed  # the rollout's cache dtype: its policy's embedding's (q38.rollout.rollout)
    dtype = embed.dtype if isinstance(embed, torch.Tensor) else torch.float32
    longest = max(len(p) for p in prompt_ids)
    extra = merged_copy_bytes(state.params) if state.peft is not None else 0
    need = rollout_price(mc, prompts_per_iteration, group_size, longest, max_new_tokens, dtype, extra)
    if need <= free:
        return
    fit = 0
    while fit < prompts_per_iteration and rollout_price(mc, fit + 1, group_size, longest, max_new_tokens, dtype,
                                                        extra) <= free:
        fit += 1
    raise ConfigError(f"a rollout of {prompts_per_iteration} prompts x group size {group_size} (prompts up to "
                      f"{longest} tokens + {max_new_tokens} new) needs {need / 2**20:,.1f} MiB, more than the "
                      f"{free / 2**20:,.1f} MiB of {source}; at most {fit} prompts per iteration fit: lower "
                      "--prompts-per-iteration, --group-size or --max-new-tokens")
