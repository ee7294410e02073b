"""Zero-centred RMSNorm (weights stored as ``w``, applied as ``1 + w``) and the gated RMSNorm of GDN.

Both are autograd functions with a hand-written backward (derivation below): the forward computes exactly the
reference expressions of docs/model.md#zero-centred-rmsnorm (same ops, same casts), and the backward works from the saved inputs
and the per-row ``r = rsqrt(mean(x²) + eps)`` in fp32, in a few in-place passes over one or two buffers. Autograd
through the reference expressions takes about a dozen passes and as many fresh activation-sized buffers per norm
(there are 14 norms per 4-layer step of the benchmark model; on CPU every fresh buffer also costs page faults).

Backward of ``y = x̂ ⊙ u`` with ``x̂ = r·x`` (``u`` the applied weight), for ``g = dy ⊙ u``:
``dx = r·(g − x̂·mean(g ⊙ x̂))`` per row and ``du = Σ_rows dy ⊙ x̂``. The gated norm ``y = w ⊙ x̂ ⊙ silu(z)`` is the
same with ``u = w ⊙ silu(z)`` per element, plus ``dz = dy ⊙ w ⊙ x̂ ⊙ silu'(z)``, ``silu'(z) = σ(z)(1 + z(1 − σ(z)))``.
"""

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor


def _rstd(xf: Tensor, eps: float) -> Tensor:
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _rows(t: Tensor) -> Tensor:
    """``t`` as ``[rows, c]`` (for the weight gradient's sum over every leading dim)."""
    return t.reshape(-1, t.shape[-1])


def _dx_(g: Tensor, xhat: Tensor, r: Tensor, gx: Tensor) -> Tensor:
    """``r·(g − x̂·mean(g ⊙ x̂))`` in place in ``g``, given the row sums ``gx = Σ g ⊙ x̂`` (``[...]``; the caller takes
    them as a matrix-vector product from a buffer it has anyway): two passes."""
    return g.addcmul_(xhat, (gx / g.shape[-1]).unsqueeze(-1), value=-1.0).mul_(r)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        xf = x.float()
        r = _rstd(xf, eps)
        ctx.save_for_backward(x, w, r)
        return (xf * r * (1.0 + w.float())).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, r = ctx.saved_tensors
        xhat, dyf, u = x.float() * r, dy.float(), 1.0 + w.float()
        p = dyf * xhat
        dw = _rows(p).sum(0).to(w.dtype) if ctx.needs_input_grad[1] else None
        # Σ g ⊙ x̂ for g = dy ⊙ u is (dy ⊙ x̂)·u: a matrix-vector product over the buffer dw was summed from
        dx = _dx_(dyf * u, xhat, r, p @ u) if ctx.needs_input_grad[0] else None
        return (None if dx is None else dx.to(x.dtype)), dw, None


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, w, eps):
        dtype = x.dtype
        xf = x.float()
        r = _rstd(xf, eps)
        ctx.save_for_backward(x, z, w, r)
        y = w * (xf * r).to(dtype)
        return (y * F.silu(z.float())).to(dtype)

    @staticmethod
    def backward(ctx, dy):
        x, z, w, r = ctx.saved_tensors
        zf, dyf, wf = z.float(), dy.float(), w.float()
        xhat = x.float() * r
        q = dyf * xhat
        silu = F.silu(zf)
        qs = q * silu  # dy ⊙ x̂ ⊙ silu(z): its row sums give dw, its product with w the row sums dx needs
        dw = _rows(qs).sum(0).to(w.dtype) if ctx.needs_input_grad[2] else None
        gx = qs @ wf  # Σ g ⊙ x̂ for g = dy ⊙ w ⊙ silu(z)
        # dz = silu'(z) ⊙ (dy ⊙ x̂ ⊙ w), by the fused kernel autograd runs for F.silu (q is not needed after this)
        dz = torch.ops.aten.silu_backward(q.mul_(wf), zf).to(z.dtype) if ctx.needs_input_grad[1] else None
        dx = _dx_(silu.mul_(dyf).mul_(wf), xhat, r, gx).to(x.dtype) if ctx.needs_input_grad[0] else None
        return dx, dz, dw, None


def rms_norm(x: Float[Tensor, "*batch c"], w: Float[Tensor, " c"], eps: float) -> Float[Tensor, "*batch c"]:
    """``x / rms(x) * (1 + w)`` computed in fp32, cast back to ``x.dtype`` (docs/model.md#zero-centred-rmsnorm)."""
    return _RMSNorm.apply(x, w, eps)


def gated_rms_norm(
    x: Float[Tensor, "*batch c"], z: Float[Tensor, "*batch c"], w: Float[Tensor, " c"], eps: float
) -> Float[Tensor, "*batch c"]:
    """``w * norm(x) * silu(z)`` with a plain (not zero-centred) weight (docs/model.md#gated-rmsnorm-gdn-output)."""
    return _GatedRMSNorm.apply(x, z, w, eps)
