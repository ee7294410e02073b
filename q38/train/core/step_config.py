"""Training configuration (frozen attrs) and the up-front validation of option combinations.

Every rule here has a test that triggers its message (tests/test_config.py) and a line in docs/configuration.md.
"""

from typing import Any, Mapping

import attrs

from q38.model_config import ConfigError, ModelConfig, check_keys
from q38.schema import boolean, finite, ge, gt, in_range, one_of, structure

SCHEDULES = ("cosine", "linear", "constant")
AUX_SCOPES = ("micro_batch", "global_batch")
AUX_TYPES = ("pooled", "per_layer", "sequence")
AUX_TOKENS = ("real", "labelled")
NAN_POLICIES = ("stop", "skip")
# optimizer state (docs/configuration.md): AdamW moments in fp32, bf16 or 8-bit block-wise; the master weight as fp32
# or as the bf16 weight plus a 16-bit remainder (together the fp32 bits)
MOMENT_DTYPES = ("float32", "bfloat16", "int8")
MASTER_DTYPES = ("float32", "bfloat16_remainder")
EP_DISPATCHES = ("flat", "hierarchical")
# mixed precision (docs/parallel.md#mixed-precision): master weights fp32 (or bf16 + remainder: master_dtype)
PRECISION_DTYPES = ("float32", "bfloat16")
# Leaves that stay fp32 in compute under a 16-bit param_dtype (never rounded by the gather): the GDN decay A_log and
# the GDN gated-norm weight, the two leaves released Qwen3.5 checkpoints store in fp32
# (docs/parallel.md#mixed-precision)
DEFAULT_FP32_PARAMS = ("*.mixer.A_log", "*.mixer.norm_w")
DEFAULT_NO_DECAY = (
    "*norm*", "*.dt_bias", "*.A_log", "*.w_shared_gate", "*.w_router",  # norms, gates, biases
)


def _precision_dtype(inst, a, v) -> None:
    if v not in PRECISION_DTYPES:
        raise ConfigError(f"{a.name} must be one of {PRECISION_DTYPES}, got {v!r} (master weights and AdamW moments "
                          "are always float32; float16 would need loss scaling, which q38 does not implement: use "
                          "bfloat16)")


def _tuple(x):
    return tuple(x) if x is not None else None


