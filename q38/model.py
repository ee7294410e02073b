"""The composed model: parameter tree, init, forward (hidden states, router logits, MTP hiddens), logits, counts."""

import functools
import re
from typing import Any, Callable

import attrs
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from q38.model_config import ModelConfig
from q38.kernels import DEFAULT_KERNELS, KernelConfig
from q38.layers.block import abstract_layer, layer_apply
from q38.layers.common import ParamInfo, materialize
from q38.layers.context import SeqInfo, seq_info
from q38.layers.kinds import MIXER_KINDS, MTP_LAYER_TYPE
from q38.layers.moe import ExpertDispatch
from q38.layers.norm import rms_norm
from q38.pytree import named_leaves, pytree_node, tree_map_with_path


@pytree_node
@attrs.frozen
class MTPParams:
    """Multi-token prediction block (docs/model.md#multi-token-prediction-mtp): shared fc and norms, one decoder layer
    per depth, or one layer for every depth (``ModelConfig.mtp_shared_layer``)."""

    norm_emb: Tensor  # [d] pre_fc_norm_embedding
    norm_hidden: Tensor  # [d] pre_fc_norm_hidden
    fc: Tensor  # [d, 2d]: columns [0:d] take the embedding, [d:2d] the hidden state
    layers: list  # list[LayerParams], full attention + MoE, one per depth (one in all when shared)
    norm: Tensor  # [d]


@pytree_node
@attrs.frozen
class ModelParams:
    embed: Tensor  # [v, d]
    layers: list  # list[LayerParams]
    final_norm: Tensor  # [d]
    lm_head: Tensor | None  # [v, d]; None when tied to the embedding
    mtp: MTPParams | None


@attrs.frozen
class ModelOutput:
    """``hidden``: post-final-norm states; ``router_logits``: one ``[n, e]`` per MoE layer (main layers, then MTP
    depths); ``mtp_hidden``: post-``mtp.norm`` states of each depth (its logits predict token ``t + 1 + depth``)."""

    hidden: Float[Tensor, "b s d"]
    router_logits: tuple[Tensor, ...]
    mtp_hidden: tuple[Tensor, ...]


@attrs.frozen
class LayerHooks:
    """How the step runs the model; every hook is the identity on one device.

    ``gather``: param subtree → compute form (FSDP all-gather); ``wrap_layer(fn, params, x, on_forward,
    on_recompute)``: wraps each layer call (activation checkpointing / offload), calling ``on_forward()`` /
    ``on_recompute()`` (when not None) as the layer's checkpointed forward / its recompute in backward begins;
    ``dispatch``: EP token dispatch; ``info``: per-token sequence facts (CP-aware); ``prefetch(tree, when)``: start
    gathering a layer's params early (FSDP overlap, ``MeshRuntime.prefetch``).
    """

    gather: Callable[[Any], Any] = lambda p: p
    wrap_layer: Callable[..., Any] | None = None
    dispatch: ExpertDispatch | None = None
    prefetch: Callable[..., None] | None = None


def abstract_params(cfg: ModelConfig) -> ModelParams:
    d, v, std = cfg.hidden_size, cfg.vocab_size, cfg.initializer_range
    mtp = None
    if cfg.mtp_num_layers > 0:
        mtp = MTPParams(
            norm_emb=ParamInfo((d,), "zeros", axes=("norm",)),
            norm_hidden=ParamInfo((d,), "zeros", axes=("norm",)),
            fc=ParamInfo((d, 2 * d), std=std, axes=("mtp_out", "mtp_in")),
            layers=[abstract_layer(cfg, MTP_LAYER_TYPE) for _ in range(cfg.mtp_layers_stored)],
            norm=ParamInfo((d,), "zeros", axes=("norm",)),
        )
    return ModelParams(
        embed=ParamInfo((v, d), std=std, axes=("vocab", "embed")),
        layers=[abstract_layer(cfg, t) for t in cfg.layer_types],
        final_norm=ParamInfo((d,), "zeros", axes=("norm",)),
        lm_head=None if cfg.tie_word_embeddings else ParamInfo((v, d), std=std, axes=("vocab", "embed")),
        mtp=mtp,
    )


