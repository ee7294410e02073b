"""Chunked LM loss: parity with the unchunked reference, edge cases, and no ``[n, v]`` allocation."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from q38.kernels import DEFAULT_KERNELS, REGISTRY, KernelConfig, resolve_kernels
from q38.train.core.loss import chunked_lm_loss, dynamic_chunk_size, unchunked_lm_loss

_NO_COMPILE = REGISTRY["loss"]["compiled"].problem()  # kernels.loss: compiled needs torch.compile to work here
needs_compile = pytest.mark.skipif(_NO_COMPILE is not None, reason=str(_NO_COMPILE))

N, D, V = 50, 32, 1000
ATOL = 1e-6


def _inputs(seed=0, n=N, d=D, v=V, dtype=torch.float32, ignored=(3, 17, 18, 44)):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=dtype)
    w_head = (torch.randn(v, d, generator=gen) / d**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[list(ignored)] = -100
    return hidden, w_head, targets


def _loss_and_grads(fn, hidden, w_head, targets, grad_hidden=True, grad_w=True, scale=1.0, **kw):
    hidden = hidden.detach().requires_grad_(grad_hidden)
    w_head = w_head.detach().requires_grad_(grad_w)
    loss = fn(hidden, w_head, targets, **kw)
    (loss * scale).backward()
    return loss.detach(), hidden.grad, w_head.grad


def _normalizer(targets):
    return (targets != -100).sum()


@pytest.mark.parametrize("chunk", [3, 7, 10, 50, 64])
def test_matches_unchunked(chunk):
    torch.manual_seed(0)
    hidden, w_head, targets = _inputs()
    targets[20:30] = -100  # with chunk 10 this whole chunk is ignored
    norm = float(_normalizer(targets))
    ref = _loss_and_grads(unchunked_lm_loss, hidden, w_head, targets, normalizer=norm)
    out = _loss_and_grads(chunked_lm_loss, hidden, w_head, targets, normalizer=norm, chunk_size=chunk)
    for r, o in zip(ref, out):
        assert o.dtype == r.dtype and o.shape == r.shape
        torch.testing.assert_close(o, r, atol=ATOL, rtol=0)
    # the gradient rows of ignored tokens are exactly zero
    assert torch.all(out[1][targets == -100] == 0)


def test_all_ignored_gives_zero_loss_and_grads():
    hidden, w_head, targets = _inputs()
    targets[:] = -100
    loss, dx, dw = _loss_and_grads(chunked_lm_loss, hidden, w_head, targets, normalizer=1.0, chunk_size=8)
    assert loss.item() == 0.0
    assert torch.all(dx == 0) and torch.all(dw == 0)


def test_all_ignored_chunk_is_zero_and_finite():
    hidden, w_head, targets = _inputs(ignored=())
    targets[10:20] = -100
    hidden[10:20] = 1e4  # huge logits on the ignored rows must not leak NaN/inf
    _, dx, dw = _loss_and_grads(chunked_lm_loss, hidden, w_head, targets, normalizer=40.0, chunk_size=10)
    assert torch.all(dx[10:20] == 0)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()


def test_tensor_normalizer_grad_scale_and_custom_ignore_index():
    hidden, w_head, targets = _inputs(ignored=())
    targets[[1, 2, 40]] = 7  # ``7`` is the ignore index here
    norm = (targets != 7).sum()
    kw = dict(normalizer=norm, ignore_index=7, scale=3.5)
    ref = _loss_and_grads(unchunked_lm_loss, hidden, w_head, targets, **kw)
    out = _loss_and_grads(chunked_lm_loss, hidden, w_head, targets, chunk_size=9, **kw)
    for r, o in zip(ref, out):
        torch.testing.assert_close(o, r, atol=ATOL * 4, rtol=0)


@pytest.mark.parametrize("grad_hidden,grad_w", [(True, False), (False, True)])
def test_partial_requires_grad(grad_hidden, grad_w):
    hidden, w_head, targets = _inputs()
    kw = dict(normalizer=float(_normalizer(targets)), grad_hidden=grad_hidden, grad_w=grad_w)
    ref = _loss_and_grads(unchunked_lm_loss, hidden, w_head, targets, **kw)
    out = _loss_and_grads(chunked_lm_loss, hidden, w_head, targets, chunk_size=16, **kw)
    for r, o in zip(ref, out):
        assert (r is None) == (o is None)
        if r is not None:
            torch.testing.assert_close(o, r, atol=ATOL, rtol=0)


def test_no_grad_needed():
    hidden, w_head, targets = _inputs()
    with torch.no_grad():
        loss = chunked_lm_loss(hidden, w_head, targets, normalizer=46, chunk_size=16)
    ref = unchunked_lm_loss(hidden, w_head, targets, normalizer=46)
    torch.testing.assert_close(loss, ref, atol=ATOL, rtol=0)


def test_bf16_inputs():
    hidden, w_head, targets = _inputs(dtype=torch.bfloat16)
    norm = float(_normalizer(targets))
    ref = _loss_and_grads(unchunked_lm_loss, hidden, w_head, targets, normalizer=norm)
    out = _loss_and_grads(chunked_lm_loss, hidden, w_head, targets, normalizer=norm, chunk_size=16)
    assert out[0].dtype == torch.float32
    assert out[1].dtype == torch.bfloat16 and out[2].dtype == torch.bfloat16
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)  # same bf16 logits, fp32 softmax
    for r, o in zip(ref[1:], out[1:]):
        torch.testing.assert_close(o.float(), r.float(), atol=2e-3, rtol=2e-2)


def test_bf16_hidden_fp32_head():
    hidden, w_head, targets = _inputs()
    hidden = hidden.bfloat16()
    norm = float(_normalizer(targets))
    ref = _loss_and_grads(unchunked_lm_loss, hidden, w_head, targets, normalizer=norm)
    out = _loss_and_grads(chunked_lm_loss, hidden, w_head, targets, normalizer=norm, chunk_size=16)
    assert out[1].dtype == torch.bfloat16 and out[2].dtype == torch.float32
    for r, o in zip(ref, out):
        torch.testing.assert_close(o, r, atol=ATOL, rtol=0)


def test_gradcheck_fp64():
    hidden, w_head, targets = _inputs(n=9, d=4, v=11, dtype=torch.float64, ignored=(2,))
    hidden.requires_grad_(True)
    w_head.requires_grad_(True)
    torch.autograd.gradcheck(
        lambda h, w: chunked_lm_loss(h, w, targets, normalizer=8.0, chunk_size=4), (hidden, w_head)
    )


def test_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    hidden, w_head, targets = _inputs()
    norm = float(_normalizer(targets))

    def ckpt_loss(h, w, t, **kw):
        return checkpoint(chunked_lm_loss, h, w, t, use_reentrant=False, **kw)

    ref = _loss_and_grads(unchunked_lm_loss, hidden, w_head, targets, normalizer=norm)
    out = _loss_and_grads(ckpt_loss, hidden, w_head, targets, normalizer=norm, chunk_size=12)
    for r, o in zip(ref, out):
        torch.testing.assert_close(o, r, atol=ATOL, rtol=0)


def test_dynamic_budget():
    assert dynamic_chunk_size(N, V, budget_bytes=10 * V * 8) == 10
    assert dynamic_chunk_size(N, V, budget_bytes=10 * V * 8 + V * 8 - 1) == 10
    assert dynamic_chunk_size(N, V, budget_bytes=1) == 1  # at least one token
    assert dynamic_chunk_size(N, V, budget_bytes=10**12) == N  # never more than the tokens
    assert dynamic_chunk_size(0, V, budget_bytes=10**12) == 1
    with pytest.raises(ValueError):
        dynamic_chunk_size(N, V, budget_bytes=0)

    hidden, w_head, targets = _inputs()
    norm = float(_normalizer(targets))
    ref = _loss_and_grads(unchunked_lm_loss, hidden, w_head, targets, normalizer=norm)
    out = _loss_and_grads(chunked_lm_loss, hidden, w_head, targets, normalizer=norm, chunk_budget_bytes=7 * V * 8)
    for r, o in zip(ref, out):
        torch.testing.assert_close(o, r, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kw", [{}, {"chunk_size": 8, "chunk_budget_bytes": 1 << 20}])
def test_needs_exactly_one_chunk_option(kw):
    hidden, w_head, targets = _inputs()
    with pytest.raises(ValueError, match="chunk_size.*chunk_budget_bytes"):
        chunked_lm_loss(hidden, w_head, targets, normalizer=1.0, **kw)


def test_empty_tokens():
    hidden, w_head, targets = _inputs(n=0, ignored=())
    loss, dx, dw = _loss_and_grads(chunked_lm_loss, hidden, w_head, targets, normalizer=1.0, chunk_size=8)
    assert loss.item() == 0.0 and dx.shape == (0, D) and torch.all(dw == 0)


def test_no_saved_tensor_is_n_by_v():
    hidden, w_head, targets = _inputs()
    hidden.requires_grad_(True)
    w_head.requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_lm_loss(hidden, w_head, targets, normalizer=46.0, chunk_size=5)
    loss.backward()
    assert saved, "the hook saw nothing"
    assert max(torch.Size(s).numel() for s in saved) < N * V, saved

    # the hook does see the reference's [n, v] activations
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        unchunked_lm_loss(hidden, w_head, targets, normalizer=46.0)
    assert max(torch.Size(s).numel() for s in saved) >= N * V


class _MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.mark.parametrize("fn,expect_nv", [(chunked_lm_loss, False), (unchunked_lm_loss, True)])
def test_no_op_output_is_n_by_v(fn, expect_nv):
    hidden, w_head, targets = _inputs()
    hidden.requires_grad_(True)
    w_head.requires_grad_(True)
    kw = {"chunk_size": 5} if fn is chunked_lm_loss else {}
    with _MaxNumel() as mode:
        fn(hidden, w_head, targets, normalizer=46.0, **kw).backward()
    assert (mode.max_numel >= N * V) == expect_nv, mode.max_numel
    if not expect_nv:
        assert mode.max_numel <= max(5 * V, V * D, N * D)


def test_signatures_typecheck():
    """The jaxtyping annotations hold under beartype (the pytest hook of the project runs the same check)."""
    beartype = pytest.importorskip("beartype").beartype
    from jaxtyping import TypeCheckError, jaxtyped

    checked = jaxtyped(typechecker=beartype)(chunked_lm_loss)
    hidden, w_head, targets = _inputs()
    checked(hidden, w_head, targets, normalizer=torch.tensor(46), chunk_size=8)
    with pytest.raises(TypeCheckError):
        checked(hidden, w_head[:, :-1], targets, normalizer=46.0, chunk_size=8)


@needs_compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_epilogues_match_eager(dtype):
    """``kernels.loss: compiled`` (the torch.compile'd block epilogues; on CPU through Inductor's C++ backend) against
    the eager loop and the unchunked reference: loss and both gradients, with a partial last block, ignored rows and
    a negative loss scale (sign handling). fp32 within 1e-6 (the blocks' logsumexp is combined by logaddexp instead
    of the online max); bf16 within the eager path's own distance from the reference, plus one bf16 ulp."""
    hidden, w_head, targets = _inputs(dtype=dtype)
    norm = float(_normalizer(targets))
    kw = dict(normalizer=norm, chunk_size=7, scale=-3.0)  # 7 * 1000 // 50 = 140 columns: a partial last block
    ref = _loss_and_grads(unchunked_lm_loss, hidden, w_head, targets, normalizer=norm, scale=-3.0)
    eager = _loss_and_grads(chunked_lm_loss, hidden, w_head, targets, **kw)
    fused = _loss_and_grads(chunked_lm_loss, hidden, w_head, targets, kernels=DEFAULT_KERNELS.replace(loss="compiled"),
                            **kw)
    for r, e, f in zip(ref, eager, fused):
        assert f.dtype == e.dtype and f.shape == e.shape
        if dtype == torch.float32:
            torch.testing.assert_close(f, e, atol=1e-6, rtol=0)
        else:
            bound = (e.float() - r.float()).abs().max() + r.float().abs().max() * 2**-8
            assert (f.float() - r.float()).abs().max() <= bound
    assert torch.all(fused[1][targets == -100] == 0)


