"""Hugging Face checkpoint I/O: ``load_hf`` / ``save_hf`` between a HF directory and ``(ModelConfig, ModelParams)``,
for the Qwen3.5-MoE and Qwen3-Next layouts and their MTP keys (the key tables: docs/hf_checkpoints.md).

The q38 ↔ HF correspondence is data: the ``*_RENAMES`` tables here (one q38 leaf ↔ one HF key), the per-expert
converter, and each mixer kind's record in ``q38.layers.kinds``; ``_plan`` turns them into one ``Rule`` per leaf
group, the one list loading, saving and key validation all walk. Loading reads only the slices a block needs
(``HFReader``); saving is planned before any tensor exists (``plan_export``) and streams file by file into a
temporary sibling directory renamed into place (docs/checkpoints.md).
"""

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import attrs
import torch
from torch import Tensor

from q38.hf_config import config_from_hf, hf_config_dict, read_hf_config
from q38.model_config import ConfigError, ModelConfig
from q38.fp8 import (
    FP8_DTYPE, Fp8Format, Fp8FormatError, check_scales, covering, default_quantized, dequantize, quantize, scale_key,
    scale_shape,
)
from q38.layers.hf_keys import CheckpointLayout, Rule, rename_rule, renames
from q38.layers.kinds import GDN_FLAT_RENAMES, MIXER_KINDS, MTP_LAYER_TYPE
from q38.model import ModelParams, abstract_params, is_param_info
from q38.pytree import named_leaves, tree_map_with_path

__all__ = [
    "CheckpointError", "ExportExtras", "HFReader", "HFSource", "load_hf", "open_hf", "save_hf", "fp8_dtypes",
    "DEFAULT_MAX_SHARD_BYTES",
]

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # transformers' "5GB"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Keys of a multimodal checkpoint that the text model never reads.
IGNORED_KEYS = re.compile(r"^(model\.visual\.|visual\.)")
_LIST_LIMIT = 20


class CheckpointError(ValueError):
    """A checkpoint directory does not match the model config (missing / unexpected keys, wrong shapes)."""


# ---- the key tables -------------------------------------------------------------------------------------------------
# Model-level leaves. ``{p}`` is the text prefix (``model.`` or ``model.language_model.``).
MODEL_RENAMES = {
    "embed": "{p}embed_tokens.weight",
    "final_norm": "{p}norm.weight",
    "lm_head": "lm_head.weight",
}
MTP_RENAMES = {
    "mtp.norm_emb": "mtp.pre_fc_norm_embedding.weight",
    "mtp.norm_hidden": "mtp.pre_fc_norm_hidden.weight",
    "mtp.fc": "mtp.fc.weight",  # [d, 2d]: columns [0:d] embedding, [d:2d] hidden (same in both)
    "mtp.norm": "mtp.norm.weight",
}
# Decoder-layer leaves, relative to ``layers.{i}.`` (q38) and ``{p}layers.{i}.`` / ``mtp.layers.{j}.`` (HF).
LAYER_RENAMES = {
    "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "moe.w_router": "mlp.gate.weight",
    "moe.ws_gate": "mlp.shared_expert.gate_proj.weight",
    "moe.ws_up": "mlp.shared_expert.up_proj.weight",
    "moe.ws_down": "mlp.shared_expert.down_proj.weight",
    "moe.w_shared_gate": "mlp.shared_expert_gate.weight",
}
FUSED_EXPERT_RENAMES = {
    "moe.we_gate_up": "mlp.experts.gate_up_proj",  # [e, 2f, d]: rows [0:f] gate, [f:2f] up
    "moe.we_down": "mlp.experts.down_proj",  # [e, d, f]
}
PER_EXPERT_KEY = "mlp.experts.{i}.{proj}_proj.weight"  # gate/up [f, d], down [d, f]


# ---- rules ----------------------------------------------------------------------------------------------------------
def _per_expert(q_gate_up: str, q_down: str, hp: str, e: int, f: int, d: int) -> list[Rule]:
    """Fused q38 ``[e, 2f, d]`` / ``[e, d, f]`` ↔ HF ``experts.{i}.{gate,up,down}_proj.weight``."""
    gu_keys = tuple(hp + PER_EXPERT_KEY.format(i=i, proj=proj) for i in range(e) for proj in ("gate", "up"))
    down_keys = tuple(hp + PER_EXPERT_KEY.format(i=i, proj="down") for i in range(e))

    def gu_to_hf(t):
        return tuple(t[i, j * f : (j + 1) * f] for i in range(e) for j in range(2))

    def gu_block(read, which, index):
        ex, rows, cols = index

        def parts():  # expert i's rows [0:f] are HF tensor 2i (gate), [f:2f] tensor 2i+1 (up)
            for i in range(ex.start, ex.stop):
                for j in range(2):
                    lo, hi = max(rows.start, j * f), min(rows.stop, (j + 1) * f)
                    if lo < hi:
                        yield i - ex.start, lo - rows.start, read(2 * i + j, (slice(lo - j * f, hi - j * f), cols))

        return _assemble(parts(), (ex.stop - ex.start, rows.stop - rows.start, cols.stop - cols.start))

    def down_block(read, which, index):
        ex, rows, cols = index
        parts = ((i - ex.start, 0, read(i, (rows, cols))) for i in range(ex.start, ex.stop))
        return _assemble(parts, (ex.stop - ex.start, rows.stop - rows.start, cols.stop - cols.start))

    return [
        Rule((q_gate_up,), gu_keys, ((f, d),) * (2 * e), gu_to_hf, gu_block),
        Rule((q_down,), down_keys, ((d, f),) * e, lambda t: tuple(t[i] for i in range(e)), down_block),
    ]


