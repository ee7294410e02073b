"""Layer-level numerics and invariances against naive references (fp32)."""

import pytest
import torch
import torch.nn.functional as F

import q38
from q38.layers.gdn import causal_conv1d, gated_delta_rule_chunked, gated_delta_rule_recurrent
from q38.kernels import DEFAULT_KERNELS
from q38.layers.moe import MoEParams, moe_apply
from q38.layers.norm import gated_rms_norm, rms_norm
from q38.model import init_params

TOL = 1e-5  # fp32 tolerance for reference comparisons


def close(a, b, tol=TOL):
    """max |a − b| ≤ ``tol`` (whole-model comparisons; measured ≤ 7.7e-6 with |h| up to ~4)."""
    return (a - b).abs().max() <= tol


WHOLE_MODEL_TOL = TOL


def _gdn_inputs(gen, b=2, s=150, h=3, a=8, p=6):
    q = torch.randn(b, s, h, a, generator=gen)
    k = torch.randn(b, s, h, a, generator=gen)
    v = torch.randn(b, s, h, p, generator=gen)
    g = -F.softplus(torch.randn(b, s, h, generator=gen))  # log-decay ≤ 0
    beta = torch.rand(b, s, h, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("s", [1, 37, 64, 150])
def test_gdn_chunked_matches_recurrent(gen, s):
    q, k, v, g, beta = _gdn_inputs(gen, s=s)
    o_c, s_c = gated_delta_rule_chunked(q, k, v, g, beta)
    o_r, s_r = gated_delta_rule_recurrent(q, k, v, g, beta)
    assert (o_c - o_r).abs().max() <= TOL
    assert (s_c - s_r).abs().max() <= TOL


def test_gdn_chunked_matches_recurrent_with_documents_and_initial_state(gen):
    q, k, v, g, beta = _gdn_inputs(gen, s=150)
    doc = torch.tensor([[0] * 20 + [1] * 90 + [2] * 40, [0] * 64 + [1] * 64 + [2] * 22])
    init = torch.randn(2, 3, 8, 6, generator=gen)
    o_c, s_c = gated_delta_rule_chunked(q, k, v, g, beta, doc, init, chunk_size=16)
    o_r, s_r = gated_delta_rule_recurrent(q, k, v, g, beta, doc, init)
    assert (o_c - o_r).abs().max() <= TOL
    assert (s_c - s_r).abs().max() <= TOL


def test_gdn_documents_do_not_leak(gen):
    q, k, v, g, beta = _gdn_inputs(gen, b=1, s=100)
    doc = torch.tensor([[0] * 45 + [1] * 55])
    o, _ = gated_delta_rule_chunked(q, k, v, g, beta, doc)
    o2, _ = gated_delta_rule_chunked(*(t[:, 45:] for t in (q, k, v, g, beta)))
    assert (o[:, 45:] - o2).abs().max() <= TOL


def test_causal_conv_matches_conv1d_and_respects_documents(gen):
    x = torch.randn(2, 30, 5, generator=gen)
    w = torch.randn(5, 4, generator=gen)
    ref = F.conv1d(x.transpose(1, 2), w[:, None], padding=3, groups=5)[..., :30].transpose(1, 2)
    assert (causal_conv1d(x, w) - ref).abs().max() <= TOL
    doc = torch.tensor([[0] * 10 + [1] * 20] * 2)
    y = causal_conv1d(x, w, doc)
    ref2 = F.conv1d(x[:, 10:].transpose(1, 2), w[:, None], padding=3, groups=5)[..., :20].transpose(1, 2)
    assert (y[:, 10:] - ref2).abs().max() <= TOL


def _naive_conv(x, w, doc, halo, halo_doc):
    """Per position and tap over the concatenated ``[halo; x]``, differentiated by autograd (the reference for the
    custom backward of ``_CausalConv``)."""
    kw = w.shape[1]
    xp = torch.cat([halo, x], dim=1)
    dp = torch.cat([halo_doc, doc], dim=1)
    rows = []
    for t in range(x.shape[1]):
        taps = [xp[:, t + j] * w[:, j] * (dp[:, t + j] == doc[:, t]).to(x.dtype)[:, None] for j in range(kw)]
        rows.append(torch.stack(taps).sum(0))
    return torch.stack(rows, dim=1)


@pytest.mark.parametrize("s", [2, 3, 17])  # shorter than, equal to and longer than the K - 1 = 3 halo
@pytest.mark.parametrize("with_halo", [False, True])
def test_causal_conv_backward_matches_autograd(gen, s, with_halo):
    """Output and the gradients of x, w and the halo (context parallel) against autograd through a per-tap loop,
    with a document boundary; fp64, tolerance 1e-12."""
    b, ch, kw = 2, 5, 4
    x = torch.randn(b, s, ch, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(ch, kw, generator=gen, dtype=torch.float64, requires_grad=True)
    halo = torch.randn(b, kw - 1, ch, generator=gen, dtype=torch.float64, requires_grad=True)
    doc = torch.tensor([[0] * (s // 2) + [1] * (s - s // 2), [3] * s])
    halo_doc = torch.tensor([[-2, 0, 0], [3, 2, 3]])
    dy = torch.randn(b, s, ch, generator=gen, dtype=torch.float64)
    for d, hd in ((doc, halo_doc), (None, None)):
        ref_doc, ref_hd = (d, hd) if d is not None else (torch.zeros_like(doc), torch.zeros_like(halo_doc))
        ref_halo = halo if with_halo else torch.zeros_like(halo)
        y_ref = _naive_conv(x, w, ref_doc, ref_halo, ref_hd)
        y = causal_conv1d(x, w, d, halo if with_halo else None, hd if with_halo else None)
        if d is not None and not with_halo:  # without a halo every tap before the row start is dropped
            y_ref = _naive_conv(x, w, ref_doc, ref_halo, torch.full_like(halo_doc, -2))
        assert (y - y_ref).abs().max() <= 1e-12
        wrt = [x, w, halo] if with_halo else [x, w]
        got = torch.autograd.grad(y, wrt, dy)
        want = torch.autograd.grad(y_ref, wrt, dy)
        for g1, g2 in zip(got, want):
            assert (g1 - g2).abs().max() <= 1e-12


def _rms_ref(x, w, eps):
    """docs/model.md#zero-centred-rmsnorm written out (autograd differentiates it)."""
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.to(xf.dtype))).to(x.dtype)


def _gated_ref(x, z, w, eps):
    """docs/model.md#gated-rmsnorm-gdn-output written out: the fp32 norm, cast to the input dtype, times w, times silu(z) in fp32."""
    dt = x.dtype
    xf = x.float() if dt != torch.float64 else x
    y = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    return (y * F.silu(z.to(xf.dtype))).to(dt)


def test_norm_backwards_match_autograd(gen):
    """The hand-written norm backwards against autograd through the reference expressions: fp64 (the functions
    compute in fp32, so 1e-6 relative), every input gradient, a leading batch of several dims."""
    x = torch.randn(3, 5, 4, 16, generator=gen, dtype=torch.float64) * 3
    z = torch.randn(3, 5, 4, 16, generator=gen, dtype=torch.float64) * 2
    w = torch.randn(16, generator=gen, dtype=torch.float64)
    dy = torch.randn(3, 5, 4, 16, generator=gen, dtype=torch.float64)
    for fn, ref, args in ((rms_norm, _rms_ref, (x, w)), (gated_rms_norm, _gated_ref, (x, z, w))):
        ins = [a.clone().requires_grad_() for a in args]
        y = fn(*ins, 1e-6)
        y_ref = ref(*ins, 1e-6)
        assert (y - y_ref).abs().max() <= 1e-6 * y_ref.abs().max()
        got = torch.autograd.grad(y, ins, dy)
        want = torch.autograd.grad(y_ref, ins, dy)
        for g1, g2 in zip(got, want):
            assert (g1 - g2).abs().max() <= 1e-6 * g2.abs().max(), fn.__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_forwards_equal_the_reference_expressions(gen, dtype):
    """The forward is the reference expression op for op: bit-identical in fp32 and bf16 (the bf16 casts where
    the reference (HF) puts them)."""
    x = torch.randn(4, 7, 32, generator=gen).to(dtype)
    z = torch.randn(4, 7, 32, generator=gen).to(dtype)
    w = torch.randn(32, generator=gen).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-6), _rms_ref(x, w, 1e-6))
    assert torch.equal(gated_rms_norm(x, z, w, 1e-6), _gated_ref(x, z, w, 1e-6))


def test_rope_and_its_backward_match_autograd_through_rotate_half(gen):
    """Partial RoPE (the first 6 of 10 channels) against the textbook ``x·cos + rotate_half(x)·sin`` with the rest
    passed through, differentiated by autograd; fp64 (1e-12), distinct sin halves so a swapped half would show."""
    from q38.layers.rope import apply_rope

    x = torch.randn(2, 5, 3, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64)
    sin = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64)
    dy = torch.randn(2, 5, 3, 10, generator=gen, dtype=torch.float64)
    r = 6
    c, s = cos[:, :, None], sin[:, :, None]
    x_rot = x[..., :r]
    ref = torch.cat([x_rot * c + torch.cat([-x_rot[..., 3:], x_rot[..., :3]], -1) * s, x[..., r:]], -1)
    y = apply_rope(x, cos, sin)
    assert (y - ref).abs().max() <= 1e-12
    (g,), (g_ref,) = torch.autograd.grad(y, [x], dy), torch.autograd.grad(ref, [x], dy)
    assert (g - g_ref).abs().max() <= 1e-12


