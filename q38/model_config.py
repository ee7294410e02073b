"""Model configuration: one frozen attrs class, loaded from YAML presets (``q38.hf_config`` reads and writes Hugging
Face ``config.json``).

Every field of the Qwen3.5-MoE / Qwen3-Next text model (docs/model.md#config-fields-and-presets). Kernel choices are a run setting
(``q38.kernels.KernelConfig``), not part of the model.
Checks live in ``__attrs_post_init__`` and name the offending field and the fix.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import attrs

from q38.errors import ConfigError, check_keys, need

SPECS_DIR = Path(os.environ.get("Q38_SPECS", Path(__file__).resolve().parent.parent / "specs"))


@attrs.frozen(kw_only=True)
class ModelFamily:
    """How a ``model_type`` maps onto q38: its checkpoint layout and its MTP depth field names."""

    name: str
    checkpoint_layout: str  # "qwen3_5_moe" (fused experts, flat GDN projections) | "qwen3_next"
    prefix: str  # key prefix of the text model in a checkpoint


MODEL_FAMILIES: dict[str, ModelFamily] = {
    "qwen3_5_moe": ModelFamily(name="qwen3_5_moe", checkpoint_layout="qwen3_5_moe", prefix="model.language_model."),
    "qwen3_5_moe_text": ModelFamily(name="qwen3_5_moe", checkpoint_layout="qwen3_5_moe", prefix="model."),
    "qwen3_next": ModelFamily(name="qwen3_next", checkpoint_layout="qwen3_next", prefix="model."),
    # The family of the 2.4T preset: the Qwen3.5-MoE text architecture with MTP, saved in the Qwen3.5 layout.
    "qwen3_8_moe": ModelFamily(name="qwen3_8_moe", checkpoint_layout="qwen3_5_moe", prefix="model.language_model."),
}

MTP_DEPTH_FIELDS = ("mtp_num_hidden_layers", "num_nextn_predict_layers", "mtp_num_layers")

# The layer-kind table (q38.layers.kinds.MIXER_KINDS) whose names ``layer_types`` entries may take. The table
# registers itself here when it is imported, which importing q38.model, q38.hf_config or the name q38.ModelConfig does
# (not ``import q38`` alone: the command line's help answers without torch); this module cannot import it (the layers
# import this module).
_layer_kinds: Mapping[str, Any] | None = None


def register_layer_kinds(table: Mapping[str, Any]) -> None:
    """Check ``layer_types`` against ``table`` (a live mapping: a kind added to it later is accepted too)."""
    global _layer_kinds
    _layer_kinds = table


# legacy ModelConfig field → KernelConfig field (q38.kernels)
LEGACY_KEYS = {
    "gdn_implementation": "gdn",
    "causal_conv1d_implementation": "causal_conv1d",
    "attention_implementation": "attention",
    "use_grouped_expert_matmul": "experts",  # a bool: true → grouped_mm, false → batched
    "gdn_chunk_size": "gdn_chunk_size",  # was a ModelConfig field (default 64)
}
# what each legacy key meant when left at its default: mapped without a note
_LEGACY_DEFAULTS = {"gdn": "torch", "causal_conv1d": "torch", "attention": "sdpa", "gdn_chunk_size": 64}


def legacy_kernel_keys(
    d: Mapping[str, Any], *, source: str = "model config", mapped: bool = True
) -> tuple[dict, dict[str, Any]]:
    """Split a model-config mapping into ``(model keys, kernel keys)``: the pre-``KernelConfig`` keys
    (``LEGACY_KEYS``: ``gdn_implementation`` / ``causal_conv1d_implementation`` / ``attention_implementation`` /
    ``use_grouped_expert_matmul`` / ``gdn_chunk_size``) become ``kernels`` entries. A non-default value gets a ``UserWarning`` note saying where it went (``mapped``: into this run's
    kernels; otherwise, e.g. from a checkpoint's metadata, it does not bind the run and is ignored)."""
    rest = dict(d)
    kern = {}
    for old, new in LEGACY_KEYS.items():
        if old in rest:
            kern[new] = rest.pop(old)
    if "experts" in kern:  # use_grouped_expert_matmul was a bool; false was the default (no note)
        if kern["experts"] is True:
            kern["experts"] = "grouped_mm"
        else:
            kern.pop("experts")
    moved = {k: v for k, v in kern.items() if v != _LEGACY_DEFAULTS.get(k)}
    if moved:
        olds = {n: o for o, n in LEGACY_KEYS.items()}
        what = ", ".join(f"{olds[k]}: {v}" for k, v in moved.items())
        as_kernels = "{" + ", ".join(f"{k}: {v}" for k, v in moved.items()) + "}"
        where = (f"read as kernels: {as_kernels} (put it in the run config's kernels section)" if mapped else
                 "ignored here (the run's kernels section decides; this model is the same under any kernels)")
        warnings.warn(f"{source}: {what} is a run setting now, not part of the model; {where}", UserWarning,
                      stacklevel=3)
    return rest, kern


def model_family(model_type: str) -> ModelFamily:
    try:
        return MODEL_FAMILIES[model_type]
    except KeyError:
        raise ConfigError(
            f"unknown model_type {model_type!r}; known model types: {', '.join(sorted(MODEL_FAMILIES))}"
        ) from None


def _default_layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))


