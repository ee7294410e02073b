"""The dtype each part of a step is stored, computed or sent in, read from a run config the way the trainer reads it
(``train.param_dtype`` or its alias ``run.dtype``, ``train.reduce_dtype``; master weights and AdamW moments are always
fp32), and the one block of ``q38 plan`` that states it (docs/plan.md#dtypes-and-tokens-per-rank)."""

from typing import Any, Mapping

import attrs

from q38.model_config import ConfigError

SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
RUNTIME_DEFAULT = "fp32"  # TrainConfig's param_dtype and reduce_dtype when a run config sets neither


def short_dtype(name: Any) -> str:
    """``bf16`` for ``bfloat16``, ``torch.bfloat16`` or ``bf16`` (and likewise fp32, fp16)."""
    key = str(name).replace("torch.", "")
    if key not in SHORT:
        raise ConfigError(f"unknown dtype {name!r}; use one of bf16, fp16, fp32")
    return SHORT[key]


@attrs.frozen
class Precision:
    """The mixed-precision policy of one run: ``param`` is the compute dtype (each layer's shards are cast to it
    before the all-gather; activations are in it too), ``reduce`` the gradients' (accumulated, reduce-scattered,
    all-reduced); master weights and AdamW moments are fp32."""

    param: str = attrs.field(default=RUNTIME_DEFAULT, converter=short_dtype)
    reduce: str = attrs.field(default=RUNTIME_DEFAULT, converter=short_dtype)
    master: str = "fp32"  # fp32 | bf16+remainder (train.master_dtype)
    moments: str = "fp32"  # fp32 | bf16 | int8 (train.moment_dtype)
    offload: bool = False  # masters and moments in host memory (train.offload_optimizer)
    lora_base: str | None = None  # a LoRA run's frozen base: fp8 | compute (peft.base_dtype); None: a full fine-tune

    def roles(self) -> tuple[tuple[str, str, str], ...]:
        """(role, dtype, what it covers), one per role, in the order ``q38 plan`` prints them."""
        where = " in host memory (offloaded)" if self.offload else ""
        compute = (("params", self.param, "the compute copy: shards cast before the all-gather, gathered layers, "
                                          "matmuls"),
                   ("activations", self.param, "saved for backward, EP all-to-all and CP exchanges (loss logits: "
                                               "fp32)"))
        if self.lora_base is not None:
            base = (("fp8", "the projections in block-FP8 (+ an fp32 scale per 128×128 block), the other leaves in "
                            f"{self.param}; no master, moments or gradient") if self.lora_base == "fp8" else
                    (self.param, "in the compute dtype; no master, moments or gradient"))
            return (
                ("frozen base", *base),
                ("adapter masters", self.master, "the LoRA A and B that AdamW updates"),
                ("AdamW moments", self.moments, "m and v of the adapters"),
                ("gradients", self.reduce, "of the adapters only: accumulated, reduce-scattered and all-reduced"),
                *compute,
            )
        return (
            ("master weights", self.master, f"the stored parameter shards AdamW updates{where}"),
            ("AdamW moments", self.moments, f"m and v, stored beside the masters{where}"),
            ("gradients", self.reduce, "accumulated over micro-batches, reduce-scattered and all-reduced"),
            *compute,
        )


def format_precision(p: Precision) -> str:
    """The dtype block: one line per role."""
    lora = "; a LoRA run (peft): base and adapters" if p.lora_base is not None else ""
    lines = ["dtypes (train.param_dtype or run.dtype, train.reduce_dtype, train.moment_dtype, train.master_dtype; "
             f"q38 plan --dtype / --reduce-dtype / --moment-dtype / --master-dtype override them{lora})"]
    lines += [f"  {role:<16}{dt + ' ':<6}{what}" for role, dt, what in p.roles()]
    return "\n".join(lines)


def run_precision(raw: Mapping[str, Any], *, param_dtype: str | None = None,
                  reduce_dtype: str | None = None, moment_dtype: str | None = None, master_dtype: str | None = None,
                  offload: bool | None = None, lora_base: str | None = None) -> Precision:
    """The precision of the run config ``raw`` (its YAML mapping; {} for none), as the trainer resolves it, with the
    ``q38 plan`` overrides applied; unset: fp32, the trainer's default (moments and masters too). ``lora_base``: the
    planned LoRA run's base dtype (``fp8`` | ``compute``), None for a full fine-tune."""
    train, run = raw.get("train") or {}, raw.get("run") or {}
    if train.get("param_dtype") and run.get("dtype") and short_dtype(train["param_dtype"]) != short_dtype(run["dtype"]):
        raise ConfigError(f"run.dtype {run['dtype']!r} and train.param_dtype {train['param_dtype']!r} disagree; "
                          "run.dtype is an alias of train.param_dtype: drop run.dtype or make them equal")
    param = param_dtype or train.get("param_dtype") or run.get("dtype") or RUNTIME_DEFAULT
    moments = {"float32": "fp32", "bfloat16": "bf16"}.get(str(moment_dtype or train.get("moment_dtype") or "float32"))
    master = {"float32": "fp32", "bfloat16_remainder": "bf16+remainder"}.get(
        str(master_dtype or train.get("master_dtype") or "float32"))
    return Precision(param=param, reduce=reduce_dtype or train.get("reduce_dtype") or RUNTIME_DEFAULT,
                     moments=moments or str(moment_dtype or train.get("moment_dtype")), master=master or "fp32",
                     offload=bool(train.get("offload_optimizer") if offload is None else offload), lora_base=lora_base)