@attrs.frozen(kw_only=True)
class TrainConfig:
    """Optimizer, schedule, loss options, recompute and micro-batching for ``train_step``."""

    # optimizer (AdamW) and schedule
    lr: float = attrs.field(default=3e-4, validator=[gt(0), finite])  # peak learning rate (after warmup)
    min_lr_ratio: float = attrs.field(default=0.1, validator=in_range(0, 1))  # the schedule decays to lr × this
    warmup_steps: int = attrs.field(default=0, validator=ge(0))  # linear warmup from 0 to lr
    # length of the LR schedule in steps (set it to run.steps)
    total_steps: int = attrs.field(default=1000, validator=gt(0))
    schedule: str = attrs.field(default="cosine", validator=one_of(*SCHEDULES))  # LR decay after warmup
    beta1: float = attrs.field(default=0.9, validator=in_range(0, 1, hi_open=True))  # AdamW first-moment decay
    beta2: float = attrs.field(default=0.95, validator=in_range(0, 1, hi_open=True))  # AdamW second-moment decay
    eps: float = attrs.field(default=1e-8, validator=[gt(0), finite])  # AdamW epsilon
    weight_decay: float = attrs.field(default=0.1, validator=[ge(0), finite])  # decoupled AdamW weight decay
    # glob patterns of parameter paths without weight decay
    no_decay: tuple[str, ...] = attrs.field(default=DEFAULT_NO_DECAY, converter=_tuple)
    # clip the global gradient norm to this (null: no clipping)
    grad_clip: float | None = attrs.field(default=1.0, validator=gt(0))
    # gradient accumulation: the step's batch is split into this many micro-batches (MindSpeed's chunk_mbs)
    micro_batches: int = attrs.field(default=1, validator=ge(1))
    # losses
    # tokens per chunk of the chunked cross-entropy (null: one chunk)
    loss_chunk_size: int | None = attrs.field(default=1024, validator=gt(0))
    dynamic_chunk_loss: bool = False  # size loss chunks from loss_chunk_budget_bytes instead of loss_chunk_size
    # memory for one chunk's logits (with dynamic_chunk_loss)
    loss_chunk_budget_bytes: int | None = attrs.field(default=None, validator=gt(0))
    # weight of the MTP terms (divided over the depths)
    mtp_loss_scaling_factor: float = attrs.field(default=0.1, validator=[ge(0), finite])
    # None: the model's router_aux_loss_coef
    aux_loss_coef: float | None = attrs.field(default=None, validator=[ge(0), finite])
    # count expert load per micro-batch or over the global batch
    aux_loss_scope: str = attrs.field(default="micro_batch", validator=one_of(*AUX_SCOPES))
    aux_loss_type: str = attrs.field(default="pooled", validator=one_of(*AUX_TYPES))  # pooled | per_layer | sequence
    aux_loss_tokens: str = attrs.field(default="real", validator=one_of(*AUX_TOKENS))  # real (non-padding) | labelled
    # aux-loss-free balancing (DeepSeek-V3 §2.1.2): a per-expert router bias for top-k selection, moved by ±rate
    aux_loss_free: bool = attrs.field(default=False, validator=boolean)
    # step of the aux-loss-free router bias update
    router_bias_rate: float = attrs.field(default=1e-3, validator=[gt(0), finite])
    # memory
    recompute: bool = False  # activation recompute of each decoder layer in backward
    skip_flash_attn_recompute: bool = False  # keep the attention kernel's output during recompute
    skip_gdn_recompute: bool = False  # keep the GDN core's output during recompute
    offload_activations: bool = False  # keep saved activations in host memory
    # communication overlap on a mesh: prefetch the next layer's FSDP gathers, reduce gradients async (waited after
    # each micro-batch's backward); same math as the serial schedule
    overlap_comm: bool = attrs.field(default=True, validator=boolean)
    fsdp_prefetch: bool | None = None  # None: follows overlap_comm; true/false force the prefetch alone
    # expert-parallel balance (needs an `ep` mesh dim > 1)
    enable_ep_balance: bool = False
    # hot experts duplicated per EP rank with enable_ep_balance
    max_dup_experts_num: int = attrs.field(default=2, validator=ge(0))
    # EP token dispatch (docs/parallel.md#expert-parallelism): flat (every slot to its owner) or hierarchical (a
    # token crosses to each remote node once); the same bits either way. Inside one node hierarchical is flat.
    ep_dispatch: str = attrs.field(default="flat", validator=one_of(*EP_DISPATCHES))
    # the EP all-to-alls of one half of the tokens in flight while the other half's (and the shared) experts run
    ep_overlap: bool = attrs.field(default=True, validator=boolean)
    # failure handling
    # a non-finite loss: stop the run, or skip the update
    nan_policy: str = attrs.field(default="stop", validator=one_of(*NAN_POLICIES))
    # mixed precision: fp32 master weights and moments; `param_dtype` for compute and FSDP gathers (each rank casts
    # its shard before the all-gather), `reduce_dtype` for gradient reduce-scatter / all-reduce and micro-batch
    # accumulation. Defaults keep fp32 runs exact.
    param_dtype: str = attrs.field(default="float32", validator=_precision_dtype)
    # dtype of the gradient reduce-scatter, all-reduce and accumulation
    reduce_dtype: str = attrs.field(default="float32", validator=_precision_dtype)
    # parameters (glob patterns on their paths, like no_decay) computed and gathered in fp32 whatever param_dtype;
    # init_from a Hugging Face checkpoint adds the leaf kinds it stores in fp32 beside 16-bit weights
    fp32_params: tuple[str, ...] = attrs.field(default=DEFAULT_FP32_PARAMS, converter=_tuple)
    # FSDP without recompute: free each gathered parameter after its layer's forward, gather it again in backward
    # (not applied with enable_ep_balance, whose per-rank graphs differ; use recompute there)
    reshard_after_forward: bool = True
    # optimizer state: `moment_dtype` stores both AdamW moments (int8: block-wise quantized, one fp32 scale per
    # block); `master_dtype` the master weights; `offload_optimizer` keeps masters and moments in host memory and
    # steps there
    moment_dtype: str = attrs.field(default="float32", validator=one_of(*MOMENT_DTYPES))
    # master weights: fp32, or the bf16 weight plus a 16-bit remainder (needs param_dtype bfloat16; the bf16 half
    # is the compute weight: 4 bytes a parameter either way, no cast copy before the gathers)
    master_dtype: str = attrs.field(default="float32", validator=one_of(*MASTER_DTYPES))
    # masters and moments in host memory, the AdamW step there; the device keeps the param_dtype compute copy of each
    # weight (needs param_dtype bfloat16; master_dtype float32; not with a peft section)
    offload_optimizer: bool = attrs.field(default=False, validator=boolean)

    def __attrs_post_init__(self) -> None:
        validate_train_config(self)

    @property
    def torch_param_dtype(self):
        import torch

        return getattr(torch, self.param_dtype)

    def compute_dtype(self, path: str):
        """The dtype parameter ``path`` is gathered and computed in: fp32 when it matches ``fp32_params``, else
        ``param_dtype``."""
        import fnmatch

        import torch

        if path.endswith(".scale_inv") or any(fnmatch.fnmatchcase(path, pat) for pat in self.fp32_params):
            return torch.float32  # (block-FP8 scales are gathered as stored: q38.fp8.Fp8Weight)
        return self.torch_param_dtype

    @property
    def torch_reduce_dtype(self):
        import torch

        return getattr(torch, self.reduce_dtype)

    def replace(self, **changes: Any) -> "TrainConfig":
        return attrs.evolve(self, **changes)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "train") -> "TrainConfig":
        check_keys(d, [a.name for a in attrs.fields(cls)], f"{source}: unknown train config key(s)")
        return structure(cls, d, "train")  # typed: every field by its annotation and range validator

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["no_decay"] = list(self.no_decay)
        d["fp32_params"] = list(self.fp32_params)
        return d


