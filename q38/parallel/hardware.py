"""A hardware profile (``specs/hardware/*.yaml``): peak FLOPs, memory, bandwidths and per-kernel efficiencies that
``q38 plan`` prices a step on; and the share of device memory a plan may fill."""

import math
from collections.abc import Mapping

import attrs

from q38.model_config import ConfigError
from q38.parallel.efficiency import Efficiency, parse_collectives, parse_range, parse_table

GIB = 2**30


def _nbytes(dtype: str) -> int:
    return {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}[dtype]

# The share of a device's memory a plan may fill; the rest is for allocator fragmentation, the CUDA / CANN context
# and collective buffers (q38 plan --search's default cap; the plain plan reports against it too).
MEMORY_HEADROOM = 0.9

# ---- hardware ---------------------------------------------------------------------------------------------------


# numeric fields of a profile, with the bounds a figure must lie in (a number outside is a typo in units)
_BOUNDS = {
    "peak_bf16_flops": (1e12, 1e17), "peak_fp32_flops": (1e11, 1e17), "peak_fp8_flops": (1e12, 1e17),
    "hbm_bytes": (1e9, 1e13), "hbm_bandwidth": (1e10, 1e14), "intra_node_bandwidth": (1e9, 1e13),
    "inter_node_bandwidth": (1e8, 1e13), "devices_per_node": (1, 1024), "host_memory_bytes": (1e9, 1e15),
    "host_memory_bandwidth": (1e9, 1e14), "host_link_bandwidth": (1e9, 1e13),
}
_OPTIONAL = ("peak_fp8_flops", "host_memory_bytes", "host_memory_bandwidth", "host_link_bandwidth")


