"""Kernels are a run setting, not model identity: ``KernelConfig`` (one implementation per op), ``REGISTRY`` (what
every implementation needs and supports, each op's portable ``fallback`` marked), ``auto`` resolution and the
up-front check of a run's combination. A layer calls ``info.kernels.fn(op)(...)`` on a resolved config and never
asks which implementation it got. Each op's call contract and the registry's rules: docs/kernels.md#the-registry.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any, Callable, Mapping

import attrs

from q38.model_config import ModelConfig
from q38.errors import ConfigError, check_keys

OPS = ("gdn", "causal_conv1d", "attention", "experts", "block", "loss")
GDN_CHUNK = 64  # the torch GDN core's chunk on accelerators (FLA's), and the one q38 plan and the FLOP count model


def auto_gdn_chunk(device: str, key_head_dim: int | None = None, value_head_dim: int | None = None) -> int:
    """The torch GDN core's chunk length for ``auto``: ``GDN_CHUNK`` except on CPU with head dims ≤ 64 (not known:
    ``GDN_CHUNK``), where 32 is faster (docs/kernels.md#the-registry)."""
    if str(device).split(":")[0] == "cpu" and key_head_dim is not None and max(key_head_dim, value_head_dim) <= 64:
        return 32
    return GDN_CHUNK


def _version(pkg: str) -> tuple[int, ...] | None:
    try:
        v = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def _fla_problem() -> str | None:
    """Why FLA's gated-delta-rule backward is not known good here (None when it is)."""
    fla = _version("flash-linear-attention") or _version("fla-core")
    if fla is None:
        return "flash-linear-attention is not installed (pip install 'q38[cuda]')"
    if fla < (0, 5, 2):
        return f"flash-linear-attention {'.'.join(map(str, fla))} is older than 0.5.2"
    if _version("tilelang") is not None:
        return None
    triton = _version("triton")
    if triton is None:
        return "FLA needs Triton (or its TileLang backend) and neither is installed"
    if triton < (3, 7, 1):
        return (f"Triton {'.'.join(map(str, triton))} < 3.7.1 miscompiles FLA's gated backward (chunk_bwd_dqkwg) "
                "on some GPUs; install triton>=3.7.1 or tilelang")
    return None


def _grouped_mm_problem() -> str | None:
    import torch
    import torch.nn.functional as F

    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm (torch >= 2.9 has it)"
    return None


def _grouped_mm_shape_problem(model, dtype: str | None) -> str | None:
    """Why ``F.grouped_mm`` cannot take this model's expert matrices (None if it can): it needs every row stride
    to be a multiple of 16 bytes, so the hidden size and the expert FFN width must be multiples of 16 / element
    size (4 in fp32, 8 in bf16). ``model`` None: not checked; ``dtype`` None: fp32."""
    if model is None:
        return None
    size = 2 if dtype in ("bfloat16", "float16", "bf16", "fp16") else 4
    for key in ("hidden_size", "moe_intermediate_size"):
        width = getattr(model, key)
        if width * size % 16:
            return (f"needs {key} to be a multiple of {16 // size} in {dtype or 'float32'} (its strides must be "
                    f"multiples of 16 bytes); this model's is {width}")
    return None


def _compile_problem() -> str | None:
    """Why ``torch.compile`` cannot build kernels here: Triton for a CUDA device, a C++ compiler for the CPU."""
    import importlib.util
    import os
    import shutil

    import torch

    if torch.cuda.is_available():
        return None if importlib.util.find_spec("triton") else "torch.compile needs Triton on CUDA (pip install triton)"
    cxx = os.environ.get("CXX", "c++")
    return None if shutil.which(cxx) else f"torch.compile on CPU needs a C++ compiler ({cxx!r} not found)"


def _varlen_problem() -> str | None:
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10 has it)"
    return None


def _import_problem(module: str, pip: str) -> Callable[[], str | None]:
    def check() -> str | None:
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed ({pip})"
        return None

    return check


