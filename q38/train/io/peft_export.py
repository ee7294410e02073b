"""Exporting a LoRA run (docs/finetuning.md#export-a-lora-run): its adapters in the Hugging Face PEFT format
(``export_peft``, ``q38 convert --to-peft``) and its merged model as a full Hugging Face checkpoint
(``export_merged``, ``q38 convert --to-hf`` of a LoRA checkpoint). Both stream: no process holds the model, each
tensor is read from the DCP checkpoint (and the base) only when its output is written.

The PEFT layout is the one ``peft`` builds on transformers' ``Qwen3_5MoeForCausalLM`` (the page above has the
table): ``nn.Linear`` projections are ``target_modules`` with q38's ``A`` / ``B`` as they are; the fused routed
experts (and the router) are ``target_parameters``, an expert adapter flattened as ``to_peft_a`` / ``to_peft_b`` say,
two on one module nested in the order transformers registers them (``PARAMETER_ORDER``). What PEFT cannot express
exactly is refused in one line that points to the merged export (``plan_peft``).
"""

import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import attrs
import torch
from jaxtyping import Float
from torch import Tensor

from q38.hf import (
    ExportExtras, _Entry, _abstract_shapes, _plan, _write_safetensors, export_tmp_dir, plan_export, publish_export,
)
from q38.fp8 import default_quantized
from q38.layers.hf_keys import CheckpointLayout
from q38.lora import EXPERT_TARGETS, Lora, PeftConfig, SharedLora, add_adapters, merge_weight, split_path
from q38.model_config import ConfigError, ModelConfig
from q38.pytree import named_leaves
from q38.train.io.checkpoint import (
    _barrier, _fsync_dir, _rank, checkpoint_reader, is_checkpoint, read_meta, resolve_checkpoint, saved_tensors,
    shared_tmp_dir,
)
from q38.train.io.hf_io import FP8, SOURCE, _leaf_loader, all_ranks_ok, export_dtypes, write_export

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PEFT puts before a module path in its saved keys
# q38 targets that transformers holds as a bare parameter (not an nn.Linear): PEFT's ``target_parameters``
PARAMETER_TARGETS = ("w_router", *EXPERT_TARGETS)
# the order in which transformers registers a module's parameters: PEFT wraps them in that order, the first innermost
PARAMETER_ORDER = {"mlp.experts": ("gate_up_proj", "down_proj"), "mlp.gate": ("weight",)}
MERGED_HINT = "export the merged model instead (`q38 convert --to-hf`)"


class PeftExportError(ConfigError):
    """A LoRA checkpoint (or part of one) that cannot be written in the requested form."""


# ---- the LoRA checkpoint --------------------------------------------------------------------------------------------


@attrs.frozen
class LoraCheckpoint:
    """A LoRA run's checkpoint, checked: its model, LoRA setting and base reference (``meta.json``), and the
    adapters it holds (``adapted``: the adapted weight paths in checkpoint order, ``saved``: ``{key: (shape,
    dtype)}``)."""

    path: Path
    meta: dict
    config: ModelConfig
    peft: PeftConfig
    base: dict
    adapted: tuple[str, ...]
    saved: dict
    reader: object

    def adapter_keys(self, weight: str) -> tuple[str, str]:
        """The two adapter leaves of ``weight`` (``….lora_a`` / ``….lora_b``, or the ``shared_`` pair)."""
        a = f"{weight}.lora_a"
        return (a, f"{weight}.lora_b") if f"params.{a}" in self.saved else (f"{weight}.shared_a", f"{weight}.shared_b")


