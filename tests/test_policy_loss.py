"""The policy-gradient objective (``q38.train.core.policy``): on packed rows, its loss and every parameter's gradient
equal a naive per-sequence reference written here (each sequence run alone, full logits, the GRPO / DAPO formulas
by hand), with clipping taken on both sides, KL on and off, token and sequence normalisation, chunked and not; fp32,
tolerance ``TOL``. Bad settings are one ``ConfigError`` line."""

import pytest
import torch

from q38.errors import ConfigError
from q38.model import forward, head_weight
from q38.pytree import named_leaves
from q38.train.core.policy import PolicyLossConfig, policy_terms
from q38.train.core.state import init_state
from q38.train.core.step import loss_and_grads, train_step
from q38.train.core.step_config import TrainConfig
from tests.test_donate import CFG as _CFG

TOL = 1e-5
CFG = _CFG.replace(mtp_num_layers=0)  # every dimension unlike the tiny preset's
TEMP = 0.7


def _sequences(seed=0):
    """2 prompts × 3 completions of different lengths: (prompt ids, completion ids, advantage)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p_len, c_lens, advs in ((5, (4, 7, 2), (1.0, -0.5, -0.5)), (3, (6, 3, 5), (-1.2, 0.9, 0.3))):
        prompt = torch.randint(0, CFG.vocab_size, (p_len,), generator=g)
        for c_len, a in zip(c_lens, advs):
            out.append((prompt, torch.randint(0, CFG.vocab_size, (c_len,), generator=g), a))
    return out


def _seq_logprobs(params, prompt, comp):
    """Naive reference: the sequence alone, full logits, log-softmax of logits / TEMP at each completion token."""
    ids = torch.cat([prompt, comp])[None]
    h = forward(params, ids, CFG).hidden[0]
    logp = torch.log_softmax((h @ head_weight(params).T) / TEMP, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(ids[0]) - 1)
    return logp[pos, comp]


def _noise(seqs, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(len(c), generator=g) - 0.5) * 2 * scale for _, c, _ in seqs]


def _pack(seqs, old, ref, row_len=24):
    """Rows of ``row_len``: each sequence (prompt + completion) one document, greedy first fit; -100 on prompts."""
    rows, cur = [], []
    for i, (p, c, _) in enumerate(seqs):
        n = len(p) + len(c)
        if sum(len(seqs[j][0]) + len(seqs[j][1]) for j in cur) + n > row_len:
            rows.append(cur)
            cur = []
        cur.append(i)
    rows.append(cur)
    b = len(rows)
    z = lambda dt: torch.zeros(b, row_len, dtype=dt)  # noqa: E731
    ids, labels, doc = z(torch.long), z(torch.long) - 100, z(torch.long) - 1
    o, a, r = z(torch.float32), z(torch.float32), z(torch.float32)
    for row, members in enumerate(rows):
        at = 0
        for i in members:
            p, c, adv = seqs[i]
            n = len(p) + len(c)
            ids[row, at: at + n] = torch.cat([p, c])
            labels[row, at + len(p): at + n] = c
            doc[row, at: at + n] = i
            o[row, at + len(p): at + n] = old[i]
            r[row, at + len(p): at + n] = ref[i]
            a[row, at: at + n] = adv
            at += n
    return {"input_ids": ids, "labels": labels, "doc_ids": doc, "old_logprobs": o, "advantages": a,
            "ref_logprobs": r}


def _reference(params, seqs, old, ref, pc):
    """The objective by hand, per sequence; returns (objective, flags of tokens clipped high / low)."""
    per_tok, per_seq, n_tok, hi, lo = [], [], 0, 0, 0
    for (p, c, adv), o, rf in zip(seqs, old, ref):
        logp = _seq_logprobs(params, p, c)
        ratio = torch.exp(logp - o)
        surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - pc.clip_low, 1 + pc.clip_high) * adv)
        loss_t = -surr
        if pc.kl_coef:
            d = rf - logp
            loss_t = loss_t + pc.kl_coef * (torch.exp(d) - d - 1)
        hi += int(((ratio > 1 + pc.clip_high) & (adv > 0)).sum())
        lo += int(((ratio < 1 - pc.clip_low) & (adv < 0)).sum())
        per_tok.append(loss_t.sum())
        per_seq.append(loss_t.mean())
        n_tok += len(c)
    if pc.norm == "token":
        return torch.stack(per_tok).sum() / n_tok, hi, lo
    return torch.stack(per_seq).mean(), hi, lo


@pytest.mark.parametrize("norm,kl,chunk,per_row", [("token", 0.0, None, False), ("sequence", 0.0, 5, True),
                                                   ("token", 0.3, 7, True), ("sequence", 0.3, None, False)])
def test_policy_loss_and_grads_equal_a_per_sequence_reference(norm, kl, chunk, per_row):
    """``per_row``: one micro-batch per row (the global counts span micro-batches)."""
    state = init_state(CFG, TrainConfig(), seed=2)
    pc = PolicyLossConfig(clip_low=0.2, clip_high=0.28, norm=norm, kl_coef=kl, temperature=TEMP)
    seqs = _sequences(1)
    with torch.no_grad():
        true = [_seq_logprobs(state.params, p, c) for p, c, _ in seqs]
    old = [t + n for t, n in zip(true, _noise(seqs, 0.5, 3))]  # ratios in ~[0.6, 1.65]: both clip sides taken
    ref = [t + n for t, n in zip(true, _noise(seqs, 0.4, 4))]
    batch = _pack(seqs, old, ref)
    rows = batch["input_ids"].shape[0]
    assert rows >= 2 and int(batch["doc_ids"][0].max()) > int(batch["doc_ids"][0].min())  # packed, several rows
    tc = TrainConfig(loss_chunk_size=chunk, lr=1e-3, warmup_steps=1, micro_batches=rows if per_row else 1)
    state = init_state(CFG, tc, seed=2)

    r = loss_and_grads(state, batch, terms=policy_terms(CFG, tc, pc, aux=False))

    names = [n for n, _ in named_leaves(state.params)]
    leaves = [t.detach().clone().requires_grad_(True) for _, t in named_leaves(state.params)]
    params = torch.utils._pytree.tree_unflatten(leaves, torch.utils._pytree.tree_structure(state.params))
    want, hi, lo = _reference(params, seqs, old, ref, pc)
    assert hi > 0 and lo > 0  # clipping exercised on both sides
    want_g = torch.autograd.grad(want, leaves, allow_unused=True)
    assert abs(float(r.objective) - float(want.detach())) <= TOL
    n_tok = sum(len(c) for _, c, _ in seqs)
    assert float(r.terms["clip_frac"]) == pytest.approx((hi + lo) / n_tok, abs=1e-6)
    assert float(r.terms["logprob_diff"]) == pytest.approx(
        float(torch.cat([n.abs() for n in _noise(seqs, 0.5, 3)]).mean()), abs=1e-5)
    # the largest |trainer − rollout log-prob| of the step, against the naive per-sequence log-probs (a max over
    # micro-batches when per_row): not the sum or the mean of the per-micro-batch maxima
    with torch.no_grad():
        naive_max = max(float((_seq_logprobs(state.params, p, c) - o).abs().max())
                        for (p, c, _), o in zip(seqs, old))
    assert float(r.terms["mismatch_max"]) == pytest.approx(naive_max, abs=1e-5)
    assert naive_max > 1.5 * float(r.terms["logprob_diff"])  # a max, not the mean: the test can tell them apart
    if not kl:
        assert float(r.terms["kl"]) > 0  # reported even when not in the objective (the batch has ref_logprobs)
    checked = 0
    for name, got, exp in zip(names, r.grads, want_g):
        exp = torch.zeros_like(got) if exp is None else exp
        err = float((got.float() - exp).abs().max())
        assert err <= TOL, f"{name}: max |grad - reference| = {err:.2e}"
        checked += bool(exp.abs().max() > 0)
    assert checked >= len(names) - 2  # every leaf but possibly unrouted-free ones gets a nonzero gradient


def test_one_policy_step_runs_and_reports_its_metrics():
    tc = TrainConfig(lr=1e-3, warmup_steps=1)
    state = init_state(CFG, tc, seed=2)
    seqs = _sequences(2)
    with torch.no_grad():
        true = [_seq_logprobs(state.params, p, c) for p, c, _ in seqs]
    batch = _pack(seqs, true, true)
    new, m = train_step(state, batch, terms=policy_terms(CFG, tc, PolicyLossConfig(temperature=TEMP)))
    d = m.as_dict()
    assert d["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and d["logprob_diff"] <= 1e-5 and d["clip_frac"] == 0
    assert d["kl"] == pytest.approx(0.0, abs=1e-6) and d["entropy"] > 0 and int(new.step) == 1


def test_a_term_reduced_by_max_is_reported_only():
    from q38.train.core.objective import Term

    with pytest.raises(ValueError, match="weight 0"):
        Term("m", 0.5, lambda ti: ti, reduce="max")
    with pytest.raises(ValueError, match="reduce must be one of"):
        Term("m", 0.0, lambda ti: ti, reduce="mean")


def test_bad_policy_settings_and_batches_are_one_line():
    for kw, words in (({"norm": "seq"}, "rl.norm"), ({"clip_low": 1.0}, "rl.clip_low"),
                      ({"temperature": 0}, "rl.temperature"), ({"kl_coef": -1}, "rl.kl_coef")):
        with pytest.raises(ConfigError, match=words) as e:
            PolicyLossConfig(**kw)
        assert "\n" not in str(e.value)
    tc = TrainConfig()
    state = init_state(CFG, tc, seed=0)
    seqs = _sequences(0)
    batch = _pack(seqs, [torch.zeros(len(c)) for _, c, _ in seqs], [torch.zeros(len(c)) for _, c, _ in seqs])
    with pytest.raises(ConfigError, match="ref_logprobs"):
        loss_and_grads(state, {k: v for k, v in batch.items() if k != "ref_logprobs"},
                       terms=policy_terms(CFG, tc, PolicyLossConfig(kl_coef=0.1)))
    with pytest.raises(ConfigError, match="old_logprobs and advantages"):
        loss_and_grads(state, {k: batch[k] for k in ("input_ids", "labels", "doc_ids")},
                       terms=policy_terms(CFG, tc, PolicyLossConfig()))