def _keep_flag_kinds() -> list:
    """One layer kind per selective-recompute keep flag (the kind table's, ``q38.layers.kinds``)."""
    from q38.layers.kinds import MIXER_KINDS

    return list({k.keep_flag: k for k in MIXER_KINDS.values()}.values())


def validate_train_config(t: TrainConfig) -> None:
    """Rules between fields (each field's own type and range is checked by its validator). Each message names the
    options involved and the fix."""
    rules = (
        (0 <= t.warmup_steps <= t.total_steps,
         f"warmup_steps ({t.warmup_steps}) must be between 0 and total_steps ({t.total_steps})"),
        *((not (getattr(t, k.keep_flag) and not t.recompute),
           f"{k.keep_flag}: true needs recompute: true (it keeps the {k.region} kernel's output during activation "
           f"recompute); set recompute: true or drop {k.keep_flag}") for k in _keep_flag_kinds()),
        (not t.dynamic_chunk_loss or t.loss_chunk_budget_bytes is not None,
         "dynamic_chunk_loss: true needs loss_chunk_budget_bytes (the memory budget for one chunk's logits), "
         "e.g. loss_chunk_budget_bytes: 268435456"),
    )
    for ok, msg in rules:
        if not ok:
            raise ConfigError(msg)
    if t.master_dtype == "bfloat16_remainder" and t.param_dtype != "bfloat16":
        raise ConfigError(f"master_dtype: bfloat16_remainder stores each master as its bf16 compute weight plus a "
                          f"16-bit remainder, so it needs param_dtype: bfloat16 (got {t.param_dtype}); set "
                          "train.param_dtype: bfloat16 (or run.dtype: bfloat16), or master_dtype: float32")
    if t.offload_optimizer and t.param_dtype != "bfloat16":
        raise ConfigError(f"offload_optimizer: true keeps only the compute copy of each weight on the device, in "
                          f"param_dtype, so it needs param_dtype: bfloat16 (got {t.param_dtype}); set "
                          "train.param_dtype: bfloat16, or offload_optimizer: false")
    if t.offload_optimizer and t.master_dtype != "float32":
        raise ConfigError(f"offload_optimizer: true keeps fp32 masters on the host, where the bf16 + remainder form "
                          f"saves nothing; set master_dtype: float32 (got {t.master_dtype}) or offload_optimizer: "
                          "false")


def validate_run(
    model: ModelConfig, train: TrainConfig, *, device: str = "cpu", ep_size: int = 1, kernels=None, cp_size: int = 1
):
    """Cross-config rules: kernels (``q38.kernels.KernelConfig``) vs device and CP, EP balance vs the layout, MTP
    depth. Returns the resolved kernels (``auto`` replaced by the implementation this run uses)."""
    from q38.kernels import resolve_kernels

    # one ConfigError per unsupported choice
    resolved = resolve_kernels(kernels, device=device, cp=cp_size > 1, dtype=train.param_dtype, model=model)
    if train.enable_ep_balance and ep_size <= 1:
        raise ConfigError(
            "enable_ep_balance: true needs expert parallelism (a layout with an `ep` mesh dim > 1); "
            f"the layout's ep size is {ep_size}. Use an EP layout (e.g. fsdp_ep) or set enable_ep_balance: false"
        )
    if resolved.block == "compiled" and ep_size > 1:  # the layer would refuse it at the first step
        raise ConfigError(
            f"kernels.block: compiled runs without expert parallelism for now (the EP dispatch's collectives cannot "
            f"be in the compiled graph); the layout's ep size is {ep_size}. Set kernels.block: eager, or use a "
            "layout without an `ep` mesh dim"
        )
    if train.skip_flash_attn_recompute and resolved.attention == "eager":
        raise ConfigError(
            "skip_flash_attn_recompute: true needs a fused attention kernel (kernels.attention: sdpa); "
            "eager attention has no single kernel output to keep"
        )
    return resolved