def open_lora_checkpoint(ck: str | os.PathLike) -> LoraCheckpoint:
    """Read and check a LoRA checkpoint before anything is written: ``meta.json`` names a LoRA setting and a base,
    and the checkpoint holds exactly the adapters that setting gives the model, with their shapes."""
    ck = Path(ck)
    meta = read_meta(ck)
    entry = meta.get("peft")
    if not entry:
        raise PeftExportError(f"{ck} is not a LoRA checkpoint (its meta.json has no peft entry): it holds a whole "
                              "model; export it with `q38 convert --to-hf`")
    if not isinstance(entry, dict) or not isinstance(entry.get("base"), dict):
        raise PeftExportError(f"{ck}/meta.json: peft entry without a base reference; not a checkpoint of a q38 LoRA "
                              "run")
    cfg = ModelConfig.from_dict(meta["model_config"], source=f"{ck}/meta.json")
    peft = PeftConfig.from_dict({k: v for k, v in entry.items() if k != "base"}, source=f"{ck}/meta.json")
    from q38.model import init_params

    want = {f"params.{n}": (tuple(t.shape), torch.float32)
            for n, t in named_leaves(add_adapters(init_params(cfg, device="meta"), peft, seed=0))
            if split_path(n)[1] not in (None, "base")}
    reader = checkpoint_reader(ck)
    saved = saved_tensors(ck, reader)
    have = {k: v for k, v in saved.items() if k.startswith("params.")}
    problems = [f"missing {k}" for k in want if k not in have]
    problems += [f"unexpected {k}" for k in have if k not in want]
    problems += [f"{k}: shape {list(have[k][0])}, the LoRA setting gives {list(s)}" for k, (s, _) in want.items()
                 if k in have and tuple(have[k][0]) != s]
    if problems:
        raise PeftExportError(f"checkpoint {ck} does not hold the adapters its meta.json's peft setting gives "
                              f"{cfg.model_type}: {'; '.join(problems[:4])}")
    adapted = tuple(dict.fromkeys(split_path(k.removeprefix("params."))[0] for k in want))
    return LoraCheckpoint(ck, meta, cfg, peft, entry["base"], adapted, saved, reader)


# ---- the PEFT layout ------------------------------------------------------------------------------------------------


@attrs.frozen
class PeftTensor:
    """One tensor of ``adapter_model.safetensors``: PEFT key, shape, and the q38 adapter leaf it is made of
    (``experts``: the number of experts of a fused-expert adapter, 0 for a matrix)."""

    key: str
    shape: tuple[int, ...]
    leaf: str
    experts: int = 0


def to_peft_a(a: Float[Tensor, "*e r i"]) -> Float[Tensor, "er i"]:
    """q38 ``A`` (``[r, in]``, or per expert ``[e, r, in]``) → PEFT's ``lora_A.weight`` (``[e·r, in]``: expert
    ``k``'s rows ``k·r .. k·r + r``)."""
    return a.reshape(-1, a.shape[-1])


def to_peft_b(b: Float[Tensor, "*e o r"]) -> Float[Tensor, "o re"]:
    """q38 ``B`` (``[out, r]``, or per expert ``[e, out, r]``) → PEFT's ``lora_B.weight`` (``[out, r·e]``: column
    ``j·e + k`` is column ``j`` of expert ``k``'s ``B``)."""
    if b.dim() == 2:
        return b
    e, o, r = b.shape
    return b.permute(1, 2, 0).reshape(o, r * e)


def _layer_suffix(key: str) -> str:
    """``model.layers.3.self_attn.q_proj`` → ``self_attn.q_proj`` (the name under a decoder layer)."""
    parts = key.split(".")
    i = parts.index("layers")
    return ".".join(parts[i + 2:])


