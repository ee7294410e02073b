"""Hugging Face checkpoint I/O: ``load_hf`` / ``save_hf`` between a HF directory and ``(ModelConfig, ModelParams)``.

Layouts (the key tables, for users: docs/hf_checkpoints.md):

* **Qwen3.5-MoE** — text prefix ``model.language_model.`` (``model_type`` ``qwen3_5_moe``; ``model.visual.*`` is
  ignored) or ``model.`` (``qwen3_5_moe_text``, what ``Qwen3_5MoeForCausalLM.save_pretrained`` writes); flat GDN
  projections ``in_proj_qkv / in_proj_z / in_proj_b / in_proj_a``; routed experts fused
  (``mlp.experts.gate_up_proj [e, 2f, d]``, ``mlp.experts.down_proj [e, d, f]``) or per expert
  (``mlp.experts.{i}.{gate,up,down}_proj.weight``; transformers 5.23 ``save_pretrained`` writes this form).
* **Qwen3-Next** — prefix ``model.``, per-expert experts, ``in_proj_qkvz`` / ``in_proj_ba`` grouped per key head.
* **MTP** — top-level ``mtp.*`` keys with (usually) per-expert experts.

The q38 ↔ HF correspondence lives in the tables below (``*_RENAMES``: one q38 leaf ↔ one HF key, same tensor)
plus four converters (conv weight, per-expert experts, grouped qkvz, grouped ba). ``_plan`` turns them into one
``Rule`` per q38 leaf group; loading, saving and key validation all walk that one list.

Loading reads one tensor at a time through ``safetensors.safe_open``; saving streams tensors into the safetensors
files one at a time, into a temporary sibling directory that is renamed into place when complete.
"""

import json
import os
import re
import shutil
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import attrs
import torch
from torch import Tensor

from q38.config import ModelConfig
from q38.model import ModelParams, abstract_params, is_param_info
from q38.pytree import named_leaves, tree_map_with_path

__all__ = ["CheckpointError", "load_hf", "save_hf", "DEFAULT_MAX_SHARD_BYTES"]

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
ATTN_RENAMES = {
    "mixer.w_q": "self_attn.q_proj.weight",  # per head: c query rows then c gate rows (same in both)
    "mixer.w_k": "self_attn.k_proj.weight",
    "mixer.w_v": "self_attn.v_proj.weight",
    "mixer.w_o": "self_attn.o_proj.weight",
    "mixer.q_norm": "self_attn.q_norm.weight",
    "mixer.k_norm": "self_attn.k_norm.weight",
}
GDN_RENAMES = {
    "mixer.dt_bias": "linear_attn.dt_bias",
    "mixer.A_log": "linear_attn.A_log",
    "mixer.norm_w": "linear_attn.norm.weight",
    "mixer.w_out": "linear_attn.out_proj.weight",
}
GDN_FLAT_RENAMES = {  # Qwen3.5 layout; Qwen3-Next groups these per key head (``_grouped_qkvz`` / ``_grouped_ba``)
    "mixer.w_qkv": "linear_attn.in_proj_qkv.weight",
    "mixer.w_z": "linear_attn.in_proj_z.weight",
    "mixer.w_b": "linear_attn.in_proj_b.weight",
    "mixer.w_a": "linear_attn.in_proj_a.weight",
}
GDN_CONV = ("mixer.conv_w", "linear_attn.conv1d.weight")  # q38 [ch, w] ↔ HF [ch, 1, w]
FUSED_EXPERT_RENAMES = {
    "moe.we_gate_up": "mlp.experts.gate_up_proj",  # [e, 2f, d]: rows [0:f] gate, [f:2f] up
    "moe.we_down": "mlp.experts.down_proj",  # [e, d, f]
}
PER_EXPERT_KEY = "mlp.experts.{i}.{proj}_proj.weight"  # gate/up [f, d], down [d, f]


# ---- rules ----------------------------------------------------------------------------------------------------------
@attrs.frozen
class Rule:
    """q38 leaves ``q38`` ↔ HF tensors ``hf`` (shapes ``hf_shapes``).

    ``to_hf(*q38 tensors) -> tuple of HF tensors``; ``from_hf(load) -> tuple of q38 tensors`` where ``load(i)``
    reads HF tensor ``i`` (already cast and moved).
    """

    q38: tuple[str, ...]
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_hf: Callable[..., tuple]
    from_hf: Callable[[Callable[[int], Tensor]], tuple]


def _rename(q: str, h: str, shape: tuple[int, ...]) -> Rule:
    return Rule((q,), (h,), (shape,), lambda t: (t,), lambda load: (load(0),))


