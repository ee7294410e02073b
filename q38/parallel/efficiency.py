"""What each kernel of a step reaches on a device, and the FLOPs it really executes: how ``q38 plan`` prices compute.

A hardware profile's ``efficiency`` table gives, per priced op (``matmul``, ``experts``, ``attention``, ``gdn``,
``loss``) and kernel (the registry's names, as ``resolve_kernels`` picks them), the fraction of the dtype's dense
peak reached, as a low-high range, each entry ``published`` (a kernel benchmark of that kernel on that GPU class),
``measured`` (a command and date) or ``assumed`` (a range that says how unsure it is), with its source;
``read_measured`` reads the JSON lines ``benchmarks/gpu.sh`` writes. Its ``collectives`` table gives the bus
bandwidth each collective reaches as a fraction of the link's, the same way (:func:`parse_collectives`). Attention's executed FLOPs depend on how the kernel masks (:func:`attention_factor`).
The ops, the masking rules and the ``--doc-len`` assumption: docs/plan.md#how-compute-is-priced.
"""

import datetime
import functools
import json
import time
import math
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs

from q38.errors import ConfigError

PRICED_OPS = ("matmul", "experts", "attention", "gdn", "loss")
# per priced op: the kernel registry's op, and the implementation names the profiles may list (the registry's own,
# plus the names agreed for implementations that are being wired in)
REGISTRY_OP = {"matmul": None, "experts": "experts", "attention": "attention", "gdn": "gdn", "loss": "loss"}
KNOWN_IMPLS = {
    "matmul": ("torch",),
    "experts": ("grouped_mm", "batched"),
    "attention": ("eager", "sdpa", "flex", "varlen", "npu"),
    "gdn": ("torch", "fla", "npu"),
    "loss": ("torch", "compiled"),
}
STATUSES = ("measured", "published", "assumed")
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
LINKS = ("intra", "inter")
DEFAULT_DOC_LEN = 2048  # tokens per document in packed rows (an assumption; q38 plan --doc-len)
FLEX_BLOCK = 128  # FlexAttention's default block size (query and key)


def known_impls(op: str) -> tuple[str, ...]:
    from q38.kernels import REGISTRY

    reg = REGISTRY_OP[op]
    return tuple(dict.fromkeys([*KNOWN_IMPLS[op], *(REGISTRY[reg] if reg else ())]))


@attrs.frozen(kw_only=True)
class Efficiency:
    """One kernel's share of peak on one device, on the FLOPs it executes: ``low``-``high`` of the dtype's dense
    peak (equal for a single measured figure); ``value``, the midpoint, is the point estimate the plan ranks by."""

    op: str
    impl: str
    value: float
    status: str  # measured | published | assumed
    source: str = ""  # published / assumed: where the number comes from
    command: str = ""  # measured: the command that printed it
    date: str = ""
    device: str = ""
    low: float = attrs.field(default=None)
    high: float = attrs.field(default=None)
    # the entry's range for narrower shapes: (width, entry) applies when the op's width (the expert FFN width for
    # ``experts``, the model width otherwise) is at most ``width``
    narrow: tuple[int, "Efficiency"] | None = None

    def at_width(self, width: int | None) -> "Efficiency":
        """This entry, or its ``narrow`` range when ``width`` is at most the narrow entry's width."""
        if self.narrow is not None and width is not None and width <= self.narrow[0]:
            return self.narrow[1].at_width(width)
        return self

    def __attrs_post_init__(self) -> None:
        if self.low is None:
            object.__setattr__(self, "low", self.value)
        if self.high is None:
            object.__setattr__(self, "high", self.value)

    def describe(self) -> str:
        if self.status == "measured":
            return f"measured {self.date} on {self.device}: {self.command}"
        return f"{self.status}: {self.source}"

    def span(self) -> str:
        """``0.30-0.45``, or one figure when the range is a point."""
        return f"{self.value:.2f}" if self.low == self.high else f"{self.low:.2f}-{self.high:.2f}"


def _check_impl(op: str, impl: str, where: str) -> None:
    if op not in PRICED_OPS:
        raise ConfigError(f"{where}: unknown op {op!r}; the priced ops are {', '.join(PRICED_OPS)}")
    names = known_impls(op)
    if impl not in names:
        raise ConfigError(f"{where}: unknown {op} implementation {impl!r}; one of {', '.join(names)}")


def _fraction(v: Any, where: str) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: efficiency must be a number in (0, 1], got {v!r}") from None
    if not math.isfinite(x) or not 0 < x <= 1:
        raise ConfigError(f"{where}: efficiency must be in (0, 1] (a fraction of peak), got {x}")
    return x


