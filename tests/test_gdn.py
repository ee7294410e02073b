"""The custom backward of the chunked gated delta rule (``_ChunkGatedDeltaRule``, docs/gdn_backward.md) against
two independent references: autograd through today's chunked implementation (``backward="autograd"``) and
autograd through the token-by-token recurrence. fp32 throughout.

Tolerance: max |Δ| ≤ ``TOL · max(1, max |reference|)`` per tensor with ``TOL = 1e-5`` (measured ≤ 1.9e-7 against the
autograd chunked path and ≤ 2.5e-7 against the recurrence, on values up to ~2.5).
"""

import pytest
import torch
import torch.nn.functional as F

from q38.layers.gdn import gated_delta_rule_chunked, gated_delta_rule_recurrent

TOL = 1e-5


def _close(x, ref, tol=TOL):
    return (x - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def _inputs(gen, b=2, s=150, h=3, a=8, p=6, a_log_max=None):
    q = torch.randn(b, s, h, a, generator=gen)
    k = torch.randn(b, s, h, a, generator=gen)
    v = torch.randn(b, s, h, p, generator=gen)
    if a_log_max is None:
        g = -F.softplus(torch.randn(b, s, h, generator=gen))
    else:
        # The model's decay: g = −exp(A_log)·softplus(a + dt_bias), A_log spread up to log 16 over heads, dt_bias 1
        # (|γ| summed over a 64-token chunk reaches ~10³ on the fastest head).
        a_log = torch.linspace(0.0, a_log_max, h)
        g = -a_log.exp() * F.softplus(torch.randn(b, s, h, generator=gen) + 1.0)
    beta = torch.rand(b, s, h, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _run(fn, ins, doc, s0, **kw):
    """Outputs, final state, and the gradients of a loss that weights both (so dS_final ≠ 0) w.r.t. every input."""
    o, S = fn(*ins, doc, s0, **kw)
    wo = torch.sin(torch.arange(o.numel(), dtype=o.dtype)).view_as(o)
    ws = torch.cos(torch.arange(S.numel(), dtype=S.dtype)).view_as(S)
    wrt = ins + ([s0] if s0 is not None and s0.requires_grad else [])
    grads = torch.autograd.grad((o * wo).sum() + (S * ws).sum(), wrt)
    return (o, S, *grads)


NAMES = ("o", "S_final", "dq", "dk", "dv", "dg", "dbeta", "dS0")
DOCS = [[0] * 20 + [1] * 90 + [2] * 40, [0] * 64 + [1] * 64 + [2] * 22]  # a boundary exactly on a chunk border


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("a_log_max", [None, 2.7726], ids=["mild", "alog16"])
@pytest.mark.parametrize("masked", [False, True], ids=["one_doc", "packed"])
def test_custom_backward_matches_autograd(gen, chunk, a_log_max, masked):
    ins = _inputs(gen, a_log_max=a_log_max)
    doc = torch.tensor(DOCS) if masked else None
    s0 = torch.randn(2, 3, 8, 6, generator=gen).requires_grad_()
    custom = _run(gated_delta_rule_chunked, ins, doc, s0, chunk_size=chunk)
    ref = _run(gated_delta_rule_chunked, ins, doc, s0, chunk_size=chunk, backward="autograd")
    for name, x, r in zip(NAMES, custom, ref):
        assert _close(x, r), (name, (x - r).abs().max().item())


@pytest.mark.parametrize("a_log_max", [None, 2.7726], ids=["mild", "alog16"])
def test_custom_backward_matches_recurrent(gen, a_log_max):
    ins = _inputs(gen, s=100, a_log_max=a_log_max)
    doc = torch.tensor([[0] * 30 + [1] * 70, [0] * 100])
    s0 = torch.randn(2, 3, 8, 6, generator=gen).requires_grad_()
    custom = _run(gated_delta_rule_chunked, ins, doc, s0, chunk_size=32)
    ref = _run(gated_delta_rule_recurrent, ins, doc, s0)
    for name, x, r in zip(NAMES, custom, ref):
        assert _close(x, r), (name, (x - r).abs().max().item())


def test_custom_backward_without_initial_state_or_state_gradient(gen):
    ins = _inputs(gen, s=70)
    o = gated_delta_rule_chunked(*ins, chunk_size=16)[0]
    o_ref = gated_delta_rule_chunked(*ins, chunk_size=16, backward="autograd")[0]
    w = torch.sin(torch.arange(o.numel(), dtype=o.dtype)).view_as(o)
    for x, r in zip(torch.autograd.grad((o * w).sum(), ins), torch.autograd.grad((o_ref * w).sum(), ins)):
        assert _close(x, r)


def test_packed_equals_separate(gen):
    """Two documents in one row give the outputs and input gradients of the documents run as separate rows."""
    ins = _inputs(gen, b=1, s=100)
    doc = torch.tensor([[0] * 37 + [1] * 63])
    o, _ = gated_delta_rule_chunked(*ins, doc, chunk_size=16)
    w = torch.sin(torch.arange(o.numel(), dtype=o.dtype)).view_as(o)
    grads = torch.autograd.grad((o * w).sum(), ins)
    for lo, hi in ((0, 37), (37, 100)):
        part = [t.detach()[:, lo:hi].clone().requires_grad_() for t in ins]
        o_p, _ = gated_delta_rule_chunked(*part, chunk_size=16)
        assert _close(o_p, o[:, lo:hi])
        g_p = torch.autograd.grad((o_p * w[:, lo:hi]).sum(), part)
        for x, r in zip(g_p, grads):
            assert _close(x, r[:, lo:hi])


def test_cp_augmented_form_matches_autograd(gen):
    """The context-parallel form (zero extra values, identity initial state, as ``_gdn_core`` runs it)."""
    b, s, h, a, p = 2, 80, 3, 8, 6
    q, k, v, g, beta = _inputs(gen, b=b, s=s, h=h, a=a, p=p, a_log_max=2.7726)
    doc = torch.tensor([[0] * 30 + [1] * 50, [0] * 80])
    v_aug = torch.cat([v, v.new_zeros(b, s, h, a)], dim=-1)
    s0 = torch.cat([torch.zeros(b, h, a, p), torch.eye(a).expand(b, h, a, a)], dim=-1)
    custom = _run(gated_delta_rule_chunked, [q, k, v_aug, g, beta], doc, s0, chunk_size=16)
    ref = _run(gated_delta_rule_chunked, [q, k, v_aug, g, beta], doc, s0, chunk_size=16, backward="autograd")
    for name, x, r in zip(NAMES, custom, ref):
        assert _close(x, r), name


def _saved_bytes(fn):
    """Bytes of distinct tensor storages saved for backward while ``fn`` runs (saved-tensor hooks)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_custom_saves_inputs_and_chunk_states_only(gen):
    """The core function saves exactly its prepared inputs plus one ``[a, p]`` state per chunk and head."""
    b, s, h, a, p, C = 1, 256, 2, 16, 16, 64
    ins = _inputs(gen, b=b, s=s, h=h, a=a, p=p)
    n_custom, _ = _saved_bytes(lambda: gated_delta_rule_chunked(*ins, chunk_size=C))
    n_auto, _ = _saved_bytes(lambda: gated_delta_rule_chunked(*ins, chunk_size=C, backward="autograd"))
    n = s // C
    core = 4 * (b * h * s * (2 * a + p) + 2 * b * h * s + b * h * n * a * p)  # q, k, v, g, β, chunk states (fp32)
    assert n_custom == core, (n_custom, core)  # the L2 norm and fp32 cast run inside: nothing else is saved
    assert n_custom < n_auto / 4, (n_custom, n_auto)
    # bf16 inputs are saved as bf16 (the states stay fp32)
    ins16 = [t.detach().bfloat16().requires_grad_() for t in ins[:3]] + ins[3:]
    n16, _ = _saved_bytes(lambda: gated_delta_rule_chunked(*ins16, chunk_size=C))
    assert n16 == core - 2 * b * h * s * (2 * a + p), (n16, core)


def _denormal_count(t: torch.Tensor) -> int:
    a = t.abs()
    return int(((a > 0) & (a < torch.finfo(t.dtype).tiny)).sum())


def test_exp_ftz_and_flush_tiny_drop_only_what_is_below_the_floor():
    from q38.layers.gdn import _EXP_FLOOR, _exp_ftz, _flush_tiny

    x = torch.tensor([0.0, -1.0, -63.9, _EXP_FLOOR - 1e-3, -87.0, -103.0, -1e4, 5.0])
    keep = torch.tensor([True, True, True, True, True, True, True, False])
    ref = x.double().exp()
    got = _exp_ftz(x, keep)
    above = (x >= _EXP_FLOOR) & keep
    assert torch.equal(got[above], x[above].exp())  # bit-identical where kept
    assert (got[~above] == 0).all()  # exactly 0 (no denormal, no +inf from the masked entry)
    assert (ref[~above & keep] < torch.tensor(_EXP_FLOOR, dtype=torch.float64).exp()).all()  # dropped: < e^floor
    y = torch.tensor([1.0, -1e-20, 1e-27, 1e-29, -1e-40, 0.0])
    assert torch.equal(_flush_tiny(y), torch.tensor([1.0, -1e-20, 1e-27, 0.0, 0.0, 0.0]))


def test_chunk_factors_hold_no_denormals_under_production_gates(gen):
    """The CPU speed of the core rests on this: a denormal operand costs a microcode assist per element (a bmm with
    a few denormal rows ran 10x slower). With |γ| ~ 10³ per chunk the plain exps and the decayed WY inverse have a
    band of them; the factors the core multiplies must have none."""
    from q38.layers.gdn import _chunk_factors, _prepared

    q, k, v, g, beta = (t.detach() for t in _inputs(gen, b=2, s=128, h=4, a=16, p=16, a_log_max=2.7726))
    raw = [t.transpose(1, 2).reshape(2, 4, 2, 64, *t.shape[3:]) for t in (q, k, v, g, beta)]
    *_, kn, vf, gf, bf = _prepared(*raw)
    plain = (gf.double().cumsum(-1)[..., :, None] - gf.double().cumsum(-1)[..., None, :]).float().tril().exp()
    assert _denormal_count(plain) > 0  # the inputs do reach the denormal band
    kb, vb, A, T, Gam, E, E_q, Ec_k, decay, U, W_raw, W, _ = _chunk_factors(kn, vf, gf, bf, None)
    for name, t in dict(L=A * Gam, T=T, Gam=Gam, E=E, Ec_k=Ec_k, decay=decay, U=U, W=W).items():
        assert _denormal_count(t) == 0, name


@pytest.mark.parametrize("masked", [False, True], ids=["one_doc", "packed"])
def test_key_heads_shared_by_value_heads(gen, masked):
    """q, k with fewer heads than v (value head i reads key head i // r, as in Qwen3.5's GDN) go into the custom
    function per key head; it equals autograd through the chunked rule on q, k repeated to the value heads, and the
    q / k gradients are those of the repeat (summed over each key head's value heads)."""
    b, s, hk, r, a, p = 2, 150, 2, 3, 8, 6
    q = torch.randn(b, s, hk, a, generator=gen).requires_grad_()
    k = torch.randn(b, s, hk, a, generator=gen).requires_grad_()
    v = torch.randn(b, s, hk * r, p, generator=gen).requires_grad_()
    g = (-torch.linspace(0.0, 2.7726, hk * r).exp() * F.softplus(torch.randn(b, s, hk * r, generator=gen) + 1.0))
    g = g.requires_grad_()
    beta = torch.rand(b, s, hk * r, generator=gen).requires_grad_()
    doc = torch.tensor(DOCS) if masked else None
    s0 = torch.randn(b, hk * r, a, p, generator=gen).requires_grad_()
    ins = [q, k, v, g, beta]
    custom = _run(gated_delta_rule_chunked, ins, doc, s0, chunk_size=64)

    def repeated(q, k, *rest, **kw):
        return gated_delta_rule_chunked(q.repeat_interleave(r, 2), k.repeat_interleave(r, 2), *rest, **kw)

    ref = _run(repeated, ins, doc, s0, chunk_size=64, backward="autograd")
    for name, x, y in zip(NAMES, custom, ref):
        assert x.shape == y.shape and _close(x, y), (name, (x - y).abs().max().item())


def test_the_layer_takes_its_gdn_backward_as_an_argument(gen, monkeypatch):
    """``gdn_apply(..., backward=...)`` reaches the torch core: ``autograd`` runs the autograd reference (spied),
    ``custom`` does not, and both give the same output and gradients (the core-level comparisons are above)."""
    import q38.layers.gdn as gdn
    from q38.model_config import ModelConfig
    from q38.layers.context import seq_info
    from q38.model import init_params

    cfg = ModelConfig.preset("tiny")
    p = init_params(cfg, seed=0).layers[cfg.layer_types.index("linear_attention")].mixer
    leaves = [t.requires_grad_() for t in torch.utils._pytree.tree_leaves(p)]
    x = torch.randn(2, 40, cfg.hidden_size, generator=gen, requires_grad=True)
    info = seq_info(torch.tensor([[0] * 15 + [1] * 25, [0] * 40]), 2, 40, "cpu")
    ran, real = [], gdn.gated_delta_rule_chunked_autograd
    monkeypatch.setattr(gdn, "gated_delta_rule_chunked_autograd", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    out = {}
    for mode in ("custom", "autograd"):
        ran.clear()
        y = gdn.gdn_apply(p, x, cfg, info, backward=mode)
        out[mode] = (y, *torch.autograd.grad((y * torch.sin(y.detach())).sum(), [x, *leaves]))
        assert bool(ran) == (mode == "autograd")
    assert all(_close(c, r) for c, r in zip(out["custom"], out["autograd"]))
