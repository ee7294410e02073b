"""Functional decoding (docs/evaluate.md#how-decoding-works): ``decode_step(params, cache, token) -> (logits, cache)``
over a pytree cache of every main layer's decode state (``q38.layers.decode``: GDN conv windows and recurrent
states, attention keys/values), prompts fed in one pass of the sequence form (``prefill``; or token by token,
``feed``), several tokens per row over the cache (``extend``, ``keep_prefix``: speculative decoding's verification,
``q38.speculative``), and sampling (``generate``: greedy, temperature, top-k, top-p, a seed; rows stop at stop tokens
or by a caller's rule, e.g. a stop string). MoE layers run ``moe_apply``, the function training runs; the MTP block
drafts tokens only in ``q38.speculative``.

A batch holds one sequence per row. Rows may skip steps (``active`` False: the row's cache and position stay as they
were), which is how prompts of different lengths are fed as one batch: left-aligned to end together (``feed``).
"""

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import attrs
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from q38.layers.decode import (
    GDNCache, attention_decode, attention_extend, empty_gdn_cache, empty_kv_cache, gdn_decode, gdn_extend, gdn_keep,
    kv_keep,
)
from q38.layers.moe import ExpertDispatch, moe_apply, select_experts
from q38.layers.norm import rms_norm
from q38.model import ModelParams, head_weight
from q38.model_config import ModelConfig
from q38.pytree import pytree_node


class StagePipe(Protocol):
    """What a pipelined decode needs of its pipeline (``q38.parallel.pipeline.DecodePipe``; declared here so the
    model floor imports nothing above it): ``layers``, the main layers this rank runs; ``run``, this rank's layers
    with the hidden states received from and sent to the neighbouring stages; ``head``, the last stage's logits on
    every stage."""

    layers: frozenset

    def run(self, x: Tensor | None, shape: tuple, layer: Callable[[int, Tensor], Tensor]) -> Tensor | None: ...

    def head(self, x: Tensor | None, shape: tuple, fn: Callable[[Tensor], Tensor]) -> Tensor: ...


@pytree_node
@attrs.frozen
class DecodeCache:
    """``layers[i]``: main layer ``i``'s cache (``GDNCache`` for ``linear_attention``, ``KVCache`` for
    ``full_attention``); ``pos``: each row's next position (tokens fed so far)."""

    layers: list
    pos: Tensor  # [b] int64


def empty_cache(cfg: ModelConfig, batch: int, *, dtype: torch.dtype = torch.float32, device=None,
                layers: Collection[int] | None = None) -> DecodeCache:
    """The cache before any token: every row at position 0. ``layers``: only these main layers get a cache (the
    others None: a pipeline stage's decode holds its own layers' caches); None: every layer."""
    make = {"linear_attention": empty_gdn_cache, "full_attention": empty_kv_cache}
    unknown = sorted({t for t in cfg.layer_types if t not in make})
    if unknown:
        raise NotImplementedError(f"decoding has no one-token step for layer kind(s) {unknown}; add one to "
                                  "q38/layers/decode.py")
    return DecodeCache(layers=[make[t](cfg, batch, dtype, device) if layers is None or i in layers else None
                               for i, t in enumerate(cfg.layer_types)],
                       pos=torch.zeros(batch, dtype=torch.long, device=device))


