"""The policy-gradient objective (GRPO / DAPO / PPO-clip) as named terms beside the LM objective (docs/rl.md).

A policy-gradient batch is a packed LM batch (prompt tokens labelled -100, each completion labelled with its own
tokens) that also carries, per token, the rollout's log-probs (``old_logprobs``), the advantages of the token's
sequence (``advantages``) and optionally a reference policy's log-probs (``ref_logprobs``); ``q38.batch`` moves
them to target positions. For each valid target ``t`` of sequence ``i``, with ``logp_t`` the current policy's
log-prob of the sampled token (logits divided by the sampling temperature):

    r_t  = exp(logp_t − old_t)
    l_t  = −min(r_t · A_i, clip(r_t, 1 − clip_low, 1 + clip_high) · A_i)
    k3_t = exp(ref_t − logp_t) − (ref_t − logp_t) − 1                      (Schulman's k3 estimator of KL(π‖π_ref))

``token`` normalisation (DAPO): ``loss = Σ_t l_t / N``, ``N`` the valid targets of the whole step; ``sequence``
normalisation (GRPO): ``loss = Σ_i (1/|o_i|) Σ_{t∈i} l_t / S``, ``S`` the sequences of the whole step. ``kl`` is
normalised the same way and weighted by ``kl_coef``. Both counts are global (all micro-batches and ranks), so
partials are only summed, as for the LM terms (docs/objective.md#terms).

Metrics, as zero-weight terms over the valid targets of the step: ``clip_frac`` (tokens whose clipped branch is
taken), ``ratio_mean``, ``entropy`` (of the tempered distribution, from the logits the log-prob needs anyway),
``logprob_diff`` (mean |logp − old|: the train–rollout mismatch on the first update of a rollout batch) and
``mismatch_max`` (max |logp − old| over the step's valid targets: a ``max`` term, reduced by max over micro-batches
and every rank, so FSDP, EP and CP give the one-process value).

The per-token log-probs run chunked over tokens (``train.loss_chunk_size`` or the dynamic budget), each chunk
recomputed in backward (activation checkpointing): never a ``[tokens, vocab]`` tensor beyond one chunk.
"""

import attrs
import torch
import torch.utils.checkpoint as ckpt
from jaxtyping import Float, Int
from torch import Tensor

from q38.batch import IGNORE_INDEX
from q38.errors import ConfigError
from q38.train.core.loss import dynamic_chunk_size
from q38.train.core.objective import Term, TermInput, aux_coef, aux_term

NORMS = ("token", "sequence")


