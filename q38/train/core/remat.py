"""Activation recompute (per layer, optionally selective) and activation offload to host memory."""

import contextlib
import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from q38.layers.kinds import flagged_regions
from q38.train.core.step_config import TrainConfig


class KernelRegions:
    """The hot-kernel region the running layer is in (a region name of the kind table, ``q38.layers.kinds``, or
    None), one per step: the layers enter ``enter(name)`` (given to them as ``SeqInfo.region``) around their hot
    kernel, and the selective recompute policy keeps the outputs of the ops inside a kept region. Forward and the
    recompute in backward run one after the other, never at once, so one record serves both."""

    def __init__(self) -> None:
        self.current: str | None = None

    @contextlib.contextmanager
    def enter(self, name: str):
        prev, self.current = self.current, name
        try:
            yield
        finally:
            self.current = prev


def _policy(keep: frozenset, regions: KernelRegions):
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if regions.current in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpoint_contexts(inner, on_forward, on_recompute):
    """``checkpoint``'s ``context_fn``: the forward and recompute contexts of ``inner`` (selective recompute's; None:
    none), each calling its callback as it is entered, before the policy sees an op. Checkpoint enters the forward
    context only when it records a backward, and the recompute one only in backward."""
    fwd, rec = inner() if inner is not None else (contextlib.nullcontext(), contextlib.nullcontext())
    return _calling_first(on_forward, fwd), _calling_first(on_recompute, rec)


@contextlib.contextmanager
def _calling_first(callback, ctx):
    if callback is not None:
        callback()
    with ctx:
        yield


def layer_wrapper(tc: TrainConfig, saved_hooks=None, regions: KernelRegions | None = None):
    """``wrap_layer(fn, params, x, on_forward, on_recompute)`` for ``LayerHooks``: plain call, checkpoint, or selective
    checkpoint (``on_forward()`` / ``on_recompute()``, when given, run as the checkpointed forward / the recompute in
    backward begins, before ``fn``, outside the selective policy's op recording); with offload
    every tensor saved for backward lives in host memory until it is needed. ``saved_hooks`` (a context factory,
    used without recompute): the FSDP reshard-after-forward hooks of the mesh runtime. ``regions``: the step's
    ``KernelRegions``, whose ``enter`` the layers' ``SeqInfo.region`` must be (needed for selective recompute)."""
    keep = flagged_regions(tc)

    if keep and regions is None:
        raise ValueError("selective recompute (skip_*_recompute) needs the step's KernelRegions (regions=)")

    def wrap(fn, p, x, on_forward=None, on_recompute=None):
        if not tc.recompute:
            return fn(p, x)
        inner = functools.partial(create_selective_checkpoint_contexts, _policy(keep, regions)) if keep else None
        contexts = functools.partial(_checkpoint_contexts, inner, on_forward, on_recompute)
        return checkpoint(fn, p, x, use_reentrant=False, determinism_check="none", context_fn=contexts)

    if saved_hooks is not None and not tc.recompute and not tc.offload_activations:

        def resharded(fn, p, x, on_forward=None, on_recompute=None):  # no checkpoint: the callbacks are not due
            with saved_hooks():
                return fn(p, x)

        return resharded
    if not (tc.recompute or tc.offload_activations):
        return None
    if tc.offload_activations:

        def offloaded(fn, p, x, on_forward=None, on_recompute=None):
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return wrap(fn, p, x, on_forward, on_recompute)

        return offloaded
    return wrap