def is_param_info(x: Any) -> bool:
    return isinstance(x, ParamInfo)


def generic_path(path: str) -> str:
    """``layers.3.mixer.w_q`` → ``layers.*.mixer.w_q``: a parameter's kind, whatever its layer index."""
    return re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", path)


@functools.lru_cache(maxsize=1)
def declared_params() -> dict[str, ParamInfo]:
    """Every kind of parameter the layers declare, keyed by :func:`generic_path`: its logical axes and FSDP dim
    (shapes are those of a small model with one layer of every kind of the table, MTP and an untied head; only the
    axes are used). This is how a layout places tensors that carry no ``ParamInfo`` (e.g. a live parameter tree)."""
    cfg = attrs.evolve(ModelConfig.preset("tiny"), tie_word_embeddings=False, mtp_num_layers=1,
                       num_hidden_layers=len(MIXER_KINDS), layer_types=tuple(MIXER_KINDS))
    leaves = named_leaves(abstract_params(cfg), is_leaf=is_param_info)
    return {generic_path(p): info for p, info in leaves}


def declared_info(path: str) -> ParamInfo:
    """The declaration of the parameter at dotted ``path`` (any layer index); a LoRA node's leaves are declared by
    ``q38.lora.declared_info``."""
    info = declared_params().get(generic_path(path))
    if info is None:
        raise KeyError(
            f"no layer declares a parameter {path!r} (known kinds: {', '.join(declared_params())}); "
            "declare it with a ParamInfo in its layer's abstract_* function"
        )
    return info


def init_params(config: ModelConfig, *, seed: int = 0, device=None, dtype=None) -> ModelParams:
    """Initialise every parameter; each value depends only on ``seed`` and the parameter's path."""
    return tree_map_with_path(
        lambda path, info: materialize(info, path, seed=seed, device=device, dtype=dtype),
        abstract_params(config),
        is_leaf=is_param_info,
    )


def head_weight(params: ModelParams) -> Tensor:
    return params.embed if params.lm_head is None else params.lm_head


def shift_tokens(
    x: Int[Tensor, "b s"], doc_ids: Int[Tensor, "b s"] | None, shift: int, fill: int
) -> Int[Tensor, "b s"]:
    """``out[t] = x[t + shift]`` when that position is in the same document as ``t``, else ``fill``."""
    if shift == 0:
        return x
    b, s = x.shape
    out = torch.full_like(x, fill)
    if shift >= s:
        return out
    src = x[:, shift:]
    keep = torch.ones_like(src, dtype=torch.bool)
    if doc_ids is not None:
        keep = doc_ids[:, shift:] == doc_ids[:, :-shift]
    out[:, :-shift] = torch.where(keep, src, torch.full_like(src, fill))
    return out


def _run_layer(hooks: LayerHooks, p, x, cfg, info, router_bias=None, recomputed_next=None, kind=None, replay=None):
    """One layer through the hooks. ``recomputed_next``: the params of the layer backward recomputes after this
    one (the one before it in forward; None for the first layer). ``kind``: its ``layer_types`` entry. ``replay``:
    its tokens' experts ``[n, k]`` (routing replay) or None."""
    apply = info.kernels.fn("block")(layer_apply)  # kernels.block: the layer eager or compiled
    fn = lambda p_, x_: apply(hooks.gather(p_), x_, cfg, info, hooks.dispatch, router_bias, kind, replay)  # noqa: E731
    if hooks.wrap_layer is None:
        return fn(p, x)
    if hooks.prefetch is None:
        return hooks.wrap_layer(fn, p, x, None, None)
    return hooks.wrap_layer(fn, p, x, *_checkpoint_prefetches(hooks.prefetch, p, recomputed_next))