@attrs.frozen(kw_only=True)
class KernelImpl:
    """What one implementation of an op needs and supports."""

    devices: tuple[str, ...]  # device types it runs on
    cp: bool  # works with context parallelism (the sequence split over ranks)
    packed: bool  # works with packed rows (several documents in one row)
    backward: bool  # has a (correct) backward, so it can train
    # per device type, the compute dtypes it takes (a device not listed: any)
    dtypes: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    min_capability: tuple[int, int] | None = None  # CUDA compute capability it needs (checked on a CUDA device)
    problem: Callable[[], str | None] = lambda: None  # why it cannot run in this environment (None: it can)
    auto: bool = True  # ``auto`` may pick it (False: only when named, e.g. until measured faster on a device)
    # when ``auto`` may pick it, given (device, cp, packed) (None: whenever it serves the run)
    auto_if: Callable[[str, bool, bool], bool] | None = None
    # per device type, why it has no backward there though it has one elsewhere (cannot train on that device)
    no_backward: Mapping[str, str] = attrs.field(factory=dict)
    note: str = ""
    # the callable that implements it, or its ``module:attr`` path (imported on first use; None: not wired into q38)
    fn: Callable | str | None = None
    # (module, what provides it): the optional package the callable imports
    requires: tuple[str, str] | None = None
    # the op's portable path: exactly one per op, runs wherever any of the op's implementations runs, supports CP,
    # packed rows and backward and needs no optional package (checked by ``check_registry``); what a run is told to
    # name when another implementation cannot load, and what ``DEFAULT_KERNELS`` runs
    fallback: bool = False

    def load(self, op: str, name: str) -> Callable:
        """The callable ``fn`` names, its module and ``requires`` imported now if they were not (an ``ImportError``
        naming ``kernels.<op>`` and what to install when ``requires`` is missing)."""
        if self.fn is None:
            raise NotImplementedError(f"kernels.{op}: {name}: {self.problem() or 'not wired into q38'}")
        if self.requires is not None:
            try:
                importlib.import_module(self.requires[0])
            except ImportError as e:
                portable = fallback(op)
                raise ImportError(f"kernels.{op}: {name} needs {self.requires[1]}; set kernels.{op}: {portable} to "
                                  "use the reference path") from e
        if callable(self.fn):
            return self.fn
        module, attr = self.fn.split(":")
        return getattr(importlib.import_module(module), attr)