def plan_peft(lc: LoraCheckpoint, base_name: str | None) -> tuple[list[PeftTensor], dict]:
    """``(tensors of adapter_model.safetensors, adapter_config.json)`` of the LoRA checkpoint ``lc``, or the one-line
    refusal of what PEFT cannot express exactly (see the module docstring)."""
    cfg, peft = lc.config, lc.peft
    if cfg.family.checkpoint_layout != "qwen3_5_moe":
        raise PeftExportError(f"PEFT export is implemented for the Qwen3.5-MoE layout (transformers' "
                              f"Qwen3_5MoeForCausalLM), not {cfg.model_type} ({cfg.family.checkpoint_layout}); "
                              f"{MERGED_HINT}")
    mtp = [w for w in lc.adapted if w.startswith("mtp.")]
    if mtp:
        raise PeftExportError(f"{mtp[0]}: adapters of the MTP layers (peft.mtp: true) have no module in "
                              f"transformers' Qwen3_5MoeForCausalLM (it has no mtp.* layers), so PEFT cannot load "
                              f"them; {MERGED_HINT}, which keeps mtp.*")
    shared = [w for w in lc.adapted if f"params.{w}.shared_a" in lc.saved]
    if shared:
        raise PeftExportError(f"{shared[0]}: peft.experts: shared (one adapter for every routed expert of a layer) "
                              f"has no PEFT form (PEFT adapts a fused expert tensor per expert); {MERGED_HINT}")
    layout = CheckpointLayout(prefix="model.", gdn_grouped=False, fused_experts=lambda hp: not hp.startswith("mtp."))
    rules = {r.q38[0]: r for r in _plan(cfg, layout) if len(r.q38) == 1}
    shapes = _abstract_shapes(cfg)
    module_targets: set[str] = set()
    param_targets: set[str] = set()
    by_module: dict[str, list[tuple[str, str]]] = {}  # HF module -> [(parameter name, q38 weight)]
    for w in lc.adapted:
        rule = rules.get(w)
        probe = torch.empty(shapes[w], device="meta")
        if rule is None or len(rule.hf) != 1 or rule.to_hf(probe)[0] is not probe:
            raise PeftExportError(f"{w}: the Hugging Face checkpoint does not store this weight as one tensor "
                                  f"unchanged (it is part of, or made from, {list(rule.hf)[:2] if rule else '?'}), "
                                  f"so a PEFT adapter cannot carry q38's delta exactly; {MERGED_HINT}")
        module, _, pname = rule.hf[0].rpartition(".")
        if w.rsplit(".", 1)[-1] in PARAMETER_TARGETS:
            param_targets.add(_layer_suffix(rule.hf[0]))
        else:
            if pname != "weight":
                raise AssertionError(f"{w}: {rule.hf[0]} is not a module weight")
            module_targets.add(_layer_suffix(module))
        by_module.setdefault(module, []).append((pname, w))
    tensors: list[PeftTensor] = []
    for module, entries in by_module.items():
        order = PARAMETER_ORDER.get(_layer_suffix(module), ("weight",))
        entries.sort(key=lambda pw: order.index(pw[0]))
        for depth, (pname, w) in enumerate(reversed(entries)):  # the last registered parameter is outermost
            ka, kb = lc.adapter_keys(w)
            (sa, _), (sb, _) = lc.saved[f"params.{ka}"], lc.saved[f"params.{kb}"]
            e = sa[0] if len(sa) == 3 else 0
            prefix = f"{PEFT_PREFIX}{module}.{'base_layer.' * depth}"
            a_shape = (sa[0] * sa[1], sa[2]) if e else tuple(sa)
            b_shape = (sb[1], sb[2] * sb[0]) if e else tuple(sb)
            tensors.append(PeftTensor(prefix + "lora_A.weight", a_shape, ka, e))
            tensors.append(PeftTensor(prefix + "lora_B.weight", b_shape, kb, e))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name, "revision": None,
        "inference_mode": True, "r": peft.rank, "lora_alpha": peft.alpha, "lora_dropout": 0.0,
        "target_modules": sorted(module_targets) or None, "target_parameters": sorted(param_targets) or None,
        "exclude_modules": None, "fan_in_fan_out": False, "bias": "none", "use_rslora": False, "use_dora": False,
        "lora_bias": False, "modules_to_save": None, "init_lora_weights": True, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }
    return tensors, config


def _base_name(lc: LoraCheckpoint, base: str | os.PathLike | None) -> str | None:
    """``base_model_name_or_path``: the base given (``--base``), else the one the checkpoint names (``None`` for a
    base drawn from a seed)."""
    if base is not None:
        return str(base)
    return lc.base.get("init_from")


