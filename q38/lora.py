"""LoRA adapters (docs/finetuning.md#lora): the ``peft`` run setting, the adapter pytree nodes, their declarations
and the unmerged products the layers run with an adapted (gathered) weight.

An adapted parameter is a node in place of the weight in the parameter tree: ``Lora(base, lora_a, lora_b)``
(one adapter per matrix, or per routed expert: ``A [.., r, in]``, ``B [.., out, r]``) or ``SharedLora(base, shared_a,
shared_b)`` (one adapter shared by every routed expert of a layer: ``A [r, in]``, ``B [out, r]``). The step's gather
hook brings base and adapter into compute form (each sharded on its own logical axes) and :func:`compute_form` keeps
them apart: the layers' matmul helpers (``q38.layers.common.linear``, the experts' grouped / batched products) call
the node, which computes ``x·Wᵀ + (alpha / r)·(x·Aᵀ)·Bᵀ`` with the base a constant (no weight gradient, no merged
copy). ``B`` starts at zero, so step 0 is the base model exactly. A block-FP8 base (``peft.base_dtype: fp8``) is a
``q38.fp8.Fp8Weight`` in place of a tensor base (or of a frozen weight without adapter), dequantized inside each
product after its bits and scales are gathered (and again in backward). :func:`merge_weight` / :func:`merged_params`
build ``base + (alpha / r)·B @ A`` for the merged export (and :func:`merge_adapters` the former merged run form, kept
for ``benchmarks/lora.py`` and the equality tests).

Dims: ``e`` routed experts, ``r`` the LoRA rank; ``o`` / ``i`` a projection's output and input widths.
"""

import attrs
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from jaxtyping import Float
from torch import Tensor

from q38.errors import ConfigError, check_keys, need
from q38.fp8 import FP8_LEAVES, Fp8Weight, dequantize_blocks, scale_shape
from q38.layers.common import ParamInfo

# q38's own parameter names that can carry an adapter (docs/finetuning.md#lora lists what each is)
ATTENTION_TARGETS = ("w_q", "w_k", "w_v", "w_o")
GDN_TARGETS = ("w_qkv", "w_z", "w_b", "w_a", "w_out")
EXPERT_TARGETS = ("we_gate_up", "we_down")
SHARED_EXPERT_TARGETS = ("ws_gate", "ws_up", "ws_down")
ROUTER_TARGETS = ("w_router",)
TARGETS = ATTENTION_TARGETS + GDN_TARGETS + EXPERT_TARGETS + SHARED_EXPERT_TARGETS + ROUTER_TARGETS
DEFAULT_TARGETS = ATTENTION_TARGETS + GDN_TARGETS + EXPERT_TARGETS + SHARED_EXPERT_TARGETS  # router off
EXPERT_MODES = ("per_expert", "shared")
BASE_DTYPES = ("compute", "fp8")
ADAPTER_KEYS = ("lora_a", "lora_b", "shared_a", "shared_b")


def _targets(x) -> tuple[str, ...]:
    if isinstance(x, str):
        return (x,)
    return tuple(x)


