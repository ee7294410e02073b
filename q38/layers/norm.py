"""Zero-centred RMSNorm (weights stored as ``w``, applied as ``1 + w``) and the gated RMSNorm of GDN."""

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor


def rms_norm(x: Float[Tensor, "*batch c"], w: Float[Tensor, " c"], eps: float) -> Float[Tensor, "*batch c"]:
    """``x / rms(x) * (1 + w)`` computed in fp32, cast back to ``x.dtype`` (architecture.md §3.1)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).to(x.dtype)


def gated_rms_norm(
    x: Float[Tensor, "*batch c"], z: Float[Tensor, "*batch c"], w: Float[Tensor, " c"], eps: float
) -> Float[Tensor, "*batch c"]:
    """``w * norm(x) * silu(z)`` with a plain (not zero-centred) weight (architecture.md §3.2)."""
    dtype = x.dtype
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = w * y
    return (y * F.silu(z.float())).to(dtype)
