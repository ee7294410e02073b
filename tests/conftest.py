import os

import pytest
import torch

# FLA's Triton kernels run on a CPU-only machine through Triton's interpreter (tests/fla_cpu.py). Triton reads the
# switch as it defines each kernel, its own library's included, and torch imports Triton early (torch._dynamo): so it
# is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_default_dtype(torch.float32)

import q38.model  # noqa: E402,F401 (registers the layer kinds every ModelConfig checks; `import q38` alone does not)
torch.use_deterministic_algorithms(True, warn_only=True)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def gen():
    """A fresh, seeded generator per test (Equinox's getkey)."""
    return torch.Generator().manual_seed(0)


@pytest.fixture
def tiny_cfg():
    from q38.model_config import ModelConfig

    return ModelConfig.preset("tiny")


@pytest.fixture(scope="session", autouse=True)
def _transformers_reference_on_its_torch_path():
    """transformers swaps its pure-torch gated delta rule for flash-linear-attention's kernels whenever ``fla``
    imports (the slow suite installs it for tests/test_gdn_fla.py). The reference is transformers' own torch code:
    where FLA is installed and there is no GPU, its Qwen3.5 / Qwen3-Next modules get their torch functions back
    (``functools.wraps`` keeps them as ``__wrapped__``)."""
    import importlib.util

    if torch.cuda.is_available() or importlib.util.find_spec("fla") is None:
        yield
        return
    import importlib

    for name in ("qwen3_5_moe", "qwen3_next"):
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                   "causal_conv1d_update"):
            f = getattr(mod, fn, None)
            if f is not None and hasattr(f, "__wrapped__"):
                setattr(mod, fn, f.__wrapped__)
    yield