def test_rms_norm_zero_centred(gen):
    x = torch.randn(4, 8, generator=gen)
    w = torch.randn(8, generator=gen)
    ref = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert (rms_norm(x, w, 1e-6) - ref).abs().max() <= TOL


def _experts(grouped: bool):
    return DEFAULT_KERNELS.replace(experts="grouped_mm" if grouped else "batched")


def _moe_cfg(**kw):
    base = dict(hidden_size=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8,
                shared_expert_intermediate_size=8, num_hidden_layers=1, layer_types=["full_attention"],
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=32)
    base.update(kw)
    return q38.ModelConfig(**base)


def _naive_moe(p: MoEParams, x, cfg):
    """Loop-over-tokens reference of the MoE block."""
    out = torch.zeros_like(x)
    f = cfg.moe_intermediate_size
    for n in range(x.shape[0]):
        probs = torch.softmax(p.w_router @ x[n], -1)
        w, idx = torch.topk(probs, cfg.num_experts_per_tok)
        if cfg.norm_topk_prob:
            w = w / w.sum()
        for wj, e in zip(w, idx):
            gu = p.we_gate_up[e] @ x[n]
            out[n] += wj * (p.we_down[e] @ (F.silu(gu[:f]) * gu[f:]))
        sh = p.ws_down @ (F.silu(p.ws_gate @ x[n]) * (p.ws_up @ x[n]))
        out[n] += torch.sigmoid(p.w_shared_gate @ x[n])[0] * sh
    return out


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_moe_matches_naive_and_is_permutation_invariant(gen, grouped, top_k):
    cfg = _moe_cfg(num_experts_per_tok=top_k, initializer_range=0.3)
    p = init_params(cfg, seed=1).layers[0].moe
    x = torch.randn(1, 23, 16, generator=gen)
    y, logits = moe_apply(p, x, cfg, kernels=_experts(grouped))
    assert logits.shape == (23, 6)
    assert (y[0] - _naive_moe(p, x[0], cfg)).abs().max() <= TOL
    perm = torch.randperm(23, generator=gen)
    y_perm, _ = moe_apply(p, x[:, perm], cfg, kernels=_experts(grouped))
    assert (y_perm - y[:, perm]).abs().max() <= TOL


