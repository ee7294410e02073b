"""Parameter declarations shared by every layer file: ``ParamInfo`` (shape + init rule) and materialisation."""

import hashlib
import math
from typing import Protocol, runtime_checkable

import attrs
import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor


def _default_fsdp_dim(self) -> int | None:
    return 0 if len(self.shape) >= 2 else None


@attrs.frozen
class ParamInfo:
    """What a parameter is before it exists: its global shape, how to initialise it, and how it may be sharded.

    ``init`` is one of ``normal`` (std = ``std``), ``zeros``, ``ones``, ``a_log`` (log U(0.01, 16), the GDN decay).

    ``axes`` names one *logical axis* per tensor dim (``None`` = unnamed); a layout's ``rules`` map logical axes to
    mesh dims (docs/parallel.md#what-a-layout-is). ``fsdp_dim`` is the dim that carries the FSDP role: every layout's ``fsdp`` mesh dims
    shard it (the largest dim: the output rows of a projection, the ``d`` dim of skinny gates). It defaults to dim 0
    for matrices and to ``None`` (never FSDP-sharded) for vectors, so a new weight is FSDP-sharded unless it says
    otherwise.
    """

    shape: tuple[int, ...]
    init: str = "normal"
    std: float = 0.02
    axes: tuple[str | None, ...] | None = attrs.field(default=None, kw_only=True)
    fsdp_dim: int | None = attrs.field(default=attrs.Factory(_default_fsdp_dim, takes_self=True), kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.axes is None:
            object.__setattr__(self, "axes", (None,) * len(self.shape))
        if len(self.axes) != len(self.shape):
            raise ValueError(
                f"ParamInfo of shape {list(self.shape)} declares {len(self.axes)} logical axes {list(self.axes)}; "
                "give one logical axis (or None) per tensor dim"
            )
        if self.fsdp_dim is not None and not 0 <= self.fsdp_dim < len(self.shape):
            raise ValueError(f"ParamInfo of shape {list(self.shape)}: fsdp_dim {self.fsdp_dim} is not a dim of it")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def leaf_generator(seed: int, path: str, block: int = 0) -> torch.Generator:
    """A CPU generator whose seed depends only on (seed, parameter path, row block): init is mesh-independent."""
    h = hashlib.sha256(f"{seed}:{path}:{block}".encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))
    return g


def _rows_per_block(shape: tuple[int, ...]) -> int:
    """Random values are drawn in blocks of dim-0 rows (about 1M values each, a function of the shape only), so
    a rank can draw just the rows of its shard and still get the values every other mesh would give."""
    return max(1, (1 << 20) // max(1, math.prod(shape[1:])))


def materialize(
    info: ParamInfo, path: str, *, seed: int, device=None, dtype=None, index: tuple[slice, ...] | None = None
) -> Tensor:
    """Create one parameter tensor (or the sub-block ``index`` of it, e.g. a shard) from its ``ParamInfo``; values
    depend only on ``seed`` and ``path``. ``dtype``: a dtype, or ``dtype(path)`` (e.g. ``TrainConfig.compute_dtype``)."""
    dtype = (dtype(path) if callable(dtype) else dtype) or torch.float32
    full = tuple(slice(0, n) for n in info.shape)
    index = tuple(index) if index is not None else full
    shape = tuple(sl.stop - sl.start for sl in index)
    if torch.device(device or "cpu").type == "meta":
        return torch.empty(shape, device="meta", dtype=dtype)
    # Values are drawn on the CPU (seeded CPU generators, so init is identical on every device and mesh) and moved
    # to ``device`` at the end: these CPU tensors never reach a collective.
    if info.init == "zeros":
        t = torch.zeros(shape, dtype=torch.float32)
    elif info.init == "ones":
        t = torch.ones(shape, dtype=torch.float32)
    elif info.init in ("normal", "a_log"):
        r = _rows_per_block(info.shape)
        lo, hi = index[0].start, index[0].stop
        blocks = []
        for b in range(lo // r, (hi - 1) // r + 1 if hi > lo else lo // r):
            rows = min(r, info.shape[0] - b * r)
            g = leaf_generator(seed, path, b)
            if info.init == "normal":
                blk = torch.randn((rows, *info.shape[1:]), generator=g, dtype=torch.float32) * info.std
            else:
                blk = torch.empty((rows, *info.shape[1:]), dtype=torch.float32).uniform_(0.01, 16.0, generator=g).log_()
            blocks.append(blk[max(lo - b * r, 0) : hi - b * r])
        t = torch.cat(blocks) if blocks else torch.empty((0, *info.shape[1:]))
        t = t[(slice(None), *index[1:])].contiguous()
    else:
        raise ValueError(f"unknown init rule {info.init!r} for parameter {path}")
    return t.to(device=device, dtype=dtype)



@runtime_checkable
class WeightNode(Protocol):
    """A weight in compute form that computes its own products (a LoRA run's adapted weight, base and adapter
    unmerged, or a frozen block-FP8 weight: ``q38.lora``); the layers' matmul helpers dispatch on it."""

    def linear(self, x: Tensor) -> Tensor: ...

    def grouped_mm(self, x_md: Tensor, offs: Tensor) -> Tensor: ...

    def bmm(self, x_eqd: Tensor) -> Tensor: ...


def linear(x: Float[Tensor, "... i"], w) -> Float[Tensor, "... o"]:
    """``x·wᵀ`` of a projection weight ``[o, i]``: a tensor, or a weight node in compute form (a LoRA run's adapted
    or block-FP8 weight, ``q38.lora``), which computes its own product (the frozen base's and the adapter's,
    unmerged: ``node.linear(x)``)."""
    return F.linear(x, w) if isinstance(w, Tensor) else w.linear(x)
