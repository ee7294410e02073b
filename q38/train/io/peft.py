"""LoRA runs (docs/finetuning.md#lora): the train state of a ``peft`` run and the reference its checkpoints keep to
the frozen base.

A LoRA checkpoint holds the adapters, their AdamW moments and the step (no base weights), and ``meta.json`` names
the base: ``{"init_from": path, "sha256": ...}`` (the hash of a Hugging Face directory's safetensors index, or of the
headers of its safetensors files when it has no index; of a q38 checkpoint's manifest), or for a fresh base
``{"init_from": null, "seed": N}``. A resume rebuilds the base from that reference and refuses another one.

``peft.base_dtype: fp8``: the base's projections are held in block-FP8 (``fp8_base``): a block-FP8 Hugging Face
checkpoint's e4m3 bits and scales kept as stored, anything else quantized per 128 × 128 block as each rank reads it.
"""

import hashlib
import json
from pathlib import Path

import torch

from q38.errors import ConfigError
from q38.lora import PeftConfig, add_adapters


class BaseMismatch(ConfigError):
    """A LoRA checkpoint was trained on another base than the run names."""


def _safetensors_headers_sha256(d: Path) -> str:
    from q38.train.io.untrusted import open_regular

    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")):
        with open_regular(f, "init_from", follow=True) as fh:  # a FIFO or device is refused, never waited on
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode())
            h.update(fh.read(min(n, 100 << 20)))
    return h.hexdigest()


def _file_sha256(f: Path) -> str:
    from q38.train.io.untrusted import sha256_file

    return sha256_file(f, follow=True)  # a Hugging Face cache links its files to blobs


def base_reference(init_from: str | None, seed: int) -> dict:
    """What identifies a LoRA run's base: its path and a hash of its index (see the module docstring)."""
    if not init_from:
        return {"init_from": None, "seed": int(seed)}
    from q38.train.io.checkpoint import MANIFEST_FILE, is_checkpoint, resolve_checkpoint

    p = Path(init_from)
    if (p / "config.json").is_file() and not is_checkpoint(p):
        index = p / "model.safetensors.index.json"
        digest = _file_sha256(index) if index.is_file() else _safetensors_headers_sha256(p)
        return {"init_from": str(p), "sha256": digest}
    ck = resolve_checkpoint(p)
    return {"init_from": str(ck), "sha256": _file_sha256(ck / MANIFEST_FILE)}


def check_base(meta: dict, ref: dict, where: str) -> None:
    """Refuse to resume the LoRA checkpoint ``where`` (its ``meta``) on another base than ``ref``."""
    saved = (meta.get("peft") or {}).get("base")
    if saved is None:
        raise BaseMismatch(f"{where} is not a LoRA checkpoint (its meta.json has no peft.base) but the run config has "
                           "a peft section; resume it without peft, or start the LoRA run in a new run.out_dir")
    if saved.get("sha256") != ref.get("sha256") or saved.get("seed") != ref.get("seed"):
        raise BaseMismatch(f"{where} trained its adapters on base {json.dumps(saved)}, but this run's base is "
                           f"{json.dumps(ref)}; set init_from to the checkpoint's base, or use a new run.out_dir")