def _checkpoint_prefetches(prefetch: Callable[..., None], p, recomputed_next) -> tuple[Callable, Callable]:
    """What a checkpointed layer's forward and recompute start as they begin, outside the checkpoint's op recording:
    in backward, the gathers of the layer recomputed next (so they overlap this layer's recompute and backward).
    Selective recompute matches the recompute's ops one by one against the forward's, so each gather must be
    consumed from a prefetch in both runs or in neither: the layer's own gathers not already prefetched (forward:
    the first layer; backward: the first layer it reaches) are started here too, just in time."""

    def on_forward() -> None:
        prefetch(p, "now")

    def on_recompute() -> None:
        prefetch(p, "now")
        if recomputed_next is not None:
            prefetch(recomputed_next, "behind")

    return on_forward, on_recompute


def mtp_layer_index(config: ModelConfig, depth: int) -> int:
    """The MTP layer that runs at ``depth`` (1-based): layer 0 at every depth when shared, else layer ``depth - 1``."""
    return 0 if config.mtp_shared_layer else depth - 1


def forward(
    params: ModelParams,
    input_ids: Int[Tensor, "b s"],
    config: ModelConfig,
    *,
    doc_ids: Int[Tensor, "b s"] | None = None,
    mtp_input_ids: tuple[Tensor, ...] | None = None,
    info: SeqInfo | None = None,
    hooks: LayerHooks | None = None,
    router_bias: Float[Tensor, "l e"] | None = None,
    routes: Int[Tensor, "b s l k"] | None = None,
) -> ModelOutput:
    """Run the decoder stack and the MTP block.

    ``doc_ids`` marks packed documents (attention, conv and GDN state never cross them; RoPE restarts).
    ``mtp_input_ids[d-1]`` is the input of depth ``d`` (tokens shifted left by ``d`` within each document); it is
    derived from ``input_ids`` when not given (context parallel passes it, shifted before the split).
    ``router_bias[i]`` is the expert-selection bias of MoE layer ``i`` (main layers, then MTP depths), for
    aux-loss-free balancing; None routes by the plain top-k. ``routes[:, :, i]``: routing replay, the experts of
    every token in main layer ``i`` (-1: the router's own top-k), used instead of the router's choice (the gates
    still from the router; the MTP depths route by their own top-k).
    """
    hooks = hooks or LayerHooks()
    b, s = input_ids.shape
    if routes is not None and tuple(routes.shape) != (b, s, config.num_hidden_layers, config.num_experts_per_tok):
        raise ValueError(f"routes {tuple(routes.shape)} must be [batch, seq, main layers, top-k] = "
                         f"{(b, s, config.num_hidden_layers, config.num_experts_per_tok)}")
    info = info or seq_info(doc_ids, b, s, input_ids.device)
    embed = hooks.gather(params.embed)
    x = F.embedding(input_ids, embed)
    router_logits = []
    upcoming = list(params.layers[1:]) + ([params.mtp] if params.mtp is not None else [])
    for i, lp in enumerate(params.layers):
        if hooks.prefetch is not None and torch.is_grad_enabled() and i < len(upcoming):
            hooks.prefetch(upcoming[i])
        replay = None if routes is None else routes[:, :, i].reshape(-1, routes.shape[-1]).long()
        x, rl = _run_layer(hooks, lp, x, config, info, None if router_bias is None else router_bias[i],
                           params.layers[i - 1] if i > 0 else None, config.layer_types[i], replay)
        router_logits.append(rl)
    hidden = rms_norm(x, hooks.gather(params.final_norm), config.rms_norm_eps)

    mtp_hidden = []
    if params.mtp is not None:

        def mtp_embedding(depth: int) -> Tensor:
            ids_d = (
                mtp_input_ids[depth - 1]
                if mtp_input_ids is not None
                else shift_tokens(input_ids, info.doc_ids if info.packed else None, depth, fill=0)
            )
            return F.embedding(ids_d, embed)

        mtp_hidden = _mtp_block(params, hidden, config, info, hooks, router_bias, mtp_embedding, router_logits)
    return ModelOutput(hidden=hidden, router_logits=tuple(router_logits), mtp_hidden=tuple(mtp_hidden))


