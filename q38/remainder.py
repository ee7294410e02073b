"""bf16 + remainder master weights (``train.master_dtype: bfloat16_remainder``; docs/optimizer.md, "bf16 +
remainder masters").

An fp32 master ``x`` with bits ``u`` (32 bits, read as unsigned) is stored as two 16-bit halves:

- ``high = (u + 0x8000) >> 16``: the bf16 weight forward computes with (round half up on the magnitude bits: it is
  torch's round-to-nearest-even cast except at exact ties, a low half of ``0x8000``, where it rounds away from zero);
- ``remainder = u - (high << 16)``, in ``[-32768, 32767]``: an int16.

``(high << 16) + remainder`` is ``u`` again for every bit pattern (modulo 2**32), so the fp32 master is never lost.
(The 32768 NaN patterns per sign whose magnitude bits are ``0x7FFF8000`` or above carry into the sign bit: their
high half is a zero of the other sign; their join is still exact. A finite master never comes near them.)

Everything here is integer arithmetic on the bits (int32, wrapping), on plain tensors: the caller passes the local
shards of DTensors. ``join_`` / ``split_`` work in place with one int32 buffer per leaf (the fp32 master's own
storage), which is what the donated step's per-leaf temporaries are.
"""

import torch
from torch import Tensor

HALF = 0x8000


def split(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(high bf16, remainder int16)`` of fp32 ``x`` (new tensors)."""
    if x.dtype != torch.float32:
        raise TypeError(f"split takes fp32 masters, got {x.dtype}")
    high = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    rem = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    split_(x.detach().clone(), high, rem)
    return high, rem


def split_(x: Tensor, high: Tensor, rem: Tensor) -> None:
    """Write the halves of fp32 ``x`` into ``high`` (bf16) and ``rem`` (int16), in place. ``x`` is used as the
    work buffer and holds garbage afterwards (the donated step drops it right after)."""
    t = x.view(torch.int32)
    t.add_(HALF)  # u + 0x8000 (wrapping)
    rem.copy_(t)  # its low 16 bits (the int32 -> int16 conversion keeps them) ...
    rem.bitwise_xor_(-HALF)  # ... minus 0x8000, modulo 2**16: the remainder
    t.bitwise_right_shift_(16)
    high.view(torch.int16).copy_(t)  # the low 16 bits of (u + 0x8000) >> 16: the high half


def join(high: Tensor, rem: Tensor) -> Tensor:
    """The fp32 master of ``high`` (bf16) and ``rem`` (int16), a new tensor."""
    if high.dtype != torch.bfloat16 or rem.dtype != torch.int16:
        raise TypeError(f"join takes a bf16 high half and an int16 remainder, got {high.dtype} and {rem.dtype}")
    t = torch.empty(high.shape, dtype=torch.int32, device=high.device)
    t.copy_(high.view(torch.int16))
    t.bitwise_left_shift_(16)
    t.add_(rem)
    return t.view(torch.float32)


def is_remainder_path(path: str, train_config) -> bool:
    """Whether parameter ``path`` keeps its master as bf16 + remainder under ``train_config``: every leaf computed
    in bf16 (``compute_dtype``), none of the ``fp32_params`` leaves (those keep an fp32 master)."""
    return (train_config.master_dtype == "bfloat16_remainder"
            and train_config.compute_dtype(path) == torch.bfloat16)