def _assemble(parts, shape: tuple[int, int, int]) -> Tensor:
    """An ``[e, r, c]`` block from per-expert pieces ``(expert, first row, [rows, c] tensor)``, read one at a time."""
    out = None
    for i, r, t in parts:
        if out is None:
            out = torch.empty(shape, dtype=t.dtype, device=t.device)
        out[i, r : r + t.shape[0]] = t
    if out is None:  # an empty block (no experts on this rank)
        raise AssertionError(f"empty expert block of shape {shape}")
    return out


def _abstract_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{q38 path: shape}`` of every parameter (``lm_head`` / ``mtp`` are ``None`` leaves when absent)."""
    leaves = named_leaves(abstract_params(cfg), is_leaf=is_param_info)
    return {path: info.shape for path, info in leaves if info is not None}


def _plan(cfg: ModelConfig, layout: CheckpointLayout) -> list[Rule]:
    """One ``Rule`` per q38 leaf group, in checkpoint order; covers every leaf of ``abstract_params(cfg)`` once."""
    shapes = _abstract_shapes(cfg)
    p = layout.prefix
    e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    rules = [rename_rule(q, h.format(p=p), shapes[q]) for q, h in MODEL_RENAMES.items() if q in shapes]

    def layer(qp: str, hp: str, layer_type: str) -> None:
        rules.extend(MIXER_KINDS[layer_type].hf_rules(cfg, layout, qp + "mixer.", hp, shapes))
        rules.extend(renames(LAYER_RENAMES, qp, hp, shapes))
        if layout.fused_experts(hp):
            rules.extend(renames(FUSED_EXPERT_RENAMES, qp, hp, shapes))
        else:
            rules.extend(_per_expert(qp + "moe.we_gate_up", qp + "moe.we_down", hp, e, f, d))

    for i, t in enumerate(cfg.layer_types):
        layer(f"layers.{i}.", f"{p}layers.{i}.", t)
    if cfg.mtp_num_layers > 0:
        rules.extend(rename_rule(q, h, shapes[q]) for q, h in MTP_RENAMES.items())
        for j in range(cfg.mtp_layers_stored):  # one layer for every depth when shared
            layer(f"mtp.layers.{j}.", f"mtp.layers.{j}.", MTP_LAYER_TYPE)

    covered = [q for r in rules for q in r.q38]
    if sorted(covered) != sorted(shapes):  # a new ModelParams leaf without a table entry is a bug here
        raise AssertionError(
            f"q38.hf key tables out of sync with ModelParams: unmapped {sorted(set(shapes) - set(covered))}, "
            f"unknown {sorted(set(covered) - set(shapes))}"
        )
    return rules


# ---- loading --------------------------------------------------------------------------------------------------------
def _fmt_list(title: str, items: list[str]) -> str:
    shown = "\n    ".join(items[:_LIST_LIMIT])
    more = f"\n    ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else ""
    return f"  {title} ({len(items)}):\n    {shown}{more}"


def _checkpoint_index(path: Path) -> dict[str, str]:
    """``{key: file name}`` of a single-file or sharded safetensors checkpoint. Every file the index names must be
    a regular file inside ``path`` (a symlink only into ``path`` or its hub cache's blobs: ``q38.files.inside``)."""
    from q38.files import inside, load_json  # the checkpoint reader's file rules (a leaf module)

    if (path / INDEX_FILE).is_file() or (path / INDEX_FILE).is_symlink():
        where = str(path / INDEX_FILE)
        index = load_json(inside(path, INDEX_FILE, where, follow=True), where, follow=True)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{path / INDEX_FILE}: no 'weight_map' mapping of tensor names to file names")
        for fn in dict.fromkeys(weight_map.values()):  # refused: a name that is not a file inside ``path``
            inside(path, fn, f"{where}: shard file", follow=True)
        return dict(weight_map)
    if (path / SINGLE_FILE).is_file() or (path / SINGLE_FILE).is_symlink():
        from safetensors import safe_open

        f = inside(path, SINGLE_FILE, f"checkpoint {path}", follow=True)
        with safe_open(str(f), framework="pt") as fh:
            return {k: SINGLE_FILE for k in fh.keys()}
    raise CheckpointError(f"checkpoint {path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _load_layout(cfg: ModelConfig, keys: set[str]) -> CheckpointLayout:
    """Detect the text prefix, GDN projection layout and per-layer expert layout from the keys present."""
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in keys) else "model."
    has_flat = any(k.endswith(GDN_FLAT_RENAMES["w_qkv"]) for k in keys)
    has_grouped = any(k.endswith("linear_attn.in_proj_qkvz.weight") for k in keys)
    grouped = has_grouped or (cfg.family.checkpoint_layout == "qwen3_next" and not has_flat)

    def fused(hp: str) -> bool:
        if hp + FUSED_EXPERT_RENAMES["moe.we_gate_up"] in keys or hp + FUSED_EXPERT_RENAMES["moe.we_down"] in keys:
            return True
        if hp + PER_EXPERT_KEY.format(i=0, proj="gate") in keys or any(k.startswith(hp + "mlp.experts.") for k in keys):
            return False
        # Nothing there: report the layout this family normally uses (Qwen3.5 main layers fused).
        return cfg.family.checkpoint_layout == "qwen3_5_moe" and not hp.startswith("mtp.")

    return CheckpointLayout(prefix=prefix, gdn_grouped=grouped, fused_experts=fused)


_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_FP8_ST = "F8_E4M3"


@attrs.frozen
class HFSource:
    """A Hugging Face checkpoint directory opened and validated against its config (keys, shapes, dtypes from the
    safetensors headers; no tensor is read): ``rules`` map it onto q38 leaves. ``fp8``: the block-FP8 format of a
    quantized checkpoint (``q38.fp8``), whose keys ``quantized`` are stored in e4m3 with a ``_scale_inv`` each;
    ``dtypes``: the safetensors dtype of every HF key the model reads."""

    path: Path
    config: ModelConfig
    index: dict  # HF key -> file name
    layout: CheckpointLayout
    rules: list
    fp8: Fp8Format | None = None
    quantized: frozenset = frozenset()
    dtypes: dict = attrs.field(factory=dict)

    def leaf_rules(self) -> dict[str, tuple[Rule, int]]:
        """``{q38 leaf: (its rule, which of the rule's q38 outputs)}``."""
        return {q: (r, w) for r in self.rules for w, q in enumerate(r.q38)}

    def source_dtype(self, leaf: str) -> torch.dtype:
        """The dtype the checkpoint stores q38 leaf ``leaf`` in (its rule's first HF tensor; ``float8_e4m3fn`` for
        a quantized one)."""
        rule, _ = self.leaf_rules()[leaf]
        return _dtype_of(self.dtypes[rule.hf[0]])

    def source_format(self) -> dict:
        """What an export needs to write this checkpoint's format again (JSON; kept in a q38 checkpoint's
        metadata): ``dtypes``, the stored dtype of each q38 leaf kind (``layers.*.mixer.A_log``; a leaf whose dtype
        differs from its kind's most common one is listed under its own path too), and ``fp8``, the block-FP8 format
        (``None``: not quantized)."""
        from collections import Counter

        from q38.model import generic_path

        by_kind: dict[str, Counter] = {}
        per_leaf = {}
        for r in self.rules:
            for q in r.q38:
                dt = str(_dtype_of(self.dtypes[r.hf[0]])).removeprefix("torch.")
                per_leaf[q] = dt
                by_kind.setdefault(generic_path(q), Counter())[dt] += 1
        dtypes = {k: c.most_common(1)[0][0] for k, c in by_kind.items()}
        dtypes.update({q: dt for q, dt in per_leaf.items() if dtypes[generic_path(q)] != dt})
        return {"dtypes": dtypes, "fp8": None if self.fp8 is None else self.fp8.to_dict()}


def _fp8_format(path: Path) -> Fp8Format | None:
    """The block-FP8 format of ``path/config.json`` (``None`` without a ``quantization_config``)."""
    raw = read_hf_config(path)
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{path}/config.json: quantization_config must be a mapping, got {type(qc).__name__}")
    try:
        return Fp8Format.from_hf(qc, source=f"{path}/config.json")
    except Fp8FormatError as e:
        raise CheckpointError(str(e)) from None


def open_hf(path: str | os.PathLike, *, mtp_num_layers: int | None = None,
            mtp_shared_layer: bool | None = None) -> HFSource:
    """Open a HF checkpoint directory (``config.json`` + safetensors, bf16/fp32 or block-FP8) and validate every key,
    shape and dtype the model needs. ``mtp_num_layers`` / ``mtp_shared_layer``: override the config's MTP depth
    and sharing (see ``load_hf``). Raises ``CheckpointError`` naming every missing, unexpected, wrongly shaped or
    non-float key (an FP8 weight without its scale, or a scale of the wrong shape, included)."""
    from safetensors import safe_open

    path = Path(path)
    cfg = config_from_hf(path)
    if mtp_num_layers is not None:
        cfg = cfg.replace(mtp_num_layers=int(mtp_num_layers))
    if mtp_shared_layer is not None:
        cfg = cfg.replace(mtp_shared_layer=bool(mtp_shared_layer))
    fp8 = _fp8_format(path)
    index = _checkpoint_index(path)
    layout = _load_layout(cfg, set(index))
    rules = _plan(cfg, layout)
    expected = {k: s for r in rules for k, s in zip(r.hf, r.hf_shapes)}
    missing = [k for k in expected if k not in index]
    scales = {scale_key(k): k for k in expected}
    ignored = lambda k: (  # noqa: E731
        bool(IGNORED_KEYS.match(k))
        or (mtp_num_layers is not None and k.startswith("mtp."))
        or (cfg.tie_word_embeddings and k == "lm_head.weight")
    )
    bad_shapes, bad_dtypes = [], []
    dtypes: dict[str, str] = {}
    quantized: set[str] = set()
    by_file: dict[str, list[str]] = {}
    for k in expected:
        if k in index:
            by_file.setdefault(index[k], []).append(k)
    for fn, keys in by_file.items():
        with safe_open(str(path / fn), framework="pt") as fh:
            for k in keys:
                sl = fh.get_slice(k)
                got = tuple(sl.get_shape())
                dtypes[k] = sl.get_dtype()
                if got != tuple(expected[k]):
                    bad_shapes.append(f"{k}: checkpoint {list(got)}, expected {list(expected[k])}")
                if dtypes[k] == _FP8_ST:
                    why = _fp8_problem(k, got, fp8, index)
                    if why:
                        bad_dtypes.append(why)
                    else:
                        quantized.add(k)
                elif dtypes[k] not in _FLOAT_DTYPES:
                    bad_dtypes.append(f"{k}: {dtypes[k]}, expected a float dtype ({', '.join(sorted(_FLOAT_DTYPES))}"
                                      f"{', or F8_E4M3 with a weight_scale_inv' if fp8 else ''})")
    for k in sorted(quantized):  # the scales: fp32 (or another float), one per block
        sk = scale_key(k)
        with safe_open(str(path / index[sk]), framework="pt") as fh:
            sl = fh.get_slice(sk)
            want = scale_shape(expected[k], fp8.block)
            if tuple(sl.get_shape()) != want:
                bad_shapes.append(f"{sk}: checkpoint {list(sl.get_shape())}, expected {list(want)} (one scale per "
                                  f"{fp8.block[0]}x{fp8.block[1]} block of {k} {list(expected[k])})")
            if sl.get_dtype() not in _FLOAT_DTYPES:
                bad_dtypes.append(f"{sk}: {sl.get_dtype()}, expected a float dtype (F32)")
    unexpected = sorted(k for k in index if k not in expected and not ignored(k)
                        and not (k in scales and scales[k] in quantized))
    if missing or unexpected or bad_shapes or bad_dtypes:
        parts = [
            f"checkpoint {path} does not match its config (model_type {cfg.model_type}, "
            f"{cfg.num_hidden_layers} layers, mtp_num_layers {cfg.mtp_num_layers}, text prefix {layout.prefix!r}):"
        ]
        if missing:
            parts.append(_fmt_list("missing keys", missing))
        if unexpected:
            parts.append(_fmt_list("unexpected keys", unexpected))
        if bad_shapes:
            parts.append(_fmt_list("shape mismatches", bad_shapes))
        if bad_dtypes:
            parts.append(_fmt_list("dtype mismatches", bad_dtypes))
        if any(k.startswith("mtp.") for k in missing) and not any(k.startswith("mtp.") for k in index):
            parts.append(
                "  hint: the checkpoint has no mtp.* weights (transformers' save_pretrained drops them); "
                "pass mtp_num_layers=0 to load it without MTP"
            )
        raise CheckpointError("\n".join(parts))
    return HFSource(path, cfg, index, layout, rules, fp8, frozenset(quantized), dtypes)


def _fp8_problem(k: str, shape: tuple, fp8: Fp8Format | None, index: dict) -> str | None:
    """Why the e4m3 tensor ``k`` cannot be read (None: it can)."""
    if fp8 is None:
        return (f"{k}: F8_E4M3, but config.json has no quantization_config (quant_method fp8, weight_block_size): "
                "without the block scales the weights would be wrong; add the checkpoint's quantization_config")
    if len(shape) != 2 or not k.endswith(".weight"):
        return f"{k}: F8_E4M3 {list(shape)}: block-FP8 quantizes 2-D X.weight tensors only"
    if scale_key(k) not in index:
        return (f"{k}: F8_E4M3 without {scale_key(k)}: the block scales are missing (loading FP8 weights without "
                "them gives wrong weights); use the complete checkpoint")
    return None


class HFReader:
    """Reads blocks of q38 leaves from an opened HF checkpoint, each HF tensor sliced in the file (safetensors
    ``get_slice``): a rank reads only the bytes of its shards, except for rules that need a whole HF tensor (the
    grouped Qwen3-Next projections), which read that one tensor and keep the block. A block-FP8 tensor is read the
    same way, its slice of e4m3 values and the scales of the blocks the slice touches, and dequantized in fp32
    (then cast to the reader's dtype; fp32 when it has none). Each read opens the file and
    closes it again: safetensors maps the whole file, and the pages a read touches stay resident (and counted in
    the process's memory) for as long as the map is open. Use as a context manager."""

    def __init__(self, src: HFSource, *, dtype=None, device=None):
        self.src, self.dtype, self.device = src, dtype, device
        self._rules = src.leaf_rules()
        self.bytes_read = 0

    def __enter__(self) -> "HFReader":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _read(self, key: str, index: tuple[slice, ...] | None, dtype=None) -> Tensor:
        from safetensors import safe_open

        if key in self.src.quantized:
            return self._read_fp8(key, index, dtype)
        with safe_open(str(self.src.path / self.src.index[key]), framework="pt") as fh:
            t = fh.get_tensor(key) if index is None else fh.get_slice(key)[index]
            # a copy that owns its memory: what safetensors returns is a view of its map of the whole file
            t = t.to(device=self.device, dtype=dtype, copy=True)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _read_fp8(self, key: str, index: tuple[slice, ...] | None, dtype=None) -> Tensor:
        """Block ``index`` of the e4m3 weight ``key``: the slice's values and the scales of the blocks it touches."""
        from safetensors import safe_open

        block = self.src.fp8.block
        sk = scale_key(key)
        with safe_open(str(self.src.path / self.src.index[key]), framework="pt") as fh:
            sl = fh.get_slice(key)
            shape = tuple(sl.get_shape())
            rows, cols = index if index is not None else (slice(None), slice(None))
            rows, cols = (slice(*s.indices(n)[:2]) for s, n in zip((rows, cols), shape))
            q = sl[rows, cols].to(device=self.device, copy=True)
        with safe_open(str(self.src.path / self.src.index[sk]), framework="pt") as fh:
            br, bc = covering(rows, shape[0], block[0]), covering(cols, shape[1], block[1])
            scale = fh.get_slice(sk)[br, bc].to(device=self.device, dtype=torch.float32, copy=True)
        check_scales(scale, f"{self.src.path / self.src.index[sk]}: {sk}", (br.start, bc.start))
        self.bytes_read += q.numel() * q.element_size() + scale.numel() * scale.element_size()
        return dequantize(q, scale, rows, cols, block).to(dtype or torch.float32)

    def stored_dtype(self, leaf: str) -> torch.dtype:
        """The dtype leaf ``leaf`` loads in without a cast: its stored dtype (its rule's first HF tensor), fp32 for
        a block-FP8 one (dequantized)."""
        dt = self.src.source_dtype(leaf)
        return torch.float32 if dt == FP8_DTYPE else dt

    def block(self, leaf: str, index: tuple[slice, ...]) -> Tensor:
        """The block ``index`` of q38 leaf ``leaf`` (contiguous, in the reader's dtype, or ``dtype(leaf)`` when the
        reader's dtype is a function of the leaf, and device)."""
        rule, which = self._rules[leaf]
        dtype = self.dtype(leaf) if callable(self.dtype) else self.dtype
        shape = tuple(sl.stop - sl.start for sl in index)
        if 0 in shape:
            return torch.empty(shape, dtype=dtype or self.stored_dtype(leaf), device=self.device)
        return rule.block(lambda i, hf_index: self._read(rule.hf[i], hf_index, dtype), which, index).contiguous()


def _dtype_of(st_dtype: str) -> torch.dtype:
    return {v: k for k, v in _ST_DTYPES.items()}[st_dtype]


def load_hf(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | Callable[[str], torch.dtype] | None = None,
    device: torch.device | str | None = None,
    mtp_num_layers: int | None = None,
    mtp_shared_layer: bool | None = None,
) -> tuple[ModelConfig, ModelParams]:
    """Read a HF checkpoint directory (``config.json`` + safetensors) → ``(ModelConfig, ModelParams)``.

    ``dtype``: cast every tensor, or each leaf to ``dtype(path)`` (default: keep the stored dtypes; a block-FP8
    weight is dequantized to fp32).
    ``mtp_num_layers``: override the config's MTP depth, e.g. ``0`` for a checkpoint written by transformers'
    ``save_pretrained`` (which drops ``mtp.*``); with an override, ``mtp.*`` keys beyond that depth are ignored.
    ``mtp_shared_layer``: run ``mtp.layers.0`` at every depth (docs/model.md#multi-token-prediction-mtp). Raises
    ``CheckpointError`` naming every missing, unexpected, wrongly shaped or non-float key. (Sharded:
    ``q38.train.io.hf_io.load_hf_sharded`` reads only a rank's slices through the same ``HFReader``.)
    """
    src = open_hf(path, mtp_num_layers=mtp_num_layers, mtp_shared_layer=mtp_shared_layer)
    with HFReader(src, dtype=dtype, device=device) as reader:
        params = tree_map_with_path(
            lambda p, info: None if info is None else reader.block(p, tuple(slice(0, n) for n in info.shape)),
            abstract_params(src.config), is_leaf=is_param_info,
        )
    return src.config, params


# ---- saving ---------------------------------------------------------------------------------------------------------
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@attrs.frozen
class _Entry:
    key: str
    rule: int  # index into the plan
    out: int  # which of the rule's HF outputs
    shape: tuple[int, ...]
    dtype: torch.dtype
    part: str = "value"  # "value": the HF tensor; block-FP8: "fp8" (its e4m3 values) or "scale" (its scale_inv)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def _check_params(cfg: ModelConfig, params: ModelParams) -> dict[str, Tensor]:
    leaves = {p: t for p, t in named_leaves(params) if t is not None}
    expected = _abstract_shapes(cfg)
    problems = [f"missing {p}" for p in expected if p not in leaves]
    problems += [f"unexpected {p}" for p in leaves if p not in expected]
    for p, t in leaves.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"save_hf: parameter {p} is a {type(t).__name__}, not a torch.Tensor")
        if type(t) is not Tensor and not isinstance(t, torch.nn.Parameter):
            raise TypeError(
                f"save_hf: parameter {p} is a {type(t).__name__}; save_hf takes plain tensors only — gather "
                "distributed parameters (e.g. DTensor.full_tensor()) to one process first"
            )
        if t.is_meta:
            raise TypeError(f"save_hf: parameter {p} is on the meta device; materialise the parameters first")
        if p in expected and tuple(t.shape) != tuple(expected[p]):
            problems.append(f"{p}: shape {list(t.shape)}, config expects {list(expected[p])}")
    if problems:
        raise CheckpointError("save_hf: params do not match the config:\n  " + "\n  ".join(problems))
    return leaves


