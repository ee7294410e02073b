"""The decoder layer (pre-norm, two residuals) used by every main layer and by each MTP depth; its token mixer is
the layer's kind (``q38.layers.kinds.MIXER_KINDS``)."""

from typing import Callable, Union

import attrs
import torch
from jaxtyping import Float, Int
from torch import Tensor
from torch.profiler import record_function

from q38.model_config import ModelConfig
from q38.kernels import OPS
from q38.layers.common import ParamInfo, WeightNode
from q38.layers.context import SeqInfo
from q38.layers.kinds import MIXER_KINDS, kind_of
from q38.layers.moe import ExpertDispatch, MoEParams, abstract_moe, moe_apply
from q38.layers.norm import rms_norm
from q38.pytree import pytree_node

MixerParams = Union[tuple(k.params for k in MIXER_KINDS.values())]  # noqa: UP007 (built from the table)


@pytree_node
@attrs.frozen
class LayerParams:
    attn_norm: Tensor  # [d] input_layernorm (zero-centred)
    mixer: MixerParams  # the params of the layer's mixer kind (its layer_types entry)
    mlp_norm: Tensor  # [d] post_attention_layernorm
    moe: MoEParams


def abstract_layer(cfg: ModelConfig, layer_type: str) -> LayerParams:
    d = cfg.hidden_size
    return LayerParams(
        attn_norm=ParamInfo((d,), "zeros", axes=("norm",)),
        mixer=MIXER_KINDS[layer_type].abstract(cfg),
        mlp_norm=ParamInfo((d,), "zeros", axes=("norm",)),
        moe=abstract_moe(cfg),
    )


def layer_apply(
    p: LayerParams,
    x: Float[Tensor, "b s d"],
    cfg: ModelConfig,
    info: SeqInfo,
    dispatch: ExpertDispatch | None = None,
    router_bias: Float[Tensor, " e"] | None = None,
    kind: str | None = None,
    replay: Int[Tensor, "n k"] | None = None,
) -> tuple[Float[Tensor, "b s d"], Float[Tensor, "n e"]]:
    """``x + mixer(norm(x))``, then ``x + moe(norm(x))``; returns the router logits too. ``router_bias``: the MoE
    layer's expert-selection bias (aux-loss-free balancing), or None. ``kind``: the layer's ``layer_types`` entry
    (the model passes it; None: the one kind whose params class ``p.mixer`` is, ``kind_of``). ``replay``: the
    tokens' experts to use instead of the router's top-k (``moe_apply``'s routing replay), or None."""
    h = rms_norm(x, p.attn_norm, cfg.rms_norm_eps)
    kind = kind_of(p.mixer) if kind is None else MIXER_KINDS[kind]
    with record_function(f"q38.{kind.name}"):  # phase names in a profiler trace (run.profile)
        x = x + kind.apply(p.mixer, h, cfg, info)
    with record_function("q38.moe"):
        y, router_logits = moe_apply(p.moe, rms_norm(x, p.mlp_norm, cfg.rms_norm_eps), cfg, dispatch, router_bias,
                                     info.kernels, replay)
    return x + y, router_logits


def eager_block(apply: Callable) -> Callable:
    """``kernels.block: eager``: the layer's apply function as it is (its ops run one by one)."""
    return apply


# apply function -> its compiled wrapper (``compiled_block``): one torch.compile per function, shared by every layer
_COMPILED: dict[Callable, Callable] = {}


def compiled_block(apply: Callable) -> Callable:
    """``kernels.block: compiled``: ``apply`` (``layer_apply``'s signature) under ``torch.compile(fullgraph=True)``,
    regional: one graph per layer kind, reused by every layer of that kind (a new kind or shape recompiles). One
    device without expert parallelism: the CP exchanges and the EP dispatch run collectives the graph cannot hold,
    so a layer with either raises. Every kernel the step resolved is loaded before the compiled call, so the trace
    never imports one."""
    run = _COMPILED.get(apply)
    if run is None:
        compiled = torch.compile(apply, fullgraph=True)

        def run(p, x, cfg, info, dispatch=None, router_bias=None, kind=None, replay=None):
            if replay is not None:
                raise NotImplementedError("kernels.block: compiled with routing replay (rl.routing_replay) is not "
                                          "implemented yet; set kernels.block: eager")
            if dispatch is not None or not info.comm.is_local:
                raise NotImplementedError("kernels.block: compiled runs on one device without expert parallelism "
                                          "(no cp / ep mesh dims) for now; set kernels.block: eager")
            if any(isinstance(w, WeightNode) for w in (*attrs.astuple(p.mixer, recurse=False),
                                                       *attrs.astuple(p.moe, recurse=False))):
                raise NotImplementedError("kernels.block: compiled with a LoRA run or a block-FP8 base (adapters "
                                          "beside their frozen weights) is not implemented yet; set kernels.block: "
                                          "eager")
            for op in OPS:
                info.kernels.fn(op)
            return compiled(p, x, cfg, info, dispatch, router_bias, kind)

        _COMPILED[apply] = run
    return run
