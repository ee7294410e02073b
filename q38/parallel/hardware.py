"""A hardware profile (``specs/hardware/*.yaml``): peak FLOPs, memory, bandwidths and per-kernel efficiencies that
``q38 plan`` prices a step on; and the share of device memory a plan may fill."""

import attrs

from q38.model_config import ConfigError
from q38.parallel.efficiency import Efficiency, parse_table

GIB = 2**30


def _nbytes(dtype: str) -> int:
    return {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}[dtype]

# The share of a device's memory a plan may fill; the rest is for allocator fragmentation, the CUDA / CANN context
# and collective buffers (q38 plan --search's default cap; the plain plan reports against it too).
MEMORY_HEADROOM = 0.9

# ---- hardware ---------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Hardware:
    """One accelerator kind (``specs/hardware/<name>.yaml``). ``efficiency``: what each (op, kernel) reaches
    (``q38.parallel.efficiency``); ``achievable_fraction`` prices an (op, kernel) the table does not list.
    ``device``: the torch device type the kernels are resolved for (``cuda``, ``npu``)."""

    name: str
    peak_bf16_flops: float  # dense, per device
    peak_fp32_flops: float
    achievable_fraction: float  # of peak, for an (op, kernel) without an ``efficiency`` entry (an assumption)
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s per device, one direction (NVLink / HCCS)
    inter_node_bandwidth: float  # bytes/s per device, one direction (its share of the node's NICs)
    devices_per_node: int
    sources: tuple[str, ...] = ()
    device: str = "cuda"
    efficiency: tuple[Efficiency, ...] = ()
    # host side, for an offloaded optimizer (train.offload_optimizer); None: not known for this profile
    host_memory_bytes: float | None = None  # per node
    host_memory_bandwidth: float | None = None  # bytes/s per node, what the host AdamW streams at
    host_link_bandwidth: float | None = None  # bytes/s per device and direction (PCIe), device <-> host copies

    @classmethod
    def load(cls, name: str) -> "Hardware":
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
        raw = yaml.safe_load(path.read_text()) or {}
        fields = [a.name for a in attrs.fields(cls)]
        bad = [k for k in raw if k not in fields]
        if bad:
            raise ConfigError(f"{path}: unknown hardware key(s) {bad}; valid keys: {', '.join(fields)}")
        raw["sources"] = tuple(raw.get("sources") or ())
        raw["efficiency"] = parse_table(raw.get("efficiency"), str(path))
        raw["device"] = str(raw.get("device", "cuda"))
        if raw["device"] not in ("cuda", "npu", "cpu"):
            raise ConfigError(f"{path}: device must be cuda, npu or cpu (the torch device type), got {raw['device']!r}")
        optional = ("sources", "device", "efficiency", "host_memory_bytes", "host_memory_bandwidth",
                    "host_link_bandwidth")
        missing = [f for f in fields if f not in raw and f not in optional]
        if missing:
            raise ConfigError(f"{path}: missing hardware key(s) {missing}")
        for f in fields:
            if f == "name" or f in optional[:3] or raw.get(f) is None:
                continue
            try:  # YAML 1.1 reads 989.0e12 (no exponent sign) as a string
                raw[f] = int(raw[f]) if f == "devices_per_node" else float(raw[f])
            except (TypeError, ValueError):
                raise ConfigError(f"{path}: {f} must be a number, got {raw[f]!r}") from None
            if raw[f] <= 0:
                raise ConfigError(f"{path}: {f} must be > 0, got {raw[f]!r}")
        return cls(**raw)

    def peak(self, compute_dtype: str) -> float:
        return self.peak_fp32_flops if _nbytes(compute_dtype) == 4 else self.peak_bf16_flops

    def price(self, op: str, impl: str) -> Efficiency:
        """The efficiency of ``impl`` for ``op``: the table's entry, else ``achievable_fraction`` (marked assumed)."""
        for e in self.efficiency:
            if e.op == op and e.impl == impl:
                return e
        return Efficiency(op=op, impl=impl, value=self.achievable_fraction, status="assumed",
                          source=f"no entry for {op}/{impl} in the {self.name} profile: its achievable_fraction")

    def with_measured(self, measured: tuple[Efficiency, ...]) -> "Hardware":
        """This profile with ``measured`` entries over its own (``q38 plan --efficiencies``)."""
        over = {(e.op, e.impl) for e in measured}
        return attrs.evolve(self, efficiency=tuple(e for e in self.efficiency if (e.op, e.impl) not in over)
                            + tuple(measured))