def parse_range(v: Any, where: str) -> tuple[float, float]:
    """``[low, high]`` (or one number: a point) as fractions in (0, 1] with ``low <= high``; one ``ConfigError``
    naming ``where`` and the fix otherwise."""
    if isinstance(v, (list, tuple)):
        if len(v) != 2:
            raise ConfigError(f"{where}: a range is [low, high] (two fractions of peak), got {list(v)!r}")
        lo, hi = _fraction(v[0], f"{where} (low)"), _fraction(v[1], f"{where} (high)")
        if lo > hi:
            raise ConfigError(f"{where}: the range's low end {lo} is above its high end {hi}; write [low, high]")
        return lo, hi
    if v is None:
        raise ConfigError(f"{where}: missing efficiency; give [low, high] (fractions of peak) or one measured figure")
    x = _fraction(v, where)
    return x, x


def _entry(e: Any, at: str, *, op: str, impl: str) -> "Efficiency":
    """One ``{efficiency, status, source | command+date+device}`` entry (a kernel's or a collective's)."""
    if not isinstance(e, Mapping):
        raise ConfigError(f"{at} must be a mapping with efficiency and status")
    keys = {"efficiency", "status", "source", "command", "date", "device", "narrow"}
    bad = sorted(set(e) - keys)
    if bad:
        raise ConfigError(f"{at}: unknown key(s) {bad}; valid: {', '.join(sorted(keys))}")
    narrow = None
    if e.get("narrow") is not None:
        n = e["narrow"]
        w = n.get("max_width") if isinstance(n, Mapping) else None
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ConfigError(f"{at}.narrow: needs max_width, a positive integer (the widest shape it applies to), "
                              f"got {w!r}")
        narrow = (w, _entry({k: v for k, v in n.items() if k != "max_width"}, f"{at}.narrow", op=op, impl=impl))
    status = e.get("status")
    if status not in STATUSES:
        raise ConfigError(f"{at}: status must be measured, published or assumed, got {status!r}")
    need = ("command", "date", "device") if status == "measured" else ("source",)
    missing = [k for k in need if not str(e.get(k) or "").strip()]
    if missing:
        raise ConfigError(f"{at}: a {status} efficiency needs {', '.join(need)} (missing {missing})")
    lo, hi = parse_range(e.get("efficiency"), f"{at}.efficiency")
    if status == "assumed" and lo == hi:
        raise ConfigError(f"{at}: an assumed efficiency must be a range [low, high] that says how unsure it is, got "
                          f"the point {lo}; give the spread of what it rests on")
    return Efficiency(op=op, impl=impl, value=(lo + hi) / 2, low=lo, high=hi, status=status, narrow=narrow,
                      **{k: str(e[k]) for k in ("source", "command", "date", "device") if k in e})


def parse_table(raw: Any, where: str) -> tuple[Efficiency, ...]:
    """A profile's ``efficiency`` mapping (op → implementation → entry) as entries; one ``ConfigError`` naming the
    entry and the fix on anything malformed."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: efficiency must be a mapping op -> implementation -> entry, got "
                          f"{type(raw).__name__}")
    out = []
    for op, impls in raw.items():
        if not isinstance(impls, Mapping):
            raise ConfigError(f"{where}: efficiency.{op} must map implementation names to entries")
        for impl, e in impls.items():
            at = f"{where}: efficiency.{op}.{impl}"
            _check_impl(str(op), str(impl), at)
            out.append(_entry(e, at, op=str(op), impl=str(impl)))
    return tuple(out)


def parse_collectives(raw: Any, where: str) -> tuple[Efficiency, ...]:
    """A profile's ``collectives`` mapping (kind → ``intra`` | ``inter`` → entry): the bus bandwidth each
    collective reaches as a fraction of the link's one-direction bandwidth per device (an ``Efficiency`` whose
    ``op`` is the kind and ``impl`` the link); one ``ConfigError`` naming the entry and the fix on anything
    malformed."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: collectives must be a mapping kind -> intra|inter -> entry, got "
                          f"{type(raw).__name__}")
    out = []
    for kind, links in raw.items():
        if kind not in COLLECTIVE_KINDS:
            raise ConfigError(f"{where}: collectives.{kind}: unknown collective; one of {', '.join(COLLECTIVE_KINDS)}")
        if not isinstance(links, Mapping):
            raise ConfigError(f"{where}: collectives.{kind} must map intra and inter to entries")
        for link, e in links.items():
            at = f"{where}: collectives.{kind}.{link}"
            if link not in LINKS:
                raise ConfigError(f"{at}: unknown link; intra (inside a node) or inter (across nodes)")
            out.append(_entry(e, at, op=str(kind), impl=str(link)))
    return tuple(out)


