"""Partial rotary position embedding (NeoX ``rotate_half`` pairs on the first ``rotary_dim`` channels)."""

import torch
from jaxtyping import Float, Int
from torch import Tensor


def rope_cos_sin(
    positions: Int[Tensor, "b s"], rotary_dim: int, theta: float
) -> tuple[Float[Tensor, "b s r"], Float[Tensor, "b s r"]]:
    """cos/sin tables ``[b, s, rotary_dim]`` for integer positions (fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim))
    freqs = positions.float()[..., None] * inv_freq  # [b s r/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(
    x: Float[Tensor, "b s h c"], cos: Float[Tensor, "b s r"], sin: Float[Tensor, "b s r"]
) -> Float[Tensor, "b s h c"]:
    """Rotate the first ``r`` channels of every head; the remaining ``c - r`` pass through.

    With ``x_rot = [x1 | x2]``: ``y1 = x1·cos1 − x2·sin1``, ``y2 = x2·cos2 + x1·sin2`` (NeoX ``rotate_half``).
    An autograd function: written into one output buffer, and its backward
    (``dx1 = dy1·cos1 + dy2·sin2``, ``dx2 = dy2·cos2 − dy1·sin1``, pass-through copied) into one gradient buffer;
    autograd through the slices and concatenations zero-fills a full-size gradient per slice and sums them."""
    return _Rope.apply(x, cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype))


def _rotate(x: Tensor, c1: Tensor, c2: Tensor, s1: Tensor, s2: Tensor, sign: float) -> Tensor:
    """``[x1·c1 − sign·x2·s1 | x2·c2 + sign·x1·s2]`` on the first ``r`` channels, the rest copied."""
    h = c1.shape[-1]
    r = 2 * h
    if torch.compiler.is_compiling():  # functional: torch.compile cannot trace ``out=`` writes into slices
        x1, x2 = x[..., :h], x[..., h:r]
        return torch.cat([x1 * c1 - sign * (x2 * s1), x2 * c2 + sign * (x1 * s2), x[..., r:]], dim=-1)
    out = torch.empty_like(x)
    x1, x2 = x[..., :h], x[..., h:r]
    torch.mul(x1, c1, out=out[..., :h]).addcmul_(x2, s1, value=-sign)
    torch.mul(x2, c2, out=out[..., h:r]).addcmul_(x1, s2, value=sign)
    out[..., r:] = x[..., r:]
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        h = cos.shape[-1] // 2
        return _rotate(x, cos[..., :h], cos[..., h:], sin[..., :h], sin[..., h:], 1.0)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        h = cos.shape[-1] // 2
        # the transpose of the rotation: dx1 = dy1·c1 + dy2·s2, dx2 = dy2·c2 − dy1·s1 (the sin halves swap)
        return _rotate(dy, cos[..., :h], cos[..., h:], sin[..., h:], sin[..., :h], -1.0), None, None


def positions_from_docs(doc_ids: Int[Tensor, "b s"]) -> Int[Tensor, "b s"]:
    """Position of each token inside its document (restarts at 0 where the document id changes)."""
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, s)
    new_doc = torch.ones_like(doc_ids, dtype=torch.bool)
    new_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(new_doc, idx, torch.zeros_like(idx))
    start = torch.cummax(start, dim=1).values
    return idx - start
