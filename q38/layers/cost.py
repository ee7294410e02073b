"""The records a mixer kind's cost formulas take and return (``q38.layers.kinds.MixerKind.flops`` / ``saved`` /
``cp_exchange``): a layer call (``Workload``), its matmul FLOPs, its saved bytes and its context-parallel exchange.
Each kind's formulas live next to its layer (``q38.layers.gdn_cost``) or in the kind table; ``q38.flops`` and
``q38.parallel.budget`` read them through the table.
"""

import attrs

from q38.kernels import GDN_CHUNK


@attrs.frozen(kw_only=True)
class Workload:
    """One layer call the formulas are evaluated at: ``rows`` rows of ``seq`` tokens local to a CP rank (attention
    keys span ``seq × cp``), activations of ``act_bytes``. ``causal_skip``: the attention kernel skips the masked
    triangle; ``kv_native``: attention takes k, v with their own heads; ``gdn_kernel``: fla's GDN kernel (else the
    torch core, in chunks of ``gdn_chunk``)."""

    rows: float | int
    seq: int
    cp: int = 1
    act_bytes: int = 2
    causal_skip: bool = True
    kv_native: bool = False
    gdn_kernel: bool = False
    gdn_chunk: int = GDN_CHUNK

    @property
    def tokens(self) -> float | int:
        return self.rows * self.seq


@attrs.frozen(kw_only=True)
class MixerFlops:
    """Forward matmul FLOPs of one mixer call. ``terms``: by ``q38.flops.StepFlops`` term (``dense``,
    ``attention``, ``gdn_core``, ``solve``: the GDN triangular solve, reported with ``gdn_core``); ``kernel``: the
    terms inside the recompute region (selective recompute does not run them again); ``backward``: what the
    backward of the kernel terms executes when that is not 2 × their forward (None: it is)."""

    terms: dict
    kernel: tuple[str, ...]
    backward: float | None = None


@attrs.frozen(kw_only=True)
class MixerSaved:
    """Bytes autograd saves for one mixer call: ``core`` (the kernel region's inputs and saved state), ``rest``
    (projections, norms, gates), ``widest`` (the largest single saved tensor), ``kept`` (what selective recompute
    stores for the region), ``mixer_backward`` (bytes alive at the peak of the core's own backward; 0: not
    modelled)."""

    core: float
    rest: float
    widest: float
    kept: float
    mixer_backward: float = 0.0


@attrs.frozen(kw_only=True)
class CPExchange:
    """What one mixer call exchanges over ``cp`` (context parallelism): ``bytes`` received per rank per call of
    ``collective``; ``calls``: how often it runs per step (forward, backward), ``recompute_calls`` when the kernel
    region is recomputed."""

    collective: str
    bytes: float
    calls: int
    recompute_calls: int
    early: bool = False  # its forward calls are started before the compute that does not need them (overlap_comm)
