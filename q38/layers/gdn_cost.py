"""What a Gated DeltaNet layer costs, counted from q38/layers/gdn.py: its matmul FLOPs, the bytes autograd saves, the
torch core's backward working set and its context-parallel state exchange (the ``linear_attention`` record of
``q38.layers.kinds`` points here). The derivations are in docs/gdn_backward.md#what-q38-plan-models.

Dims: ``H``/``Hk`` value/key heads, ``a``/``p`` key/value head dims, ``C`` the chunk, ``n`` local tokens.
"""

import math

from q38.kernels import GDN_CHUNK
from q38.layers.cost import CPExchange, MixerFlops, MixerSaved, Workload
from q38.model_config import ModelConfig


def gdn_flops(cfg: ModelConfig, w: Workload) -> MixerFlops:
    """Forward matmul FLOPs (projections and conv: ``dense``; the chunked core: ``gdn_core`` and its triangular
    ``solve``) and what the core's backward executes."""
    d, tokens, rows, seq, cp = cfg.hidden_size, w.tokens, w.rows, w.seq, w.cp
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    a, p, kw = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    conv = cfg.linear_conv_dim
    dense = 2 * tokens * d * (conv + nv * p + 2 * nv) + 2 * tokens * nv * p * d
    dense += 2 * tokens * conv * kw  # depthwise causal conv
    C = w.gdn_chunk
    chunks = rows * math.ceil(seq / C)
    pe = p + (a if cp > 1 else 0)  # CP runs extra value columns for the state response
    r = nk / nv  # q·kᵀ is taken once per key head (gdn.py `_masked_qk`); the rest per value head
    # per chunk and value head: C²a products (A = Kβ Kᵀ, S·Kβ, q·kᵀ), C²p (U = T·Vβ, P·Vnew), Cap (W·S, Kdᵀ·Vnew,
    # (Q⊙E)·S) and one triangular solve (C³); the backward's products are listed in the docs page
    core = chunks * nv * (2 * C * C * a * (2 + r) + 4 * C * C * pe + 6 * C * a * pe)
    solve = chunks * nv * C**3
    backward = chunks * nv * (2 * C * C * a * (7 + 3 * r) + 10 * C * C * pe + 14 * C * a * pe + C**3)
    return MixerFlops(terms={"dense": dense, "gdn_core": core, "solve": solve}, kernel=("gdn_core", "solve"),
                      backward=backward)


def gdn_backward_working(cfg: ModelConfig, rows: float | int, seq: int, act: int, cp: int = 1,
                         chunk: int = GDN_CHUNK) -> float:
    """Bytes the torch GDN core's backward (``_ChunkGatedDeltaRule.backward``) allocates at its peak on top of what
    its forward saved, including the incoming ``d_o``: ``7 C² + C(15a + 8p)`` fp32 per chunk and head plus the
    contiguous copies of its inputs (derivation: docs/gdn_backward.md#what-q38-plan-models; measured by
    tests/test_plan_budget.py). Not the fla kernel, whose backward is not modelled."""
    H, a, p = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = H // cfg.linear_num_key_heads
    C = chunk
    pe = p + (a if cp > 1 else 0)
    N = rows * H * math.ceil(seq / C)
    per_chunk = 7 * C * C + C * (15 * a + 8 * pe) + 2 * a * pe + 4 * C
    per_chunk += C * (2 * a / r + pe) + 2 * C  # contiguous fp32 copies: q, k per key head; v, g, β (any dtype)
    per_chunk += C * pe  # the contiguous copy of d_o (it arrives as a strided view of the [b s h p] gradient)
    return float((N * per_chunk + rows * H * (a * pe + C * pe)) * 4)


def gdn_saved(cfg: ModelConfig, w: Workload) -> MixerSaved:
    """Saved bytes. ``gdn_kernel=False``: the chunked torch core with its own backward (inputs q, k per key head, v,
    g, beta in the activation dtype and one fp32 state per chunk); ``gdn_kernel=True``: fla's chunk kernel, which
    saves its inputs, the per-chunk ``A`` matrix and the output."""
    H, a, p, K = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                  cfg.linear_conv_kernel_dim)
    Hk = cfg.linear_num_key_heads
    conv = cfg.linear_conv_dim
    rows, seq, act, cp, C = w.rows, w.seq, w.act_bytes, w.cp, w.gdn_chunk
    n = w.tokens
    S = rows * math.ceil(seq / C) * C  # padded tokens
    j = math.ceil(seq / C)
    pe = p + (a if cp > 1 else 0)
    # projections, conv, gates, gated norm, output projection input (activation dtype); the conv saves its input
    # (the projection's output) and the K - 1 halo rows, not a padded copy
    pre = (n * conv + rows * (K - 1) * conv * (cp > 1) + n * conv + 3 * n * H + n * H) * act  # saved before the core
    # gated norm (its own backward: saves its inputs o and z and the rsqrt) and the output projection's input
    rest = pre + (2 * n * H * p + n * H * p) * act + n * H * 4
    if w.gdn_kernel:
        core = n * H * (2 * a + pe + 2) * act + n * H * C * 4 + n * H * pe * act
        widest = n * H * C * 4
        return MixerSaved(core=core, rest=rest, widest=widest, kept=n * cfg.linear_value_dim * act)
    f32 = 4
    # q, k per key head (the core expands them inside), v, g, β per value head; one fp32 state per chunk
    core = n * (2 * Hk * a + H * (pe + 2)) * act + rows * H * j * a * pe * f32
    widest = S * H * C * f32
    # at the core's backward the MoE, output projection and gated norm have run their backward: alive are the core's
    # saved inputs and states, what was saved before it (conv, gates), the input norm's input, output and rsqrt, the
    # gradient of the norm's gate z, and the core backward's own working set
    mixer_backward = (core + pre + (2 * n * cfg.hidden_size + n * cfg.linear_value_dim) * act + n * 4
                      + gdn_backward_working(cfg, rows, seq, act, cp, C))
    return MixerSaved(core=core, rest=rest, widest=widest, kept=core, mixer_backward=mixer_backward)


def gdn_cp_exchange(cfg: ModelConfig, w: Workload) -> CPExchange:
    a, p, H = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    st = w.rows * H * a * (p + a) * 4 * (w.cp - 1)  # each rank's fp32 chunk-boundary state and state response
    return CPExchange(collective="all-gather GDN states", bytes=st, calls=3, recompute_calls=3)