def _tuple(x):
    return tuple(x) if x is not None else None


MAX_LAYERS = 4096  # num_hidden_layers, num_experts, mtp_num_layers: the shape code loops over them
MAX_SIZE = 1 << 24  # any other size of a model config (vocab, widths, heads): 16 Mi, 64x the largest preset's vocab
_COUNT_FIELDS = ("num_hidden_layers", "num_experts", "num_experts_per_tok", "mtp_num_layers")
_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
                "max_position_embeddings")


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Static, hashable model configuration (never a pytree leaf)."""

    model_type: str = "qwen3_5_moe"  # the Hugging Face model type of the family member
    vocab_size: int = 248320  # rows of the embedding and the LM head
    hidden_size: int = 2048  # the residual stream width
    num_hidden_layers: int = 40  # decoder layers
    # one mixer kind per layer (linear_attention | full_attention); null: 3 GDN then 1 full
    layer_types: tuple[str, ...] | None = attrs.field(default=None, converter=_tuple)
    # full attention
    num_attention_heads: int = 16  # query heads of a full-attention layer
    num_key_value_heads: int = 2  # key/value heads of a full-attention layer (divides the query heads)
    head_dim: int = 256  # width of one attention head
    rope_theta: float = 10_000_000.0  # rotary base frequency
    partial_rotary_factor: float = 0.25  # fraction of head_dim that is rotated
    # gated deltanet
    linear_num_key_heads: int = 16  # GDN query/key heads
    linear_num_value_heads: int = 32  # GDN value heads (a multiple of the key heads)
    linear_key_head_dim: int = 128  # width of one GDN query/key head
    linear_value_head_dim: int = 128  # width of one GDN value head
    linear_conv_kernel_dim: int = 4  # GDN causal convolution width
    # moe
    num_experts: int = 256  # routed experts per MoE layer
    num_experts_per_tok: int = 8  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 512  # hidden width of one routed expert
    shared_expert_intermediate_size: int = 512  # hidden width of the shared expert (0: none)
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing aux loss (train.aux_loss_coef overrides it)
    # mtp
    mtp_num_layers: int = 0  # depths D (each its own loss term mtp_<d>)
    # true: one MTP decoder layer (HF mtp.layers.0) runs at every depth, as vLLM / SGLang draft with it;
    # false: one layer per depth (mtp.layers.0 .. D-1)
    mtp_shared_layer: bool = False
    # misc
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_word_embeddings: bool = False  # the LM head shares the embedding matrix
    initializer_range: float = 0.02  # std of the normal init of the weights
    max_position_embeddings: int = 262144  # longest sequence the rotary tables are built for
    hidden_act: str = "silu"  # the experts' activation (silu only)
    attention_bias: bool = False  # biases on the attention projections (false only)
    bos_token_id: int | None = None  # written to config.json on export
    eos_token_id: int | None = None  # written to config.json on export
    pad_token_id: int | None = None  # written to config.json on export
    # Kernel choices and the torch GDN core's chunk length are run settings (q38.kernels.KernelConfig), not fields here.

    def __attrs_post_init__(self) -> None:
        self._check_sizes()  # before anything is built from them (the default layer_types is one entry per layer)
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", _default_layer_types(self.num_hidden_layers))
        model_family(self.model_type)
        self._validate()

    def _check_sizes(self) -> None:
        """Every size an integer, the layer, expert and MTP counts at most ``MAX_LAYERS``, every other size at most
        ``MAX_SIZE`` (far above the 2.4T preset's; what a model of these sizes needs in memory is checked where it
        would be allocated: ``q38.model.check_host_memory``)."""
        for a in attrs.fields(type(self)):
            v = getattr(self, a.name)
            if a.name in _SIZE_FIELDS or a.name in _COUNT_FIELDS:
                need(isinstance(v, int) and not isinstance(v, bool),
                     f"{a.name} must be an integer, got {type(v).__name__} {str(v)[:40]}")
                lim = MAX_LAYERS if a.name in _COUNT_FIELDS else MAX_SIZE
                need(abs(v) <= lim, f"{a.name} = {v} exceeds the limit {lim:,} (no model of this family comes "
                                    "near it); fix the model config")

    # ---- validation ---------------------------------------------------------------------------------
    def _validate(self) -> None:
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size",
        ):
            need(int(getattr(self, name)) > 0, f"{name} must be a positive integer, got {getattr(self, name)!r}")
        need(self.shared_expert_intermediate_size >= 0, "shared_expert_intermediate_size must be >= 0")
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads ({self.num_attention_heads}) must be divisible by num_key_value_heads "
            f"({self.num_key_value_heads}); pick a kv head count that divides the query heads",
        )
        need(
            self.linear_num_value_heads % self.linear_num_key_heads == 0,
            f"linear_num_value_heads ({self.linear_num_value_heads}) must be divisible by linear_num_key_heads "
            f"({self.linear_num_key_heads}); each key head serves a whole group of value heads",
        )
        need(
            len(self.layer_types) == self.num_hidden_layers,
            f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}; "
            "give one entry per layer or drop layer_types to use the 3:1 default",
        )
        if _layer_kinds is None:
            raise RuntimeError("the layer-kind table is not loaded: import q38.model (or q38.layers.kinds, "
                               "q38.hf_config) before building a ModelConfig")
        bad = [t for t in self.layer_types if t not in _layer_kinds]
        need(not bad, f"layer_types entries must be one of {tuple(_layer_kinds)}; got {sorted(set(bad))} (a new "
                      "kind is a record in q38/layers/kinds.py: docs/extending.md#add-a-layer-kind)")
        need(
            self.num_experts_per_tok <= self.num_experts,
            f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts ({self.num_experts})",
        )
        need(
            0.0 < self.partial_rotary_factor <= 1.0,
            f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}",
        )
        need(
            self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
            f"rotary dim = int(head_dim * partial_rotary_factor) = {self.rotary_dim} must be even and > 0; "
            "change head_dim or partial_rotary_factor",
        )
        need(self.mtp_num_layers >= 0, f"mtp_num_layers must be >= 0 (0 disables MTP), got {self.mtp_num_layers}")
        need(self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} is not supported; this family uses 'silu'")
        need(
            not self.attention_bias,
            "attention_bias=True is not supported by q38 (no released checkpoint of this family uses it)",
        )
        need(self.rms_norm_eps > 0, "rms_norm_eps must be > 0")

    # ---- derived sizes ------------------------------------------------------------------------------
    @property
    def family(self) -> ModelFamily:
        return model_family(self.model_type)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def linear_value_groups(self) -> int:
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def mtp_layers_stored(self) -> int:
        """MTP decoder layers the model holds: one when shared by every depth, else one per depth."""
        return min(1, self.mtp_num_layers) if self.mtp_shared_layer else self.mtp_num_layers

    # ---- constructors -------------------------------------------------------------------------------
    def replace(self, **changes: Any) -> "ModelConfig":
        return attrs.evolve(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [a.name for a in attrs.fields(cls)]

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any], *, source: str = "config", kernels_out: dict | None = None
    ) -> "ModelConfig":
        """``kernels_out``: receives the pre-``KernelConfig`` kernel keys (``gdn_implementation`` ...) mapped onto
        ``KernelConfig`` names; they are accepted with a note and never become part of the model."""
        d, legacy = legacy_kernel_keys(d, source=source, mapped=kernels_out is not None)
        if kernels_out is not None:
            kernels_out.update(legacy)
        if "full_attention_interval" in d:
            interval = int(d.pop("full_attention_interval"))
            if d.get("layer_types") is None:
                d["layer_types"] = _default_layer_types(int(d.get("num_hidden_layers", 40)), interval)
        check_keys(d, cls.field_names(), f"{source}: unknown model config key(s)")
        from q38.schema import structure

        return structure(cls, d, "model")  # typed: every field by its annotation

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, *, kernels_out: dict | None = None) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"model config file not found: {path}")
        from q38.errors import read_yaml_file

        d = read_yaml_file(path, "model config")
        if d is None:  # not the default model: an empty file is a mistake (the defaults are a full-size model)
            raise ConfigError(f"model config {path} is empty; write the model's keys there, or name a preset")
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys, got {type(d).__name__}")
        check_keys([k for k in d if not isinstance(k, str)], (), f"{path}: unknown model config key(s)")
        return cls.from_dict(d, source=str(path), kernels_out=kernels_out)

    @classmethod
    def presets(cls) -> list[str]:
        return sorted(p.stem for p in (SPECS_DIR / "models").glob("*.yaml"))

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        path = SPECS_DIR / "models" / f"{name}.yaml"
        if not path.is_file():
            raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(cls.presets())}")
        return cls.from_yaml(path)

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d
