"""Rollouts for post-training with rewards (docs/rl.md#rollouts): ``group_size`` sampled completions per prompt from
q38's own decode (``q38.decode``: the layer code training runs), each sampled token's log-prob recorded at sampling.

The recorded log-prob is ``log softmax(logits / temperature)[token]``: the tempered policy the policy-gradient
objective recomputes (``q38.train.core.policy``, same temperature). Top-k / top-p restrict which tokens can be drawn
but not the recorded log-prob (the policy being trained is the tempered distribution, as in verl and vLLM's
``logprobs``); with ``top_p`` < 1 the draws come from a truncated distribution, which the docs say.
"""

from typing import Sequence

import attrs
import torch
from torch import Tensor

from q38.decode import NO_HOOKS, DecodeHooks, Sampling, _first_leaf, cache_bytes, generate_scored
from q38.errors import ConfigError
from q38.model import ModelParams
from q38.model_config import ModelConfig


@attrs.frozen
class Completion:
    """One sampled completion: ``prompt_index`` into the prompts, the ``prompt`` and sampled ``tokens`` (ids),
    ``logprobs[j]`` the log-prob of ``tokens[j]`` when it was drawn, ``stopped``: it ended at a stop id (else at
    ``max_new_tokens``); ``routes`` (``record_routes``): the experts every MoE main layer chose for each token of
    prompt and completion as the rollout fed it, -1 for the last sampled token (never fed)."""

    prompt_index: int
    prompt: tuple
    tokens: tuple
    logprobs: tuple
    stopped: bool
    routes: Tensor | None = None  # routing replay: [prompt + tokens, main layers, k] int16 experts (-1: none)


def check_rollout(prompts: Sequence[Sequence[int]], group_size: int, max_new_tokens: int, sampling: Sampling,
                  config: ModelConfig) -> None:
    """Refuse a rollout that cannot train (one ``ConfigError`` line each)."""
    if not (isinstance(group_size, int) and group_size >= 2):
        raise ConfigError(f"rl.group_size must be an integer >= 2 (a group of one sample has no advantage: its reward "
                          f"minus the group mean is 0), got {group_size!r}")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ConfigError(f"rl.max_new_tokens must be an integer >= 1 (a rollout must produce tokens), got "
                          f"{max_new_tokens!r}")
    if sampling.temperature <= 0:
        raise ConfigError("rl.temperature must be > 0: greedy decoding gives every sample of a group the same "
                          "completion (no advantage) and no sampling distribution to take log-probs from")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("a rollout needs at least one prompt, each of at least one token")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > config.max_position_embeddings:
        raise ConfigError(f"a prompt of {longest} tokens plus max_new_tokens {max_new_tokens} passes the model's "
                          f"max_position_embeddings ({config.max_position_embeddings}); shorten either")


def rollout_bytes(config: ModelConfig, prompts: Sequence[Sequence[int]], group_size: int, max_new_tokens: int,
                  dtype: torch.dtype) -> int:
    """What a rollout's decode batch holds beyond the weights: ``len(prompts) · group_size`` rows, each a decode
    cache (``q38.decode.cache_bytes``: GDN states, attention keys and values in ``dtype``) for the longest prompt
    plus ``max_new_tokens`` steps, and the fp32 logits and sampling probabilities over the vocabulary."""
    rows = len(prompts) * group_size
    longest = max(len(p) for p in prompts)
    return rows * (cache_bytes(config, 1, longest + max_new_tokens, dtype) + 2 * 4 * config.vocab_size)


def sampled_logprobs(logits, token: Tensor, temperature: float) -> Tensor:
    """``log softmax(logits / temperature)[token]`` per row, fp32 (the division as the trainer does it: times
    ``1 / temperature``)."""
    return torch.log_softmax(logits.float() * (1.0 / temperature), dim=-1).gather(1, token[:, None]).squeeze(1)