def read_measured(path: str | Path, peak: Callable[[str], float]) -> tuple[Efficiency, ...]:
    """Measured efficiencies from a JSON-lines file (benchmarks/gpu.sh writes it; format in benchmarks/README.md):
    per line ``{"op", "impl", "efficiency" | "tflops", "device", "command" (or "source"), "date"}`` and optionally
    ``"dtype"`` (of the peak ``tflops`` is a share of; default bf16); other keys are the benchmark's own record
    (shape, reference time) and are not read. ``peak(dtype)``: the profile's peak FLOP/s. Skipped: blank lines, lines
    with neither efficiency nor tflops (errors, compile ratios), lines for one document per row (``"layout":
    "unpacked"``). A missing date is the file's modification date; a later line for the same (op, impl) and
    ``"width"`` replaces an earlier one. ``"width"`` (optional): the op's width it was measured at (the expert FFN
    width for ``experts``, the model width otherwise); lines of one (op, impl) at several widths become one entry,
    the widest, whose ``narrow`` ranges are the narrower ones (each applies to shapes at most its width)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--efficiencies {path}: file not found (a JSON-lines file benchmarks/gpu.sh writes)")
    out: dict[tuple[str, str, int | None], Efficiency] = {}
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        at = f"{path}:{n}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{at}: not a JSON object ({e.msg}); one object per line") from None
        except RecursionError:
            raise ConfigError(f"{at}: JSON nested too deeply; one flat object per line") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{at}: expected a JSON object, got {type(d).__name__}")
        if "efficiency" not in d and "tflops" not in d:
            continue  # a record for people (an error, a compile ratio): nothing to price
        if d.get("layout") == "unpacked":
            continue  # one document per row (e.g. SDPA's causal flash bound): the profile prices packed rows
        if not str(d.get("command") or "").strip() and str(d.get("source") or "").strip():
            d["command"] = d["source"]  # the benchmarks' own name for it
        if not str(d.get("date") or "").strip():
            d["date"] = time.strftime("%Y-%m-%d", time.gmtime(p.stat().st_mtime))  # the file's, where a line has none
        missing = [k for k in ("op", "impl", "device", "command") if not str(d.get(k) or "").strip()]
        if missing:
            raise ConfigError(f"{at}: missing {missing} (every measured line names op, impl, device, command)")
        op, impl = str(d["op"]), str(d["impl"])
        _check_impl(op, impl, at)
        if ("efficiency" in d) == ("tflops" in d):
            raise ConfigError(f"{at}: give exactly one of efficiency (a fraction of peak) and tflops")
        if "tflops" in d:
            dtype = str(d.get("dtype", "bf16"))
            try:
                tf = float(d["tflops"])
                pk = peak(dtype)
            except (TypeError, ValueError, KeyError):
                raise ConfigError(f"{at}: tflops must be a number and dtype one of bf16, fp16, fp32, got "
                                  f"{d['tflops']!r} / {dtype!r}") from None
            value = _fraction(tf * 1e12 / pk, f"{at} (tflops {tf} of a {pk / 1e12:g} TFLOP/s peak)")
        else:
            value = _fraction(d["efficiency"], at)
        width = d.get("width")
        if width is not None and (not isinstance(width, int) or isinstance(width, bool) or width < 1):
            raise ConfigError(f"{at}: width must be a positive integer (the op's width it was measured at), got "
                              f"{width!r}")
        out[op, impl, width] = Efficiency(op=op, impl=impl, value=value, status="measured",
                                          command=str(d["command"]), date=str(d["date"]), device=str(d["device"]))
    return _by_width(out)


def _by_width(lines: dict) -> tuple[Efficiency, ...]:
    """One entry per (op, impl): the widest line (a line without a width counts as the widest), the narrower ones
    chained as its ``narrow`` ranges."""
    groups: dict[tuple[str, str], list] = {}
    for (op, impl, width), e in lines.items():
        groups.setdefault((op, impl), []).append((math.inf if width is None else width, e))
    out = []
    for entries in groups.values():
        entries.sort(key=lambda we: we[0])
        entry, below = entries[0][1], entries[0][0]
        for width, e in entries[1:]:  # narrowest first: each wider one holds the chain so far as its narrow range
            entry, below = attrs.evolve(e, narrow=(int(below), entry)), width
        out.append(entry)
    return tuple(out)


def measured_line(op: str, impl: str, *, device: str, command: str, tflops: float | None = None,
                  efficiency: float | None = None, dtype: str = "bf16", width: int | None = None) -> str:
    """One line of the measured-efficiency file (what a benchmark prints; ``read_measured`` reads it); ``width``:
    the op's width it was measured at."""
    d: dict[str, Any] = {"op": op, "impl": impl}
    if width is not None:
        d["width"] = int(width)
    if tflops is not None:
        d["tflops"] = float(f"{float(tflops):.4g}")
        d["dtype"] = dtype
    else:
        d["efficiency"] = float(f"{float(efficiency):.4g}")
    d.update(device=device, command=command, date=datetime.date.today().isoformat())
    return json.dumps(d)


