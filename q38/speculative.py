"""Speculative decoding with the MTP heads as drafts (docs/evaluate.md#speculative-decoding).

Each round, for every row whose main cache holds positions ``0..P-1`` and whose next token ``x_P`` is chosen:

1. **Draft** ``k`` tokens: depth ``d`` (1..k) at position ``P - 1`` takes the previous depth's hidden state there
   (depth 1: the main model's) and the embedding of token ``P - 1 + d`` (``x_P``, then the drafts of depths
   ``1..d-1``), exactly the chain training runs (``q38.model.forward``), and its greedy token is draft ``d``, a
   guess of ``x_{P+d}``. Each depth's MTP layer attends over its own stream of earlier positions, kept in a
   ``KVCache`` per depth; its entries are written with true tokens only (a position's entry is kept once the
   tokens it reads are committed; the last ``k - 1`` positions are recomputed next round). Depth ``d`` runs MTP
   layer ``(d - 1) mod`` (layers stored): a model with fewer heads than ``k`` reuses its heads, as the serving
   engines do.
2. **Verify** with the main model in one pass over ``[x_P, draft_1 .. draft_k]`` (``q38.decode.extend``,
   stepwise): its greedy token after each prefix. The accepted drafts are the longest prefix equal to the main
   model's greedy tokens; the main model's token after them (the bonus) is committed too: ``a + 1`` tokens per pass.
3. **Roll back**: the main cache keeps the ``a + 1`` fed tokens (``keep_prefix``: the GDN state and conv window
   of that token, the attention keys after it dropped).

Greedy (temperature 0): the committed tokens are the main model's greedy tokens whatever the drafts, so the output
equals plain greedy decoding token for token. Sampled (temperature > 0, with top-k / top-p): each draft is drawn
from the head's distribution ``q`` (the same warpers), and the standard speculative-sampling rule decides: draft
``x`` at a step whose main-model distribution is ``p`` is accepted with probability ``min(1, p(x) / q(x))``; the first
rejected one is replaced by a draw from ``max(0, p - q)`` renormalised, and when all ``k`` are accepted the bonus is
drawn from the main model's distribution after them. The committed tokens are then distributed exactly as plain
sampling's (not the same draws: the generator is consumed in another order).
"""

from typing import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from q38.decode import Sampling, extend, keep_prefix, prefill, sampling_probs
from q38.layers.decode import KVCache, attention_extend, empty_kv_cache, kv_keep
from q38.layers.moe import moe_apply
from q38.layers.norm import rms_norm
from q38.model import ModelParams, head_weight
from q38.model_config import ModelConfig

MAX_DRAFTS = 16  # k: the verification pass keeps one GDN state per fed token and layer (k + 1 of them)


