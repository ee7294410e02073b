"""AdamW over the train state's local shards with PyTorch's own kernels (``torch.optim.adamw.adamw``: the
``foreach`` multi-tensor path, or the ``fused`` kernel on accelerators that have it).

The state stays a pytree (``TrainState.params / exp_avg / exp_avg_sq``: fp32 masters and moments, DTensors on a
mesh); ``adamw_step`` runs the kernels on the local shards of copies, so ``train_step`` never mutates its input state;
``adamw_step_`` (the donated step) runs them on the state's own local shards, leaf by leaf. Decoupled
weight decay uses the decay mask (``no_decay`` patterns): two kernel calls, one with ``weight_decay = 0``.

bf16 + remainder masters (``train.master_dtype: bfloat16_remainder``, ``q38.remainder``): ``remainders[i]`` is leaf
``i``'s int16 remainder (``params[i]`` its bf16 high half) or None (an fp32 master). The kernel runs on the fp32
master joined from the two halves (integer ops, exact), which is split back after it.

Offloaded optimizer state (``train.offload_optimizer: true``, ``q38.offload``): ``host_masters[i]`` is leaf ``i``'s
fp32 master on the host (``params[i]`` its compute copy on the device; its moments on the host too) or None (the
leaf's master is ``params[i]`` itself). Such a leaf's gradient is copied to the host, the same kernel runs there on
the master and moments, and ``params[i]`` becomes ``master.to(params[i].dtype)``.
"""

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from q38 import offload as off
from q38 import qmoment
from q38 import remainder as rm

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
               impl: str | None = None, remainders: list | None = None, host_masters: list | None = None) -> tuple:
    """One AdamW update of flat leaf lists (DTensors or plain tensors; ``step`` counts this update, from 1).

    Returns new ``(params, exp_avgs, exp_avg_sqs)`` lists in the inputs' types and placements; inputs are not
    modified. ``grad_scale``: the clipping factor the gradients are multiplied by first (a 0-dim tensor or float).
    The update runs in fp32: a leaf or moment stored in another dtype (bf16 moments: ``train.moment_dtype``) is
    updated in fp32 and rounded back to its dtype. With ``remainders`` (bf16 + remainder masters): returns
    ``(params, exp_avgs, exp_avg_sqs, remainders)``, each such leaf's new high half and remainder split from its
    updated fp32 master. With ``host_masters`` (offloaded optimizer state): returns ``(params, exp_avgs,
    exp_avg_sqs, host_masters)``, each offloaded leaf's new host master and its device compute copy."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"AdamW impl must be one of {IMPLS}, got {impl!r}")
    p_loc = [_local(p) for p in params]
    rems = remainders if remainders is not None else [None] * len(params)
    hms = host_masters if host_masters is not None else [None] * len(params)
    work_p = [_local(h).detach().clone() if h is not None
              else p.detach().to(torch.float32, copy=True) if r is None else rm.join(p.detach(), _local(r))
              for p, r, h in zip(p_loc, rems, hms)]
    work_m = [_work(m) for m in exp_avgs]
    work_v = [_work(v) for v in exp_avg_sqs]
    to_host = off.GradsToHost(grads, [h is not None for h in hms])
    g = [to_host.take(i).to(torch.float32) if h is not None else _local(x).detach().to(torch.float32)
         for i, (x, h) in enumerate(zip(grads, hms))]
    if grad_scale is not None and not (isinstance(grad_scale, float) and grad_scale == 1.0):
        if host_masters is None:
            g = torch._foreach_mul(g, grad_scale)
        else:  # (the host leaves' gradients scaled by the factor's host copy)
            host_scale = grad_scale.to(off.HOST) if isinstance(grad_scale, Tensor) else grad_scale
            g = [x * (host_scale if h is not None else grad_scale) for x, h in zip(g, hms)]
    for dec, host in ((True, False), (True, True), (False, False), (False, True)):
        # (the host leaves in calls of their own: one device per kernel call)
        idx = [i for i, d in enumerate(decay) if bool(d) == dec and (hms[i] is not None) == host
               and work_p[i].numel() > 0]
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
    new_m = [_stored(m, w) for m, w in zip(exp_avgs, work_m)]
    new_v = [_stored(v, w) for v, w in zip(exp_avg_sqs, work_v)]
    if host_masters is not None:  # offloaded: the new host masters, and their compute copies on the device
        new_p = [_rewrap(p, off.to_device(w, pl) if h is not None else w.to(pl.dtype))
                 for p, pl, w, h in zip(params, p_loc, work_p, hms)]
        return new_p, new_m, new_v, [None if h is None else _rewrap(h, w) for h, w in zip(hms, work_p)]
    if remainders is None:
        new_p = [_rewrap(p, w.to(pl.dtype)) for p, pl, w in zip(params, p_loc, work_p)]
        return new_p, new_m, new_v
    new_p, new_r = [], []
    for i, (p, pl, r) in enumerate(zip(params, p_loc, rems)):
        w, work_p[i] = work_p[i], None  # (each master's fp32 buffer is the work buffer of its own split)
        if r is None:
            new_p.append(_rewrap(p, w.to(pl.dtype)))
            new_r.append(None)
            continue
        high, low = torch.empty_like(pl), torch.empty_like(_local(r))
        rm.split_(w, high, low)
        new_p.append(_rewrap(p, high))
        new_r.append(_rewrap(r, low))
    return new_p, new_m, new_v, new_r


@torch.no_grad()
def adamw_step_(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, decay: list[bool], *, step: int,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale=None,
                impl: str | None = None, remainders: list | None = None, host_masters: list | None = None) -> None:
    """``adamw_step`` in place, leaf by leaf (the donated step: ``train_step(..., donate=True)``).

    Each leaf's local shards of master and moments are updated by torch's kernel itself, its gradient multiplied by
    ``grad_scale`` in place; ``grads[i]`` is set to None as soon as leaf ``i`` is done, so the caller's list holds
    no gradient afterwards. Temporaries at any moment: one leaf's (e.g. ``sqrt(exp_avg_sq)`` of the foreach path).
    The same bits as ``adamw_step``: the kernels compute each element independently of how leaves are grouped.
    ``remainders``: a bf16 + remainder leaf's fp32 master is joined into one fp32 buffer (its temporaries: that
    buffer), updated there and split back into the leaf's own high half and remainder.
    ``host_masters``: an offloaded leaf's gradient is taken to the host (``q38.offload.GradsToHost``: on CUDA the next
    leaf's copy in flight meanwhile), its host master and moments updated there in place, and its device compute
    copy overwritten with the new master's cast."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"AdamW impl must be one of {IMPLS}, got {impl!r}")
    scale = None if grad_scale is None or (isinstance(grad_scale, float) and grad_scale == 1.0) else grad_scale
    hms = host_masters if host_masters is not None else [None] * len(params)
    to_host = off.GradsToHost(grads, [h is not None for h in hms])
    host_scale = scale.to(off.HOST) if isinstance(scale, Tensor) and any(h is not None for h in hms) else scale
    for i, dec in enumerate(decay):
        p, m, v = _local(params[i]), exp_avgs[i], exp_avg_sqs[i]
        m, v = (x if qmoment.is_int8_moment(x) else _local(x) for x in (m, v))
        h = None if hms[i] is None else _local(hms[i])
        g = (_local(grads[i]).detach() if h is None else to_host.take(i)).to(torch.float32)
        grads[i] = None  # this leaf's gradient now lives only in `g`, dropped at the end of the iteration
        if p.numel() == 0:
            continue
        if scale is not None:
            g.mul_(scale if h is None else host_scale)
        dev = p.device if h is None else h.device  # an offloaded leaf steps on the host
        kind = impl or default_impl(dev)
        r = None if remainders is None or remainders[i] is None else _local(remainders[i])
        p_dev, p = p, (p if h is None else h)  # the master the kernel updates: the leaf, or its host master
        work = [rm.join(p, r) if t is p and r is not None  # a bf16 + remainder master joined, exact
                else qmoment.load(t) if qmoment.is_int8_moment(t) else t if t.dtype == torch.float32
                else t.to(torch.float32) for t in (p, m, v)]  # (one leaf's copies; int8 moments dequantized)
        steps = [torch.full((), float(step - 1), dtype=torch.float32, device="cpu" if kind == "foreach" else dev)]
        adamw([work[0]], [g], [work[1]], [work[2]], [], steps, foreach=kind == "foreach", fused=kind == "fused",
              amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay if dec else 0.0, eps=eps,
              maximize=False)
        if r is not None:
            rm.split_(work[0], p, r)  # back into the leaf's own halves (the fp32 buffer is spent)
            work[0] = p
        for t, w in zip((p, m, v), work):
            if qmoment.is_int8_moment(t):
                qmoment.store_(t, w)  # requantized into the moment's own codes and scales
            elif w is not t:
                t.copy_(w)  # rounded back to the stored dtype
        if h is not None:
            off.write_device_(p_dev, h)  # the new compute copy: master.to(param_dtype), on the device
        del g, work