def _conv(q: str, h: str, shape: tuple[int, ...]) -> Rule:
    ch, w = shape
    return Rule((q,), (h,), ((ch, 1, w),), lambda t: (t.unsqueeze(1),), lambda load: (load(0).reshape(ch, w),))


def _per_expert(q_gate_up: str, q_down: str, hp: str, e: int, f: int, d: int) -> list[Rule]:
    """Fused q38 ``[e, 2f, d]`` / ``[e, d, f]`` ↔ HF ``experts.{i}.{gate,up,down}_proj.weight``."""
    gu_keys = tuple(hp + PER_EXPERT_KEY.format(i=i, proj=proj) for i in range(e) for proj in ("gate", "up"))
    down_keys = tuple(hp + PER_EXPERT_KEY.format(i=i, proj="down") for i in range(e))

    def gu_to_hf(t):
        return tuple(t[i, j * f : (j + 1) * f] for i in range(e) for j in range(2))

    def gu_from_hf(load):
        first = load(0)
        out = torch.empty((e, 2 * f, d), dtype=first.dtype, device=first.device)
        for n in range(2 * e):  # one [f, d] tensor in flight at a time
            i, j = divmod(n, 2)
            out[i, j * f : (j + 1) * f] = first if n == 0 else load(n)
        return (out,)

    def down_from_hf(load):
        first = load(0)
        out = torch.empty((e, d, f), dtype=first.dtype, device=first.device)
        for i in range(e):
            out[i] = first if i == 0 else load(i)
        return (out,)

    return [
        Rule((q_gate_up,), gu_keys, ((f, d),) * (2 * e), gu_to_hf, gu_from_hf),
        Rule((q_down,), down_keys, ((d, f),) * e, lambda t: tuple(t[i] for i in range(e)), down_from_hf),
    ]


def _grouped_qkvz(q_qkv: str, q_z: str, h: str, cfg: ModelConfig) -> Rule:
    """Flat ``w_qkv`` (rows [q all | k all | v all]) + ``w_z`` ↔ Qwen3-Next ``in_proj_qkvz``, whose rows are blocks
    per key head ``g``: ``[q_g (dk) | k_g (dk) | v_{g·r..g·r+r-1} (r·dv) | z_{same} (r·dv)]``."""
    nk, dk, d = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.hidden_size
    rdv = cfg.linear_value_groups * cfg.linear_value_head_dim
    kd, vd = cfg.linear_key_dim, cfg.linear_value_dim

    def to_hf(w_qkv, w_z):
        q, k, v = torch.split(w_qkv, [kd, kd, vd], dim=0)
        blocks = [q.reshape(nk, dk, d), k.reshape(nk, dk, d), v.reshape(nk, rdv, d), w_z.reshape(nk, rdv, d)]
        return (torch.cat(blocks, dim=1).reshape(2 * kd + 2 * vd, d),)

    def from_hf(load):
        q, k, v, z = torch.split(load(0).reshape(nk, 2 * dk + 2 * rdv, d), [dk, dk, rdv, rdv], dim=1)
        return torch.cat([q.reshape(kd, d), k.reshape(kd, d), v.reshape(vd, d)], dim=0), z.reshape(vd, d)

    return Rule((q_qkv, q_z), (h,), ((2 * kd + 2 * vd, d),), to_hf, from_hf)


def _grouped_ba(q_b: str, q_a: str, h: str, cfg: ModelConfig) -> Rule:
    """``w_b`` / ``w_a`` ``[nv, d]`` ↔ Qwen3-Next ``in_proj_ba``: per key head ``[b (r) | a (r)]``."""
    nk, nv, r, d = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_groups, cfg.hidden_size

    def to_hf(w_b, w_a):
        return (torch.cat([w_b.reshape(nk, r, d), w_a.reshape(nk, r, d)], dim=1).reshape(2 * nv, d),)

    def from_hf(load):
        b, a = torch.split(load(0).reshape(nk, 2 * r, d), [r, r], dim=1)
        return b.reshape(nv, d), a.reshape(nv, d)

    return Rule((q_b, q_a), (h,), ((2 * nv, d),), to_hf, from_hf)