def _mtp_block(params: ModelParams, hidden: Tensor, config: ModelConfig, info: SeqInfo, hooks: LayerHooks,
               router_bias: Tensor | None, mtp_embedding: Callable[[int], Tensor], router_logits: list,
               before_first=None) -> list[Tensor]:
    """The MTP depths after the main stack's ``hidden``: depth ``d`` takes ``mtp_embedding(d)`` (the embedding of
    its input tokens) and the previous depth's state; appends each depth's router logits to ``router_logits`` and
    returns the post-norm states. ``before_first``: the layer backward recomputes after depth 1 (default the last
    main layer)."""
    mp = params.mtp
    norm_emb, norm_hidden, fc, norm = hooks.gather((mp.norm_emb, mp.norm_hidden, mp.fc, mp.norm))
    h_prev = hidden
    out = []
    num_layers = config.num_hidden_layers
    for depth in range(1, config.mtp_num_layers + 1):
        lp = mp.layers[mtp_layer_index(config, depth)]
        e = mtp_embedding(depth)
        h = F.linear(
            torch.cat([rms_norm(e, norm_emb, config.rms_norm_eps), rms_norm(h_prev, norm_hidden, config.rms_norm_eps)], -1),
            fc,
        )
        bias = None if router_bias is None else router_bias[num_layers + depth - 1]
        # backward recomputes it next
        if depth > 1:
            before = mp.layers[mtp_layer_index(config, depth - 1)]
        else:
            before = params.layers[-1] if before_first is None else before_first
        h, rl = _run_layer(hooks, lp, h, config, info, bias, before, MTP_LAYER_TYPE)
        router_logits.append(rl)
        h_prev = rms_norm(h, norm, config.rms_norm_eps)
        out.append(h_prev)
    return out


@attrs.frozen
class ChunkOutput:
    """What one pipeline chunk computed: ``x`` (the residual stream after its last layer; for the last chunk the
    post-final-norm ``hidden``), ``mtp_embeds`` (the MTP depths' input embeddings, made by the first chunk and
    carried to the last), ``router_logits`` (its layers', then the MTP depths' on the last chunk), ``mtp_hidden``."""

    x: Tensor
    mtp_embeds: tuple[Tensor, ...]
    router_logits: tuple[Tensor, ...]
    mtp_hidden: tuple[Tensor, ...] = ()


def forward_chunk(
    params: ModelParams,
    layers: range,
    config: ModelConfig,
    *,
    input_ids: Tensor | None = None,
    mtp_input_ids: tuple[Tensor, ...] | None = None,
    x: Tensor | None = None,
    mtp_embeds: tuple[Tensor, ...] = (),
    info: SeqInfo,
    hooks: LayerHooks,
    router_bias: Tensor | None = None,
) -> ChunkOutput:
    """Layers ``layers`` of the stack (a pipeline stage chunk), the same ops as :func:`forward` on them: the first
    chunk (``layers.start == 0``) embeds ``input_ids`` and the MTP inputs ``mtp_input_ids``; the others continue from
    ``x`` and carry ``mtp_embeds``; the last (``layers.stop == num_hidden_layers``) applies the final norm and the MTP
    block. ``params`` needs only the leaves of these layers (and the embedding / head side they own)."""
    first, last = layers.start == 0, layers.stop == config.num_hidden_layers
    if first:
        embed = hooks.gather(params.embed)
        x = F.embedding(input_ids, embed)
        mtp_embeds = tuple(F.embedding(mtp_input_ids[d], embed) for d in range(config.mtp_num_layers))
    router_logits = []
    for i in layers:
        if hooks.prefetch is not None and torch.is_grad_enabled():
            nxt = params.layers[i + 1] if i + 1 < layers.stop else (params.mtp if last else None)
            if nxt is not None:
                hooks.prefetch(nxt)
        x, rl = _run_layer(hooks, params.layers[i], x, config, info, None if router_bias is None else router_bias[i],
                           params.layers[i - 1] if i > layers.start else None, config.layer_types[i])
        router_logits.append(rl)
    if not last:
        return ChunkOutput(x, tuple(mtp_embeds), tuple(router_logits))
    hidden = rms_norm(x, hooks.gather(params.final_norm), config.rms_norm_eps)
    mtp_hidden = []
    if params.mtp is not None:
        mtp_hidden = _mtp_block(params, hidden, config, info, hooks, router_bias, lambda d: mtp_embeds[d - 1],
                                router_logits, before_first=params.layers[layers.stop - 1])
    return ChunkOutput(hidden, (), tuple(router_logits), tuple(mtp_hidden))