@torch.no_grad()
def rollout(
    params: ModelParams, config: ModelConfig, prompts: Sequence[Sequence[int]], *, group_size: int,
    max_new_tokens: int, sampling: Sampling, stop_ids: Sequence[int] = (), router_bias: Tensor | None = None,
    dtype: torch.dtype | None = None, max_bytes: int | None = None, hooks: DecodeHooks = NO_HOOKS,
    first_prompt: int = 0, total_prompts: int | None = None, record_routes: bool = False,
) -> list[Completion]:
    """``group_size`` completions of every prompt (prompt ``i``'s group: results ``i·G … i·G + G − 1``), all rows in
    one decode batch. A row stops after a token of ``stop_ids`` (kept) or at ``max_new_tokens``. ``params``: plain
    tensors (a LoRA tree merged first); ``sampling.seed`` fixes the draws. ``max_bytes``: refuse up front, before
    any step, a rollout whose ``rollout_bytes`` pass it.

    Rows draw by inverse CDF from one uniform per row and step (``q38.decode.sample_at``): row ``r`` of the whole
    rollout (prompt ``p``, sample ``j``: ``r = p·G + j``) samples the same tokens however the prompts are split over
    ranks. A rank's share: ``prompts`` are prompts ``first_prompt …`` of ``total_prompts`` (their ``prompt_index``
    counts from ``first_prompt``), ``hooks`` the sharded decode (``q38.decode.DecodeHooks``).

    ``record_routes``: each completion carries the experts its tokens were routed to (``Completion.routes``), for
    routing replay in the training forward."""
    check_rollout(prompts, group_size, max_new_tokens, sampling, config)
    total_prompts = len(prompts) if total_prompts is None else total_prompts
    if not 0 <= first_prompt <= total_prompts - len(prompts):
        raise ValueError(f"prompts {first_prompt}..{first_prompt + len(prompts) - 1} are not among {total_prompts}")
    dtype = dtype or _first_leaf(params).dtype
    if max_bytes is not None:
        need = rollout_bytes(config, prompts, group_size, max_new_tokens, dtype)
        if need > max_bytes:
            rows = len(prompts) * group_size
            raise ConfigError(f"a rollout of {len(prompts)} prompts x group_size {group_size} with max_new_tokens "
                              f"{max_new_tokens} needs {need / 2**20:,.1f} MiB of decode cache and logits, more than "
                              f"the {max_bytes / 2**20:,.1f} MiB allowed; take at most "
                              f"{max(0, max_bytes * rows // need // group_size)} prompts per iteration or fewer new "
                              "tokens")
    rows = [list(p) for p in prompts for _ in range(group_size)]
    stops = tuple(int(t) for t in stop_ids)
    first_row = first_prompt * group_size
    if record_routes:
        hooks = attrs.evolve(hooks, routes=[])
    out, lps = generate_scored(params, config, rows, max_new_tokens=max_new_tokens, sampling=sampling,
                               stop_ids=stops, router_bias=router_bias, dtype=dtype,
                               score=lambda logits, tok: sampled_logprobs(logits, tok, sampling.temperature),
                               draw_rows=(total_prompts * group_size, range(first_row, first_row + len(rows))),
                               hooks=hooks)
    stopped = [bool(o) and o[-1] in stops for o in out]
    routes = _row_routes(hooks.routes, rows, out) if record_routes else [None] * len(rows)
    return [Completion(first_prompt + r // group_size, tuple(rows[r]), tuple(out[r]), tuple(lps[r]), stopped[r],
                       routes[r]) for r in range(len(rows))]


def _row_routes(steps: list, prompts: list, out: list) -> list[Tensor]:
    """Each row's experts per token ``[prompt + completion, layers, k]`` int16 from the recorded calls: ``steps[0]``
    the prefill ``[b, longest prompt, layers, k]`` (row ``r``'s first ``len(prompt)`` columns), ``steps[j]`` the
    decode step that fed sampled token ``j - 1``. A row's tokens before its last were fed while it ran; its last
    token never is (or only after the row stopped), so it gets -1 (the training forward routes it by its own top-k:
    its output reaches no target of its sequence)."""
    rows = []
    for r, (p, o) in enumerate(zip(prompts, out)):
        fed = [steps[0][r, :len(p)]] + [steps[1 + j][r] for j in range(len(o) - 1)]
        last = torch.full_like(steps[0][r, :1], -1)
        rows.append(torch.cat(fed + ([last] if o else [])).to("cpu", torch.int16))
    return rows