def test_compiled_loss_is_never_picked_by_auto():
    """Not measured faster on a device yet: ``auto`` takes the eager epilogues; naming it works."""
    assert resolve_kernels(KernelConfig(), device="cpu").loss == "torch"
    if _NO_COMPILE is None:
        assert resolve_kernels(KernelConfig(loss="compiled"), device="cpu").loss == "compiled"


@needs_compile
def test_compiled_epilogues_run_from_another_thread():
    """On CUDA autograd runs backward on a device thread, so the compiled backward epilogue is called from a thread
    other than the one that built it: equal there to the eager expression (bf16, within one ulp: Inductor's exp
    may round differently from ATen's), new shapes included."""
    import threading

    from q38.train.core.loss import _block_grad_, _compiled

    gen = torch.Generator().manual_seed(0)

    def check(n, b):
        x = torch.randn(n, b, generator=gen).bfloat16()
        shift, onehot = torch.randn(n, generator=gen), -torch.rand(n, generator=gen)
        col = torch.randint(-1, b, (n,), generator=gen)
        want = (torch.exp(x.float() - shift[:, None]) + torch.where(torch.arange(b)[None] == col[:, None],
                                                                     onehot[:, None], 0.0)).bfloat16()
        got = _compiled(_block_grad_)(x.clone(), shift, col, onehot).float()
        return bool(((got - want.float()).abs() <= want.float().abs() * 2**-7).all())  # within one bf16 ulp

    assert check(16, 100)
    got = []
    worker = threading.Thread(target=lambda: got.extend([check(16, 100), check(24, 77)]))
    worker.start()
    worker.join()
    assert got == [True, True]
