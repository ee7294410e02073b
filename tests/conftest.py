import os

import pytest
import torch

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