def test_weighted_swiglu_backward_matches_autograd(gen):
    """The experts' fused ``silu(gate) ⊙ up ⊙ w`` against autograd through the plain expression: output and the
    gradients of h = [gate | up] and w, fp64, 1e-12."""
    from q38.layers.moe import _WeightedSwiGLU

    h = torch.randn(13, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.rand(13, generator=gen, dtype=torch.float64, requires_grad=True)
    da = torch.randn(13, 5, generator=gen, dtype=torch.float64)
    a = _WeightedSwiGLU.apply(w, h)
    ref = F.silu(h[:, :5]) * h[:, 5:] * w[:, None]
    assert (a - ref).abs().max() <= 1e-12
    for g1, g2 in zip(torch.autograd.grad(a, [h, w], da), torch.autograd.grad(ref, [h, w], da)):
        assert (g1 - g2).abs().max() <= 1e-12
    # gate and up given apart (the shared expert's two projections): the same function and gradients
    gate, up = (t.detach().clone().requires_grad_() for t in h.chunk(2, dim=-1))
    a2 = _WeightedSwiGLU.apply(w, gate, up)
    assert (a2 - ref).abs().max() <= 1e-12
    dh, dw = torch.autograd.grad(F.silu(h[:, :5]) * h[:, 5:] * w[:, None], [h, w], da)
    for g1, g2 in zip(torch.autograd.grad(a2, [gate, up, w], da), (*dh.chunk(2, dim=-1), dw)):
        assert (g1 - g2).abs().max() <= 1e-12


def test_shared_expert_equals_the_reference_expression_and_saves_no_output_sized_tensor(gen):
    """The shared expert (sigmoid gate folded into the weighted SwiGLU) against ``sigmoid(x·w_g) ⊙ down(silu(x·Wgᵀ) ⊙
    x·Wuᵀ)`` (Hugging Face's Qwen3.5-MoE expression): output and every gradient in fp64 within 1e-12; and what it saves
    for backward is ``gate``, ``up``, the activation and the gate weights (3·n·fs + n elements beyond the input and
    the parameters, as q38/parallel/budget.py counts), no ``[n, d]`` tensor."""
    from q38.layers.moe import shared_expert

    cfg = _moe_cfg(initializer_range=0.3)
    p = init_params(cfg, seed=1, dtype=torch.float64).layers[0].moe
    n, d, fs = 17, cfg.hidden_size, cfg.shared_expert_intermediate_size
    x = torch.randn(n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    leaves = [x] + [t.requires_grad_() for t in (p.ws_gate, p.ws_up, p.ws_down, p.w_shared_gate)]
    saved = {}

    def pack(t):  # storages other than the input's and the parameters' (which a saved view may share)
        if t.untyped_storage().data_ptr() not in {leaf.untyped_storage().data_ptr() for leaf in leaves}:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = shared_expert(p, x)
    ref = torch.sigmoid(x @ p.w_shared_gate.T) * ((F.silu(x @ p.ws_gate.T) * (x @ p.ws_up.T)) @ p.ws_down.T)
    assert (y - ref).abs().max() <= 1e-12
    dy = torch.randn(n, d, generator=gen, dtype=torch.float64)
    for g1, g2 in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(ref, leaves, dy)):
        assert (g1 - g2).abs().max() <= 1e-12
    assert sum(saved.values()) == 3 * n * fs + n and n * d not in saved.values()


def test_moe_grads_grouped_vs_batched(gen):
    x = torch.randn(1, 19, 16, generator=gen)
    grads = []
    for grouped in (False, True):
        cfg = _moe_cfg(initializer_range=0.3)
        p = init_params(cfg, seed=1).layers[0].moe
        leaves = [p.we_gate_up.requires_grad_(), p.we_down.requires_grad_(), p.w_router.requires_grad_()]
        y, _ = moe_apply(p, x, cfg, kernels=_experts(grouped))
        grads.append(torch.autograd.grad((y * torch.linspace(-1, 1, 16)).sum(), leaves))
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= TOL


def test_model_appending_tokens_never_changes_earlier_outputs(tiny_cfg, gen):
    cfg = tiny_cfg.replace(initializer_range=0.1)
    p = init_params(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 90), generator=gen)
    full = q38.forward(p, ids, cfg)
    prefix = q38.forward(p, ids[:, :61], cfg)
    assert close(full.hidden[:, :61], prefix.hidden)
    # MTP depth d at position t sees token t+d: the prefix run stays equal where t + d < 61.
    assert close(full.mtp_hidden[0][:, :60], prefix.mtp_hidden[0][:, :60])