# Per op: implementations in ``auto`` preference order (fastest first); the one with ``fallback=True`` is the
# portable torch path.
REGISTRY: dict[str, dict[str, KernelImpl]] = {
    "gdn": {
        "fla": KernelImpl(devices=("cuda",), cp=True, packed=True, backward=True, problem=_fla_problem,
                          note="flash-linear-attention chunk kernels; packed rows via cu_seqlens, CP by q38's exact "
                               "state carry through FLA's initial and final states",
                          fn="q38.layers.gdn:gdn_core_fla",
                          requires=("fla", "flash-linear-attention (pip install 'q38[cuda]') and a CUDA device")),
        "npu": KernelImpl(devices=("npu",), cp=False, packed=False, backward=False,
                          problem=lambda: "MindSpeed's Ascend GDN kernels are not wired into q38 yet"),
        "torch": KernelImpl(devices=("cpu", "cuda", "npu", "meta"), cp=True, packed=True, backward=True, fallback=True,
                            note="chunked WY form with its own backward (docs/gdn_backward.md)",
                            fn="q38.layers.gdn:gdn_core_torch"),
    },
    "causal_conv1d": {
        "cuda": KernelImpl(devices=("cuda",), cp=False, packed=False, backward=True,
                           problem=_import_problem("causal_conv1d", "pip install causal-conv1d"),
                           fn="q38.layers.gdn:conv_cuda",
                           requires=("causal_conv1d", "the causal-conv1d package (pip install causal-conv1d) and a "
                                                      "CUDA device")),
        "npu": KernelImpl(devices=("npu",), cp=False, packed=False, backward=False,
                          problem=lambda: "torch_npu's causal conv kernel is not wired into q38 yet"),
        "torch": KernelImpl(devices=("cpu", "cuda", "npu", "meta"), cp=True, packed=True, backward=True, fallback=True,
                            fn="q38.layers.gdn:conv_torch"),
    },
    "attention": {
        "flex": KernelImpl(devices=("cpu", "cuda"), cp=True, packed=True, backward=True, problem=_compile_problem,
                           auto_if=lambda device, cp, packed: device == "cuda" and (cp or packed),
                           no_backward={"cpu": "has no backward on CPU (torch's FlexAttention is forward-only there)"},
                           note="compiled FlexAttention over a block mask built from doc ids and token indices "
                                "(masked blocks skipped, no [s, t] mask); auto on CUDA for packed rows or CP (one "
                                "causal document per row without CP: sdpa's flash kernel needs no mask)",
                           fn="q38.layers.attention:flex_attention"),
        "varlen": KernelImpl(devices=("cuda",), cp=False, packed=True, backward=True,
                             dtypes={"cuda": ("bfloat16", "float16")}, min_capability=(8, 0), auto=False,
                             problem=_varlen_problem,
                             note="torch's flash varlen_attn over cu_seqlens (one sequence per document); no CP; "
                                  "auto does not pick it until a device run measures it faster than flex "
                                  "(benchmarks/gpu.sh)",
                             fn="q38.layers.attention:varlen_attention"),
        "npu": KernelImpl(devices=("npu",), cp=True, packed=True, backward=True,
                          dtypes={"npu": ("bfloat16", "float16")},
                          problem=_import_problem("torch_npu", "install the torch_npu matching torch"),
                          note="torch_npu.npu_fusion_attention, TND layout, actual_seq_qlen / actual_seq_kvlen per "
                               "document (CP: local queries against their documents' gathered keys)",
                          fn="q38.layers.attention:npu_attention",
                          requires=("torch_npu", "torch_npu (Ascend) and an NPU device")),
        "sdpa": KernelImpl(devices=("cpu", "cuda", "npu", "meta"), cp=True, packed=True, backward=True, fallback=True,
                           note="F.scaled_dot_product_attention (a dense boolean [b 1 s t] mask for packed rows / CP: the "
                                "reference; causal without a mask: the flash kernel)",
                           fn="q38.layers.attention:sdpa_attention"),
        "eager": KernelImpl(devices=("cpu", "cuda", "npu", "meta"), cp=True, packed=True, backward=True,
                            note="explicit fp32 softmax(QKᵀ)V; the reference", fn="q38.layers.attention:eager_attention"),
    },
    "experts": {
        "grouped_mm": KernelImpl(devices=("cpu", "cuda", "meta"), cp=True, packed=True, backward=True,
                                 dtypes={"cuda": ("bfloat16",), "meta": ("bfloat16",)}, min_capability=(8, 0),
                                 problem=_grouped_mm_problem,
                                 note="F.grouped_mm over the slots sorted by expert: no padding, no per-expert Python",
                                 fn="q38.layers.moe:swiglu_grouped_mm"),
        "batched": KernelImpl(devices=("cpu", "cuda", "npu", "meta"), cp=True, packed=True, backward=True,
                              fallback=True,
                              note="slots scattered into [experts, capacity, d] and one padded bmm per projection",
                              fn="q38.layers.moe:swiglu_batched"),
    },
    "block": {
        "compiled": KernelImpl(devices=("cpu", "cuda"), cp=False, packed=True, backward=True, auto=False,
                               problem=_compile_problem,
                               note="each decoder layer's apply compiled whole (torch.compile, fullgraph; FLA as a "
                                    "custom op); one device, no expert parallelism yet; auto does not pick it until a "
                                    "device run measures it faster (benchmarks/gpu.sh)",
                               fn="q38.layers.block:compiled_block"),
        "eager": KernelImpl(devices=("cpu", "cuda", "npu", "meta"), cp=True, packed=True, backward=True, fallback=True,
                            note="the layer's ops run one by one", fn="q38.layers.block:eager_block"),
    },
    "loss": {
        "compiled": KernelImpl(devices=("cpu", "cuda"), cp=True, packed=True, backward=True, auto=False,
                               problem=_compile_problem,
                               note="torch.compile'd block epilogues: one pass per logits block in forward and in "
                                    "backward instead of five and four; auto does not pick it until a device run "
                                    "measures it faster (benchmarks/gpu.sh)",
                               fn="q38.train.core.loss:chunked_loss_sum_compiled"),
        "torch": KernelImpl(devices=("cpu", "cuda", "npu", "meta"), cp=True, packed=True, backward=True, fallback=True,
                            note="eager passes over fp32 copies of each logits block",
                            fn="q38.train.core.loss:chunked_loss_sum_eager"),
    },
}


