"""Peak live tensor bytes of a CPU computation, measured like an allocator would see them.

A ``TorchDispatchMode`` sees every tensor every aten op returns (forward, autograd backward, collectives' buffers);
each distinct storage (a DTensor's local shard) is counted from its first appearance until Python frees it (a ``weakref.finalize`` on the
storage). Tensors alive before the mode starts (parameters, optimizer state) are registered up front. Views and
in-place results share their storage and are counted once. This is independent of q38's planner: it knows nothing
about layers, layouts or the model.
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
import torch.utils._pytree as pytree


class PeakMemory(TorchDispatchMode):
    def __init__(self, existing=()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}
        self.timeline: list[tuple[str, int]] = []
        for t in pytree.tree_leaves(existing):
            if isinstance(t, torch.Tensor):
                self._track(t)

    def _track(self, t: torch.Tensor) -> None:
        t = getattr(t, "_local_tensor", t)  # a DTensor: its local shard
        if t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
        except RuntimeError:  # a wrapper without storage of its own (AsyncCollectiveTensor): its data is counted
            return  # when the op that fills it returns
        n = st.nbytes()
        if key == 0 or key in self._seen:
            return
        self._seen[key] = n
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out
