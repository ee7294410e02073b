"""The HBM traffic of a step's memory-bound ops, counted from q38's own layer code: what ``q38 plan`` prices beside
the FLOP-bound kernels (the ``elementwise`` row of its per-op table; docs/plan.md#how-compute-is-priced).

Norms, residual adds, RoPE, gates, the router's softmax and top-k, the shared expert's activation, dtype casts, the
torch causal conv: each eager op reads its inputs and writes its outputs through HBM, and none of it is in the FLOP
count. :func:`layer_traffic` runs one layer of each kind forward and backward on fake tensors (no memory, no compute)
at the model's real widths and sums, op by op, the bytes of every tensor an op reads or writes, leaving out what other
rows of the table price: the matrix products (``matmul``), the attention and GDN cores (their kernels'
efficiencies), the routed experts with their dispatch (``experts``, whose published benchmark includes the routing
and permutation), and ops that move no data (views).
"""

import contextlib
import functools

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from q38.model_config import ModelConfig

# ops that move no bytes (views, metadata) or that another row of the plan prices (matrix products)
_FREE = {
    "view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute", "slice", "select", "unsqueeze",
    "squeeze", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk", "narrow",
    "diagonal", "lift_fresh", "_reshape_alias", "view_as", "unflatten", "flatten", "empty", "empty_like",
    "new_empty", "empty_strided", "new_empty_strided", "sym_size", "sym_stride", "sym_numel", "is_same_size",
    "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "matmul", "linear", "dot", "mv", "addmv",
}


class _Count(TorchDispatchMode):
    """Bytes of every tensor each counted op reads or writes, per phase; ``paused`` inside the priced kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = {"forward": 0, "backward": 0}
        self.phase = "forward"
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outs and not self.paused and func.namespace == "aten" and \
                func.overloadpacket.__name__.rstrip("_") not in _FREE:  # an op that writes a tensor
            seen = {}
            for t in (*tree_leaves((args, kwargs or {})), *outs):
                if isinstance(t, torch.Tensor):  # a broadcast view reads its storage once, a slice its own elements
                    seen[id(t)] = min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
            self.bytes[self.phase] += sum(seen.values())
        return out


_COUNT: list[_Count] = []


@contextlib.contextmanager
def _paused():
    for c in _COUNT:
        c.paused += 1
    try:
        yield
    finally:
        for c in _COUNT:
            c.paused -= 1


class _Opaque(torch.autograd.Function):
    """A priced kernel as the count sees it: an output of ``shape`` from ``inputs``, nothing counted inside."""

    @staticmethod
    def forward(ctx, like, shape, *inputs):
        ctx.shapes = [(t.shape, t.dtype) if isinstance(t, torch.Tensor) else None for t in inputs]
        with _paused():
            return like.new_empty(shape)

    @staticmethod
    def backward(ctx, grad):
        with _paused():
            return None, None, *(grad.new_empty(s[0], dtype=s[1]) if s else None for s in ctx.shapes)


def _gdn_core(q, k, v, g, beta, info, **_):
    return _Opaque.apply(v, v.shape, q, k, v, g, beta)


def _attention_core(q, k, v, mask, scale):
    return _Opaque.apply(q, q.shape, q, k, v)


class _Fused(torch.autograd.Function):
    """A fused memory-bound kernel (the CUDA causal conv): reads its input and writes its output once, each way."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad * 1


def _conv_fused(x, w, info, halo=None):
    return _Fused.apply(x)


def _routed(x_nd, w_nk, idx_nk, p, cfg, experts, shared):
    return shared() + _Opaque.apply(x_nd, x_nd.shape, x_nd, w_nk)


@attrs.frozen
class LayerTraffic:
    """Bytes one layer's memory-bound ops move through HBM, per layer kind: per token (``forward``, ``backward``)
    and per call, whatever its tokens (``forward_fixed``, ``backward_fixed``: casts and sums over weights)."""

    forward: dict
    backward: dict
    forward_fixed: dict
    backward_fixed: dict


