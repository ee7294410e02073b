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
from tests.dist_utils import run_distributed
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

INT8 = TC.replace(moment_dtype="int8")


def _q_ref(x, signed):
    """Block-wise 8-bit quantization written out here (docs/optimizer.md#8-bit-moments): blocks of 256 along the
    flattening; signed absmax with 127 levels, or linear in sqrt with 255 levels and a floor of one code for v > 0.
    Returns the dequantized float64 values."""
    flat = x.double().reshape(-1)
    out = torch.empty_like(flat)
    for s in range(0, flat.numel(), 256):
        b = flat[s:s + 256]
        if signed:
            a = float(b.abs().max())
            out[s:s + 256] = 0.0 if a == 0 else torch.round(b / a * 127) / 127 * a
        else:
            r = b.clamp(min=0).sqrt()
            a = float(r.max())
            q = torch.zeros_like(r) if a == 0 else torch.round(r / a * 255)
            q[(b > 0) & (q < 1)] = 1
            out[s:s + 256] = (q / 255 * a) ** 2
    return out.view(x.shape)


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "donated"])
def test_int8_moments_against_a_hand_written_reference(inplace):
    from q38 import qmoment

    g0 = torch.Generator().manual_seed(1)
    shapes = [(37, 11), (700,), (3, 7, 5)]  # 407 values: one full block and a partial one; 700: 2 full + partial
    p = [torch.randn(s, generator=g0) for s in shapes]
    m = [qmoment.zeros_like(x, True) for x in p]
    v = [qmoment.zeros_like(x, False) for x in p]
    assert m[0].codes.dtype == torch.int8 and v[0].codes.dtype == torch.uint8 and m[1].scales.shape == (1, 3)
    ref = [(x.double(), torch.zeros(s, dtype=torch.float64), torch.zeros(s, dtype=torch.float64))
           for x, s in zip(p, shapes)]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for t in range(1, 5):
        grads = [torch.randn(s, generator=g0) * 10 ** torch.randint(-3, 1, s, generator=g0) for s in shapes]
        new = []
        for (rp, rm, rv), g in zip(ref, grads):
            rp = rp * (1 - kw["lr"] * kw["weight_decay"])
            rm = kw["beta1"] * rm + (1 - kw["beta1"]) * g.double()
            rv = kw["beta2"] * rv + (1 - kw["beta2"]) * g.double() ** 2
            upd = (rm / (1 - kw["beta1"] ** t)) / ((rv / (1 - kw["beta2"] ** t)).sqrt() + kw["eps"])
            new.append((rp - kw["lr"] * upd, _q_ref(rm, True), _q_ref(rv, False)))
        if inplace:
            adamw_step_(p, list(grads), m, v, [True] * 3, step=t, **kw)
        else:
            p, m, v = adamw_step(p, grads, m, v, [True] * 3, step=t, **kw)
        ref = new
        for x, a, b, (rp, rm, rv) in zip(p, m, v, ref):
            # the kernel's fp32 arithmetic vs float64 may land one code apart at a rounding tie
            da, db = qmoment.load(a).double(), qmoment.load(b).double()
            step_m = rm.abs().reshape(-1).max() / 127
            assert (da - rm).abs().max() <= step_m * 1.01
            assert ((da - rm).abs() > 1e-3 * step_m).float().mean() < 0.01  # nearly every code equal
            assert ((db.sqrt() - rv.sqrt()).abs() <= rv.sqrt().max() / 255 * 1.01 + 1e-12).all()
            assert (x.double() - rp).abs().max() <= 1e-5
        # the reference continues from the state's own (quantized) moments
        ref = [(x.double(), qmoment.load(a).double(), qmoment.load(b).double()) for x, a, b in zip(p, m, v)]


def test_int8_moments_donated_equals_pure_and_resume_is_exact(tmp_path):
    from q38.train.io.checkpoint import empty_params, load_checkpoint, save_checkpoint
    from q38.train.core.state import state_from_params

    state = init_state(CFG, INT8, seed=2)
    names = [n for n, _ in named_leaves(state.exp_avg_sq)]
    assert all(n.endswith((".codes", ".scales")) for n in names)
    pure = state
    for i in range(2):
        pure, _ = train_step(pure, _b(i))
    don = tree_map(lambda t: t.clone(), state)
    for i in range(2):
        don, _ = train_step(don, _b(i), donate=True)
    assert _same_state(pure, don) == []
    assert any(bool(t.ne(0).any()) for n, t in named_leaves(don.exp_avg) if n.endswith(".codes"))
    save_checkpoint(tmp_path, don, {"step": 2, "model_config": CFG.to_dict(), "train_config": INT8.to_dict()})
    template = state_from_params(empty_params(CFG), CFG, INT8)
    back, _ = load_checkpoint(tmp_path / "step_000002", template)
    assert _same_state(back, don) == []
    # q38 convert reads only the parameters: the same files as the fp32-moment checkpoint of the same parameters
    from q38.cli import main
    from q38.train.core.state import state_from_params as sfp

    twin = sfp(tree_map(lambda t: t.clone(), back.params), CFG, TC)
    save_checkpoint(tmp_path / "fp32", twin, {"step": 2, "model_config": CFG.to_dict(), "train_config": TC.to_dict()})
    for src, out in ((tmp_path / "step_000002", "hf8"), (tmp_path / "fp32" / "step_000002", "hf32")):
        assert main(["convert", "--to-hf", str(src), str(tmp_path / out), "--dtype", "float32"]) == 0
    files = sorted(p.name for p in (tmp_path / "hf8").iterdir() if p.suffix == ".safetensors")
    assert files and all((tmp_path / "hf8" / f).read_bytes() == (tmp_path / "hf32" / f).read_bytes() for f in files)
    a, _ = train_step(back, _b(2), donate=True)
    b, _ = train_step(don, _b(2), donate=True)
    assert _same_state(a, b) == []


