"""Matmul FLOPs of one training step, from the model config alone: the one formula MFU (``q38 train``) and the step
time predictor (``q38 plan``) share.

Every matrix product of the layer math is counted, forward once and backward twice, except where the code does
otherwise (the loss recomputes its logits, the GDN solve's backward, recompute, the aux forward); elementwise ops
are not. ``causal_skip``: the kernel skips the masked upper triangle of causal attention. The rules:
docs/plan.md#flops.
"""

import attrs

from q38.model_config import ModelConfig
from q38.kernels import GDN_CHUNK
from q38.layers.kinds import MixerFlops, MixerKind, Workload, kept_regions, layer_kinds


@attrs.frozen
class StepFlops:
    """FLOPs of one step on one rank's tokens, by term. ``model`` excludes recompute and the extra aux forward
    (the MFU numerator); ``executed`` is what the device runs."""

    dense: float  # projections, shared experts, router, MTP fc, conv (fwd + bwd)
    experts: float  # routed experts (fwd + bwd)
    attention: float  # scores and values (fwd + bwd)
    gdn_core: float  # chunked delta rule (fwd + bwd)
    head: float  # LM head, main + MTP depths (fwd + bwd, chunked loss recompute included)
    recompute: float  # extra forward of recomputed layers
    aux_forward: float  # extra no-grad forward for the global-batch aux loss
    tokens: int
    # ``recompute`` and ``aux_forward`` by term (``dense``, ``experts``, ``attention``, ``gdn_core``): what each op's
    # kernel runs beyond the model FLOPs (q38 plan prices every op at its own kernel's efficiency)
    recompute_terms: dict = attrs.field(factory=dict, eq=False)
    aux_terms: dict = attrs.field(factory=dict, eq=False)

    @property
    def model(self) -> float:
        return self.dense + self.experts + self.attention + self.gdn_core + self.head

    @property
    def executed(self) -> float:
        return self.model + self.recompute + self.aux_forward

    def executed_term(self, term: str) -> float:
        """Executed FLOPs of one term: its model FLOPs, its recompute and its share of the aux forward."""
        return getattr(self, term) + self.recompute_terms.get(term, 0.0) + self.aux_terms.get(term, 0.0)


def _layer_forward(cfg: ModelConfig, kind: MixerKind, w: Workload) -> tuple[dict[str, float], MixerFlops]:
    """Forward matmul FLOPs of one decoder layer at ``w`` (its mixer's, from the kind's formula, then the MoE's),
    by term; and the mixer's own record (recompute region, backward)."""
    d, tokens = cfg.hidden_size, w.tokens
    out = {"dense": 0.0, "experts": 0.0, "attention": 0.0, "gdn_core": 0.0, "solve": 0.0}
    mixer = kind.flops(cfg, w)
    for key, v in mixer.terms.items():
        out[key] += v
    e, k, f, fs = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out["dense"] += 2 * tokens * d * e + 2 * tokens * (3 * d * fs) + 2 * tokens * d
    out["experts"] += 2 * tokens * k * 3 * d * f
    return out, mixer


def step_flops(cfg: ModelConfig, rows: int, seq: int, *, cp: int = 1, recompute: str = "none",
               micro_batches: int = 1, aux_global: bool = False, causal_skip: bool = True,
               valid_targets: tuple[float, ...] | None = None, gdn_chunk: int = GDN_CHUNK) -> StepFlops:
    """FLOPs of one step over ``rows`` rows of ``seq`` local tokens (this rank's share of the step, all
    micro-batches together). ``recompute``: a mode of ``q38.layers.kinds.recompute_modes()`` (the
    regions a ``selective_…`` mode keeps are not recomputed). ``valid_targets``: rows' valid targets per depth (main,
    MTP 1, ...); default every token minus the shifted-out tail of each row (unpacked rows, CP rank-agnostic).
    ``gdn_chunk``: the torch GDN core's chunk length (``kernels.gdn_chunk_size``); MFU's model FLOPs
    (``train_flops_per_token``) take the accelerator one, ``GDN_CHUNK``, whatever the run uses."""
    tokens = rows * seq
    w = Workload(rows=rows, seq=seq, cp=cp, causal_skip=causal_skip, gdn_chunk=gdn_chunk)
    kinds = layer_kinds(cfg)
    fwd = {"dense": 0.0, "experts": 0.0, "attention": 0.0, "gdn_core": 0.0, "solve": 0.0}
    recomputed = 0.0
    rec = {"dense": 0.0, "experts": 0.0, "attention": 0.0, "gdn_core": 0.0}
    keep = kept_regions(recompute)
    for kind in kinds:
        lf, mixer = _layer_forward(cfg, kind, w)
        if mixer.backward is not None:
            # a kernel whose backward rebuilds its factors instead of saving them (q38's GDN core): what it executes
            # beyond the model's 2 × forward is counted like activation recompute
            extra = mixer.backward - 2 * sum(lf[key] for key in mixer.kernel)
            recomputed += extra
            rec[_TERM[mixer.kernel[0]]] += extra
        for key, v in lf.items():
            fwd[key] += v
        if recompute != "none":
            kept = sum(lf[key] for key in mixer.kernel) if kind.region in keep else 0.0
            recomputed += sum(lf.values()) - kept
            for key, v in lf.items():
                if not (kind.region in keep and key in mixer.kernel):
                    rec[_TERM[key]] += v
    d, v = cfg.hidden_size, cfg.vocab_size
    fwd["dense"] += cfg.mtp_num_layers * 2 * tokens * 2 * d * d  # MTP fc
    if valid_targets is None:
        full_seq = seq * cp
        valid_targets = tuple(tokens * max(full_seq - 1 - depth, 0) / full_seq
                              for depth in range(cfg.mtp_num_layers + 1))
    head_fwd = sum(2 * n * d * v for n in valid_targets)
    model_fwd_no_head = fwd["dense"] + fwd["experts"] + fwd["attention"] + fwd["gdn_core"] + fwd["solve"]
    aux = aux_global and micro_batches > 1
    aux_terms = {t: 0.0 for t in rec}
    if aux:
        for key, v in fwd.items():
            aux_terms[_TERM[key]] += v
    return StepFlops(
        dense=3 * fwd["dense"],
        experts=3 * fwd["experts"],
        attention=3 * fwd["attention"],
        gdn_core=3 * (fwd["gdn_core"] + fwd["solve"]),
        head=4 * head_fwd,
        recompute=recomputed,
        aux_forward=model_fwd_no_head if aux else 0.0,
        tokens=tokens,
        recompute_terms=rec,
        aux_terms=aux_terms,
    )


_TERM = {"dense": "dense", "experts": "experts", "attention": "attention", "gdn_core": "gdn_core", "solve": "gdn_core"}


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per token of one training step (MFU's numerator / tokens): :func:`step_flops` of one row."""
    return step_flops(cfg, 1, seq_len).model / seq_len