@attrs.frozen(kw_only=True)
class PeftConfig:
    """The ``peft:`` section of a run config. ``rank`` / ``alpha``: the adapter's rank and scale ``alpha / rank``;
    ``targets``: q38 parameter names (``TARGETS``); ``experts``: ``per_expert`` (an adapter per routed expert) or
    ``shared`` (one per layer, shared by its experts); ``mtp``: adapt the MTP layers too; ``base_dtype``: how the
    frozen base is stored (``compute``: the compute dtype, ``train.param_dtype``; ``fp8``: the projections the
    released FP8 checkpoints quantize (``q38.fp8.DEFAULT_QUANTIZED``) held in block-FP8, ``q38.fp8.Fp8Weight``, the
    other frozen leaves in the compute dtype)."""

    method: str = "lora"  # lora (the only method)
    rank: int = 16  # adapter rank r
    alpha: float = 32.0  # the adapter's scale is alpha / rank
    dropout: float = 0.0  # adapter dropout (0 only: not implemented)
    # q38 parameter names that get adapters (every projection but the router by default)
    targets: tuple[str, ...] = attrs.field(default=DEFAULT_TARGETS, converter=_targets)
    experts: str = "per_expert"  # per_expert: an adapter per routed expert; shared: one per layer for all its experts
    mtp: bool = False  # adapt the MTP layers too
    base_dtype: str = "compute"  # the frozen base: compute (train.param_dtype) or fp8 (block-FP8 as released)

    def __attrs_post_init__(self) -> None:
        need(self.method == "lora", f"peft.method must be lora (the only method q38 implements), got {self.method!r}")
        need(isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank > 0,
             f"peft.rank must be a positive integer, got {self.rank!r}")
        need(isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool) and self.alpha > 0,
             f"peft.alpha must be a positive number, got {self.alpha!r}")
        need(self.dropout == 0, f"peft.dropout {self.dropout!r} is not implemented (no dropout of the adapter "
             "input); set peft.dropout: 0")
        unknown = [t for t in self.targets if t not in TARGETS]
        need(not unknown, f"peft.targets: unknown parameter name(s) {unknown}; adaptable: {', '.join(TARGETS)}")
        need(len(self.targets) > 0, "peft.targets is empty; name at least one parameter (e.g. w_q)")
        need(self.experts in EXPERT_MODES, f"peft.experts must be one of {', '.join(EXPERT_MODES)}, got "
             f"{self.experts!r}")
        need(isinstance(self.mtp, bool), f"peft.mtp must be true or false, got {self.mtp!r}")
        need(self.base_dtype in BASE_DTYPES, f"peft.base_dtype must be one of {', '.join(BASE_DTYPES)}, got "
             f"{self.base_dtype!r}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    @classmethod
    def from_dict(cls, d, *, source: str = "peft") -> "PeftConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: section 'peft' must be a mapping, got {type(d).__name__}")
        check_keys(d, [a.name for a in attrs.fields(cls)], f"unknown key(s) in section 'peft' of {source}")
        return cls(**d)

    def to_dict(self) -> dict:
        d = attrs.asdict(self)
        d["targets"] = list(self.targets)
        return d

    def adapts(self, path: str) -> bool:
        """Whether parameter ``path`` (``layers.3.mixer.w_q``) carries an adapter."""
        if path.startswith("mtp.") and not self.mtp:
            return False
        return path.rsplit(".", 1)[-1] in self.targets and (".mixer." in path or ".moe." in path)


def check_runnable(peft: "PeftConfig | None", init_from: str | None = None) -> None:
    """What the trainer runs of a ``peft`` setting: an FP8 base is built from a fresh init or a Hugging Face
    directory (read per rank block), not from a q38 checkpoint."""
    if peft is None or peft.base_dtype != "fp8" or not init_from:
        return
    from pathlib import Path

    p = Path(init_from)
    if not ((p / "config.json").is_file() and not (p / "meta.json").is_file()):
        raise ConfigError(f"peft.base_dtype: fp8 with init_from {init_from} (a q38 checkpoint) is not implemented: "
                          "the FP8 base is read from a Hugging Face directory; export it first (q38 convert "
                          f"{init_from} OUT, optionally --dtype fp8) and set init_from: OUT, or use "
                          "peft.base_dtype: compute")