def check_registry(registry: Mapping[str, Mapping[str, KernelImpl]]) -> None:
    """The registry's rules, checked when it is built: every op of ``OPS`` has implementations, exactly one of them
    marked ``fallback``, and that one is portable (it runs on every device any implementation of the op runs on,
    supports CP, packed rows and backward, is picked by ``auto`` without conditions and imports no optional
    package)."""
    if set(registry) != set(OPS):
        raise ValueError(f"kernel registry ops {sorted(registry)} differ from OPS {sorted(OPS)}")
    for op, impls in registry.items():
        marked = [n for n, i in impls.items() if i.fallback]
        if len(marked) != 1:
            raise ValueError(f"kernels.{op}: {len(marked)} implementations marked fallback=True ({marked}); mark "
                             "exactly one, the portable torch path")
        i = impls[marked[0]]
        devices = {d for j in impls.values() for d in j.devices}
        lacks = [what for what, ok in (
            (f"devices {sorted(devices - set(i.devices))}", devices <= set(i.devices)), ("cp", i.cp),
            ("packed rows", i.packed), ("backward", i.backward and not i.no_backward),
            ("every dtype", not i.dtypes), ("auto without conditions", i.auto and i.auto_if is None),
            ("no optional package", i.requires is None and i.fn is not None)) if not ok]
        if lacks:
            raise ValueError(f"kernels.{op}: fallback {marked[0]} is not portable: it lacks {', '.join(lacks)}")


def fallback(op: str) -> str:
    """The name of ``op``'s portable implementation (its ``fallback`` entry)."""
    return next(n for n, i in REGISTRY[op].items() if i.fallback)


check_registry(REGISTRY)


def _check_choice(op: str, value: str) -> None:
    names = (*REGISTRY[op], "auto")
    if value not in names:
        raise ConfigError(f"kernels.{op} must be one of {names}, got {value!r}")


@attrs.frozen(kw_only=True)
class KernelConfig:
    """One implementation per op, or ``auto`` (the fastest one known correct for the run's device, CP and rows)."""

    gdn: str = "auto"  # the GDN chunked core (docs/kernels.md)
    causal_conv1d: str = "auto"  # the GDN causal convolution
    attention: str = "auto"  # the full-attention kernel
    experts: str = "auto"  # the routed experts' matmuls
    loss: str = "auto"  # the chunked cross-entropy
    block: str = "auto"  # compiled: torch.compile each decoder layer; eager: op by op
    gdn_chunk_size: int | str = "auto"  # the torch GDN core's chunk length (auto: ``auto_gdn_chunk``)

    def __attrs_post_init__(self) -> None:
        for op in OPS:
            _check_choice(op, getattr(self, op))
        c = self.gdn_chunk_size
        if c != "auto" and (isinstance(c, bool) or not isinstance(c, int) or c <= 0):
            raise ConfigError(f"kernels.gdn_chunk_size must be a positive integer or auto, got {c!r} "
                              f"(auto: {GDN_CHUNK}, or 32 on CPU with head dims <= 64)")

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "kernels") -> "KernelConfig":  # Any: checked here
        if d is not None and not isinstance(d, Mapping):
            raise ConfigError(f"{source} must be a mapping of op: implementation, got {type(d).__name__}")
        d = dict(d or {})
        check_keys(d, (*OPS, "gdn_chunk_size"), f"{source}: unknown kernel key(s)")
        return cls(**d)

    def to_dict(self) -> dict[str, str | int]:
        return attrs.asdict(self)

    def replace(self, **changes: str | int) -> "KernelConfig":
        return attrs.evolve(self, **changes)

    @property
    def resolved(self) -> bool:
        return all(getattr(self, op) != "auto" for op in (*OPS, "gdn_chunk_size"))

    def fn(self, op: str) -> Callable:
        """The callable of ``op``'s chosen implementation (its contract: docs/kernels.md#the-registry). Needs a resolved
        choice (``resolve_kernels``), which has also checked that the implementation serves the run."""
        name = getattr(self, op)
        if name == "auto":
            raise ValueError(f"kernels.{op} is auto: resolve_kernels first (the layers run a resolved KernelConfig)")
        impl = REGISTRY[op][name]
        loaded = _LOADED.get((op, name))
        if loaded is not None and loaded[0] is impl:  # loaded once: a compiled block finds it without an import
            return loaded[1]
        fn = impl.load(op, name)
        _LOADED[(op, name)] = (impl, fn)
        return fn