def cache_bytes(cfg: ModelConfig, rows: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of the decode cache of ``rows`` rows that have taken ``length`` steps: each GDN layer's conv window and
    fp32 state (whatever the length), each attention layer's keys and values (``dtype``) and their valid flags per
    step."""
    one = empty_cache(cfg, 1, dtype=dtype, device="meta")
    fixed = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(one))
    n_attn = sum(kind == "full_attention" for kind in cfg.layer_types)
    per_step = n_attn * (2 * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize + 1)
    return rows * (fixed + length * per_step)


def _identity(tree):
    return tree


@attrs.frozen
class DecodeHooks:
    """How a decode batch runs on a rank whose parameters are sharded (``q38.train.run.rl``'s rollouts on a mesh);
    the identity on one process.

    ``gather``: a main layer's parameters in compute form (FSDP all-gather), called once per layer and step, so one
    layer's gathered parameters are alive at a time; ``dispatch``: the MoE expert dispatch when experts are spread
    over ranks (EP all-to-all); ``any_rows(flag)``: whether any rank still has a running row (every rank must take
    the same number of steps, since each step's gathers and exchanges are collectives); ``routes``: a list that
    receives, per step of the sequence form and per token step, every MoE layer's chosen experts (routing replay,
    ``q38.rollout``); ``pipe``: a pipelined layout's decode (``q38.parallel.pipeline.DecodePipe``): this rank runs
    only its stage's layers and holds only their caches, the hidden states travel between stages and every stage
    gets the last stage's logits."""

    gather: Callable = _identity
    dispatch: ExpertDispatch | None = None
    any_rows: Callable[[bool], bool] = bool
    routes: list | None = None
    pipe: StagePipe | None = None


NO_HOOKS = DecodeHooks()


def _run_layers(hooks: DecodeHooks, n: int, x: Tensor | None, shape: tuple, layer: Callable) -> Tensor | None:
    """``x = layer(i, x)`` over main layers ``0..n-1``, or over this rank's stage chunks (``hooks.pipe``: None
    where this rank does not hold the last chunk)."""
    if hooks.pipe is None:
        for i in range(n):
            x = layer(i, x)
        return x
    return hooks.pipe.run(x, shape, layer)


def _head(hooks: DecodeHooks, x: Tensor | None, shape: tuple, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``fn(x)`` (the logits ``shape``), computed where the last layer ran and shared over the pipeline."""
    return fn(x) if hooks.pipe is None else hooks.pipe.head(x, shape, fn)


def _first_leaf(params: ModelParams) -> Tensor:
    """The embedding, or on a pipeline stage without it the first parameter it holds (for its device / dtype)."""
    if params.embed is not None:
        return params.embed
    return next(t for t in torch.utils._pytree.tree_leaves(params) if t is not None)


def _moe(lp, x: Tensor, config: ModelConfig, bias: Tensor | None, hooks: DecodeHooks, chosen: list | None) -> Tensor:
    """The MoE of one layer over ``x`` ``[b, s, d]`` (normed), as training runs it; ``chosen`` (when not None)
    receives its top-k experts ``[b, s, k]`` (the router's own selection, ``select_experts`` of its logits)."""
    y, logits = moe_apply(lp.moe, x, config, hooks.dispatch, bias)
    if chosen is not None:
        idx = select_experts(logits, config.num_experts_per_tok, bias)[1]
        chosen.append(idx.view(*x.shape[:2], -1))
    return y


def _keep(active: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """``new`` where the row is active, else ``old`` (rows are dim 0)."""
    return torch.where(active.view(-1, *([1] * (new.dim() - 1))), new, old)


def decode_step(
    params: ModelParams,
    cache: DecodeCache,
    token: Int[Tensor, " b"],
    config: ModelConfig,
    *,
    active: Bool[Tensor, " b"] | None = None,
    router_bias: Float[Tensor, "l e"] | None = None,
    hooks: DecodeHooks = NO_HOOKS,
) -> tuple[Float[Tensor, "b v"], DecodeCache]:
    """Feed one token per row; return the next-token logits of every row and the new cache (inputs unchanged).

    ``params``: plain tensors (a LoRA tree merged first: ``q38.lora.merged_params``), or on a mesh the layers as
    ``hooks.gather`` takes them; ``active``: rows that take this step (None: all); an inactive row's cache and
    position are kept and its logits are meaningless. ``router_bias[i]``: MoE layer ``i``'s expert-selection bias
    (aux-loss-free balancing), as in training."""
    b = token.shape[0]
    if active is None:
        active = torch.ones(b, dtype=torch.bool, device=token.device)
    x = None if params.embed is None else F.embedding(token, params.embed)  # [b d]
    caches = list(cache.layers)
    chosen = [] if hooks.routes is not None else None

    def layer(i: int, x: Tensor) -> Tensor:
        lp, lc, kind = hooks.gather(params.layers[i]), cache.layers[i], config.layer_types[i]
        h = rms_norm(x, lp.attn_norm, config.rms_norm_eps)
        if kind == "linear_attention":
            y, new = gdn_decode(lp.mixer, h, lc, config)
            new = GDNCache(conv=_keep(active, new.conv, lc.conv), ssm=_keep(active, new.ssm, lc.ssm))
        else:
            y, new = attention_decode(lp.mixer, h, lc, cache.pos, active, config)
        caches[i] = new
        x = x + y
        bias = None if router_bias is None else router_bias[i]
        y = _moe(lp, rms_norm(x, lp.mlp_norm, config.rms_norm_eps)[:, None], config, bias, hooks, chosen)
        return x + y[:, 0]

    x = _run_layers(hooks, len(config.layer_types), x, (b, config.hidden_size), layer)
    if chosen is not None:
        hooks.routes.append(torch.stack(chosen, dim=2))  # [b, 1, layers, k]
    logits = _head(hooks, x, (b, config.vocab_size),
                   lambda x: F.linear(rms_norm(x, params.final_norm, config.rms_norm_eps), head_weight(params)))
    return logits, DecodeCache(layers=caches, pos=cache.pos + active.long())


def feed(
    params: ModelParams, cache: DecodeCache, tokens: Int[Tensor, "b s"], config: ModelConfig, *,
    active: Bool[Tensor, "b s"] | None = None, router_bias: Tensor | None = None,
) -> tuple[Float[Tensor, "b s v"], DecodeCache]:
    """``decode_step`` over the columns of ``tokens`` (``active[:, t]``: the rows that take step ``t``); returns the
    logits after every step and the final cache."""
    out = []
    for t in range(tokens.shape[1]):
        logits, cache = decode_step(params, cache, tokens[:, t], config,
                                    active=None if active is None else active[:, t], router_bias=router_bias)
        out.append(logits)
    return torch.stack(out, dim=1), cache


def left_aligned(prompts: Sequence[Sequence[int]], pad_id: int = 0, device=None) -> tuple[Tensor, Tensor]:
    """Prompts as ``[b, max_len]`` tokens and ``active`` mask, each prompt at the right end of its row (its steps
    the last ``len`` ones), so every row's prompt ends at the same step."""
    n = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), n), pad_id, dtype=torch.long, device=device)
    active = torch.zeros((len(prompts), n), dtype=torch.bool, device=device)
    for r, p in enumerate(prompts):
        if len(p):
            tokens[r, n - len(p):] = torch.tensor(list(p), dtype=torch.long, device=device)
            active[r, n - len(p):] = True
    return tokens, active


@attrs.frozen(kw_only=True)
class Sampling:
    """``temperature`` 0: greedy (argmax); else softmax(logits / temperature) restricted to the ``top_k`` most likely
    tokens (0: all; tokens tied with the k-th stay), then to the smallest set of most likely tokens whose probability
    reaches ``top_p``, renormalised: transformers' order of its temperature, top-k and top-p warpers. ``seed``: the
    draws' generator."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0: every token), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.seed, int) and 0 <= self.seed < 1 << 63):
            raise ValueError(f"seed must be an integer from 0 to 2**63 - 1, got {self.seed!r}")


def sampling_probs(logits: Float[Tensor, "b v"], s: Sampling) -> Float[Tensor, "b v"]:
    """The distribution a sampled token is drawn from (``s.temperature`` > 0), fp32, each row summing to 1."""
    scaled = logits.float() / s.temperature
    if 0 < s.top_k < scaled.shape[-1]:
        kth = scaled.topk(s.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if s.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
        sorted_p = sorted_p.masked_fill(before >= s.top_p, 0.0)  # the top-ranked token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: Float[Tensor, "b v"], s: Sampling, gen: torch.Generator | None) -> Int[Tensor, " b"]:
    """One token per row from ``logits`` under ``s`` (``gen``: the generator of the draws, one draw per row in row
    order; unused when greedy)."""
    if s.temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, s).cpu(), 1, generator=gen).view(-1).to(logits.device)


def sample_at(logits: Float[Tensor, "b v"], s: Sampling, u: Float[Tensor, " b"]) -> Int[Tensor, " b"]:
    """One token per row by inverse CDF: the first token whose cumulative probability under ``s`` (fp64) passes
    ``u[r]`` times the row's total (``u`` uniform in [0, 1)); a token of probability 0 is never drawn. Greedy
    (temperature 0): the argmax."""
    if s.temperature == 0:
        return logits.argmax(-1)
    probs = sampling_probs(logits, s).double()
    cdf = probs.cumsum(-1)
    at = (u.to(cdf.device, torch.float64) * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, at, right=True).squeeze(-1)
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).long().argmax(-1)  # the last token that can be drawn
    return torch.minimum(idx, last)


@torch.no_grad()
def generate(
    params: ModelParams, config: ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
    sampling: Sampling = Sampling(), stop_ids: Sequence[int] = (), router_bias: Tensor | None = None,
    dtype: torch.dtype | None = None, stop_when: Callable[[int, list[int]], bool] | None = None,
) -> list[list[int]]:
    """The tokens sampled after each prompt (at most ``max_new_tokens``; a row stops after a token of ``stop_ids``,
    or when ``stop_when(row, its tokens so far)`` is true, and keeps that token). The prompts (of any lengths, one
    batch) go through ``prefill``; rows that stopped skip later steps. A prompt and its new tokens must fit the
    model's ``max_position_embeddings``."""
    return generate_scored(params, config, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                           stop_ids=stop_ids, router_bias=router_bias, dtype=dtype, stop_when=stop_when)[0]


@torch.no_grad()
def generate_scored(
    params: ModelParams, config: ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
    sampling: Sampling = Sampling(), stop_ids: Sequence[int] = (), router_bias: Tensor | None = None,
    dtype: torch.dtype | None = None, stop_when: Callable[[int, list[int]], bool] | None = None,
    score: Callable[[Tensor, Tensor], Tensor] | None = None, draw_rows: tuple[int, Sequence[int]] | None = None,
    hooks: DecodeHooks = NO_HOOKS,
) -> tuple[list[list[int]], list[list[float]]]:
    """``generate``, and for each sampled token ``score(logits, tokens)[row]`` taken at sampling time from the
    logits it was drawn from (``score`` None: no scores; the rollouts of ``q38.rollout`` record log-probs).

    ``draw_rows = (total, rows)``: these prompts are rows ``rows`` of a batch of ``total`` rows spread over ranks;
    each step draws ``total`` uniforms from the seed's generator and row ``rows[r]``'s token is the inverse CDF of
    its distribution at its uniform (``sample_at``), so a row's tokens depend on the seed and its index only, however
    the rows are split. ``hooks``: a sharded decode (``DecodeHooks``)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, each of at least one token")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"a prompt of {longest} tokens and {max_new_tokens} new tokens pass the model's "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    first = _first_leaf(params)
    dev = first.device
    dtype = dtype or first.dtype
    gen = torch.Generator().manual_seed(int(sampling.seed))
    logits, cache, _ = prefill(params, config, prompts, dtype=dtype, router_bias=router_bias, hooks=hooks)
    out: list[list[int]] = [[] for _ in prompts]
    scores: list[list[float]] = [[] for _ in prompts]
    running = torch.ones(len(prompts), dtype=torch.bool, device=dev)
    if draw_rows is not None:
        total, mine = draw_rows
        mine = torch.as_tensor(list(mine), dtype=torch.long)
        if len(mine) != len(prompts) or not (0 <= int(mine.min()) and int(mine.max()) < total):
            raise ValueError(f"draw_rows: {len(mine)} row indices below {total} for {len(prompts)} prompts")
    for step in range(max_new_tokens):
        if draw_rows is None:
            nxt = sample(logits, sampling, gen)
        else:
            nxt = sample_at(logits, sampling, torch.rand(total, generator=gen, dtype=torch.float64)[mine])
        sc = score(logits, nxt).tolist() if score is not None else None
        for r, t in enumerate(nxt.tolist()):
            if running[r]:
                out[r].append(t)
                if sc is not None:
                    scores[r].append(sc[r])
                if t in stop_ids or (stop_when is not None and stop_when(r, out[r])):
                    running[r] = False
        if not hooks.any_rows(bool(running.any())) or step + 1 == max_new_tokens:
            break
        logits, cache = decode_step(params, cache, nxt, config, active=running.clone(), router_bias=router_bias,
                                    hooks=hooks)
    return out, scores


# ---- several tokens per row in one pass: prefill, and the verification pass of speculative decoding ----------------


@attrs.frozen
class Extension:
    """What ``extend`` leaves for ``keep_prefix``: the cache before it, after it, its new-token count and each GDN
    layer's per-token states (``GDNSteps``; None for attention layers or a chunked pass)."""

    before: DecodeCache
    after: DecodeCache
    new: int
    steps: list


def extend(
    params: ModelParams, cache: DecodeCache, tokens: Int[Tensor, "b n"], config: ModelConfig, *,
    lengths: Int[Tensor, " b"] | None = None, router_bias: Float[Tensor, "l e"] | None = None,
    stepwise: bool = False, hooks: DecodeHooks = NO_HOOKS,
) -> tuple[Float[Tensor, "b n d"] | None, Extension]:
    """Feed ``n`` tokens per row in one pass over the cache (row ``r``: its first ``lengths[r]`` columns; None: all
    ``n``), each layer running its sequence form from the row's cache (``gdn_extend``, ``attention_extend``, the
    MoE over the ``[b, n]`` tokens). Returns the post-final-norm hidden states of every column (the logits are
    ``hidden @ headᵀ``) and an ``Extension`` whose ``after`` is the cache after each row's tokens.

    ``stepwise``: the GDN layers keep every token's state, so that ``keep_prefix`` can keep a shorter prefix of each
    row (speculative decoding's rollback); otherwise the rule runs its chunked form (prefill). With ``hooks.pipe``
    the rank runs its stage's layers only; ``hidden`` is None where the last layer did not run."""
    b, n = tokens.shape
    dev = tokens.device
    if lengths is None:
        lengths = torch.full((b,), n, dtype=torch.long, device=dev)
    positions = cache.pos[:, None] + torch.arange(n, device=dev)[None]
    active = torch.arange(n, device=dev)[None] < lengths[:, None]
    x = None if params.embed is None else F.embedding(tokens, params.embed)  # [b n d]
    caches, steps = list(cache.layers), [None] * len(cache.layers)
    chosen = [] if hooks.routes is not None else None

    def layer(i: int, x: Tensor) -> Tensor:
        lp, lc, kind = hooks.gather(params.layers[i]), cache.layers[i], config.layer_types[i]
        h = rms_norm(x, lp.attn_norm, config.rms_norm_eps)
        if kind == "linear_attention":
            y, new, steps[i] = gdn_extend(lp.mixer, h, lc, lengths, config, stepwise=stepwise)
        else:
            y, new = attention_extend(lp.mixer, h, lc, positions, active, config)
        caches[i] = new
        x = x + y
        bias = None if router_bias is None else router_bias[i]
        return x + _moe(lp, rms_norm(x, lp.mlp_norm, config.rms_norm_eps), config, bias, hooks, chosen)

    x = _run_layers(hooks, len(config.layer_types), x, (b, n, config.hidden_size), layer)
    if chosen is not None:
        hooks.routes.append(torch.stack(chosen, dim=2))  # [b, n, layers, k]
    hidden = None if x is None else rms_norm(x, params.final_norm, config.rms_norm_eps)
    after = DecodeCache(layers=caches, pos=cache.pos + lengths)
    return hidden, Extension(before=cache, after=after, new=n, steps=steps)


def keep_prefix(ext: Extension, keep: Int[Tensor, " b"], config: ModelConfig) -> DecodeCache:
    """The cache after only each row's first ``keep[r]`` tokens of a stepwise ``extend`` (0: as before it): the GDN
    state and conv window of that token, the attention keys after it dropped (docs/evaluate.md#speculative-decoding)."""
    layers = []
    for lc, st, kind in zip(ext.after.layers, ext.steps, config.layer_types):
        if kind == "linear_attention":
            if st is None:
                raise ValueError("keep_prefix needs an extend(..., stepwise=True) pass (the GDN states of every token)")
            layers.append(gdn_keep(st, keep, config.linear_conv_kernel_dim))
        else:
            layers.append(kv_keep(lc, ext.new, keep))
    return DecodeCache(layers=layers, pos=ext.before.pos + keep)


def right_padded(prompts: Sequence[Sequence[int]], pad_id: int = 0, device=None) -> tuple[Tensor, Tensor]:
    """Prompts as ``[b, max_len]`` tokens, each at the left end of its row, and their lengths ``[b]``."""
    n = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), n), pad_id, dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = torch.tensor(list(p), dtype=torch.long, device=device)
    return tokens, torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)