def check_rank(peft: "PeftConfig | None", model_config) -> None:
    """``peft.rank`` against the model, before any adapter is allocated: at most the largest ``min(o, i)`` over the
    weights ``[.., o, i]`` it adapts. ``B @ A`` (``[o, r] @ [r, i]``) has rank at most ``min(o, i)``, so a higher
    rank adds memory to every adapter and expressiveness to none (a skinny weight, e.g. the GDN gates ``w_b`` /
    ``w_a`` of a few heads, may get a rank above its own ``min(o, i)``, as PEFT allows). One ``ConfigError`` naming
    the rank, the limit and the weight that sets it."""
    if peft is None:
        return
    from q38.model import abstract_params, is_param_info
    from q38.pytree import named_leaves

    sizes = [(min(info.shape[-2:]), path, info.shape) for path, info in
             named_leaves(abstract_params(model_config), is_leaf=is_param_info)
             if info is not None and len(info.shape) >= 2 and peft.adapts(path)]
    if not sizes:
        return
    limit, path, shape = max(sizes)
    need(peft.rank <= limit, f"peft.rank {peft.rank} exceeds the limit {limit}: no adapted weight has a rank above "
                             f"{limit} (the largest, {path} {list(shape)}, has min(out, in) = {limit}), so the extra "
                             f"rank would only cost memory; set peft.rank <= {limit}")


# ---- the adapter nodes ---------------------------------------------------------------------------------------------


class _Adapted:
    """The products an adapted weight takes part in, unmerged (what the layers' matmul helpers call:
    ``q38.layers.common.linear``, ``q38.layers.moe``'s expert products): the frozen base's product (``frozen_*``:
    a constant, input gradient only) plus ``scale ·`` the low-rank product through the adapter."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape (the base's)."""
        return tuple((self.base.bits if isinstance(self.base, Fp8Weight) else self.base).shape)

    def _ab(self, like: Tensor) -> tuple[Tensor, Tensor]:
        a, b = (self.shared_a, self.shared_b) if isinstance(self, SharedLora) else (self.lora_a, self.lora_b)
        return a.to(like.dtype), b.to(like.dtype)

    def linear(self, x: Float[Tensor, "... i"]) -> Float[Tensor, "... o"]:
        """``x·Wᵀ + s·(x·Aᵀ)·Bᵀ`` of a 2-D weight."""
        a, b = self._ab(x)
        return frozen_linear(x, self.base).add_(F.linear(F.linear(x, a), b), alpha=self.scale)

    def grouped_mm(self, x_md: Float[Tensor, "m i"], offs: Tensor) -> Float[Tensor, "m o"]:
        """Routed experts over rows sorted by expert (``offs``: each expert's end row): ``x·W_eᵀ + s·(x·A_eᵀ)·B_eᵀ``
        per expert as grouped GEMMs with the base's offsets (one pair for all experts: two plain GEMMs)."""
        a, b = self._ab(x_md)
        if isinstance(self, SharedLora):
            low = F.linear(F.linear(x_md, a), b)
        else:
            # grouped_mm wants 16-byte strides: a rank that is not a multiple of 16 bytes (rank 2 in fp32) is padded
            # with zero rows of A and zero columns of B, which add exact zeros to the product and get no gradient
            pad = -a.shape[-2] % (16 // a.element_size())
            if pad:
                a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
            low = F.grouped_mm(F.grouped_mm(x_md, a.transpose(-2, -1), offs=offs), b.transpose(-2, -1), offs=offs)
        return frozen_grouped_mm(x_md, self.base, offs).add_(low, alpha=self.scale)

    def bmm(self, x_eqd: Float[Tensor, "e q i"]) -> Float[Tensor, "e q o"]:
        """Routed experts over rows padded to ``[e, capacity, i]``: ``x·W_eᵀ + s·(x·A_eᵀ)·B_eᵀ`` per expert."""
        a, b = self._ab(x_eqd)
        if isinstance(self, SharedLora):
            low = F.linear(F.linear(x_eqd, a), b)
        else:
            low = torch.bmm(torch.bmm(x_eqd, a.transpose(-2, -1)), b.transpose(-2, -1))
        return frozen_bmm(x_eqd, self.base).add_(low, alpha=self.scale)


@attrs.frozen
class Lora(_Adapted):
    """An adapted weight: frozen ``base`` ``[.., o, i]`` plus ``scale · lora_b @ lora_a`` (``lora_a [.., r, i]``,
    ``lora_b [.., o, r]``; a leading expert dim when the base has one)."""

    base: Tensor
    lora_a: Tensor
    lora_b: Tensor
    scale: float = attrs.field(default=1.0, kw_only=True)


@attrs.frozen
class SharedLora(_Adapted):
    """Routed experts ``base [e, o, i]`` plus one adapter for all of them: ``scale · shared_b @ shared_a``
    (``shared_a [r, i]``, ``shared_b [o, r]``)."""

    base: Tensor
    shared_a: Tensor
    shared_b: Tensor
    scale: float = attrs.field(default=1.0, kw_only=True)


@attrs.frozen
class Frozen(_Adapted):
    """A frozen weight without adapter in compute form (a block-FP8 base leaf the run does not adapt): its
    products only (``compute_form`` builds it; never stored in a parameter tree)."""

    base: Fp8Weight

    def linear(self, x):
        return frozen_linear(x, self.base)

    def grouped_mm(self, x_md, offs):
        return frozen_grouped_mm(x_md, self.base, offs)

    def bmm(self, x_eqd):
        return frozen_bmm(x_eqd, self.base)


def _register(cls, names: tuple[str, str, str]) -> None:
    # the scale is static (the pytree context); a None base (a moments tree: the frozen base has no moments) is
    # recorded in the context too, as q38.pytree does for optional fields
    def flatten(n):
        keep = tuple(k for k in names if getattr(n, k) is not None)
        return [getattr(n, k) for k in keep], (n.scale, keep)

    def unflatten(children, ctx):
        values = dict.fromkeys(names)
        values.update(zip(ctx[1], children))
        return cls(**values, scale=ctx[0])

    def flatten_with_keys(n):
        children, ctx = flatten(n)
        return [(pytree.GetAttrKey(k), c) for k, c in zip(ctx[1], children)], ctx

    pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=f"q38.lora.{cls.__name__}",
                                flatten_with_keys_fn=flatten_with_keys)