def export_peft(ck: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype | None = None,
                base: str | os.PathLike | None = None, extras: ExportExtras | None = None) -> Path:
    """Write the adapters of the LoRA checkpoint ``ck`` as a PEFT adapter directory ``out`` (``adapter_config.json``
    + ``adapter_model.safetensors``; atomic: built in a temporary sibling and renamed). ``dtype``: cast the adapters
    (default: as saved, the fp32 masters). ``base``: where the base is now (default: the path the checkpoint names;
    checked against its recorded hash), written as ``base_model_name_or_path``. ``extras``: the tokenizer files and
    ``generation_config.json`` written beside the adapter (its ``config`` keys are ignored: an adapter has no
    ``config.json``). Streamed: one adapter matrix in
    memory at a time; under a process group rank 0 writes the one file PEFT reads (the adapters are a small part of
    the model) while the others wait."""
    ck, out = Path(ck), Path(out)

    def prepare():
        lc = open_lora_checkpoint(ck)
        return lc, *plan_peft(lc, _base_name(lc, base))

    lc, tensors, config = all_ranks_ok(prepare, f"reading LoRA checkpoint {ck}")
    check_base_path(lc, base)  # the base is there and unchanged, as for the merged export
    with shared_tmp_dir(export_tmp_dir(out, _broadcast_token())) as tmp:
        def write():
            if _rank() != 0:
                return
            load = _leaf_loader(ck, lc.reader, lc.saved)
            by_key = {t.key: t for t in tensors}

            def tensor(en: _Entry) -> Tensor:
                (t,) = load((by_key[en.key].leaf,))
                t = to_peft_a(t) if en.key.endswith("lora_A.weight") else to_peft_b(t)
                return t.to(en.dtype).contiguous()

            entries = [_Entry(t.key, i, 0, t.shape, dtype or lc.saved[f"params.{t.leaf}"][1])
                       for i, t in enumerate(tensors)]
            _write_safetensors(tmp / ADAPTER_FILE, entries, tensor)
            with open(tmp / ADAPTER_CONFIG, "w") as fh:
                json.dump(config, fh, indent=2, sort_keys=True)
            if extras is not None:
                extras.write(tmp)
            _fsync_dir(tmp)
            publish_export(tmp, out)
            _fsync_dir(out.parent)

        all_ranks_ok(write, f"exporting the adapters of {ck} to {out}")
    _barrier()
    return out


def _broadcast_token() -> str:
    from q38.train.io.checkpoint import _broadcast

    return _broadcast(os.urandom(4).hex())


# ---- the base and the merged model ----------------------------------------------------------------------------------


def check_base_path(lc: LoraCheckpoint, path: str | os.PathLike | None) -> dict:
    """The base reference of ``path`` (a Hugging Face directory or a q38 checkpoint; None: the path the checkpoint
    recorded), refused unless it is the base the adapters of ``lc`` were trained on (``q38.train.io.peft.
    base_difference``: the refusal names the first tensor that differs). Collective under a process group (each rank
    hashes its share of the base): every rank calls it, outside ``all_ranks_ok``. A note about a checkpoint written
    before q38 hashed the base's weights is printed once."""
    from q38.train.io.peft import EDITED, base_difference, base_reference

    if lc.base.get("init_from") is None:
        if path is not None:
            raise PeftExportError(f"{lc.path} was trained on a base drawn from seed {lc.base.get('seed')} (no "
                                  "init_from); it takes no --base")
        return lc.base
    path = Path(path if path is not None else lc.base["init_from"])
    if not path.exists():
        raise PeftExportError(f"the base {path} of LoRA checkpoint {lc.path} is not there; pass --base with where "
                              "that base is now")
    ref = base_reference(str(path), 0)
    what, note = base_difference(lc.base, ref)
    if what is not None and what.endswith(EDITED):
        raise PeftExportError(f"{lc.path}/meta.json: its record of the base {path} contradicts itself ({what}); "
                              "export a checkpoint whose meta.json is as the run wrote it")
    if what is not None:
        raise PeftExportError(f"{path} is not the base the adapters of {lc.path} were trained on ({what}; recorded "
                              f"base {lc.base.get('init_from')}, sha256 {str(lc.base.get('sha256'))[:12]}...); pass "
                              "--base with that base, unchanged")
    if note and _rank() == 0:
        import sys

        print(f"q38 convert: note: {note}", file=sys.stderr)
    return ref