def logits(
    params: ModelParams,
    input_ids: Int[Tensor, "b s"],
    config: ModelConfig,
    *,
    doc_ids: Int[Tensor, "b s"] | None = None,
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> Float[Tensor, "b s v"]:
    """Full ``[b, s, v]`` logits of the main head (evaluation and parity; training uses the chunked loss), the layers
    running ``kernels`` (resolved)."""
    b, s = input_ids.shape
    info = seq_info(doc_ids, b, s, input_ids.device, kernels=kernels)
    out = forward(params, input_ids, config, doc_ids=doc_ids, info=info)
    return F.linear(out.hidden, head_weight(params))


@attrs.frozen
class ParamCount:
    total: int
    active: int
    mtp_total: int
    mtp_active: int

    @property
    def total_with_mtp(self) -> int:
        return self.total + self.mtp_total


def count_params(config: ModelConfig) -> ParamCount:
    """Total and per-token active parameter counts, summed over the declared shapes (``abstract_params``;
    docs/model.md#parameter-counts); ``mtp_*``: the ``mtp.*`` leaves.

    Active counts every weight but the routed experts a token does not use: a weight whose first logical axis is
    ``expert`` holds ``num_experts`` experts, ``num_experts_per_tok`` of which serve a token.
    """
    e, k = config.num_experts, config.num_experts_per_tok
    total = {False: 0, True: 0}  # by "is an MTP leaf"
    active = {False: 0, True: 0}
    for path, info in named_leaves(abstract_params(config), is_leaf=is_param_info):
        if info is None:  # the tied head
            continue
        mtp = path.startswith("mtp.")
        total[mtp] += info.numel
        active[mtp] += info.numel // e * k if info.axes[:1] == ("expert",) else info.numel
    return ParamCount(total=total[False], active=active[False], mtp_total=total[True], mtp_active=active[True])


def host_memory_available() -> int | None:
    """Bytes this process may still allocate on the host: the least of the kernel's ``MemAvailable``, the room left
    under the cgroup's ``memory.max`` and under ``RLIMIT_AS`` / ``RLIMIT_DATA``; None where none can be read."""
    import resource

    room: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            room += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            cap = f.read().strip()
        if cap != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                room.append(int(cap) - int(f.read()))
    except (OSError, ValueError):
        pass
    for lim in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        soft = resource.getrlimit(lim)[0]
        if soft != resource.RLIM_INFINITY:
            try:
                with open("/proc/self/status") as f:
                    key = "VmSize:" if lim == resource.RLIMIT_AS else "VmData:"
                    used = next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
                room.append(soft - used)
            except (OSError, ValueError, StopIteration):
                room.append(soft)
    return max(0, min(room)) if room else None


def check_host_memory(config: ModelConfig, *, bytes_per_param: int | float, what: str, fix: str,
                      share: int | float = 1) -> None:
    """Refuse, before anything is allocated, a model whose parameters (``share`` of them: a rank's part) need more
    than ``host_memory_available()`` at ``bytes_per_param`` bytes each: one ``ConfigError`` naming ``what``, the
    parameter count, the bytes and the limit, and ``fix``."""
    from q38.errors import ConfigError

    n = count_params(config).total_with_mtp
    need = int(n * share * bytes_per_param)
    room = host_memory_available()
    if room is not None and need > room:
        raise ConfigError(f"{what}: the model has {n:,} parameters ({need / 2**30:,.1f} GiB at {bytes_per_param:g} "
                          f"bytes each{f', {share:.3g} of them on this process' if share != 1 else ''}), more than "
                          f"the {room / 2**30:,.1f} GiB this process can still allocate; {fix}")