def _write_safetensors(file: Path, entries: list[_Entry], tensor: Callable[[_Entry], Tensor]) -> None:
    """Stream ``entries`` into one safetensors file: header first (shapes are known), then each tensor's bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for en in entries:
        end = offset + en.nbytes
        header[en.key] = {"dtype": _ST_DTYPES[en.dtype], "shape": list(en.shape), "data_offsets": [offset, end]}
        offset += en.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8-byte alignment
    with open(file, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for en in entries:
            t = tensor(en)
            if tuple(t.shape) != en.shape or t.dtype != en.dtype:
                raise AssertionError(f"{en.key}: produced {tuple(t.shape)} {t.dtype}, planned {en.shape} {en.dtype}")
            t = t.detach().to("cpu").contiguous()
            if t.numel():
                fh.write(t.reshape(-1).view(torch.uint8).numpy().data)
        fh.flush()
        os.fsync(fh.fileno())


_EXTRA_NAME = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*/)?[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@attrs.frozen
class ExportExtras:
    """What an export holds beside its weights (docs/hf_checkpoints.md#what-an-export-holds): ``files`` (name →
    bytes: the tokenizer's files, ``generation_config.json``; a name is a file, or one folder and a file) and
    ``config`` (keys set in ``config.json``: ``bos_token_id``, ``eos_token_id``, ``pad_token_id``). Built by the
    caller from the run's tokenizer (``q38.train.data.export_files``); written into the export's temporary directory
    with the weights, so they appear together or not at all."""

    files: dict = attrs.field(factory=dict)
    config: dict = attrs.field(factory=dict)

    def __attrs_post_init__(self):
        bad = [n for n in self.files if not _EXTRA_NAME.match(n) or n in (SINGLE_FILE, INDEX_FILE, "config.json")
               or n.endswith(".safetensors")]
        if bad:
            raise ValueError(f"ExportExtras: {bad[0]!r} is not a name an export's extra file may have")

    def write(self, tmp: Path) -> None:
        """The extra files into ``tmp`` (the export's temporary directory)."""
        for name, data in self.files.items():
            f = tmp / name
            f.parent.mkdir(exist_ok=True)
            f.write_bytes(data)


@attrs.frozen
class HFExport:
    """What a HF export writes, known before any tensor is produced: the rules, the output files (``files[i]``: its
    name and entries, in order) and ``config.json``. Any process can write any file from it, so an export can be
    split over ranks file by file (``q38.train.io.hf_io``) and is byte-identical however it is split."""

    config: ModelConfig
    rules: list
    files: list  # [(file name, [_Entry, ...]), ...]
    hf_config: dict
    fp8: Fp8Format | None = None

    def leaves_of_file(self, i: int) -> list[str]:
        """The q38 leaves whose conversions file ``i`` holds (in order)."""
        seen: dict[str, None] = {}
        for en in self.files[i][1]:
            seen.update(dict.fromkeys(self.rules[en.rule].q38))
        return list(seen)

    def write_file(self, tmp: Path, i: int, leaves: Callable[[tuple[str, ...]], tuple]) -> None:
        """Write file ``i`` into ``tmp``; ``leaves(names)`` gives a rule's q38 tensors (each rule converted once, each
        block-FP8 output quantized once)."""
        cache: dict[int, tuple] = {}
        quantized: dict[int, tuple] = {}

        def tensor(en: _Entry) -> Tensor:
            if en.rule not in cache:
                cache.clear()  # one rule's tensors in flight
                quantized.clear()
                r = self.rules[en.rule]
                with torch.no_grad():
                    cache[en.rule] = r.to_hf(*leaves(r.q38))
            t = cache[en.rule][en.out]
            if en.part == "value":
                return t.to(en.dtype)
            if en.out not in quantized:
                quantized.clear()
                quantized[en.out] = quantize(t, self.fp8.block)
            return quantized[en.out][0 if en.part == "fp8" else 1]

        name, entries = self.files[i]
        _write_safetensors(tmp / name, entries, tensor)

    def write_metadata(self, tmp: Path, extras: ExportExtras | None = None) -> None:
        """``config.json`` (with ``extras.config``'s keys), for a sharded export ``model.safetensors.index.json``,
        and ``extras``' files."""
        with open(tmp / "config.json", "w") as fh:
            json.dump({**self.hf_config, **(extras.config if extras else {})}, fh, indent=2, sort_keys=True)
        if extras is not None:
            extras.write(tmp)
        if len(self.files) > 1:
            entries = [en for _, ens in self.files for en in ens]
            weight_map = {en.key: name for name, ens in self.files for en in ens}
            index = {"metadata": {"total_size": sum(en.nbytes for en in entries)}, "weight_map": weight_map}
            with open(tmp / INDEX_FILE, "w") as fh:
                json.dump(index, fh, indent=2)


def plan_export(config: ModelConfig, dtypes: Callable[[str], torch.dtype], *,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, fp8: Fp8Format | None = None) -> HFExport:
    """The HF export of ``config`` whose q38 leaf ``q`` is written in ``dtypes(q)`` (see ``save_hf``).

    ``dtypes(q) == torch.float8_e4m3fn``: every HF tensor of that leaf is written block-FP8 (e4m3 values and a
    ``_scale_inv`` per ``fp8.block``, default 128 x 128; docs/hf_checkpoints.md#block-fp8-checkpoints), the routed
    experts of every layer per expert (the format's layout), and ``config.json`` gets a ``quantization_config``
    whose ``modules_to_not_convert`` names every other 2-D weight (with those ``fp8`` lists)."""
    hf_config = hf_config_dict(config)
    next_layout = config.family.checkpoint_layout == "qwen3_next"
    shapes = _abstract_shapes(config)
    quantized = {q for q in shapes if dtypes(q) == FP8_DTYPE}
    if quantized and fp8 is None:
        fp8 = Fp8Format()
    layout = CheckpointLayout(
        prefix="model.",
        gdn_grouped=next_layout,
        fused_experts=lambda hp: not next_layout and not hp.startswith("mtp.") and not quantized,
    )
    rules = _plan(config, layout)
    entries: list[_Entry] = []
    not_converted: list[str] = []
    for ri, r in enumerate(rules):
        dtype = dtypes(r.q38[0])
        for oi, (k, s) in enumerate(zip(r.hf, r.hf_shapes)):
            s = tuple(s)
            if dtype != FP8_DTYPE:
                entries.append(_Entry(k, ri, oi, s, dtype))
                if len(s) == 2 and k.endswith(".weight") and quantized:
                    not_converted.append(k.removesuffix(".weight"))
                continue
            if len(s) != 2 or not k.endswith(".weight"):
                raise ConfigError(f"{r.q38[0]}: {k} {list(s)} cannot be written block-FP8 (2-D X.weight only); "
                                  "export this leaf in a 16/32-bit dtype")
            entries.append(_Entry(k, ri, oi, s, FP8_DTYPE, "fp8"))
            entries.append(_Entry(scale_key(k), ri, oi, scale_shape(s, fp8.block), torch.float32, "scale"))
    if len({en.key for en in entries}) != len(entries):
        raise AssertionError("q38.hf plan produced duplicate HF keys")
    hf_config.setdefault("dtype", str(dtypes("embed")).removeprefix("torch."))
    if quantized:
        hf_config["quantization_config"] = fp8.to_hf(not_converted)
    shards: list[list[_Entry]] = [[]]
    size = 0
    for en in entries:
        if shards[-1] and size + en.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(en)
        size += en.nbytes
    if len(shards) == 1:
        files = [(SINGLE_FILE, shards[0])]
    else:
        files = [(f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", sh) for i, sh in enumerate(shards)]
    return HFExport(config, rules, files, hf_config, fp8 if quantized else None)


def fp8_dtypes(dtype_of: Callable[[str], torch.dtype],
               quantized: Callable[[str], bool] = default_quantized) -> Callable[[str], torch.dtype]:
    """Per-leaf export dtypes of a block-FP8 checkpoint: ``float8_e4m3fn`` for the leaves ``quantized`` names (by
    default the projections: ``q38.fp8.DEFAULT_QUANTIZED``), ``dtype_of(q)`` for the others."""
    return lambda q: FP8_DTYPE if quantized(q) else dtype_of(q)


def export_tmp_dir(path: Path, token: str | None = None) -> Path:
    """The temporary sibling an export of ``path`` is built in (renamed over ``path`` by ``publish_export``)."""
    return path.parent / f".{path.name}.tmp-{token or uuid.uuid4().hex[:8]}"


def publish_export(tmp: Path, path: Path) -> None:
    """Rename the complete export ``tmp`` over ``path`` (an existing one is moved aside first, then removed)."""
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        path.rename(old)
        tmp.rename(path)
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    else:
        tmp.rename(path)


def hf_weights(config: ModelConfig, params: ModelParams, *, dtype: torch.dtype | None = None):
    """``(Hugging Face name, tensor)`` pairs of ``params``, one converted rule in flight at a time: the names and
    layout ``save_hf`` writes (``model.`` prefix, fused main-layer experts, ``mtp.*``), the form vLLM's and SGLang's
    ``load_weights`` take. ``params``: plain tensors (a LoRA tree merged first: ``q38.lora.merged_params``);
    ``dtype``: every tensor cast to it (default: each leaf's own)."""
    leaves = _check_params(config, params)
    yield from hf_pairs(config, leaves.__getitem__, lambda q: dtype or leaves[q].dtype)


def hf_pairs(config: ModelConfig, leaf: Callable[[str], Tensor], dtype_of: Callable[[str], torch.dtype]):
    """``hf_weights``' pairs from a leaf getter: ``leaf(q)`` gives q38 leaf ``q`` as a plain tensor when its rule is
    converted (rule by rule, in ``plan_export``'s file order: one rule's leaves and outputs in flight),
    ``dtype_of(q)`` the dtype its Hugging Face tensors take."""
    export = plan_export(config, dtype_of)
    for _, entries in export.files:
        rule, out = None, ()
        for en in entries:
            if en.rule != rule:
                r = export.rules[en.rule]
                out = ()  # the previous rule's tensors released before this one's are gathered
                with torch.no_grad():
                    out = r.to_hf(*(leaf(q) for q in r.q38))
                rule = en.rule
            yield en.key, out[en.out].to(en.dtype)


def save_hf(
    path: str | os.PathLike,
    config: ModelConfig,
    params: ModelParams,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtypes: Callable[[str], torch.dtype] | None = None,
    fp8: Fp8Format | None = None,
    extras: ExportExtras | None = None,
) -> Path:
    """Write ``params`` as a HF checkpoint directory (``config.json`` + safetensors, with ``mtp.*``).

    ``dtypes(q)``: the dtype q38 leaf ``q`` is written in (default: its tensor's dtype); ``torch.float8_e4m3fn``
    writes it block-FP8 in ``fp8``'s blocks (default 128 x 128; see ``plan_export``, and ``fp8_dtypes`` for the
    leaves the format quantizes). ``extras``: tokenizer files, ``generation_config.json`` and the token ids of
    ``config.json`` (``ExportExtras``).

    Qwen3.5-family configs are written as ``qwen3_5_moe_text`` (``model.`` prefix, loadable by
    ``Qwen3_5MoeForCausalLM``) with fused main-layer experts and per-expert MTP experts; ``qwen3_next`` configs in the
    Qwen3-Next layout (per-expert experts, grouped ``in_proj_qkvz`` / ``in_proj_ba``). Shards above
    ``max_shard_bytes`` with a ``model.safetensors.index.json``. Atomic: built in a temporary sibling directory and
    renamed over ``path`` (an existing directory is replaced, other files in it included) only once complete.
    (From a sharded run or a q38 checkpoint, ``q38.train.io.hf_io.export_checkpoint`` writes the same bytes with at
    most a few tensors in memory, split over ranks.)
    """
    path = Path(path)
    leaves = _check_params(config, params)
    export = plan_export(config, dtypes or (lambda q: leaves[q].dtype), max_shard_bytes=max_shard_bytes, fp8=fp8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = export_tmp_dir(path)
    tmp.mkdir()
    try:
        export.write_metadata(tmp, extras)
        for i in range(len(export.files)):
            export.write_file(tmp, i, lambda names: tuple(leaves[q] for q in names))
        publish_export(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