def _abstract_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{q38 path: shape}`` of every parameter (``lm_head`` / ``mtp`` are ``None`` leaves when absent)."""
    leaves = named_leaves(abstract_params(cfg), is_leaf=is_param_info)
    return {path: info.shape for path, info in leaves if info is not None}


@attrs.frozen
class CheckpointLayout:
    """Where and how a checkpoint stores the text model.

    ``prefix``: ``model.`` or ``model.language_model.``; ``gdn_grouped``: Qwen3-Next qkvz/ba projections;
    ``fused_experts(hf_layer_prefix) -> bool``: routed experts of that layer as two 3-D tensors (else per expert).
    """

    prefix: str
    gdn_grouped: bool
    fused_experts: Callable[[str], bool]


def _plan(cfg: ModelConfig, layout: CheckpointLayout) -> list[Rule]:
    """One ``Rule`` per q38 leaf group, in checkpoint order; covers every leaf of ``abstract_params(cfg)`` once."""
    shapes = _abstract_shapes(cfg)
    p = layout.prefix
    e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    rules = [_rename(q, h.format(p=p), shapes[q]) for q, h in MODEL_RENAMES.items() if q in shapes]

    def layer(qp: str, hp: str, layer_type: str) -> None:
        def ren(table):
            rules.extend(_rename(qp + q, hp + h, shapes[qp + q]) for q, h in table.items())

        if layer_type == "full_attention":
            ren(ATTN_RENAMES)
        else:
            if layout.gdn_grouped:
                la = hp + "linear_attn."
                rules.append(_grouped_qkvz(qp + "mixer.w_qkv", qp + "mixer.w_z", la + "in_proj_qkvz.weight", cfg))
                rules.append(_grouped_ba(qp + "mixer.w_b", qp + "mixer.w_a", la + "in_proj_ba.weight", cfg))
            else:
                ren(GDN_FLAT_RENAMES)
            rules.append(_conv(qp + GDN_CONV[0], hp + GDN_CONV[1], shapes[qp + GDN_CONV[0]]))
            ren(GDN_RENAMES)
        ren(LAYER_RENAMES)
        if layout.fused_experts(hp):
            ren(FUSED_EXPERT_RENAMES)
        else:
            rules.extend(_per_expert(qp + "moe.we_gate_up", qp + "moe.we_down", hp, e, f, d))

    for i, t in enumerate(cfg.layer_types):
        layer(f"layers.{i}.", f"{p}layers.{i}.", t)
    if cfg.mtp_num_layers > 0:
        rules.extend(_rename(q, h, shapes[q]) for q, h in MTP_RENAMES.items())
        for j in range(cfg.mtp_num_layers):
            layer(f"mtp.layers.{j}.", f"mtp.layers.{j}.", "full_attention")

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
    """``{key: file name}`` of a single-file or sharded safetensors checkpoint."""
    if (path / INDEX_FILE).is_file():
        with open(path / INDEX_FILE) as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path / INDEX_FILE}: no 'weight_map' mapping")
        missing = sorted({fn for fn in weight_map.values() if not (path / fn).is_file()})
        if missing:
            raise CheckpointError(f"checkpoint {path}: index names shard file(s) that do not exist: {missing}")
        return dict(weight_map)
    if (path / SINGLE_FILE).is_file():
        from safetensors import safe_open

        with safe_open(str(path / SINGLE_FILE), framework="pt") as fh:
            return {k: SINGLE_FILE for k in fh.keys()}
    raise CheckpointError(f"checkpoint {path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _load_layout(cfg: ModelConfig, keys: set[str]) -> CheckpointLayout:
    """Detect the text prefix, GDN projection layout and per-layer expert layout from the keys present."""
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in keys) else "model."
    has_flat = any(k.endswith("linear_attn.in_proj_qkv.weight") for k in keys)
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


def load_hf(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    mtp_num_layers: int | None = None,
) -> tuple[ModelConfig, ModelParams]:
    """Read a HF checkpoint directory (``config.json`` + safetensors) → ``(ModelConfig, ModelParams)``.

    ``dtype``: cast every tensor (default: keep the stored dtypes). ``mtp_num_layers``: override the config's MTP
    depth, e.g. ``0`` for a checkpoint written by transformers' ``save_pretrained`` (which drops ``mtp.*``); with an
    override, ``mtp.*`` keys beyond that depth are ignored. Raises ``CheckpointError`` naming every missing,
    unexpected or wrongly shaped key.
    """
    from safetensors import safe_open

    path = Path(path)
    cfg = ModelConfig.from_hf(path)
    if mtp_num_layers is not None:
        cfg = cfg.replace(mtp_num_layers=int(mtp_num_layers))
    index = _checkpoint_index(path)
    layout = _load_layout(cfg, set(index))
    rules = _plan(cfg, layout)

    with ExitStack() as stack:
        handles: dict[str, Any] = {}

        def handle(fn: str):
            if fn not in handles:
                handles[fn] = stack.enter_context(safe_open(str(path / fn), framework="pt"))
            return handles[fn]

        expected = {k: s for r in rules for k, s in zip(r.hf, r.hf_shapes)}
        missing = [k for k in expected if k not in index]
        ignored = lambda k: (  # noqa: E731
            bool(IGNORED_KEYS.match(k))
            or (mtp_num_layers is not None and k.startswith("mtp."))
            or (cfg.tie_word_embeddings and k == "lm_head.weight")
        )
        unexpected = sorted(k for k in index if k not in expected and not ignored(k))
        bad_shapes = []
        for k, shape in expected.items():
            if k in index:
                got = tuple(handle(index[k]).get_slice(k).get_shape())
                if got != tuple(shape):
                    bad_shapes.append(f"{k}: checkpoint {list(got)}, expected {list(shape)}")
        if missing or unexpected or bad_shapes:
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
            if any(k.startswith("mtp.") for k in missing) and not any(k.startswith("mtp.") for k in index):
                parts.append(
                    "  hint: the checkpoint has no mtp.* weights (transformers' save_pretrained drops them); "
                    "pass mtp_num_layers=0 to load it without MTP"
                )
            raise CheckpointError("\n".join(parts))

        def load_key(key: str) -> Tensor:
            return handle(index[key]).get_tensor(key).to(device=device, dtype=dtype)

        loaded: dict[str, Tensor] = {}
        for r in rules:
            outs = r.from_hf(lambda i, r=r: load_key(r.hf[i]))
            for q, t in zip(r.q38, outs):
                loaded[q] = t.contiguous()
    params = tree_map_with_path(
        lambda p, info: None if info is None else loaded[p], abstract_params(cfg), is_leaf=is_param_info
    )
    return cfg, params


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


def save_hf(
    path: str | os.PathLike,
    config: ModelConfig,
    params: ModelParams,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write ``params`` as a HF checkpoint directory (``config.json`` + safetensors, with ``mtp.*``).

    Qwen3.5-family configs are written as ``qwen3_5_moe_text`` (``model.`` prefix, loadable by
    ``Qwen3_5MoeForCausalLM``) with fused main-layer experts and per-expert MTP experts; ``qwen3_next`` configs in the
    Qwen3-Next layout (per-expert experts, grouped ``in_proj_qkvz`` / ``in_proj_ba``). Shards above
    ``max_shard_bytes`` with a ``model.safetensors.index.json``. Atomic: built in a temporary sibling directory and
    renamed over ``path`` (an existing directory is replaced, other files in it included) only once complete.
    """
    path = Path(path)
    leaves = _check_params(config, params)
    hf_config = config.to_hf_dict()
    next_layout = config.family.checkpoint_layout == "qwen3_next"
    layout = CheckpointLayout(
        prefix="model.",
        gdn_grouped=next_layout,
        fused_experts=lambda hp: not next_layout and not hp.startswith("mtp."),
    )
    rules = _plan(config, layout)
    entries: list[_Entry] = []
    for ri, r in enumerate(rules):
        dtype = leaves[r.q38[0]].dtype
        entries += [_Entry(k, ri, oi, tuple(s), dtype) for oi, (k, s) in enumerate(zip(r.hf, r.hf_shapes))]
    if len({en.key for en in entries}) != len(entries):
        raise AssertionError("q38.hf plan produced duplicate HF keys")
    hf_config.setdefault("dtype", str(leaves["embed"].dtype).removeprefix("torch."))

    shards: list[list[_Entry]] = [[]]
    size = 0
    for en in entries:
        if shards[-1] and size + en.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(en)
        size += en.nbytes

    cache: dict[int, tuple] = {}  # the HF outputs of the rule being written (each rule converted once)

    def tensor(en: _Entry) -> Tensor:
        if en.rule not in cache:
            cache.clear()
            r = rules[en.rule]
            with torch.no_grad():
                cache[en.rule] = r.to_hf(*(leaves[q] for q in r.q38))
        return cache[en.rule][en.out]

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with open(tmp / "config.json", "w") as fh:
            json.dump(hf_config, fh, indent=2, sort_keys=True)
        if len(shards) == 1:
            _write_safetensors(tmp / SINGLE_FILE, shards[0], tensor)
        else:
            weight_map = {}
            for si, shard in enumerate(shards):
                name = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
                _write_safetensors(tmp / name, shard, tensor)
                weight_map.update({en.key: name for en in shard})
            index = {"metadata": {"total_size": sum(en.nbytes for en in entries)}, "weight_map": weight_map}
            with open(tmp / INDEX_FILE, "w") as fh:
                json.dump(index, fh, indent=2)
        cache.clear()
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