# (op, implementation) -> (the registry entry, its loaded callable): ``KernelConfig.fn``'s cache
_LOADED: dict[tuple[str, str], tuple[KernelImpl, Callable]] = {}


def _cuda_capability() -> tuple[int, int] | None:
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def _unsupported(
    op: str, name: str, impl: KernelImpl, device: str, cp: bool, packed: bool, train: bool, dtype: str | None = None,
    environment: bool = True,
) -> str | None:
    """Why ``impl`` cannot serve this run (None if it can). ``environment`` False: what this machine has installed
    (packages, the GPU's capability) is not asked, only what the implementation supports; one not wired into q38
    (``fn`` None) still cannot serve."""
    if device not in impl.devices:
        return f"runs on {'/'.join(impl.devices)} only, not on {device!r}"
    allowed = impl.dtypes.get(device)
    if dtype is not None and allowed is not None and dtype not in allowed:
        return f"takes {'/'.join(allowed)} on {device}, not {dtype} (train.param_dtype)"
    if device == "cuda" and impl.min_capability is not None and environment:
        cap = _cuda_capability()
        if cap is not None and cap < impl.min_capability:
            return f"needs CUDA compute capability >= {impl.min_capability}, this GPU has {cap}"
    if cp and not impl.cp:
        return "does not support context parallelism (a `cp` mesh dim > 1)"
    if packed and not impl.packed:
        return "does not support packed rows (several documents in one row)"
    if train and not impl.backward:
        return "has no backward (cannot train)"
    if train and device in impl.no_backward:
        return impl.no_backward[device] + " (cannot train)"
    if not environment and impl.fn is not None:
        return None
    return impl.problem()


def _auto_ok(impl: KernelImpl, device: str, cp: bool, packed: bool) -> bool:
    """Whether ``auto`` may pick ``impl`` for this device and rows (if it serves the run)."""
    return impl.auto and (impl.auto_if is None or impl.auto_if(device, cp, packed))


def resolve_kernels(
    kc: KernelConfig | None, *, device: str = "cpu", cp: bool = False, packed: bool = True, train: bool = True,
    dtype: str | None = None, model: ModelConfig | None = None, environment: bool = True,
) -> KernelConfig:
    """Every op's implementation for this run: explicit choices are checked (one ``ConfigError`` naming the op, the
    implementation, what it lacks and the fix); ``auto`` takes the first implementation in registry order that
    supports the run. ``packed``: rows may hold several documents (the default: the data pipeline packs).
    ``dtype``: the compute dtype (``train.param_dtype``; None: not checked). ``model`` (a ``ModelConfig``, or None):
    its GDN head dims pick the ``auto`` chunk length (``auto_gdn_chunk``). ``environment`` False: resolve for a
    machine that has every optional package installed (``q38 plan`` for a hardware profile), not this one."""
    kc = kc or KernelConfig()
    dev = str(device).split(":")[0]
    out: dict[str, str | int] = {}
    out["gdn_chunk_size"] = kc.gdn_chunk_size if kc.gdn_chunk_size != "auto" else auto_gdn_chunk(
        dev, *((model.linear_key_head_dim, model.linear_value_head_dim) if model is not None else ()))
    for op in OPS:
        want = getattr(kc, op)
        impls = REGISTRY[op]
        whys = {n: _unsupported(op, n, i, dev, cp, packed, train, dtype, environment) for n, i in impls.items()}
        pick = next((n for n, i in impls.items() if _auto_ok(i, dev, cp, packed) and whys[n] is None), None)
        if pick is None:
            raise ConfigError(f"kernels.{op}: no implementation serves this run on device {dev!r} ("
                              + "; ".join(f"{n}: {w}" for n, w in whys.items()) + ")")
        if want == "auto":
            out[op] = pick
            continue
        if whys[want] is not None:
            ok = [n for n, w in whys.items() if w is None]
            raise ConfigError(
                f"kernels.{op}: {want} {whys[want]}; use kernels.{op}: auto (picks {pick} here) or one of {ok}"
            )
        out[op] = want
    if out["block"] == "compiled" and out["experts"] == "grouped_mm" and dtype not in (None, "bfloat16"):
        # F.grouped_mm runs eagerly in fp32 on CPU, but its meta kernel (what torch.compile traces) takes bf16 only
        if kc.experts != "auto":
            raise ConfigError(f"kernels.experts: grouped_mm cannot be compiled in {dtype} (its meta kernel takes "
                              "bfloat16 only); with kernels.block: compiled use kernels.experts: batched (or auto)")
        out["experts"] = "batched"
    bad = _grouped_mm_shape_problem(model, dtype) if out["experts"] == "grouped_mm" else None
    if bad is not None:
        if kc.experts != "auto":
            raise ConfigError(f"kernels.experts: grouped_mm {bad}; use kernels.experts: batched (or auto)")
        out["experts"] = "batched"
    if out["gdn"] != "torch" and kc.gdn_chunk_size not in ("auto", GDN_CHUNK):
        raise ConfigError(
            f"kernels.gdn_chunk_size: {kc.gdn_chunk_size} sets the torch GDN core's chunk, but kernels.gdn is "
            f"{out['gdn']} here (its kernels use chunks of {GDN_CHUNK}); drop gdn_chunk_size or set kernels.gdn: torch"
        )
    return KernelConfig(**out)