def test_packed_row_equals_documents_run_one_by_one(tiny_cfg, gen):
    cfg = tiny_cfg.replace(initializer_range=0.1, mtp_num_layers=2)
    p = init_params(cfg, seed=4)
    lens = [23, 70, 7]
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lens)), generator=gen)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None]
    packed = q38.forward(p, ids, cfg, doc_ids=doc)
    packed_logits = q38.logits(p, ids, cfg, doc_ids=doc)
    start = 0
    for n in lens:
        sep = q38.forward(p, ids[:, start : start + n], cfg)
        assert close(packed.hidden[:, start : start + n], sep.hidden, WHOLE_MODEL_TOL)
        for d in range(2):
            assert close(packed.mtp_hidden[d][:, start : start + n], sep.mtp_hidden[d], WHOLE_MODEL_TOL)
        sep_logits = q38.logits(p, ids[:, start : start + n], cfg)
        assert (packed_logits[:, start : start + n] - sep_logits).abs().max() <= 1e-4
        start += n


def test_wrong_shape_raises_shape_error(tiny_cfg):
    from jaxtyping import TypeCheckError

    from q38.layers.attention import attention_apply
    from q38.layers.context import seq_info

    p = init_params(tiny_cfg, seed=0)
    x = torch.randn(1, 5, tiny_cfg.hidden_size)
    with pytest.raises(TypeCheckError):
        rms_norm(x, torch.zeros(tiny_cfg.hidden_size + 1), 1e-6)  # weight width ≠ channel width
    with pytest.raises(TypeCheckError):
        attention_apply(p.layers[3].mixer, x[0], tiny_cfg, seq_info(None, 1, 5, "cpu"))  # missing batch dim


