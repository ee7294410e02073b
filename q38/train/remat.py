"""Activation recompute (per layer, optionally selective) and activation offload to host memory."""

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from q38.layers.common import current_region
from q38.layers.kinds import MIXER_KINDS
from q38.train.config import TrainConfig


def _policy(keep: frozenset):
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if current_region() in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def layer_wrapper(tc: TrainConfig, saved_hooks=None):
    """``wrap_layer(fn, params, x)`` for ``LayerHooks``: plain call, checkpoint, or selective checkpoint; with offload
    every tensor saved for backward lives in host memory until it is needed. ``saved_hooks`` (a context factory,
    used without recompute): the FSDP reshard-after-forward hooks of the mesh runtime."""
    keep = frozenset(k.region for k in MIXER_KINDS.values() if getattr(tc, k.keep_flag))

    def wrap(fn, p, x):
        if not tc.recompute:
            return fn(p, x)
        kwargs = {}
        if keep:
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _policy(keep))
        return checkpoint(fn, p, x, use_reentrant=False, determinism_check="none", **kwargs)

    if saved_hooks is not None and not tc.recompute and not tc.offload_activations:

        def resharded(fn, p, x):
            with saved_hooks():
                return fn(p, x)

        return resharded
    if not (tc.recompute or tc.offload_activations):
        return None
    if tc.offload_activations:

        def offloaded(fn, p, x):
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return wrap(fn, p, x)

        return offloaded
    return wrap