_register(Lora, ("base", "lora_a", "lora_b"))
_register(SharedLora, ("base", "shared_a", "shared_b"))


def is_adapted(x) -> bool:
    return isinstance(x, (Lora, SharedLora))


def is_adapter_path(path: str) -> bool:
    """Whether a leaf path is an adapter matrix (the leaves a LoRA run trains)."""
    return path.rsplit(".", 1)[-1] in ADAPTER_KEYS


# ---- declarations --------------------------------------------------------------------------------------------------


def adapter_info(base: ParamInfo, key: str, rank: int) -> ParamInfo:
    """The declaration of adapter matrix ``key`` of a weight declared ``base`` ``[.., o, i]``: the same logical axes
    as the base on the dims they share (an expert adapter is on the ``expert`` axis, so EP places it with its
    experts), ``lora_rank`` (never sharded) on the rank dim; the FSDP role on ``i`` for A and ``o`` for B, except
    the B of a skinny matrix (a 2-D base whose FSDP dim is ``i``: the router, the GDN ``b``/``a`` gates, whose ``o``
    is a few heads or experts), which stays replicated over FSDP. ``A`` is drawn from ``N(0, 1/r)`` (PEFT's
    ``gaussian`` init), ``B`` is zero."""
    *lead, o, i = base.shape
    *lead_ax, ao, ai = base.axes
    if key.startswith("shared"):
        lead, lead_ax = [], []
    nl = len(lead)
    if key.endswith("_a"):
        return ParamInfo((*lead, rank, i), std=1.0 / rank, axes=(*lead_ax, "lora_rank", ai), fsdp_dim=nl + 1)
    skinny = len(base.shape) == 2 and base.fsdp_dim == 1
    return ParamInfo((*lead, o, rank), "zeros", axes=(*lead_ax, ao, "lora_rank"), fsdp_dim=None if skinny else nl)


