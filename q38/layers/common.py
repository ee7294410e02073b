"""Parameter declarations shared by every layer file: ``ParamInfo`` (shape + init rule) and materialisation."""

import hashlib
import math

import attrs
import torch
from torch import Tensor


@attrs.frozen
class ParamInfo:
    """What a parameter is before it exists: its global shape and how to initialise it.

    ``init`` is one of ``normal`` (std = ``std``), ``zeros``, ``ones``, ``a_log`` (log U(0.01, 16), the GDN decay).
    """

    shape: tuple[int, ...]
    init: str = "normal"
    std: float = 0.02

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def leaf_generator(seed: int, path: str) -> torch.Generator:
    """A CPU generator whose seed depends only on (seed, parameter path): init is mesh-independent."""
    h = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))
    return g


def materialize(info: ParamInfo, path: str, *, seed: int, device=None, dtype=None) -> Tensor:
    """Create one parameter tensor from its ``ParamInfo``; values depend only on ``seed`` and ``path``."""
    dtype = dtype or torch.float32
    if torch.device(device or "cpu").type == "meta":
        return torch.empty(info.shape, device="meta", dtype=dtype)
    if info.init == "zeros":
        t = torch.zeros(info.shape, dtype=torch.float32)
    elif info.init == "ones":
        t = torch.ones(info.shape, dtype=torch.float32)
    else:
        g = leaf_generator(seed, path)
        if info.init == "normal":
            t = torch.randn(info.shape, generator=g, dtype=torch.float32) * info.std
        elif info.init == "a_log":
            t = torch.empty(info.shape, dtype=torch.float32).uniform_(0.01, 16.0, generator=g).log_()
        else:
            raise ValueError(f"unknown init rule {info.init!r} for parameter {path}")
    return t.to(device=device, dtype=dtype)


# ---- kernel regions ------------------------------------------------------------------------------------
# Layers mark the span of a hot kernel (attention, GDN core) so selective recompute can keep its outputs
# (``skip_flash_attn_recompute`` / ``skip_gdn_recompute``). A thread-local name; no effect on the math.
import contextlib
import threading

_REGION = threading.local()


@contextlib.contextmanager
def kernel_region(name: str):
    prev = getattr(_REGION, "name", None)
    _REGION.name = name
    try:
        yield
    finally:
        _REGION.name = prev


def current_region() -> str | None:
    return getattr(_REGION, "name", None)
