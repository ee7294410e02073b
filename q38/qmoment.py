"""8-bit block-wise AdamW moments (``train.moment_dtype: int8``, docs/optimizer.md#8-bit-moments).

A moment leaf is an ``Int8Moment``: ``codes`` (one byte a value, the weight's shape and placements) and ``scales``
(one fp32 per block of ``BLOCK`` values). Blocks run along the *flattened local shard* of the weight (a partial
last block allowed), so each rank quantizes and dequantizes its own shard with no communication. ``scales`` is a
``[shards, blocks]`` table: one row per distinct local shard (the mesh dims that shard the weight shard the table's
rows, the others replicate it), the rows padded to the largest shard's block count. The blocks depend on the
layout: a checkpoint with int8 moments resumes on the layout and world size it was saved with (refused otherwise).

- first moment (``signed``): linear absmax, ``code = round(m / absmax · 127)`` (int8), ``m = code / 127 · absmax``.
- second moment: linear in ``sqrt(v)``, ``code = round(sqrt(v) / max sqrt(v) · 255)`` (uint8),
  ``v = (code / 255 · max)²``; a non-zero ``v`` never gets code 0 (it gets at least 1). Adam divides by
  ``sqrt(v) + eps``, so the error that matters is ``sqrt(v)``'s, and the square root halves ``v``'s dynamic range
  (255 codes span ``v`` over 65025×); a ``v`` rounded to zero would turn the update into ``m / eps``, hence the
  floor of one code (such a value's step is then smaller, never larger).
"""

import math

import attrs
import torch
from torch import Tensor

from q38.pytree import pytree_node

BLOCK = 256
_SIGNED_MAX, _UNSIGNED_MAX = 127.0, 255.0


@pytree_node
@attrs.frozen
class Int8Moment:
    """One moment leaf in 8 bits: ``codes`` (int8 for the first moment, uint8 for the second; the weight's shape and
    placements) and ``scales`` (fp32 ``[shards, blocks]``, this rank's row its own shard's blocks)."""

    codes: Tensor
    scales: Tensor

    @property
    def signed(self) -> bool:
        return self.codes.dtype == torch.int8


def is_int8_moment(x) -> bool:
    return isinstance(x, Int8Moment)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def quantize(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """``(codes, scales)`` of fp32 ``x`` (any shape; blocks along its flattening): codes of ``x``'s shape, scales
    ``[ceil(numel / BLOCK)]``."""
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    nb = max(1, math.ceil(n / BLOCK))
    pad = torch.zeros(nb * BLOCK, dtype=torch.float32, device=x.device)
    pad[:n] = flat
    blocks = pad.view(nb, BLOCK)
    if signed:
        scale = blocks.abs().amax(1)
        div = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(blocks / div[:, None] * _SIGNED_MAX).to(torch.int8)
    else:
        root = blocks.clamp(min=0).sqrt()
        scale = root.amax(1)
        div = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(root / div[:, None] * _UNSIGNED_MAX)
        q = torch.where((blocks > 0) & (q < 1), torch.ones_like(q), q)
        codes = q.to(torch.uint8)
    return codes.reshape(-1)[:n].view(x.shape), scale


def dequantize(codes: Tensor, scales: Tensor) -> Tensor:
    """fp32 values of ``codes`` (int8: signed linear; uint8: linear in the square root) with per-block ``scales``
    (at least ``ceil(numel / BLOCK)`` of them; extra padding ignored)."""
    n = codes.numel()
    nb = max(1, math.ceil(n / BLOCK))
    c = torch.zeros(nb * BLOCK, dtype=torch.float32, device=codes.device)
    c[:n] = codes.reshape(-1).to(torch.float32)
    s = scales.reshape(-1)[:nb].to(torch.float32)
    if codes.dtype == torch.int8:
        out = c.view(nb, BLOCK) / _SIGNED_MAX * s[:, None]
    else:
        r = c.view(nb, BLOCK) / _UNSIGNED_MAX * s[:, None]
        out = r * r
    return out.reshape(-1)[:n].view(codes.shape)


def _shard_rows(like: Tensor) -> tuple[int, int]:
    """``(distinct shards, blocks of the largest local shard)`` of a weight (a DTensor or a plain tensor)."""
    if not hasattr(like, "to_local"):
        return 1, max(1, math.ceil(like.numel() / BLOCK))
    from torch.distributed.tensor import Shard

    shape = list(like.shape)
    shards = 1
    for size, pl in zip(like.device_mesh.shape, like.placements):
        if isinstance(pl, Shard):
            shards *= size
            shape[pl.dim] = math.ceil(shape[pl.dim] / size)  # torch.chunk: the first chunks are the largest
    return shards, max(1, math.ceil(math.prod(shape) / BLOCK))


def _wrap(like: Tensor, codes: Tensor, scales_row: Tensor) -> Int8Moment:
    """An ``Int8Moment`` placed like the weight ``like``: local ``codes``, this rank's ``scales_row`` (padded)."""
    shards, nb = _shard_rows(like)
    row = torch.zeros(1, nb, dtype=torch.float32, device=codes.device)
    row[0, : scales_row.numel()] = scales_row
    if not hasattr(like, "to_local"):
        return Int8Moment(codes, row)
    from torch.distributed.tensor import DTensor, Replicate, Shard

    c = DTensor.from_local(codes, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                           stride=like.stride())
    pl = [Shard(0) if isinstance(p, Shard) else Replicate() for p in like.placements]
    s = DTensor.from_local(row, like.device_mesh, pl, run_check=False, shape=torch.Size((shards, nb)),
                           stride=(nb, 1))
    return Int8Moment(c, s)


def zeros_like(weight: Tensor, signed: bool) -> Int8Moment:
    """The zero moment of ``weight`` (a DTensor's: its local shard's blocks)."""
    local = _local(weight)
    codes = torch.zeros(local.shape, dtype=torch.int8 if signed else torch.uint8, device=local.device)
    return _wrap(weight, codes, torch.zeros(0, device=local.device))


def load(m: Int8Moment) -> Tensor:
    """This rank's local shard of the moment in fp32."""
    return dequantize(_local(m.codes), _local(m.scales))


def store_(m: Int8Moment, value: Tensor) -> None:
    """Requantize fp32 ``value`` (the local shard) into ``m``'s own storage (the donated step)."""
    codes, scales = quantize(value, _local(m.codes).dtype == torch.int8)
    _local(m.codes).copy_(codes)
    row = _local(m.scales)
    row.zero_()
    row.view(-1)[: scales.numel()].copy_(scales)


def stored(like: Int8Moment, value: Tensor) -> Int8Moment:
    """A new ``Int8Moment`` placed like ``like`` holding fp32 ``value`` (the local shard; the pure step)."""
    codes, scales = quantize(value, _local(like.codes).dtype == torch.int8)
    return _wrap(like.codes, codes, scales)