def split_path(path: str) -> tuple[str, str | None]:
    """``layers.0.mixer.w_q.lora_a`` → (``layers.0.mixer.w_q``, ``lora_a``); a base leaf gives ``base``; a leaf of
    a block-FP8 weight (``q38.fp8.Fp8Weight``) ``bits`` / ``scale_inv`` (``base.bits`` / ``base.scale_inv`` under an
    adapter); any other path (``None``)."""
    head, _, last = path.rpartition(".")
    if head and last in FP8_LEAVES:
        h2, _, l2 = head.rpartition(".")
        return (h2, f"base.{last}") if h2 and l2 == "base" else (head, last)
    if head and (last in ADAPTER_KEYS or last == "base"):
        return head, last
    return path, None


def scale_info(base: ParamInfo, block: tuple[int, int] = (128, 128)) -> ParamInfo:
    """The declaration of the block scales ``[.., ceil(o / bo), ceil(i / bi)]`` of a weight declared ``base``: its
    logical axes and FSDP dim (the scale grid is sharded like the weight, chunked on its own)."""
    *lead, o, i = base.shape
    return ParamInfo((*lead, *scale_shape((o, i), block)), "ones", axes=base.axes, fsdp_dim=base.fsdp_dim)


# ---- building and merging ------------------------------------------------------------------------------------------


def declared_info(path: str) -> ParamInfo:
    """``q38.model.declared_info``, also for a LoRA node's leaves (``….w_q.base``, ``….w_q.lora_a``, ...), which are
    declared by the weight they adapt (its logical axes and FSDP dim; the shape given an adapter is that of rank 1)."""
    from q38.model import declared_info as weight_info

    head, key = split_path(path)
    if key is None:
        return weight_info(path)
    base = declared_info(head)
    if key.endswith("scale_inv"):
        return scale_info(base)
    return base if key in ("base", "bits", "base.bits") else adapter_info(base, key, 1)


def add_adapters(params, peft: PeftConfig, *, seed: int, make=None, base_dtype=None):
    """``params`` (a ``ModelParams`` of tensors or DTensors, some weights possibly ``Fp8Weight``: a block-FP8 base,
    kept as it is) with every targeted weight replaced by its adapted node; every other frozen leaf cast to
    ``base_dtype`` (the compute dtype: the base is stored as the layers use it), a dtype or ``base_dtype(path)``
    (``TrainConfig.compute_dtype``: the ``train.fp32_params`` leaves, e.g. ``A_log``, stay fp32).
    ``make(path, info)`` builds an adapter matrix (default: ``materialize`` on the base's device); on a mesh it builds
    the rank's shard (``q38.parallel.mesh.build_adapter``). Values depend only on ``seed`` and the path."""
    from q38.layers.common import materialize
    from q38.pytree import tree_map_with_path

    def default_make(path, info, like):
        return materialize(info, path, seed=seed, device=like.device, dtype=torch.float32)

    make = make or default_make

    def node(path, t):
        fp8 = isinstance(t, Fp8Weight)
        dt = base_dtype(path) if callable(base_dtype) else base_dtype
        base = t if fp8 or dt is None or not t.is_floating_point() else t.to(dt)
        if not peft.adapts(path):
            return base
        # the declaration gives the logical axes and FSDP role; the shape is the base's own (the model's config)
        info = attrs.evolve(declared_info(path), shape=tuple(int(n) for n in (t.bits if fp8 else t).shape))
        shared = info.axes[:1] == ("expert",) and peft.experts == "shared"
        keys = ("shared_a", "shared_b") if shared else ("lora_a", "lora_b")
        a, b = (make(f"{path}.{k}", adapter_info(info, k, peft.rank), t.bits if fp8 else t) for k in keys)
        return (SharedLora if shared else Lora)(base, a, b, scale=peft.scale)

    return tree_map_with_path(node, params, is_leaf=lambda x: isinstance(x, Fp8Weight))


def delta(n: "Lora | SharedLora") -> Tensor:
    """``scale · B @ A`` of a node in compute form (per expert for a per-expert adapter)."""
    if isinstance(n, SharedLora):
        return (n.shared_b @ n.shared_a) * n.scale
    return torch.matmul(n.lora_b, n.lora_a) * n.scale


