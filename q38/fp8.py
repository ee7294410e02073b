"""Block-FP8 checkpoints (the format of the released ``-FP8`` Qwen checkpoints and DeepSeek-V3; transformers calls it
"fine-grained FP8"): docs/hf_checkpoints.md#block-fp8-checkpoints.

``config.json`` carries ``quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [bo, bi], modules_to_not_convert: [...]}``. Each quantized ``X.weight [out, in]`` is stored as
``float8_e4m3fn`` with ``X.weight_scale_inv [ceil(out / bo), ceil(in / bi)]`` (fp32), and the weight is
``W[r, c] = float(q[r, c]) * scale_inv[r // bo, c // bi]``: one scale per ``bo x bi`` block (edge blocks are partial).
Quantizing a block: ``scale = amax(|W|) / 448`` (448 = the largest finite e4m3 value), ``q = W / scale`` rounded to
e4m3.

This module knows the format only (no q38 model): ``q38.hf`` reads and writes checkpoints with it, and a LoRA run's
frozen block-FP8 base (``Fp8Weight``, docs/finetuning.md#a-block-fp8-base) keeps its weights in it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs
import torch
import torch.utils._pytree as pytree
from jaxtyping import Float, UInt8
from torch import Tensor

__all__ = [
    "FP8_DTYPE", "FP8_MAX", "Fp8Format", "Fp8Weight", "SCALE_SUFFIX", "check_scales", "dequantize", "dequantize_blocks",
    "quantize",
    "quantize_blocks", "scale_key", "scale_shape", "default_quantized",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_SUFFIX = "_scale_inv"  # X.weight → X.weight_scale_inv


class Fp8FormatError(ValueError):
    """A ``quantization_config`` q38 cannot read (the message names the field and what q38 reads)."""


@attrs.frozen
class Fp8Format:
    """The ``quantization_config`` of a block-FP8 checkpoint."""

    block: tuple[int, int] = (128, 128)  # weight_block_size: rows (out), columns (in)
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] | None = None

    @classmethod
    def from_hf(cls, qc: Mapping[str, Any], source: str = "config.json") -> "Fp8Format":
        """Parse and check a ``quantization_config`` (``Fp8FormatError`` naming the field otherwise)."""
        method = qc.get("quant_method")
        if method != "fp8":
            raise Fp8FormatError(
                f"{source}: quantization_config.quant_method {method!r} is not read by q38 (it reads block-FP8 "
                "checkpoints, quant_method 'fp8'); dequantize the checkpoint to bf16 first"
            )
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise Fp8FormatError(f"{source}: quantization_config.fmt {fmt!r}: q38 reads e4m3 block-FP8 only")
        block = qc.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise Fp8FormatError(
                f"{source}: quantization_config.weight_block_size {block!r}: q38 reads block-wise FP8 only "
                "(two positive integers, e.g. [128, 128]); per-tensor or per-channel FP8 is not supported"
            )
        skip = qc.get("modules_to_not_convert")
        if skip is not None and not (isinstance(skip, (list, tuple)) and all(isinstance(s, str) for s in skip)):
            raise Fp8FormatError(f"{source}: quantization_config.modules_to_not_convert must be a list of names")
        return cls(block=(int(block[0]), int(block[1])), activation_scheme=str(qc.get("activation_scheme", "dynamic")),
                   modules_to_not_convert=None if skip is None else tuple(skip))

    def to_hf(self, not_converted: list[str]) -> dict[str, Any]:
        """The ``quantization_config`` of an export that leaves the modules ``not_converted`` unquantized (with
        those the source listed)."""
        skip = sorted(set(self.modules_to_not_convert or ()) | set(not_converted))
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": self.activation_scheme,
                "weight_block_size": list(self.block), "modules_to_not_convert": skip}

    def to_dict(self) -> dict[str, Any]:
        return {"weight_block_size": list(self.block), "activation_scheme": self.activation_scheme,
                "modules_to_not_convert": None if self.modules_to_not_convert is None
                else list(self.modules_to_not_convert)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Fp8Format":
        return cls.from_hf({"quant_method": "fp8", **d}, source="checkpoint metadata")


def check_scales(scale: Tensor, where: str, first_block: tuple[int, int] = (0, 0)) -> None:
    """Refuse block scales that are not finite and positive (NaN, Inf, zero or negative ``weight_scale_inv``): one
    ``Fp8FormatError`` naming ``where`` and the first bad block (``first_block``: the block index of
    ``scale[0, 0]``). A block-FP8 weight is ``q * scale_inv``: such a scale would turn the block into NaN, Inf or
    zeros without a word."""
    s = scale.float()
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        at = [int(x) for x in bad.nonzero()[0]]
        at[-2:] = [at[-2] + first_block[0], at[-1] + first_block[1]]
        raise Fp8FormatError(f"{where}: block scale {float(s[tuple(bad.nonzero()[0])]):g} at block {at} is not a "
                             "finite positive number (weight_scale_inv must be > 0 and finite); the checkpoint is "
                             "corrupt; use an intact copy")


def scale_key(key: str) -> str:
    """``X.weight`` → ``X.weight_scale_inv``."""
    return key + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a ``[out, in]`` weight: ``[ceil(out / bo), ceil(in / bi)]``."""
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def covering(sl: slice, n: int, b: int) -> slice:
    """The block indices (of size ``b``) that rows/columns ``sl`` of a dim of length ``n`` fall in."""
    start, stop, _ = sl.indices(n)
    return slice(start // b, max(start // b, (stop + b - 1) // b))


def dequantize(
    q: Tensor, scale: Float[Tensor, "br bc"], rows: slice, cols: slice, block: tuple[int, int]
) -> Float[Tensor, "r c"]:
    """fp32 ``W[rows, cols]`` from ``q = q_full[rows, cols]`` (e4m3) and ``scale = scale_inv[covering blocks]``
    (``rows`` / ``cols`` absolute, with resolved bounds: the block of each element is ``row // bo``)."""
    bo, bi = block
    r = torch.arange(rows.start, rows.stop, device=q.device) // bo - rows.start // bo
    c = torch.arange(cols.start, cols.stop, device=q.device) // bi - cols.start // bi
    return q.float() * scale.float()[r][:, c]


def quantize(w: Float[Tensor, "o i"], block: tuple[int, int]) -> tuple[Tensor, Float[Tensor, "bo bi"]]:
    """``(q e4m3 [o, i], scale_inv fp32 [ceil(o/bo), ceil(i/bi)])`` with ``scale = amax(|block|) / 448`` per
    block (an all-zero block gets scale 1)."""
    o, i = w.shape
    bo, bi = block
    go, gi = scale_shape((o, i), block)
    wf = w.detach().float()
    pad = torch.zeros(go * bo, gi * bi, dtype=torch.float32, device=w.device)
    pad[:o, :i] = wf
    blocks = pad.reshape(go, bo, gi, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(go * bo, gi * bi)[:o, :i].contiguous(), scale


# q38 leaves an FP8 export quantizes when no FP8 source says otherwise (by the leaf's name, any layer index): the
# projections of attention, GDN and the experts (the Linear layers released FP8 checkpoints quantize). Everything
# else stays in its 16/32-bit dtype: embeddings and lm_head, norms, A_log, dt_bias, the conv, the router and the
# shared-expert gate, the skinny GDN gates in_proj_b / in_proj_a, and the MTP fc.
DEFAULT_QUANTIZED = (
    "mixer.w_q", "mixer.w_k", "mixer.w_v", "mixer.w_o",  # attention
    "mixer.w_qkv", "mixer.w_z", "mixer.w_out",  # GDN
    "moe.we_gate_up", "moe.we_down", "moe.ws_gate", "moe.ws_up", "moe.ws_down",  # experts
)


def default_quantized(leaf: str) -> bool:
    """Whether an FP8 export quantizes q38 leaf ``leaf`` by default (``DEFAULT_QUANTIZED``)."""
    return any(leaf.endswith("." + s) for s in DEFAULT_QUANTIZED)


def block_misaligned(cfg, block: tuple[int, int]) -> list[str]:
    """The widths of model ``cfg`` (``name = value``) that are not a multiple of both sides of ``block``: a
    block-FP8 checkpoint of it has projections whose blocks do not line up with q38's weights (a fused gate/up, a
    head's slice), which a ``peft.base_dtype: fp8`` run cannot keep as stored. Empty: every quantized width (hidden,
    attention and GDN head dims, expert widths) is whole blocks; the released presets are."""
    names = ("hidden_size", "head_dim", "linear_key_head_dim", "linear_value_head_dim", "moe_intermediate_size",
             "shared_expert_intermediate_size")
    lcm = math.lcm(*block)
    return [f"{n} = {getattr(cfg, n)}" for n in names if getattr(cfg, n) % lcm]


# ---- a weight held in block-FP8 (a LoRA run's frozen base) ---------------------------------------------------------


def quantize_blocks(
    w: Float[Tensor, "*lead o i"], block: tuple[int, int]
) -> tuple[UInt8[Tensor, "*lead o i"], Float[Tensor, "*lead go gi"]]:
    """``quantize`` of every ``[o, i]`` matrix of ``w`` (leading dims: e.g. experts), the e4m3 values returned as
    their bits (``uint8``: the dtype collectives move; gloo refuses float8 tensors)."""
    *lead, o, i = w.shape
    flat = w.reshape(-1, o, i)
    qs = [quantize(m, block) for m in flat] if flat.shape[0] else []
    go, gi = scale_shape((o, i), block)
    if not qs:
        return (torch.empty(w.shape, dtype=torch.uint8, device=w.device),
                torch.empty((*lead, go, gi), dtype=torch.float32, device=w.device))
    q = torch.stack([a for a, _ in qs]).view(torch.uint8).reshape(w.shape)
    s = torch.stack([b for _, b in qs]).reshape(*lead, go, gi)
    return q, s


def dequantize_blocks(
    bits: UInt8[Tensor, "*lead o i"], scale_inv: Float[Tensor, "*lead go gi"], block: tuple[int, int], dtype
) -> Float[Tensor, "*lead o i"]:
    """The weight of e4m3 ``bits`` (uint8) and the scales of their whole ``[o, i]`` block grid (``scale_inv``
    ``[.., ceil(o / bo), ceil(i / bi)]``): ``float(q) * scale`` in fp32, then cast to ``dtype``."""
    o, i = bits.shape[-2:]
    bo, bi = block
    w = bits.view(FP8_DTYPE).float()
    if o % bo == 0 and i % bi == 0:  # whole blocks: scaled in place through a blocked view (no per-value scales)
        go, gi = o // bo, i // bi
        w.view(*w.shape[:-2], go, bo, gi, bi).mul_(scale_inv.float().view(*scale_inv.shape[:-2], go, 1, gi, 1))
        return w.to(dtype)
    s = scale_inv.float().repeat_interleave(bo, dim=-2)[..., :o, :].repeat_interleave(bi, dim=-1)[..., :i]
    return (w * s).to(dtype)


@attrs.frozen
class Fp8Weight:
    """A frozen weight held in block-FP8: ``bits`` ``[.., o, i]`` (uint8: the e4m3 bit patterns) and ``scale_inv``
    ``[.., ceil(o / bo), ceil(i / bi)]`` fp32, sharded on the weight's logical axes (each tensor chunked over the
    mesh on its own; the weight is dequantized only once both are gathered, so a shard border may cut a block).
    ``block`` and ``dtype`` (the compute dtype it is dequantized to) are static (the pytree context)."""

    bits: Tensor
    scale_inv: Tensor
    block: tuple[int, int] = attrs.field(default=(128, 128), kw_only=True)
    dtype: torch.dtype = attrs.field(default=torch.float32, kw_only=True)

    def dequantize(self) -> Tensor:
        """The weight in ``dtype`` (of gathered ``bits`` and ``scale_inv``)."""
        return dequantize_blocks(self.bits, self.scale_inv, self.block, self.dtype)


def _fp8_flatten(w: Fp8Weight):
    return [w.bits, w.scale_inv], (w.block, w.dtype)


def _fp8_unflatten(children, ctx) -> Fp8Weight:
    return Fp8Weight(*children, block=ctx[0], dtype=ctx[1])


pytree.register_pytree_node(
    Fp8Weight, _fp8_flatten, _fp8_unflatten, serialized_type_name="q38.fp8.Fp8Weight",
    flatten_with_keys_fn=lambda w: ([(pytree.GetAttrKey("bits"), w.bits),
                                     (pytree.GetAttrKey("scale_inv"), w.scale_inv)], (w.block, w.dtype)),
)
FP8_LEAVES = ("bits", "scale_inv")  # the leaf names of an Fp8Weight (``layers.0.mixer.w_q.base.bits``)
