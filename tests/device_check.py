"""A dispatch mode that names every tensor factory call made from q38's step code without ``device=``.

Why this catches accelerator-only bugs on a CPU-only machine (docs/testing.md#device-correctness-without-a-gpu): under gloo on CPU a tensor
built without ``device=`` lands on the CPU like everything else, so nothing fails. On CUDA/NPU the same line builds
a CPU tensor next to device tensors, and nccl/hccl refuse it (e.g. EP's load count fed to an all-reduce, or the
receive buffer of ``all_to_all_single``). The mode records each such call, with the q38 file and line that made it,
while the real multi-process gloo step runs, so the test fails where the GPU run would.
"""

import os
import sys

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.empty, torch.empty_strided, torch.zeros, torch.ones,
    torch.full, torch.arange, torch.range, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn,
    torch.randint, torch.randperm,
})
_Q38 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "q38")
WATCHED = tuple(os.path.join(_Q38, d) + os.sep for d in ("layers", "parallel", "train"))
_TORCH = os.path.dirname(torch.__file__) + os.sep


class FactoryDeviceMode(TorchFunctionMode):
    """``calls``: ``"q38/…/file.py:line name"`` for each factory call without ``device=`` made (directly, or via a
    torch Python helper) by code under q38/layers, q38/parallel or q38/train."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            from_tensor = func is torch.as_tensor and args and isinstance(args[0], Tensor)
            if not from_tensor:
                f = sys._getframe(1)
                while f is not None and f.f_code.co_filename.startswith(_TORCH):
                    f = f.f_back
                if f is not None and f.f_code.co_filename.startswith(WATCHED):
                    rel = os.path.relpath(f.f_code.co_filename, os.path.dirname(_Q38))
                    self.calls.append(f"{rel}:{f.f_lineno} {getattr(func, '__name__', func)}")
        return func(*args, **kwargs)