def merge_weight(n: "Lora | SharedLora") -> Float[Tensor, "..."]:
    """The weight a layer computes with: ``base + scale · B @ A``, in one fused op (``addmm`` / ``baddbmm``: no
    separate ``[o, i]`` delta is materialised, only the merged weight; its gradient reaches A and B, never the
    frozen base)."""
    a, b = (n.shared_a, n.shared_b) if isinstance(n, SharedLora) else (n.lora_a, n.lora_b)
    a, b = a.to(n.base.dtype), b.to(n.base.dtype)
    if isinstance(n, SharedLora):
        return torch.add(n.base, b @ a, alpha=n.scale)  # one [o, i] delta broadcast over the experts
    if n.base.dim() == 2:
        return torch.addmm(n.base, b, a, alpha=n.scale)
    return torch.baddbmm(n.base, b, a, alpha=n.scale)


# ---- the unmerged products (the run path) -----------------------------------------------------------------------


def _product(kind: str, x: Tensor, w: Tensor, offs: Tensor | None) -> Tensor:
    """``x`` times the weight ``w`` ``[.., o, i]`` transposed: ``linear`` (2-D ``w``), ``grouped_mm`` (rows sorted by
    expert, ``offs``), ``bmm`` (``[e, q, i]`` rows per expert)."""
    if kind == "linear":
        return F.linear(x, w)
    if kind == "grouped_mm":
        return F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
    return torch.bmm(x, w.transpose(-2, -1))


def _input_grad(kind: str, g: Tensor, w: Tensor, offs: Tensor | None) -> Tensor:
    """The gradient of ``_product(kind, x, w)`` w.r.t. ``x`` (``g`` its output's gradient): ``g · W``."""
    if kind == "linear":
        return torch.matmul(g, w)
    if kind == "grouped_mm":
        return F.grouped_mm(g.contiguous(), w, offs=offs)
    return torch.bmm(g, w)


class _Fp8Product(torch.autograd.Function):
    """``_product`` of ``x`` and a gathered block-FP8 weight (``bits``, ``scale_inv``): the weight is dequantized for
    the forward and dequantized again in backward for the input gradient (recomputed, not saved: what backward
    keeps is the bits and scales, 1 byte a value plus the scales, which FSDP's reshard-after-forward frees and
    re-gathers like any gathered parameter, where a saved dequantized copy would hold 2-4 bytes a value of every
    layer until its backward; the recompute is one elementwise pass, small next to the GEMM). No weight gradient."""

    @staticmethod
    def forward(ctx, x, bits, scale_inv, offs, kind, block, dtype):
        ctx.kind, ctx.block, ctx.dtype = kind, block, dtype
        ctx.save_for_backward(bits, scale_inv, offs)
        return _product(kind, x, dequantize_blocks(bits, scale_inv, block, dtype).to(x.dtype), offs)

    @staticmethod
    def backward(ctx, g):
        bits, scale_inv, offs = ctx.saved_tensors
        w = dequantize_blocks(bits, scale_inv, ctx.block, ctx.dtype).to(g.dtype)
        return _input_grad(ctx.kind, g, w, offs), None, None, None, None, None, None


def _frozen(kind: str, x: Tensor, base, offs: Tensor | None = None) -> Tensor:
    if isinstance(base, Fp8Weight):
        return _Fp8Product.apply(x, base.bits, base.scale_inv, offs, kind, base.block, base.dtype)
    return _product(kind, x, base.detach(), offs)  # a constant: autograd computes the input gradient only


def frozen_linear(x: Float[Tensor, "... i"], base) -> Float[Tensor, "... o"]:
    """``x·Wᵀ`` of a frozen weight (a tensor or an ``Fp8Weight``): no weight gradient."""
    return _frozen("linear", x, base)


def frozen_grouped_mm(x_md: Float[Tensor, "m i"], base, offs: Tensor) -> Float[Tensor, "m o"]:
    """``x·W_eᵀ`` per expert over rows sorted by expert (``F.grouped_mm``) of frozen experts: no weight gradient."""
    return _frozen("grouped_mm", x_md, base, offs)