def build_fp8_base(model_config, *, region, quantized, block: tuple[int, int], dtype, mesh=None, raw=None,
                   device=None):
    """The frozen base of a ``base_dtype: fp8`` run: every parameter ``quantized(path)`` as an ``Fp8Weight``
    (``bits`` and ``scale_inv`` each sharded on the weight's logical axes), every other in ``dtype`` (or
    ``dtype(path)``). Each rank
    builds only its own blocks: ``region(path, info, index)`` returns the fp32 values of block ``index`` (a tuple of
    slices) of parameter ``path``; a quantized shard reads the whole 128 × 128 blocks it touches and quantizes them
    (``amax / 448`` scales, as the released format does), so its bits and scales equal those of the whole tensor.
    ``raw(path, info, index, part)`` (a block-FP8 source): the stored ``bits`` / ``scale_inv`` of that block, kept
    as they are (no requantization); None for a parameter it does not hold in FP8 (then ``region`` is quantized)."""
    from torch.distributed.tensor import DTensor

    from q38.fp8 import Fp8Weight, quantize_blocks
    from q38.lora import scale_info
    from q38.model import abstract_params, is_param_info
    from q38.parallel.mesh import _contiguous_strides, local_index
    from q38.pytree import tree_map_with_path

    bo, bi = block

    def place(path, info, make_local):
        if mesh is None:
            return make_local(tuple(slice(0, n) for n in info.shape))
        placements = mesh.layout.placements_of_shapes([(path, info)], mesh.sizes)[path].dtensor_placements()
        local = make_local(local_index(info.shape, mesh, placements))
        return DTensor.from_local(local, mesh.device_mesh, placements, run_check=False,
                                  shape=torch.Size(info.shape), stride=_contiguous_strides(info.shape))

    def quantized_part(path, info, index, part):
        *lead, rows, cols = index
        o, i = info.shape[-2:]
        shape = tuple(sl.stop - sl.start for sl in index)
        if 0 in shape:
            return torch.empty(shape, dtype=torch.uint8 if part == "bits" else torch.float32, device=device)
        got = raw(path, info, index, part) if raw is not None else None
        if got is not None:
            return got
        if part == "bits":  # the whole blocks the shard touches
            r = slice(rows.start // bo * bo, min(-(-rows.stop // bo) * bo, o))
            c = slice(cols.start // bi * bi, min(-(-cols.stop // bi) * bi, i))
        else:  # index is a block range
            r = slice(rows.start * bo, min(rows.stop * bo, o))
            c = slice(cols.start * bi, min(cols.stop * bi, i))
        bits, scale = quantize_blocks(region(path, info, (*lead, r, c)), block)
        if part == "scale_inv":
            return scale
        # a copy: a view would keep the whole covering region's storage alive on this rank
        return bits[..., rows.start - r.start : rows.stop - r.start, cols.start - c.start : cols.stop - c.start].clone()

    def leaf(path, info):
        dt = dtype(path) if callable(dtype) else dtype  # TrainConfig.compute_dtype: fp32_params stay fp32
        if not quantized(path):
            return place(path, info, lambda index: region(path, info, index).to(dt))
        bits = place(f"{path}.bits", info, lambda index: quantized_part(path, info, index, "bits").contiguous())
        sinfo = scale_info(info, block)
        scale = place(f"{path}.scale_inv", sinfo, lambda index: quantized_part(path, info, index, "scale_inv"))
        return Fp8Weight(bits, scale, block=block, dtype=dt)

    return tree_map_with_path(leaf, abstract_params(model_config), is_leaf=is_param_info)


def _raw_fp8(src, reader):
    """``raw(path, info, index, part)`` for ``build_fp8_base`` over an opened block-FP8 Hugging Face
    checkpoint ``src``: the stored e4m3 bits (``uint8``) of block ``index`` of a q38 leaf, or its scales (``index``
    a range of blocks), read through the leaf's key rule; None for a leaf whose tensors are not all FP8. The scales
    are read per element and checked constant over each of q38's blocks (a q38 leaf assembled from several HF
    tensors, e.g. fused gate/up experts, keeps the release's scales only when their blocks line up)."""
    from safetensors import safe_open

    from q38.hf import CheckpointError
    from q38.fp8 import check_scales, dequantize, scale_key
    from q38.fp8 import covering as cover

    rules = src.leaf_rules()
    block = src.fp8.block
    bo, bi = block

    def read(key, hf_index, scales: bool):
        with safe_open(str(src.path / src.index[key]), framework="pt") as fh:
            sl = fh.get_slice(key)
            shape = tuple(sl.get_shape())
            rows, cols = hf_index if hf_index is not None else (slice(None), slice(None))
            rows, cols = (slice(*s.indices(n)[:2]) for s, n in zip((rows, cols), shape))
            if not scales:
                return sl[rows, cols].view(torch.uint8).clone()
        with safe_open(str(src.path / src.index[scale_key(key)]), framework="pt") as fh:
            br, bc = cover(rows, shape[0], bo), cover(cols, shape[1], bi)
            s = fh.get_slice(scale_key(key))[br, bc].float().clone()
        check_scales(s, f"{src.path / src.index[scale_key(key)]}: {scale_key(key)}", (br.start, bc.start))
        ones = torch.ones(rows.stop - rows.start, cols.stop - cols.start)
        return dequantize(ones, s, rows, cols, block)  # each element's scale

    def raw(path, info, index, part):
        rule, which = rules[path]
        if not all(k in src.quantized for k in rule.hf):
            return None
        if part == "bits":
            return rule.block(lambda i, hf_index: read(rule.hf[i], hf_index, False), which, index).contiguous()
        *lead, gr, gc = index
        o, i = info.shape[-2:]
        r, c = slice(gr.start * bo, min(gr.stop * bo, o)), slice(gc.start * bi, min(gc.stop * bi, i))
        each = rule.block(lambda i, hf_index: read(rule.hf[i], hf_index, True), which, (*lead, r, c))
        scale = each[..., ::bo, ::bi].contiguous()
        again = scale.repeat_interleave(bo, dim=-2)[..., : r.stop - r.start, :]
        if not torch.equal(again.repeat_interleave(bi, dim=-1)[..., : c.stop - c.start], each):
            raise CheckpointError(f"{src.path}: {path} is assembled from FP8 tensors whose {bo}x{bi} blocks do not "
                                  f"line up with its own (e.g. fused gate/up rows not a multiple of {bo}), so its "
                                  "scales cannot be kept as released; use peft.base_dtype: compute")
        return scale

    return raw


def fp8_base(model_config, init_from: str | None, *, seed: int, dtype, mesh=None, device=None):
    """The frozen base of a ``peft.base_dtype: fp8`` run (``build_fp8_base``): the projections the
    released FP8 checkpoints quantize (``q38.fp8.default_quantized``) as ``Fp8Weight`` s, every other leaf in
    ``dtype``; from ``init_from`` (a Hugging Face directory; a block-FP8 one keeps its bits and scales, in its own
    block size) or the seed's fresh init (quantized in 128 × 128 blocks). Each rank reads or draws only the blocks
    its shards touch."""
    from q38.fp8 import default_quantized
    from q38.layers.common import materialize

    if not init_from:
        def region(path, info, index):
            return materialize(info, path, seed=seed, device=device, dtype=torch.float32, index=index)

        return build_fp8_base(model_config, region=region, quantized=default_quantized, block=(128, 128),
                              dtype=dtype, mesh=mesh, device=device)
    from q38.hf import HFReader, open_hf
    from q38.train.io.checkpoint import CheckpointMismatch, config_diff

    src = open_hf(init_from)
    diff = config_diff(src.config.to_dict(), model_config.to_dict())
    if diff:
        raise CheckpointMismatch(f"init_from {init_from} holds another model than the config names "
                                 f"({'; '.join(diff[:6])}); set model: to {init_from} or to the matching preset")
    with HFReader(src, dtype=torch.float32, device=device) as reader:
        raw = _raw_fp8(src, reader) if src.fp8 is not None else None
        block = src.fp8.block if src.fp8 is not None else (128, 128)
        return build_fp8_base(model_config, region=lambda path, info, index: reader.block(path, index),
                              quantized=default_quantized, block=block, dtype=dtype, mesh=mesh, raw=raw,
                              device=device)


def lora_state(base, model_config, train_config, peft: PeftConfig, *, seed: int, mesh=None, device=None,
               kernels=None, empty: bool = False):
    """The state of a LoRA run over ``base`` (parameters, or DTensors on ``mesh``): adapters added (each rank
    drawing only its shards; ``empty``: allocated only, a resume's load target), the base in the compute dtype
    (fp32 for the ``train.fp32_params`` leaves; an ``Fp8Weight`` leaf of an FP8 base, ``fp8_base``, kept as it is),
    moments for the adapters only."""
    from q38.kernels import DEFAULT_KERNELS
    from q38.train.core.state import state_from_params

    make = None
    if mesh is not None:
        from q38.parallel.mesh import adapter_maker

        make = adapter_maker(mesh, seed=seed, device=device, empty=empty)
    elif empty:
        make = lambda path, info, like: torch.empty(info.shape, device=like.device)  # noqa: E731
    params = add_adapters(base, peft, seed=seed, make=make, base_dtype=train_config.compute_dtype)
    return state_from_params(params, model_config, train_config, kernels=kernels or DEFAULT_KERNELS, peft=peft)
