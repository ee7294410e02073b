"""q38: a functional, sharding-table-driven trainer for the Qwen3.5-MoE hybrid model family."""

from q38.model_config import ConfigError, ModelConfig
from q38.model import (
    ModelOutput,
    ModelParams,
    ParamCount,
    abstract_params,
    count_params,
    forward,
    head_weight,
    init_params,
    logits,
)

__version__ = "0.1.0"


def load_hf(path, **kwargs):
    """Load a Hugging Face checkpoint directory → ``(ModelConfig, ModelParams)`` (MTP weights included)."""
    from q38.hf import load_hf as _load

    return _load(path, **kwargs)


def save_hf(path, config, params, **kwargs):
    """Save ``params`` as a Hugging Face checkpoint directory in the Qwen3.5-MoE layout (with ``mtp.*``)."""
    from q38.hf import save_hf as _save

    return _save(path, config, params, **kwargs)


__all__ = [
    "ConfigError", "ModelConfig", "ModelOutput", "ModelParams", "ParamCount", "abstract_params", "count_params",
    "forward", "head_weight", "init_params", "logits", "load_hf", "save_hf",
]