def _base_loader(lc: LoraCheckpoint, base: str | os.PathLike | None, stack: ExitStack):
    """``(load(names) -> base tensors, stored dtype of a leaf, quantized at load)`` of the base of ``lc``: a Hugging
    Face directory (read per tensor with safetensors slices), a q38 checkpoint (read per leaf from DCP), or the seed's
    init (drawn per leaf; the leaves an FP8 base quantizes drawn in fp32, as the run drew them). ``quantized at
    load``: the run (``peft.base_dtype: fp8``) held this base's projections as its own block-FP8 quantization (a
    base that is not a block-FP8 checkpoint), so the values it trained on are not the stored ones."""
    from q38.model import abstract_params, is_param_info
    from q38.train.io.checkpoint import config_diff

    cfg = lc.config
    if lc.base.get("init_from") is None:
        from q38.layers.common import materialize

        infos = {p: i for p, i in named_leaves(abstract_params(cfg), is_leaf=is_param_info) if i is not None}
        seed = int(lc.base["seed"])
        compute = getattr(torch, (lc.meta.get("train_config") or {}).get("param_dtype", "float32"))

        fp8 = lc.peft.base_dtype == "fp8"

        def draw(names):
            return tuple(materialize(infos[q], q, seed=seed, dtype=torch.float32 if fp8 and default_quantized(q)
                                     else compute) for q in names)

        return draw, (lambda q: compute), fp8
    path = Path(base if base is not None else lc.base["init_from"])  # checked by check_base_path before
    if (path / "config.json").is_file() and not is_checkpoint(path):
        from q38.hf import HFReader, open_hf

        src = open_hf(path, mtp_num_layers=cfg.mtp_num_layers, mtp_shared_layer=cfg.mtp_shared_layer)
        _same_model(config_diff(src.config.to_dict(), cfg.to_dict()), path, lc)
        reader = stack.enter_context(HFReader(src))
        shapes = {p: i.shape for p, i in named_leaves(abstract_params(cfg), is_leaf=is_param_info) if i is not None}

        def read(names):
            return tuple(reader.block(q, tuple(slice(0, n) for n in shapes[q])) for q in names)

        return read, reader.stored_dtype, lc.peft.base_dtype == "fp8" and src.fp8 is None
    bk = resolve_checkpoint(path)
    bmeta = read_meta(bk)
    if bmeta.get("peft"):
        raise PeftExportError(f"the base {bk} of {lc.path} is itself a LoRA checkpoint; export needs a whole model")
    _same_model(config_diff(bmeta["model_config"], cfg.to_dict()), bk, lc)
    breader = checkpoint_reader(bk)
    bsaved = saved_tensors(bk, breader)
    from q38.train.io.checkpoint import master_dtypes

    masters = master_dtypes(bsaved)  # a base with bf16 + remainder masters: read (and typed) as its fp32 masters
    return _leaf_loader(bk, breader, bsaved), (lambda q: masters[f"params.{q}"][1]), False  # (an FP8 base: refused)


def _same_model(diff: list[str], where, lc: LoraCheckpoint) -> None:
    if diff:
        raise PeftExportError(f"the base {where} holds another model than LoRA checkpoint {lc.path} "
                              f"({'; '.join(diff[:4])})")


def merged_loader(lc: LoraCheckpoint, base_load: Callable) -> Callable[[tuple[str, ...]], tuple]:
    """``load(names)``: those q38 leaves of the merged model, each read when asked: the base leaf, and for an adapted
    weight ``base + scale · B @ A`` in fp32 (``q38.lora.merge_weight``, the merge the run computes with)."""
    adapter = _leaf_loader(lc.path, lc.reader, lc.saved)
    adapted = set(lc.adapted)

    def load(names):
        out = []
        for q, t in zip(names, base_load(names)):
            if q not in adapted:
                out.append(t)
                continue
            ka, kb = lc.adapter_keys(q)
            a, b = adapter((ka, kb))
            node = (SharedLora if ka.endswith("shared_a") else Lora)(t.float(), a.float(), b.float(),
                                                                     scale=lc.peft.scale)
            with torch.no_grad():
                out.append(merge_weight(node))
        return tuple(out)

    return load


MERGE_ONTO = ("trained", "original")  # `q38 convert --to-hf --merge-onto` (docs/finetuning.md#export-a-lora-run)
FP8_BLOCK = (128, 128)  # the blocks a run quantizes a base in at load (q38.train.io.peft.fp8_base)