@attrs.frozen(kw_only=True)
class Hardware:
    """One accelerator kind (``specs/hardware/<name>.yaml``). ``efficiency``: what each (op, kernel) reaches
    (``q38.parallel.efficiency``); ``achievable_fraction`` (the midpoint of ``achievable_range``) prices an
    (op, kernel) the table does not list. ``collectives``: the bus bandwidth each collective reaches per link class,
    as a fraction of the link's. ``device``: the torch device type the kernels are resolved for (``cuda``, ``npu``).
    ``sources``: per numeric field, where its figure comes from. ``devices_per_node``: the devices one fast
    (NVLink / HCCS) domain joins."""

    name: str
    peak_bf16_flops: float  # dense, per device
    peak_fp32_flops: float
    achievable_fraction: float  # of peak, for an (op, kernel) without an ``efficiency`` entry (an assumption)
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s per device, one direction (NVLink / HCCS)
    inter_node_bandwidth: float  # bytes/s per device, one direction (its share of the node's NICs)
    devices_per_node: int
    sources: Mapping[str, str] | tuple = ()
    device: str = "cuda"
    efficiency: tuple[Efficiency, ...] = ()
    collectives: tuple[Efficiency, ...] = ()
    achievable_range: tuple[float, float] | None = None
    # the share of hbm_bandwidth eager memory-bound ops reach ([low, high]; None: their traffic is not priced)
    hbm_efficiency: tuple[float, float] | None = None
    peak_fp8_flops: float | None = None  # dense, per device (None: no FP8 tensor cores)
    # host side, for an offloaded optimizer (train.offload_optimizer); None: not known for this profile
    host_memory_bytes: float | None = None  # per node
    host_memory_bandwidth: float | None = None  # bytes/s per node, what the host AdamW streams at
    host_link_bandwidth: float | None = None  # bytes/s per device and direction (PCIe), device <-> host copies

    @classmethod
    def load(cls, name: str) -> "Hardware":
        """Read and check a profile: every figure a finite number within its plausible range and with its source
        (``sources``), every efficiency a range in (0, 1] with its status and source, before anything is priced;
        one ``ConfigError`` naming the file, the key and the fix otherwise."""
        import yaml

        from q38.model_config import SPECS_DIR

        d = SPECS_DIR / "hardware"
        known = sorted(p.stem for p in d.glob("*.yaml"))
        path = d / f"{name}.yaml"
        if not path.is_file():
            from pathlib import Path

            if Path(name).is_file():
                path = Path(name)
            else:
                raise ConfigError(f"unknown hardware profile {name!r}; known: {', '.join(known)} "
                                  f"(or a YAML path with the fields of specs/hardware/h200.yaml)")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]}); fix the file") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a hardware profile is a mapping of keys, got {type(raw).__name__}")
        fields = [a.name for a in attrs.fields(cls) if a.name != "achievable_range"]
        bad = [k for k in raw if k not in fields]
        if bad:
            raise ConfigError(f"{path}: unknown hardware key(s) {bad}; valid keys: {', '.join(fields)}")
        raw["efficiency"] = parse_table(raw.get("efficiency"), str(path))
        raw["collectives"] = parse_collectives(raw.get("collectives"), str(path))
        raw["device"] = str(raw.get("device", "cuda"))
        if raw["device"] not in ("cuda", "npu", "cpu"):
            raise ConfigError(f"{path}: device must be cuda, npu or cpu (the torch device type), got {raw['device']!r}")
        missing = [f for f in ("name", "achievable_fraction", *_BOUNDS) if f not in raw and f not in _OPTIONAL]
        if missing:
            raise ConfigError(f"{path}: missing hardware key(s) {missing}; each is a number with its source "
                              f"(see specs/hardware/h100.yaml)")
        lo, hi = parse_range(raw["achievable_fraction"], f"{path}: achievable_fraction")
        raw["achievable_fraction"], raw["achievable_range"] = (lo + hi) / 2, (lo, hi)
        if raw.get("hbm_efficiency") is None:
            raise ConfigError(f"{path}: missing hbm_efficiency: [low, high], the share of hbm_bandwidth eager "
                              f"memory-bound ops reach (with its source; see specs/hardware/h100.yaml)")
        raw["hbm_efficiency"] = parse_range(raw["hbm_efficiency"], f"{path}: hbm_efficiency")
        for f, (low, high) in _BOUNDS.items():
            if raw.get(f) is None:
                continue
            try:  # YAML 1.1 reads 989.0e12 (no exponent sign) as a string
                x = float(raw[f])
            except (TypeError, ValueError):
                raise ConfigError(f"{path}: {f} must be a number, got {raw[f]!r}") from None
            if not math.isfinite(x) or x <= 0:
                raise ConfigError(f"{path}: {f} must be a positive finite number, got {raw[f]!r}")
            if not low <= x <= high:
                raise ConfigError(f"{path}: {f} = {x:g} is outside the plausible {low:g}..{high:g} (units: FLOP/s, "
                                  f"bytes, bytes/s, devices); check its unit")
            raw[f] = int(x) if f == "devices_per_node" else x
        srcs = raw.get("sources") or {}
        if not isinstance(srcs, dict):
            raise ConfigError(f"{path}: sources must map each numeric key to where its figure comes from, got "
                              f"{type(srcs).__name__}")
        unsourced = [f for f in ("achievable_fraction", "hbm_efficiency", *_BOUNDS) if raw.get(f) is not None
                     and not str(srcs.get(f) or "").strip()]
        if unsourced:
            raise ConfigError(f"{path}: no source for {unsourced}; add sources.<key>: a datasheet, a published "
                              f"benchmark or 'assumed: why'")
        stray = sorted(set(srcs) - set(fields))
        if stray:
            raise ConfigError(f"{path}: sources names unknown key(s) {stray}; valid keys: {', '.join(fields)}")
        raw["sources"] = {str(k): str(v) for k, v in srcs.items()}
        return cls(**raw)

    def peak(self, compute_dtype: str) -> float:
        return self.peak_fp32_flops if _nbytes(compute_dtype) == 4 else self.peak_bf16_flops

    def price(self, op: str, impl: str, width: int | None = None) -> Efficiency:
        """The efficiency of ``impl`` for ``op`` (at ``width``: an entry's ``narrow`` range applies to shapes at
        most its width): the table's entry, else ``achievable_fraction`` (marked assumed)."""
        for e in self.efficiency:
            if e.op == op and e.impl == impl:
                return e.at_width(width)
        lo, hi = self.achievable_range or (self.achievable_fraction, self.achievable_fraction)
        return Efficiency(op=op, impl=impl, value=self.achievable_fraction, low=lo, high=hi, status="assumed",
                          source=f"no entry for {op}/{impl} in the {self.name} profile: its achievable_fraction")

    def link_share(self, kind: str, link: str) -> Efficiency | None:
        """The bus-bandwidth share ``kind`` reaches on ``link`` (``intra`` | ``inter``); None: not in the profile
        (the collective is priced at the link's full bandwidth)."""
        for e in self.collectives:
            if e.op == kind and e.impl == link:
                return e
        return None

    def with_measured(self, measured: tuple[Efficiency, ...]) -> "Hardware":
        """This profile with ``measured`` entries over its own (``q38 plan --efficiencies``)."""
        over = {(e.op, e.impl) for e in measured}
        return attrs.evolve(self, efficiency=tuple(e for e in self.efficiency if (e.op, e.impl) not in over)
                            + tuple(measured))
