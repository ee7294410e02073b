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
    """Rotate the first ``r`` channels of every head; the remaining ``c - r`` pass through."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def positions_from_docs(doc_ids: Int[Tensor, "b s"]) -> Int[Tensor, "b s"]:
    """Position of each token inside its document (restarts at 0 where the document id changes)."""
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, s)
    new_doc = torch.ones_like(doc_ids, dtype=torch.bool)
    new_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(new_doc, idx, torch.zeros_like(idx))
    start = torch.cummax(start, dim=1).values
    return idx - start
