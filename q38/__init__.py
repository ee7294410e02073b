"""q38: a functional, sharding-table-driven trainer for the Qwen3.5-MoE hybrid model family.

The names below are imported on first use (PEP 562), so ``import q38`` (and the ``q38`` command's ``--help``) does
not import torch.
"""

import importlib

__version__ = "0.1.0"

_FROM = {
    "ConfigError": "q38.model_config", "ModelConfig": "q38.model_config",
    **{name: "q38.model" for name in ("ModelOutput", "ModelParams", "ParamCount", "abstract_params", "count_params",
                                      "forward", "head_weight", "init_params", "logits")},
}


def __getattr__(name: str):
    if name in _FROM:
        importlib.import_module("q38.model")  # the layer kinds register themselves, which a ModelConfig checks
        value = getattr(importlib.import_module(_FROM[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'q38' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_FROM])


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
