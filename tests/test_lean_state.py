"""Lean optimizer state (``train.moment_dtype``, docs/optimizer.md): bf16 AdamW moments are the fp32 update rounded to
bf16 after every step (against a hand-written AdamW), the donated step gives the pure step's bits, a checkpoint of
the state resumes bit for bit; the options not implemented are refused with one line."""

import pytest
import torch

from q38.model_config import ConfigError
from q38.pytree import named_leaves, tree_map
from q38.train.core.optim import adamw_step, adamw_step_
from q38.train.core.state import init_state
from q38.train.core.step import train_step
from q38.train.core.step_config import TrainConfig
from tests.test_donate import CFG, TC, _b, _same_state

BF16 = TC.replace(moment_dtype="bfloat16")

def _naive(p, g, m, v, t, lr, b1, b2, eps, wd):
    """AdamW (Loshchilov & Hutter, decoupled decay) in float64, element by element; moments rounded to bf16."""
    p, g, m, v = (x.double() for x in (p, g, m, v))
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    upd = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    return p - lr * upd, m.to(torch.bfloat16), v.to(torch.bfloat16)

@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "donated"])
def test_bf16_moments_are_the_fp32_update_rounded(inplace):
    g0 = torch.Generator().manual_seed(0)
    shapes = [(37, 5), (129,), (3, 7, 11)]
    p = [torch.randn(s, generator=g0) for s in shapes]
    m = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
    v = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
    ref = [(x.clone(), a.clone(), b.clone()) for x, a, b in zip(p, m, v)]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for t in range(1, 4):
        grads = [torch.randn(s, generator=g0) for s in shapes]
        ref = [_naive(rp, g, rm, rv, t, kw["lr"], kw["beta1"], kw["beta2"], kw["eps"], kw["weight_decay"])
               for (rp, rm, rv), g in zip(ref, grads)]
        if inplace:
            adamw_step_(p, list(grads), m, v, [True] * 3, step=t, **kw)
        else:
            p, m, v = adamw_step(p, grads, m, v, [True] * 3, step=t, **kw)
        ref = [(rp.float(), rm, rv) for rp, rm, rv in ref]
    for x, a, b, (rp, rm, rv) in zip(p, m, v, ref):
        assert a.dtype == b.dtype == torch.bfloat16
        # moments: at most one bf16 step apart (the kernel's fp32 arithmetic vs float64 may round across a tie)
        for got, want in ((a, rm), (b, rv)):
            ulp = want.float().abs() * 2 ** -7 + 1e-30
            assert ((got.float() - want.float()).abs() <= ulp).all()
        assert (x - rp).abs().max() <= 1e-5

def test_bf16_moments_donated_equals_pure_and_resume_is_exact(tmp_path):
    from q38.train.io.checkpoint import empty_params, load_checkpoint, save_checkpoint
    from q38.train.core.state import state_from_params

    state = init_state(CFG, BF16, seed=2)
    assert all(t.dtype == torch.bfloat16 for _, t in named_leaves(state.exp_avg_sq))
    pure = state
    for i in range(2):
        pure, _ = train_step(pure, _b(i))
    don = tree_map(lambda t: t.clone(), state)
    for i in range(2):
        don, _ = train_step(don, _b(i), donate=True)
    assert _same_state(pure, don) == []
    save_checkpoint(tmp_path, don, {"step": 2, "model_config": CFG.to_dict(), "train_config": BF16.to_dict()})
    template = state_from_params(empty_params(CFG), CFG, BF16)
    back, _ = load_checkpoint(tmp_path / "step_000002", template)
    assert _same_state(back, don) == [] and all(t.dtype == torch.bfloat16 for _, t in named_leaves(back.exp_avg))
    a, _ = train_step(back, _b(2), donate=True)
    b, _ = train_step(don, _b(2), donate=True)
    assert _same_state(a, b) == []

@pytest.mark.parametrize("key,value", [("moment_dtype", "int8"), ("master_dtype", "bfloat16_remainder"),
                                       ("offload_optimizer", True)])
def test_unfinished_lean_options_are_refused(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}: {value} is not implemented yet"):
        TrainConfig(**{key: value})
    assert TrainConfig(moment_dtype="bfloat16").moment_dtype == "bfloat16"
