"""AdamW over the train state's local shards with PyTorch's own kernels (``torch.optim.adamw.adamw``: the
``foreach`` multi-tensor path, or the ``fused`` kernel on accelerators that have it).

The state stays a pytree (``TrainState.params / exp_avg / exp_avg_sq``: fp32 masters and moments, DTensors on a
mesh); ``adamw_step`` runs the kernels on the local shards of copies, so ``train_step`` never mutates its input state;
``adamw_step_`` (the donated step) runs them on the state's own local shards, leaf by leaf. Decoupled
weight decay uses the decay mask (``no_decay`` patterns): two kernel calls, one with ``weight_decay = 0``.
"""

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from q38 import qmoment

IMPLS = ("foreach", "fused")


def default_impl(device: torch.device) -> str:
    """``fused`` on accelerators whose fused AdamW kernel torch ships, ``foreach`` on CPU (and elsewhere)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    if device.type != "cpu" and device.type in _get_fused_kernels_supported_devices():
        return "fused"
    return "foreach"


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rewrap(like: Tensor, local: Tensor) -> Tensor:
    if not hasattr(like, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def _work(m) -> Tensor:
    """An fp32 copy of a moment's local shard (an ``Int8Moment`` dequantized)."""
    if qmoment.is_int8_moment(m):
        return qmoment.load(m)
    return _local(m).detach().to(torch.float32, copy=True)


def _stored(m, w: Tensor):
    """The updated fp32 local shard ``w`` as a new moment like ``m`` (rounded to its dtype, or requantized)."""
    if qmoment.is_int8_moment(m):
        return qmoment.stored(m, w)
    return _rewrap(m, w.to(_local(m).dtype))


@torch.no_grad()
def adamw_step(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, decay: list[bool], *, step: int,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale=None,
               impl: str | None = None) -> tuple[list, list, list]:
    """One AdamW update of flat leaf lists (DTensors or plain tensors; ``step`` counts this update, from 1).

    Returns new ``(params, exp_avgs, exp_avg_sqs)`` lists in the inputs' types and placements; inputs are not
    modified. ``grad_scale``: the clipping factor the gradients are multiplied by first (a 0-dim tensor or float).
    The update runs in fp32: a leaf or moment stored in another dtype (bf16 moments: ``train.moment_dtype``) is
    updated in fp32 and rounded back to its dtype."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"AdamW impl must be one of {IMPLS}, got {impl!r}")
    p_loc = [_local(p) for p in params]
    work_p = [p.detach().to(torch.float32, copy=True) for p in p_loc]
    work_m = [_work(m) for m in exp_avgs]
    work_v = [_work(v) for v in exp_avg_sqs]
    g = [_local(x).detach().to(torch.float32) for x in grads]
    if grad_scale is not None and not (isinstance(grad_scale, float) and grad_scale == 1.0):
        g = torch._foreach_mul(g, grad_scale)
    for dec in (True, False):
        idx = [i for i, d in enumerate(decay) if bool(d) == dec and work_p[i].numel() > 0]
        if not idx:
            continue
        dev = work_p[idx[0]].device
        kind = impl or default_impl(dev)
        # Step counts: host scalars for foreach (torch reads them on the host), device scalars for fused.
        steps = [
            torch.full((), float(step - 1), dtype=torch.float32, device="cpu" if kind == "foreach" else dev)
            for _ in idx
        ]
        adamw(
            [work_p[i] for i in idx], [g[i] for i in idx], [work_m[i] for i in idx], [work_v[i] for i in idx], [],
            steps, foreach=kind == "foreach", fused=kind == "fused", amsgrad=False, beta1=beta1, beta2=beta2,
            lr=lr, weight_decay=weight_decay if dec else 0.0, eps=eps, maximize=False,
        )
    new_p = [_rewrap(p, w.to(pl.dtype)) for p, pl, w in zip(params, p_loc, work_p)]
    new_m = [_stored(m, w) for m, w in zip(exp_avgs, work_m)]
    new_v = [_stored(v, w) for v, w in zip(exp_avg_sqs, work_v)]
    return new_p, new_m, new_v


@torch.no_grad()
def adamw_step_(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, decay: list[bool], *, step: int,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale=None,
                impl: str | None = None) -> None:
    """``adamw_step`` in place, leaf by leaf (the donated step: ``train_step(..., donate=True)``).

    Each leaf's local shards of master and moments are updated by torch's kernel itself, its gradient multiplied by
    ``grad_scale`` in place; ``grads[i]`` is set to None as soon as leaf ``i`` is done, so the caller's list holds
    no gradient afterwards. Temporaries at any moment: one leaf's (e.g. ``sqrt(exp_avg_sq)`` of the foreach path).
    The same bits as ``adamw_step``: the kernels compute each element independently of how leaves are grouped."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"AdamW impl must be one of {IMPLS}, got {impl!r}")
    scale = None if grad_scale is None or (isinstance(grad_scale, float) and grad_scale == 1.0) else grad_scale
    for i, dec in enumerate(decay):
        p, m, v = _local(params[i]), exp_avgs[i], exp_avg_sqs[i]
        m, v = (x if qmoment.is_int8_moment(x) else _local(x) for x in (m, v))
        g = _local(grads[i]).detach().to(torch.float32)
        grads[i] = None  # this leaf's gradient now lives only in `g`, dropped at the end of the iteration
        if p.numel() == 0:
            continue
        if scale is not None:
            g.mul_(scale)
        kind = impl or default_impl(p.device)
        work = [qmoment.load(t) if qmoment.is_int8_moment(t) else t if t.dtype == torch.float32
                else t.to(torch.float32) for t in (p, m, v)]  # (one leaf's copies; int8 moments dequantized)
        steps = [torch.full((), float(step - 1), dtype=torch.float32, device="cpu" if kind == "foreach" else p.device)]
        adamw([work[0]], [g], [work[1]], [work[2]], [], steps, foreach=kind == "foreach", fused=kind == "fused",
              amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay if dec else 0.0, eps=eps,
              maximize=False)
        for t, w in zip((p, m, v), work):
            if qmoment.is_int8_moment(t):
                qmoment.store_(t, w)  # requantized into the moment's own codes and scales
            elif w is not t:
                t.copy_(w)  # rounded back to the stored dtype
        del g, work