def test_param_counts_2_4t_formula_and_meta_init():
    cfg = q38.ModelConfig.preset("qwen3_8_2_4t")
    c = q38.count_params(cfg)
    assert abs(c.total / 2.42e12 - 1) < 0.01
    assert abs(c.active / 97.6e9 - 1) < 0.01
    params = init_params(cfg, device="meta")
    from q38.pytree import named_leaves

    leaves = named_leaves(params)
    assert all(t.device.type == "meta" for _, t in leaves)
    meta_total = sum(t.numel() for name, t in leaves if not name.startswith("mtp."))
    assert meta_total == c.total
    mtp_total = sum(t.numel() for name, t in leaves if name.startswith("mtp."))
    assert mtp_total == c.mtp_total
    # Active by enumeration: every leaf but the (e - k)/e share of routed expert weights.
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    active = sum(t.numel() * (k / e if ".we_" in name else 1) for name, t in leaves if not name.startswith("mtp."))
    assert active == pytest.approx(c.active, rel=1e-12)


def test_init_depends_only_on_seed_and_path(tiny_cfg):
    a = init_params(tiny_cfg, seed=7)
    b = init_params(tiny_cfg.replace(num_hidden_layers=8, layer_types=None), seed=7)
    assert torch.equal(a.layers[2].moe.we_down, b.layers[2].moe.we_down)
    assert torch.equal(a.embed, b.embed)
    c = init_params(tiny_cfg, seed=8)
    assert not torch.equal(a.embed, c.embed)


def test_materialize_a_shard_equals_slicing_the_full_tensor():
    from q38.layers.common import ParamInfo, _rows_per_block, materialize

    info = ParamInfo((300, 5000), std=0.5)
    assert _rows_per_block(info.shape) < 300  # several row blocks: the shard crosses a block boundary
    full = materialize(info, "layers.0.moe.we_down", seed=1)
    part = materialize(info, "layers.0.moe.we_down", seed=1, index=(slice(150, 290), slice(7, 4000)))
    assert torch.equal(part, full[150:290, 7:4000])
    empty = materialize(info, "layers.0.moe.we_down", seed=1, index=(slice(300, 300), slice(0, 5000)))
    assert empty.shape == (0, 5000)