def prefill(
    params: ModelParams, config: ModelConfig, prompts: Sequence[Sequence[int]], *,
    dtype: torch.dtype | None = None, router_bias: Tensor | None = None, hooks: DecodeHooks = NO_HOOKS,
) -> tuple[Float[Tensor, "b v"], DecodeCache, Float[Tensor, "b n d"] | None]:
    """The prompts (of any lengths, one batch) through the model's sequence form once, from an empty cache
    (``extend``, chunked GDN): returns the next-token logits after each prompt's last token, the decode cache after
    it (what ``feed`` builds one token at a time, within float rounding) and the hidden states of every prompt
    position (row ``r``'s first ``len(prompts[r])`` columns; None on a pipeline stage without the last layer)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prefill needs at least one prompt, each of at least one token")
    first = _first_leaf(params)
    dev = first.device
    tokens, lengths = right_padded(prompts, device=dev)
    cache = empty_cache(config, len(prompts), dtype=dtype or first.dtype, device=dev,
                        layers=None if hooks.pipe is None else hooks.pipe.layers)
    hidden, ext = extend(params, cache, tokens, config, lengths=lengths, router_bias=router_bias, hooks=hooks)
    logits = _head(hooks, hidden, (len(prompts), config.vocab_size),
                   lambda h: F.linear(h[torch.arange(len(prompts), device=dev), lengths - 1], head_weight(params)))
    return logits, ext.after, hidden