@attrs.frozen(kw_only=True)
class PolicyLossConfig:
    """``clip_low`` / ``clip_high``: the ratio's clip range ``[1 − clip_low, 1 + clip_high]`` (DAPO's asymmetric
    clipping: e.g. 0.2 / 0.28); ``norm``: ``token`` (DAPO) or ``sequence`` (GRPO); ``kl_coef``: weight of the k3 KL
    term to ``ref_logprobs`` (0: no KL in the objective; it is still reported when the batch has them);
    ``temperature``: the sampling temperature (the policy is softmax(logits / temperature), as recorded at
    sampling)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    norm: str = "token"
    kl_coef: float = 0.0
    temperature: float = 1.0

    def __attrs_post_init__(self) -> None:
        for name in ("clip_low", "clip_high", "kl_coef"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")):
                raise ConfigError(f"rl.{name} must be a finite number >= 0, got {v!r}")
        if self.clip_low >= 1:
            raise ConfigError(f"rl.clip_low must be below 1 (the ratio's lower bound is 1 - clip_low), got "
                              f"{self.clip_low}")
        if self.norm not in NORMS:
            raise ConfigError(f"rl.norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        t = self.temperature
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf")):
            raise ConfigError(f"rl.temperature must be a number > 0 (the rollout's sampling temperature), got {t!r}")


def _chunk_logprobs(h_cd: Tensor, w_vd: Tensor, t_c: Tensor, inv_temp: float) -> tuple[Tensor, Tensor]:
    mm = torch.promote_types(h_cd.dtype, w_vd.dtype)
    logits_cv = (h_cd.to(mm) @ w_vd.to(mm).T).float() * inv_temp
    lse_c = torch.logsumexp(logits_cv, dim=-1)
    logp_c = logits_cv.gather(1, t_c[:, None]).squeeze(1) - lse_c
    with torch.no_grad():
        ent_c = lse_c - (torch.softmax(logits_cv, dim=-1) * logits_cv).sum(-1)
    return logp_c, ent_c


def token_logprobs(
    hidden: Float[Tensor, "n d"], w_head: Float[Tensor, "v d"], targets: Int[Tensor, " n"], *,
    temperature: float = 1.0, chunk: int | None = None,
) -> tuple[Float[Tensor, " n"], Float[Tensor, " n"]]:
    """``(log softmax(hidden @ w_headᵀ / temperature)[target], entropy)`` per row, fp32; differentiable in the
    log-prob (the entropy is a metric, no gradient). ``chunk``: rows per chunk, each recomputed in backward (None:
    one pass)."""
    n = hidden.shape[0]
    inv = 1.0 / temperature
    if chunk is None or chunk >= n:
        return _chunk_logprobs(hidden, w_head, targets, inv)
    parts = [ckpt.checkpoint(_chunk_logprobs, hidden[i: i + chunk], w_head, targets[i: i + chunk], inv,
                             use_reentrant=False) for i in range(0, n, chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _chunk_rows(n: int, v: int, tc) -> int | None:
    if tc.dynamic_chunk_loss:
        return dynamic_chunk_size(n, v, tc.loss_chunk_budget_bytes)
    return tc.loss_chunk_size


def _parts(ti: TermInput, pc: PolicyLossConfig) -> dict:
    """This micro-batch's per-term partials (each already divided by its global count)."""
    extra = ti.mb.extra
    if extra is None or "old_logprobs" not in extra or "advantages" not in extra:
        raise ConfigError("a policy-gradient step needs a batch with old_logprobs and advantages per token (beside "
                          "input_ids and labels); build it with q38.train.run.rl.pack_rollouts")
    d = ti.out.hidden.shape[-1]
    t_n = ti.mb.targets.reshape(-1)
    valid = torch.nonzero(t_n != IGNORE_INDEX).flatten()
    h_nd = ti.out.hidden.reshape(-1, d).index_select(0, valid)
    t_n = t_n.index_select(0, valid)
    pick = lambda name: extra[name].reshape(-1).index_select(0, valid)  # noqa: E731
    logp, ent = token_logprobs(h_nd, ti.w_head, t_n, temperature=pc.temperature,
                               chunk=_chunk_rows(h_nd.shape[0], ti.w_head.shape[0], ti.train_config))
    old, adv = pick("old_logprobs"), pick("advantages")
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - pc.clip_low, 1 + pc.clip_high)
    tok_loss = -torch.minimum(ratio * adv, clipped * adv)
    n_tok = ti.step.n_main.clamp(min=1)
    if pc.norm == "token":
        w, n = torch.ones_like(logp), n_tok
    else:
        w, n = pick("seq_weight"), ti.step.n_seq.clamp(min=1)
    out = {"loss": (w * tok_loss).sum() / n}
    if "ref_logprobs" in extra:
        delta = pick("ref_logprobs") - logp
        out["kl"] = (w * (torch.exp(delta) - delta - 1)).sum() / n
    elif pc.kl_coef > 0:
        raise ConfigError(f"rl.kl_coef is {pc.kl_coef} but the batch has no ref_logprobs; give the reference "
                          "policy's log-probs per token, or set kl_coef: 0")
    else:
        out["kl"] = logp.sum() * 0
    with torch.no_grad():
        was_clipped = ((adv > 0) & (ratio > 1 + pc.clip_high)) | ((adv < 0) & (ratio < 1 - pc.clip_low))
        out["clip_frac"] = was_clipped.float().sum() / n_tok
        out["ratio_mean"] = ratio.sum() / n_tok
        out["entropy"] = ent.sum() / n_tok
        diff = (logp - old).abs()
        out["logprob_diff"] = diff.sum() / n_tok
        out["mismatch_max"] = diff.max() if diff.numel() else diff.new_zeros(())
    return out


def policy_terms(mc, tc, pc: PolicyLossConfig, *, aux: bool = True) -> tuple[Term, ...]:
    """The policy-gradient objective's terms: ``loss`` (the clipped surrogate, weight 1), ``kl`` (``kl_coef``),
    the metrics ``clip_frac``, ``ratio_mean``, ``entropy``, ``logprob_diff`` (weight 0: reported only),
    ``mismatch_max`` (reduced by max over micro-batches and ranks, not summed) and, with
    ``aux``, the load-balancing ``aux`` term of the LM objective. Pass them as ``train_step(..., terms=...)``."""
    memo: list = [None, None]  # (the TermInput, its partials): every term of one micro-batch shares one pass
    last = "mismatch_max"  # the last of them the step asks for: the memo (holding activations) is dropped then

    def get(name: str):
        def fn(ti: TermInput) -> Tensor:
            if memo[0] is not ti:
                memo[0], memo[1] = ti, _parts(ti, pc)
            value = memo[1][name]
            if name == last:
                memo[0] = memo[1] = None
            return value

        return fn

    terms = [Term("loss", 1.0, get("loss")), Term("kl", pc.kl_coef, get("kl"))]
    terms += [Term(m, 0.0, get(m)) for m in ("clip_frac", "ratio_mean", "entropy", "logprob_diff")]
    terms.append(Term("mismatch_max", 0.0, get("mismatch_max"), reduce="max"))
    if aux:
        terms.append(Term("aux", aux_coef(mc, tc), aux_term))
    return tuple(terms)
