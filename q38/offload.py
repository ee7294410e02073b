"""Host-offloaded optimizer state (``train.offload_optimizer: true``; docs/optimizer.md, "Offloaded optimizer").

A leaf computed in ``param_dtype`` (bf16 or fp16; not a ``fp32_params`` leaf) keeps its fp32 master
(``TrainState.host_master``) and both AdamW moments on the host (``device="cpu"``); the run's device holds only its
compute copy (the ``params`` leaf, always ``master.to(param_dtype)``: torch's round-to-nearest-even cast, the cast an
fp32-master run makes before each gather) and, during the step, its gradient. The AdamW update of such a leaf runs
on the host with the same torch call as on the device; its gradient comes over first and the new compute copy goes
back after.

On a CUDA device ``GradsToHost`` copies each gradient into a pinned host buffer on a side stream, the next leaf's copy
in flight while the host updates this one, and ``to_device`` writes the new compute copy from a pinned staging
buffer without blocking the host. On a CPU device (the tests, gloo ranks) the host is the device: the copies are
plain tensor reads and casts, nothing overlaps. The masters and moments themselves stay in pageable host memory:
they are never copied (what crosses is the gradient and the compute-dtype cast of the master).
"""

import torch
from torch import Tensor

HOST = torch.device("cpu")


def is_offload_path(path: str, train_config) -> bool:
    """Whether parameter ``path`` keeps its master and moments on the host under ``train_config``: every leaf
    computed in ``param_dtype`` when ``offload_optimizer`` is on (an ``fp32_params`` leaf keeps an fp32 master and
    fp32 moments on the device and steps there)."""
    return bool(train_config.offload_optimizer) and train_config.compute_dtype(path) != torch.float32


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class GradsToHost:
    """The gradients ``grads[i]`` (device tensors or DTensors) of the leaves ``wanted[i]`` as host tensors, taken in
    increasing ``i`` with ``take``. On CUDA the copy of the next wanted leaf is started (side stream, pinned buffer)
    before ``take`` returns, so it runs while the host updates the leaf just taken; elsewhere ``take`` returns the
    local tensor itself (the host is the device)."""

    def __init__(self, grads: list, wanted: list[bool]):
        self.grads, self.wanted = grads, wanted
        self.pending: dict[int, tuple] = {}
        cuda = [i for i, w in enumerate(wanted) if w and grads[i] is not None and _local(grads[i]).is_cuda]
        self.stream = torch.cuda.Stream(device=_local(grads[cuda[0]]).device) if cuda else None

    def _start(self, i: int) -> None:
        g = _local(self.grads[i]).detach()
        if not g.is_cuda:
            self.pending[i] = (g, None)
            return
        buf = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(g.device))  # the gradient is complete on the main stream
        with torch.cuda.stream(self.stream):
            buf.copy_(g, non_blocking=True)
            g.record_stream(self.stream)  # the caching allocator keeps it until the copy is done
            done = torch.cuda.Event()
            done.record(self.stream)
        self.pending[i] = (buf, done)

    def take(self, i: int) -> Tensor:
        """Leaf ``i``'s gradient on the host (its own dtype), the next wanted leaf's copy started."""
        if i not in self.pending:
            self._start(i)
        nxt = next((j for j in range(i + 1, len(self.wanted)) if self.wanted[j]), None)
        if nxt is not None and nxt not in self.pending and self.stream is not None:
            self._start(nxt)
        buf, done = self.pending.pop(i)
        if done is not None:
            done.synchronize()
        return buf


def to_device(master: Tensor, like: Tensor) -> Tensor:
    """The compute copy of the host fp32 ``master`` (a local tensor) in ``like``'s dtype on ``like``'s device (a new
    tensor): the round-to-nearest-even cast on the host, then one copy (from a pinned staging buffer on CUDA, not
    blocking the host)."""
    if like.device.type != "cuda":
        return master.to(like.dtype).to(like.device)
    staged = torch.empty(master.shape, dtype=like.dtype, pin_memory=True)
    staged.copy_(master)
    return staged.to(like.device, non_blocking=True)  # (the host allocator keeps `staged` until the copy is done)


def write_device_(dst: Tensor, master: Tensor) -> None:
    """``dst`` (a device compute copy, local) ``= master.to(dst.dtype)`` in place (donated step)."""
    if dst.device.type != "cuda":
        dst.copy_(master)  # (a cast copy: round to nearest even, as master.to(dst.dtype))
        return
    staged = torch.empty(master.shape, dtype=dst.dtype, pin_memory=True)
    staged.copy_(master)
    dst.copy_(staged, non_blocking=True)
