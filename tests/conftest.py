import os

import pytest
import torch

# FLA's Triton kernels run on a CPU-only machine through Triton's interpreter (tests/fla_cpu.py). Triton reads the
# switch as it defines each kernel, its own library's included, and torch imports Triton early (torch._dynamo): so it
# is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_default_dtype(torch.float32)
torch.use_deterministic_algorithms(True, warn_only=True)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def gen():
    """A fresh, seeded generator per test (Equinox's getkey)."""
    return torch.Generator().manual_seed(0)


@pytest.fixture
def tiny_cfg():
    from q38.config import ModelConfig

    return ModelConfig.preset("tiny")