# ---- the work each attention kernel executes ---------------------------------------------------------------------


def attention_work(impl: str, *, packed: bool, cp: int) -> str:
    """How ``impl`` masks (what it computes): ``dense`` every (query, key) pair; ``causal`` the causal triangle of
    the row; ``blocks`` the 128 × 128 blocks holding an unmasked pair; ``documents`` each document's own causal
    triangle."""
    if impl == "eager":
        return "dense"  # an explicit [s, t] score matrix, masked after
    if impl == "sdpa":
        return "dense" if packed or cp > 1 else "causal"  # with a mask SDPA cannot skip blocks
    if impl == "flex":
        return "blocks"
    if impl in ("varlen", "npu"):
        return "documents"
    raise ConfigError(f"attention implementation {impl!r}: the plan does not know which pairs it computes; one of "
                      f"{', '.join(KNOWN_IMPLS['attention'])}")


@functools.lru_cache(maxsize=512)
def keys_per_query(work: str, seq: int, cp: int, doc_len: int, block: int = FLEX_BLOCK) -> float:
    """Mean keys each query of a rank computes against (averaged over the CP ranks, contiguous shards of ``seq``
    tokens of a row of ``seq · cp``), for documents of ``doc_len`` tokens packed from the row's start (the last one
    cut at the row's end; ``doc_len`` ≥ the row: one document)."""
    row = seq * cp
    L = min(doc_len, row)
    if work == "dense":
        return float(row)
    if work == "causal":
        return (row + 1) / 2
    if work == "documents":  # query q attends to (q mod L) + 1 keys
        full, rest = divmod(row, L)
        return (full * L * (L + 1) / 2 + rest * (rest + 1) / 2) / row
    if work == "blocks":
        # query block g (rows [gB, (g+1)B)) needs the key blocks from the one holding its first row's document start
        # to itself: the union of [doc_start(q), q] over its rows is one contiguous range
        nb = math.ceil(row / block)
        blocks = sum(g - (((g * block) // L) * L) // block + 1 for g in range(nb))
        return blocks * block * block / row
    raise ValueError(f"unknown attention work {work!r}")


def attention_factor(impl: str, *, packed: bool, seq: int, cp: int, doc_len: int) -> float:
    """Executed attention FLOPs of ``impl`` over the model count (``q38.flops``: the causal triangle of the row)."""
    return keys_per_query(attention_work(impl, packed=packed, cp=cp), seq, cp, doc_len) / keys_per_query(
        "causal", seq, cp, doc_len)


@attrs.frozen(kw_only=True)
class OpTime:
    """One priced op of a step: its kernel, the FLOPs it executes per rank, its efficiency and time (at the
    midpoint, and at the low and high ends of the efficiency's range: ``slow_s``, ``fast_s``)."""

    op: str
    impl: str
    flops: float  # executed per rank and step (recompute included)
    efficiency: Efficiency
    seconds: float
    forward_s: float
    note: str = ""
    bytes: float = 0.0  # the memory-bound row: HBM bytes per rank and step (its efficiency: a share of HBM bandwidth)
    slow_s: float = attrs.field(default=None)
    fast_s: float = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        e = self.efficiency
        if self.slow_s is None:
            object.__setattr__(self, "slow_s", self.seconds * e.value / e.low)
        if self.fast_s is None:
            object.__setattr__(self, "fast_s", self.seconds * e.value / e.high)

    def at(self, end: str) -> tuple[float, float]:
        """(seconds, forward seconds) at ``end``: ``mid``, ``slow`` (the range's low efficiency) or ``fast``."""
        k = {"mid": 1.0, "slow": self.efficiency.value / self.efficiency.low,
             "fast": self.efficiency.value / self.efficiency.high}[end]
        return self.seconds * k, self.forward_s * k