def trained_loader(base_load: Callable) -> Callable[[tuple[str, ...]], tuple]:
    """``load(names)`` of the base values a ``peft.base_dtype: fp8`` run trained on when it quantized its base at
    load: each leaf it holds in block-FP8 (``q38.fp8.default_quantized``) quantized per 128 × 128 block from the fp32
    base values (``quantize_blocks``, as ``fp8_base`` does) and dequantized in fp32; every other leaf as read."""
    from q38.fp8 import dequantize_blocks, quantize_blocks

    def load(names):
        out = []
        for q, t in zip(names, base_load(names)):
            if default_quantized(q):
                bits, scale = quantize_blocks(t.float(), FP8_BLOCK)
                t = dequantize_blocks(bits, scale, FP8_BLOCK, torch.float32)
            out.append(t)
        return tuple(out)

    return load


def merge_description(meta: dict, merge_onto: str, base: str | os.PathLike | None) -> str:
    """What the merged export of a LoRA checkpoint (its ``meta``) merges onto, in words, for the line
    ``q38 convert`` prints."""
    entry = meta.get("peft") or {}
    where = base or (entry.get("base") or {}).get("init_from")
    name = f"the base {where}" if where else f"the base drawn from seed {(entry.get('base') or {}).get('seed')}"
    if entry.get("base_dtype") != "fp8":
        return name
    if where and ((meta.get("source_format") or {}).get("fp8") is not None):
        return f"{name} (a block-FP8 checkpoint: its dequantized values, as the run trained on)"
    if merge_onto == "trained":
        return f"{name} quantized to block-FP8 (128x128) and dequantized, the values the run trained on"
    return f"{name} as stored (the run trained on its block-FP8 quantization; --merge-onto trained merges onto that)"


def export_merged(ck: str | os.PathLike, out: str | os.PathLike, *, dtype=SOURCE,
                  max_shard_bytes: int | None = None, base: str | os.PathLike | None = None,
                  merge_onto: str = "trained", extras: ExportExtras | None = None) -> Path:
    """Write the merged model of the LoRA checkpoint ``ck`` (its base + ``scale · B @ A`` on every adapted weight) as
    a Hugging Face directory ``out``, streamed and sharded as ``q38.train.io.hf_io.export_checkpoint`` writes a
    checkpoint (each rank its share of the files, one conversion rule's tensors in memory). The base is the one the
    checkpoint names (``base``: where it is now), checked against the recorded reference first (``check_base_path``):
    a Hugging Face directory, a q38 checkpoint, or the seed's init. ``merge_onto`` (a ``peft.base_dtype: fp8`` run
    whose base was quantized at load): ``"trained"``, the dequantized block-FP8 values the run trained on
    (``trained_loader``), or ``"original"``, the stored base; the same for any other run. ``dtype``: as
    ``export_checkpoint`` (``"source"``: each tensor in the dtype of the Hugging Face base, block-FP8 again for an
    FP8 one; ``None``: the base's stored dtypes). ``extras``: as ``export_checkpoint``'s."""
    from q38.hf import DEFAULT_MAX_SHARD_BYTES

    if merge_onto not in MERGE_ONTO:
        raise PeftExportError(f"merge_onto must be one of {', '.join(MERGE_ONTO)}, got {merge_onto!r}")
    ck, out = Path(ck), Path(out)
    stack = ExitStack()
    with stack:
        lc = all_ranks_ok(lambda: open_lora_checkpoint(ck), f"reading LoRA checkpoint {ck}")
        check_base_path(lc, base)  # collective: every rank hashes its share of the base

        def prepare():
            base_load, base_dtype, quantized_at_load = _base_loader(lc, base, stack)
            if quantized_at_load and merge_onto == "trained":
                base_load = trained_loader(base_load)
            if dtype is None:
                dtypes, fp8 = base_dtype, None
            else:
                dtypes, fp8 = export_dtypes(lc.meta, dtype, {})
            export = plan_export(lc.config, dtypes, max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
                                 fp8=fp8)
            return base_load, export

        base_load, export = all_ranks_ok(prepare, f"reading the base of LoRA checkpoint {ck}")
        return write_export(export, out, lambda: merged_loader(lc, base_load), f"exporting the merged {ck} to {out}",
                            extras)


__all__ = ["FP8", "SOURCE", "export_merged", "export_peft", "open_lora_checkpoint", "plan_peft"]