def _production_gates(gen, b, s, h):
    """``g = -exp(A_log) · softplus(a + dt_bias)`` as ``gdn_apply`` computes it, with ``A_log`` from the init
    distribution (log U(0.01, 16); heads 0 and -1 pinned to 16 and 0.01), ``dt_bias = 1`` (its init) and
    ``a ~ N(0, 1)``: |γ| reaches ~1.6e3 within one 64-token chunk."""
    a_coef = torch.empty(h).uniform_(0.01, 16, generator=gen)
    a_coef[0], a_coef[-1] = 16.0, 0.01
    a_log, dt_bias = a_coef.log(), 1.0
    return -a_log.exp() * F.softplus(torch.randn(b, s, h, generator=gen) + dt_bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_chunked_matches_recurrent_with_production_gates(gen, dtype):
    """Chunked vs token-by-token with real decays, fp32 and bf16 inputs (gates fp32, as in ``gdn_apply``), with and
    without documents and an initial state. Tolerances: fp32 outputs and states 1e-5 (measured ≤ 4.2e-7); bf16
    outputs one bf16 step of their magnitude, 2^-8 · max|o| (measured ≤ 3.1e-5 at |o| ≈ 0.6), states 1e-5."""
    b, s, h, a, p = 2, 150, 4, 16, 16
    q, k = torch.randn(b, s, h, a, generator=gen), torch.randn(b, s, h, a, generator=gen)
    v = torch.randn(b, s, h, p, generator=gen)
    g = _production_gates(gen, b, s, h)
    assert g[:, :64].cumsum(1).abs().max() > 500  # the in-chunk decays the issue is about
    beta = torch.sigmoid(torch.randn(b, s, h, generator=gen))
    q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))
    doc = torch.tensor([[0] * 20 + [1] * 90 + [2] * 40, [0] * 64 + [1] * 64 + [2] * 22])
    init = torch.randn(b, h, a, p, generator=gen)
    for d, s0 in ((None, None), (doc, init)):
        o_c, s_c = gated_delta_rule_chunked(q, k, v, g, beta, d, s0)
        o_r, s_r = gated_delta_rule_recurrent(q, k, v, g, beta, d, s0)
        assert o_c.dtype == dtype and o_r.abs().max() > 0.1
        tol = TOL if dtype == torch.float32 else 2**-8 * float(o_r.float().abs().max())
        assert (o_c.float() - o_r.float()).abs().max() <= tol
        assert (s_c - s_r).abs().max() <= TOL


def test_gdn_chunked_gradients_match_recurrent_with_production_gates(gen):
    """Gradients w.r.t. q, k, v, g, β (fp32): max |Δ| ≤ 1e-5 (measured ≤ 1.8e-6, on |grad| up to 3.4)."""
    b, s, h, a, p = 2, 100, 4, 16, 16
    q, k = torch.randn(b, s, h, a, generator=gen), torch.randn(b, s, h, a, generator=gen)
    v = torch.randn(b, s, h, p, generator=gen)
    g = _production_gates(gen, b, s, h)
    beta = torch.sigmoid(torch.randn(b, s, h, generator=gen))
    ins = [t.requires_grad_() for t in (q, k, v, g, beta)]
    w = torch.randn(b, s, h, p, generator=gen)
    g_c = torch.autograd.grad((gated_delta_rule_chunked(*ins)[0] * w).sum(), ins)
    g_r = torch.autograd.grad((gated_delta_rule_recurrent(*ins)[0] * w).sum(), ins)
    for name, x, y in zip("q k v g beta".split(), g_c, g_r):
        assert (x - y).abs().max() <= TOL, name


@pytest.mark.parametrize("packed", [False, True])
def test_attention_grouped_kv_heads_match_eager(packed):
    """The SDPA path (k, v with their own heads via ``enable_gqa`` when unmasked, repeated when masked) against the
    eager einsum-softmax reference with k, v repeated to the query heads: output and every gradient, fp32, 1e-5."""
    from q38.layers.attention import AttentionMask, _native_gqa, attention_apply
    from q38.layers.context import seq_info

    cfg = q38.ModelConfig.preset("tiny").replace(num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    p = init_params(cfg, seed=0).layers[cfg.layer_types.index("full_attention")].mixer
    leaves = [t.requires_grad_() for t in torch.utils._pytree.tree_leaves(p)]
    x = torch.randn(2, 24, cfg.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
    doc = torch.tensor([[0] * 10 + [1] * 14, [0] * 24]) if packed else None
    info = seq_info(doc, 2, 24, "cpu")
    mask = AttentionMask(info.seq_idx, info.doc_ids, info.seq_idx, info.doc_ids) if packed else None
    assert info.packed == packed and _native_gqa(x, mask) == (not packed)
    dy = torch.randn(2, 24, cfg.hidden_size, generator=torch.Generator().manual_seed(2))

    def run(kernels):
        y = attention_apply(p, x, cfg, seq_info(doc, 2, 24, "cpu", kernels=kernels))
        return [y, *torch.autograd.grad(y, [x, *leaves], dy)]

    got, want = run(DEFAULT_KERNELS), run(DEFAULT_KERNELS.replace(attention="eager"))
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= 1e-5 * max(1.0, w.abs().max()), (g - w).abs().max()