def test_bf16_gradients_are_held_in_bf16_and_step_as_before():
    """reduce_dtype bfloat16: the step's gradients stay bf16 (2 bytes a parameter) until each leaf's update casts
    its own; the result equals casting every gradient to fp32 first (the old behaviour) bit for bit."""
    from q38.train.core.step import loss_and_grads
    from q38.train.core.optim import adamw_step
    from q38.train.core.state import decay_mask, learning_rate
    from q38.pytree import tree_leaves

    tc = TC.replace(reduce_dtype="bfloat16")
    state = init_state(CFG, tc, seed=3)
    r = loss_and_grads(state, _b(0))
    assert all(g.dtype == torch.bfloat16 for g in r.grads)
    want_norm = torch.stack([g.float().pow(2).sum() for g in r.grads]).sum().sqrt()
    assert torch.allclose(r.grad_norm, want_norm, rtol=1e-6, atol=0)
    old = [g.float() for g in r.grads]  # the old behaviour: every gradient cast to fp32, then the step
    scale = torch.clamp(tc.grad_clip / (r.grad_norm + 1e-6), max=1.0)
    flat = tree_leaves(state.params)
    ref_p, _, _ = adamw_step(flat, old, tree_leaves(state.exp_avg), tree_leaves(state.exp_avg_sq),
                             decay_mask(state.params, tc), step=1, lr=learning_rate(1, tc), beta1=tc.beta1,
                             beta2=tc.beta2, eps=tc.eps, weight_decay=tc.weight_decay, grad_scale=scale)
    don, _ = train_step(tree_map(lambda t: t.clone(), state), _b(0), donate=True)
    pure, _ = train_step(state, _b(0))
    for a, b, c in zip(tree_leaves(don.params), tree_leaves(pure.params), ref_p):
        assert torch.equal(a, c) and torch.equal(b, c)


def _int8_rank(rank, world, layout_name, mesh_sizes, ckpt):
    from q38.parallel.layout import Layout
    from q38.parallel.mesh import make_mesh, shard, shard_batch
    from q38.train.core.state import state_from_params
    from q38.train.io.checkpoint import empty_params, load_checkpoint, save_checkpoint
    from tests.test_donate import _run

    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = shard(init_state(CFG, INT8, seed=1), mesh)
    sb = lambda b: shard_batch(b, mesh, CFG.mtp_num_layers)  # noqa: E731
    pure, lp, _ = _run(state, [_b(0), _b(1)], mesh, donate=False, shard_b=sb)
    don, ld, _ = _run(tree_map(lambda t: t.clone(), state), [_b(0), _b(1)], mesh, donate=True, shard_b=sb)
    pure_vs_donated = _same_state(pure, don)
    save_checkpoint(ckpt, don, {"step": 2, "model_config": CFG.to_dict(), "train_config": INT8.to_dict()})
    back, _ = load_checkpoint(f"{ckpt}/step_000002", state_from_params(empty_params(CFG, mesh=mesh), CFG, INT8))
    a, la, _ = _run(back, [_b(2)], mesh, donate=True, shard_b=sb)
    b, lb, _ = _run(don, [_b(2)], mesh, donate=True, shard_b=sb)
    sharded = [n for n, t in named_leaves(state.exp_avg) if hasattr(t, "to_local") and n.endswith(".scales")
               and t.shape[0] > 1]
    return {"losses": (lp, ld, la, lb), "pure_vs_donated": pure_vs_donated, "resumed": _same_state(a, b),
            "sharded_scales": len(sharded)}


@pytest.mark.dist
def test_int8_moments_on_two_ranks_donated_equals_pure_and_resume_is_exact(tmp_path):
    for o in run_distributed(_int8_rank, 2, "fsdp_ep", {"fsdp": 1, "ep": 2}, str(tmp_path)):
        assert o["losses"][0] == o["losses"][1] and o["losses"][2] == o["losses"][3]
        assert o["pure_vs_donated"] == [] and o["resumed"] == [] and o["sharded_scales"] > 0


def test_int8_checkpoint_resumes_only_on_its_layout(tmp_path):
    from q38.train.io.checkpoint import save_checkpoint
    from q38.train.run.trainer import _check_int8_layout

    state = init_state(CFG, INT8, seed=2)
    meta = {"step": 0, "model_config": CFG.to_dict(), "train_config": INT8.to_dict(), "layout": "fsdp",
            "mesh": {"fsdp": 2}}
    path = save_checkpoint(tmp_path, state, meta)
    run = lambda layout, mesh, tc=INT8: (tc.moment_dtype, layout, mesh)  # noqa: E731
    _check_int8_layout(path, *run("fsdp", {"fsdp": 2}))  # the same layout and mesh: allowed
    _check_int8_layout(path, *run("fsdp_ep", {"fsdp": 1, "ep": 2}, TC))  # moments not int8 now: nothing to refuse
    with pytest.raises(ConfigError, match=r"int8 moments quantized per shard of layout 'fsdp' mesh \{'fsdp': 2\}; "
                                          r"resume it with that layout and mesh"):
        _check_int8_layout(path, *run("fsdp", {"fsdp": 4}))