@functools.lru_cache(maxsize=32)
def layer_traffic(cfg: ModelConfig, act: str = "bf16", conv: str = "torch") -> LayerTraffic:
    """Each layer kind's memory-bound bytes in forward and in backward (module docstring), counted on fake tensors at
    ``cfg``'s widths in the ``act`` compute dtype over 256 and 512 tokens of two packed documents: the difference is
    the per-token part, the rest the per-call part. ``conv``: the causal conv kernel the run resolves (``torch``:
    its ops counted; another: one read and one write each way)."""
    a, b = _count(cfg, act, 256, conv), _count(cfg, act, 512, conv)
    per = {ph: {k: (b[ph][k] - a[ph][k]) / 256 for k in a[ph]} for ph in a}
    fixed = {ph: {k: max(0.0, a[ph][k] - 256 * per[ph][k]) for k in a[ph]} for ph in a}
    return LayerTraffic(forward=per["forward"], backward=per["backward"], forward_fixed=fixed["forward"],
                        backward_fixed=fixed["backward"])


def _count(cfg: ModelConfig, act: str, tokens: int, conv: str) -> dict:
    """{phase: {layer kind: bytes}} of one layer of each kind over ``tokens`` tokens."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from q38.kernels import KernelConfig, resolve_kernels
    from q38.layers.block import abstract_layer, layer_apply
    from q38.layers.context import seq_info
    from q38.layers.kinds import MIXER_KINDS
    from q38.pytree import tree_map

    dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}[act]
    kc = resolve_kernels(KernelConfig(gdn="torch", attention="sdpa"), device="cuda", dtype="bfloat16",
                         environment=False, packed=True)

    base = type(kc)

    @attrs.frozen(kw_only=True)
    class _Counted(base):
        def fn(self, op):
            stubs = {"gdn": _gdn_core, "attention": _attention_core}
            if conv != "torch":
                stubs["causal_conv1d"] = _conv_fused
            return stubs.get(op) or base.fn(self, op)

    kernels = _Counted(**attrs.asdict(kc, recurse=False))
    fwd, bwd = {}, {}
    count = _Count()
    dev = torch.device("cpu")  # fake tensors: nothing is allocated or computed; the cores are stubs (_Opaque)
    half = tokens // 2
    doc = torch.cat([torch.zeros(1, half, dtype=torch.long), torch.ones(1, tokens - half, dtype=torch.long)], 1)
    info = seq_info(doc, 1, tokens, dev, kernels=kernels)  # real (small, integer) tensors: positions, documents
    with FakeTensorMode(allow_non_fake_inputs=True):
        for name in dict.fromkeys(cfg.layer_types):
            kind = MIXER_KINDS[name]
            params = tree_map(lambda i: torch.empty(i.shape, dtype=torch.float32 if "A_log" in str(i.init) else dtype,
                                                    device=dev).requires_grad_(), abstract_layer(cfg, name))
            x = torch.empty(1, tokens, cfg.hidden_size, dtype=dtype, device=dev, requires_grad=True)
            leaves = [t for t in tree_leaves(params) if isinstance(t, torch.Tensor)]
            _COUNT.append(count)
            try:
                count.bytes, count.phase = {"forward": 0, "backward": 0}, "forward"
                with count:
                    y, _ = layer_apply(params, x, cfg, info, dispatch=_routed, kind=kind.name)
                    count.phase = "backward"
                    torch.autograd.grad(y, [x, *leaves], torch.empty_like(y), allow_unused=True)
            finally:
                _COUNT.remove(count)
            fwd[name], bwd[name] = count.bytes["forward"], count.bytes["backward"]
    return {"forward": fwd, "backward": bwd}


def step_traffic(cfg: ModelConfig, tokens: int, micro_batches: int, recompute: str, act: str = "bf16",
                 conv: str = "torch") -> tuple[float, float]:
    """(bytes, forward bytes) of the memory-bound ops of one rank's step over ``tokens`` tokens in ``micro_batches``
    calls: every main layer and each MTP depth's layer (an attention layer), forward and backward, and the forward
    again when recompute reruns the layers (any recompute mode reruns every layer's memory-bound ops; what the
    selective modes keep is the cores' outputs)."""
    t = layer_traffic(cfg, act, conv)
    kinds = list(cfg.layer_types) + ["full_attention"] * cfg.mtp_num_layers

    def total(per: dict, fixed: dict) -> float:
        return sum(per[k] * tokens + fixed[k] * micro_batches for k in kinds)

    fwd, bwd = total(t.forward, t.forward_fixed), total(t.backward, t.backward_fixed)
    return fwd * (2 if recompute != "none" else 1) + bwd, fwd