def kernel_report(
    *, device: str = "cpu", cp: bool = False, packed: bool = True, train: bool = True, dtype: str | None = None,
) -> list[tuple[str, str, str]]:
    """Every registered implementation against this environment and run shape, as ``(op, implementation, status)``
    rows in registry order: ``auto`` for the one ``auto`` picks, ``usable`` (``auto`` skips it until measured) or
    the reason it cannot serve the run (the same reasons ``resolve_kernels`` raises). ``q38 kernels`` prints it; the
    device script runs it first, so a session sees what its environment allows before it spends time on it."""
    dev = str(device).split(":")[0]
    rows = []
    picked = resolve_kernels(KernelConfig(), device=dev, cp=cp, packed=packed, train=train, dtype=dtype)
    for op in OPS:
        for name, impl in REGISTRY[op].items():
            why = _unsupported(op, name, impl, dev, cp, packed, train, dtype)
            if name == getattr(picked, op):
                status = "auto"
            elif why is None:
                status = ("usable" if _auto_ok(impl, dev, cp, packed) else "usable when named (auto does not pick it"
                          + (")" if not impl.auto else " for this run's device and rows)"))
            else:
                status = why
            rows.append((op, name, status))
    return rows


def describe_kernels(
    requested: KernelConfig, resolved: KernelConfig, *, device: str = "cpu", cp: bool = False, packed: bool = True,
    train: bool = True, dtype: str | None = None,
) -> str:
    """The run log's ``kernels:`` line: each op's implementation, ``(auto)`` where ``auto`` chose it, and the
    implementations ``auto`` preferred but passed over on this device, each with its reason (``gdn=torch (auto;
    passed over fla: Triton 3.6.0 < 3.7.1 ...)``): an operator sees why the faster kernel is not running."""
    dev = str(device).split(":")[0]
    status = {(op, name): why for op, name, why in kernel_report(device=dev, cp=cp, packed=packed, train=train,
                                                                   dtype=dtype)}
    parts = []
    for op in OPS:
        picked = getattr(resolved, op)
        if getattr(requested, op) != "auto":
            parts.append(f"{op}={picked}")
            continue
        over = []
        for name, impl in REGISTRY[op].items():
            if name == picked:
                break
            # one meant for this device and rows: say why it is not running
            if _auto_ok(impl, dev, cp, packed) and dev in impl.devices:
                over.append(f"{name}: {status[(op, name)]}")
        parts.append(f"{op}={picked} (auto" + (f"; passed over {'; '.join(over)})" if over else ")"))
    return "kernels: " + ", ".join(parts)


# every op's fallback (the paths that run everywhere; GDN chunks of ``GDN_CHUNK``): what a layer runs when its caller
# passes no kernels
DEFAULT_KERNELS = KernelConfig(**{op: fallback(op) for op in OPS}, gdn_chunk_size=GDN_CHUNK)