@attrs.frozen
class SpecStats:
    """What a speculative run counted: ``rounds[i] = (row, P - 1, accepted)`` per row and round (the drafts' position,
    the number of leading drafts accepted out of ``k``), and the main-model passes (prefill excluded)."""

    k: int
    rounds: list
    passes: int

    def row(self, r: int) -> dict:
        """Row ``r``'s ``passes`` (verification passes it took part in) and the ``tokens`` they committed."""
        mine = [a for row, _, a in self.rounds if row == r]
        return {"k": self.k, "passes": len(mine), "tokens": len(mine) + sum(mine)}

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification pass and row: ``1 + mean accepted drafts``."""
        return 1.0 + sum(a for _, _, a in self.rounds) / max(len(self.rounds), 1)


def check_speculative(config: ModelConfig, k: object) -> int:
    """``k`` as a draft count for ``config``, or a ``ValueError`` naming the problem and the fix."""
    if config.mtp_num_layers < 1:
        raise ValueError("speculative decoding drafts with the MTP heads, and this checkpoint has none "
                         "(mtp_num_layers 0); decode without --speculative, or train with model.mtp_num_layers >= 1")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFTS:
        raise ValueError(f"--speculative K must be an integer in [1, {MAX_DRAFTS}] (drafts per verification pass; "
                         f"the pass keeps one GDN state per draft for the rollback), got {k!r}")
    return k


def draft_layer(config: ModelConfig, depth: int) -> int:
    """The MTP layer that drafts at ``depth`` (1-based): the trained one for ``depth <= mtp_num_layers``, then the
    stored layers again in turn (``(depth - 1) mod`` stored; one shared layer: always 0)."""
    return (depth - 1) % config.mtp_layers_stored


def _bias_row(config: ModelConfig, router_bias: Tensor | None, depth: int) -> Tensor | None:
    """The router bias row of the MoE call at ``depth``: main layers first, then one row per trained depth (a depth
    beyond them takes the row of the trained depth whose layer it reuses)."""
    if router_bias is None:
        return None
    trained = (depth - 1) % config.mtp_num_layers + 1
    return router_bias[config.num_hidden_layers + trained - 1]


def mtp_extend(
    params: ModelParams, config: ModelConfig, depth: int, cache: KVCache, h_prev: Float[Tensor, "b m d"],
    tokens: Int[Tensor, "b m"], positions: Int[Tensor, "b m"], active: Bool[Tensor, "b m"],
    router_bias: Tensor | None = None,
) -> tuple[Float[Tensor, "b m d"], KVCache]:
    """MTP depth ``depth`` over ``m`` positions per row (``q38.model.forward``'s MTP block, continuing the depth's
    cache): ``h_prev`` the previous depth's (or the main model's) post-norm hidden states there, ``tokens`` the
    tokens at ``position + depth``; returns the depth's post-``mtp.norm`` states and its cache with the positions
    appended (real where ``active``)."""
    mp, eps = params.mtp, config.rms_norm_eps
    lp = mp.layers[draft_layer(config, depth)]
    e = F.embedding(tokens, params.embed)
    x = F.linear(torch.cat([rms_norm(e, mp.norm_emb, eps), rms_norm(h_prev, mp.norm_hidden, eps)], -1), mp.fc)
    y, cache = attention_extend(lp.mixer, rms_norm(x, lp.attn_norm, eps), cache, positions, active, config)
    x = x + y
    y, _ = moe_apply(lp.moe, rms_norm(x, lp.mlp_norm, eps), config, None, _bias_row(config, router_bias, depth))
    return rms_norm(x + y, mp.norm, eps), cache


def _append(buf: Tensor, new: Tensor, count: Int[Tensor, " b"]) -> Tensor:
    """Right-aligned per-row buffers: row ``r`` of ``buf`` followed by its first ``count[r]`` columns of ``new``,
    keeping the last ``buf.shape[1]`` columns."""
    cat = torch.cat([buf, new], 1)
    idx = count[:, None] + torch.arange(buf.shape[1], device=buf.device)[None]
    return torch.gather(cat, 1, idx.view(*idx.shape, *([1] * (cat.dim() - 2))).expand(-1, -1, *cat.shape[2:]))


def _argmax(hidden: Tensor, w_head: Tensor) -> Tensor:
    return F.linear(hidden, w_head).argmax(-1)


class _Draws:
    """Tokens from logits under ``sampling``: the argmax when greedy, else one draw per row (in row order) from
    ``sampling_probs`` with ``gen``; ``draw`` also returns the distribution (None when greedy)."""

    def __init__(self, sampling: Sampling) -> None:
        self.s = sampling
        self.greedy = sampling.temperature == 0
        self.gen = torch.Generator().manual_seed(int(sampling.seed))

    def draw(self, logits: Float[Tensor, "b v"]) -> tuple[Tensor, Tensor | None]:
        if self.greedy:
            return logits.argmax(-1), None
        p = sampling_probs(logits, self.s)
        return self.pick(p), p

    def pick(self, p: Float[Tensor, "b v"]) -> Int[Tensor, " b"]:
        return torch.multinomial(p.cpu(), 1, generator=self.gen).view(-1).to(p.device)

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.gen))


def _accept_sampled(draws: _Draws, fed: Tensor, q: list, logits: Tensor, running: Tensor) -> tuple[Tensor, Tensor]:
    """The speculative-sampling rule over one verification pass: ``fed[:, 1:]`` are the drafts, ``q[d]`` their
    distributions, ``logits[:, j]`` the main model's after ``j + 1`` fed tokens. Returns the accepted draft counts and
    the token committed after them (a residual draw where a draft was rejected, the bonus draw where none was)."""
    b, k = fed.shape[0], fed.shape[1] - 1
    p = torch.stack([sampling_probs(logits[:, j], draws.s) for j in range(k + 1)], 1)  # [b k+1 v]
    accepted = torch.zeros(b, dtype=torch.long, device=fed.device)
    nxt = torch.zeros(b, dtype=torch.long, device=fed.device)
    for r in running.nonzero().flatten().tolist():
        a = 0
        while a < k:
            x = int(fed[r, a + 1])
            px, qx = float(p[r, a, x]), float(q[a][r, x])
            if draws.uniform() < min(1.0, px / qx):  # qx > 0: x was drawn from q
                a += 1
                continue
            residual = (p[r, a] - q[a][r]).clamp(min=0)
            total = float(residual.sum())
            nxt[r] = draws.pick((residual / total if total > 0 else p[r, a])[None])[0]
            break
        else:
            nxt[r] = draws.pick(p[r, k][None])[0]
        accepted[r] = a
    return accepted, nxt


@torch.no_grad()
def speculative_generate(
    params: ModelParams, config: ModelConfig, prompts: Sequence[Sequence[int]], *, k: int, max_new_tokens: int,
    stop_ids: Sequence[int] = (), router_bias: Tensor | None = None, dtype: torch.dtype | None = None,
    stop_when: Callable[[int, list[int]], bool] | None = None, sampling: Sampling = Sampling(),
) -> tuple[list[list[int]], SpecStats]:
    """Decoding with ``k`` MTP drafts per main-model pass (module docstring): the tokens after each prompt (as
    ``q38.decode.generate``: at most ``max_new_tokens``, a row stops after a token of ``stop_ids`` or when
    ``stop_when(row, its tokens so far)`` is true) and the acceptance it counted. ``sampling``: greedy (the default;
    equal to plain greedy decoding) or sampled by the speculative-sampling rule (distributed as plain sampling)."""
    k = check_speculative(config, k)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, each of at least one token")
    dev = params.embed.device
    dtype = dtype or params.embed.dtype
    w_head = head_weight(params)
    b = len(prompts)
    logits, cache, hidden = prefill(params, config, prompts, dtype=dtype, router_bias=router_bias)
    lengths = cache.pos.clone()  # P: main positions fed
    draws = _Draws(sampling)
    nxt, _ = draws.draw(logits)  # x_P
    keep_cols = 2 * k + 2  # buffer columns a round reads: at most 2k positions back, plus the drafts
    # right-aligned buffers: tokens up to x_P, main hidden states up to position P - 1
    width = max(hidden.shape[1], keep_cols)
    toks = _append(torch.zeros(b, width, dtype=torch.long, device=dev),
                   torch.nn.utils.rnn.pad_sequence([torch.tensor(list(p), device=dev) for p in prompts], True),
                   lengths)
    toks = torch.cat([toks, nxt[:, None]], 1)
    h0 = _append(hidden.new_zeros(b, width, hidden.shape[2]), hidden, lengths)
    mtp = [empty_kv_cache(config, b, dtype, dev) for _ in range(k)]
    done = torch.zeros(b, dtype=torch.long, device=dev)  # MTP positions written with true tokens (all depths)
    out: list[list[int]] = [[] for _ in prompts]
    running = torch.ones(b, dtype=torch.bool, device=dev)
    rounds, passes = [], 0

    def emit(r: int, t: int) -> None:
        out[r].append(t)
        if t in stop_ids or len(out[r]) >= max_new_tokens or (stop_when is not None and stop_when(r, out[r])):
            running[r] = False

    if max_new_tokens < 1:
        return out, SpecStats(k=k, rounds=rounds, passes=passes)
    for r, t in enumerate(nxt.tolist()):
        emit(r, t)
    while bool(running.any()):
        # 1. draft: every depth over the positions [done, P - 1], right-aligned in m columns
        m = int((lengths - done)[running].max())
        positions = lengths[:, None] - m + torch.arange(m, device=dev)[None]
        active = (positions >= done[:, None]) & running[:, None]
        h, drafts, q = h0[:, -m:], [], []
        for d in range(1, k + 1):
            tok_d = torch.cat([toks, *[x[:, None] for x in drafts]], 1)[:, -m:]  # the token at position + d
            h, c = mtp_extend(params, config, d, mtp[d - 1], h, tok_d, positions.clamp(min=0), active, router_bias)
            draft, q_d = draws.draw(F.linear(h[:, -1], w_head))
            drafts.append(draft)
            q.append(q_d)
            # positions <= P - k read true tokens at every depth: kept; the last k - 1 are recomputed next round
            mtp[d - 1] = kv_keep(c, m, torch.full((b,), max(0, m - k + 1), device=dev))
        done = torch.where(running, torch.maximum(done, lengths - k + 1), done)
        # 2. verify: the main model over [x_P, draft_1..k] in one pass
        fed = torch.stack([nxt, *drafts], 1)  # [b k+1]
        hid, ext = extend(params, cache, fed, config, lengths=running.long() * (k + 1), router_bias=router_bias,
                          stepwise=True)
        passes += 1
        if draws.greedy:
            greedy = _argmax(hid, w_head)  # [b k+1]: the main model's token after each prefix
            match = (fed[:, 1:] == greedy[:, :-1]).long()
            accepted = match.cumprod(1).sum(1)  # leading drafts equal to the main model's greedy tokens
            after = greedy[torch.arange(b, device=dev), accepted]
        else:
            accepted, after = _accept_sampled(draws, fed, q, F.linear(hid, w_head), running)
        keep = torch.where(running, accepted + 1, 0)
        # 3. roll the main cache back to the kept tokens; commit drafts[:a] and the token after them
        cache = keep_prefix(ext, keep, config)
        new = torch.cat([fed[:, 1:], after[:, None]], 1).clone()
        new[torch.arange(b, device=dev), accepted] = after
        for r in running.nonzero().flatten().tolist():
            a = int(accepted[r])
            rounds.append((r, int(lengths[r]) - 1, a))
            for t in new[r, :a + 1].tolist():
                if running[r]:
                    emit(r, t)
        toks = _append(toks, new, keep)[:, -keep_cols:]
        h0 = _append(h0, hid, keep)[:, -keep_cols:]
        lengths = lengths + keep
        nxt = new[torch.arange(b, device=dev), accepted]
    return out, SpecStats(k=k, rounds=rounds, passes=passes)