def frozen_bmm(x_eqd: Float[Tensor, "e q i"], base) -> Float[Tensor, "e q o"]:
    """``x·W_eᵀ`` per expert over padded rows (``bmm``) of frozen experts: no weight gradient."""
    return _frozen("bmm", x_eqd, base)


def compute_form(tree):
    """The run path's form of a gathered subtree (the step's gather hook): every adapted node stays a node with its
    base as a constant (detached; a block-FP8 base stays its gathered bits and scales, dequantized inside each
    product), and a block-FP8 weight without adapter becomes ``Frozen``; the layers' matmul helpers run the
    unmerged products (``Lora.linear`` / ``grouped_mm`` / ``bmm``), so no merged weight and no weight gradient of
    the base exist. Other leaves pass through; the identity on a tree without adapters or FP8 weights."""
    def c(x):
        if isinstance(x, Fp8Weight):
            return Frozen(x)
        if is_adapted(x) and not isinstance(x.base, Fp8Weight):
            return attrs.evolve(x, base=x.base.detach())
        return x

    return pytree.tree_map(c, tree, is_leaf=_node)


def _node(x) -> bool:
    return is_adapted(x) or isinstance(x, Fp8Weight)


def _dequantized(x):
    """An adapted node or weight with its block-FP8 base (if any) dequantized to the base's compute dtype."""
    if isinstance(x, Fp8Weight):
        return x.dequantize()
    if is_adapted(x) and isinstance(x.base, Fp8Weight):
        return attrs.evolve(x, base=x.base.dequantize())
    return x


def merge_adapters(tree):
    """Every adapted node of ``tree`` (in compute form: gathered and cast) replaced by its merged weight, every
    block-FP8 weight (``Fp8Weight``, gathered: its bits and scales) dequantized first; other leaves pass through.
    The identity on a tree without adapters or FP8 weights."""
    def m(x):
        x = _dequantized(x)
        return merge_weight(x) if is_adapted(x) else x

    return pytree.tree_map(m, tree, is_leaf=_node)


def base_params(tree):
    """``tree`` with every adapted node replaced by its frozen base (the model the adapters were trained on; a
    block-FP8 base stays an ``Fp8Weight``)."""
    return pytree.tree_map(lambda x: x.base if is_adapted(x) else x, tree, is_leaf=is_adapted)


def merged_params(tree):
    """``tree`` with every adapted node replaced by its merged weight in fp32 (``base + scale · B @ A``): the model
    a merged export writes."""
    def m(x):
        if isinstance(x, Fp8Weight):
            return attrs.evolve(x, dtype=torch.float32).dequantize()
        if not is_adapted(x):
            return x
        if isinstance(x.base, Fp8Weight):
            x = attrs.evolve(x, base=attrs.evolve(x.base, dtype=torch.float32).dequantize())
        f = attrs.evolve(x, **{k: getattr(x, k).float() for k in attrs.fields_dict(type(x)) if k != "scale"})
        return merge_weight(f)

    return pytree.tree_map(m, tree, is_leaf=_node)


def trainable_mask(tree) -> list[bool]:
    """Per leaf of ``tree`` (flatten order): whether it trains. Without adapters every leaf trains; with adapters
    only the adapter matrices do."""
    from q38.pytree import named_leaves

    names = [p for p, _ in named_leaves(tree)]
    if not any(is_adapter_path(p) for p in names):
        return [True] * len(names)
    return [is_adapter_path(p) for p in names]


def trainable_tree(tree, fn):
    """``tree`` with each trainable leaf mapped by ``fn`` and each frozen leaf dropped (``None``): the shape of a
    LoRA run's optimizer moments."""
    from q38.pytree import tree_map_with_path

    train_all = all(trainable_mask(tree))
    return tree_map_with_path(lambda p, x: fn(x) if train_all or is_adapter_path(p) else None, tree,
                              is_leaf=lambda x: isinstance(x, Fp8Weight))  # a block-FP8 base: no moments at all

