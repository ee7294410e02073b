"""``TrainState``: parameters, AdamW moments and the step count, with the static configs as pytree metadata."""

import fnmatch
import math

import attrs
import torch
import torch.utils._pytree as pytree
from torch import Tensor

from q38.model_config import ConfigError, ModelConfig
from q38.kernels import DEFAULT_KERNELS, KernelConfig
from q38.lora import PeftConfig, trainable_mask, trainable_tree
from q38.model import ModelParams, init_params
from q38.pytree import named_leaves
from q38.train.core.step_config import TrainConfig


class DonatedStateError(RuntimeError):
    """A donated ``TrainState`` was used again (``TrainState.check_not_donated``)."""


@attrs.frozen
class TrainState:
    """Leaves: ``params``, ``exp_avg``, ``exp_avg_sq`` (fp32, same tree as params) and ``step`` (0-dim int64).
    ``model_config`` / ``train_config`` / ``kernels`` ride along as static metadata (the pytree context), never as
    leaves; ``kernels`` is the run's resolved ``KernelConfig`` (what the step's layers and loss run: a run setting,
    so the same state trains under any kernels).
    ``router_bias``: ``[moe layers, e]`` fp32 expert-selection bias of aux-loss-free balancing (``aux_loss_free``),
    else None; train state, not a parameter (no gradient, replicated and identical on every rank, checkpointed).
    ``master_remainder``: with ``train.master_dtype: bfloat16_remainder`` (``q38.remainder``), the int16 low halves
    of the fp32 masters, a tree like ``params`` (same placements) with None where a leaf keeps an fp32 master (the
    ``fp32_params`` leaves); ``params`` then holds the bf16 high halves of those leaves (the compute weights). None
    (no tree) with fp32 masters.
    ``host_master``: with ``train.offload_optimizer: true`` (``q38.offload``), the fp32 masters on the host
    (``device="cpu"``), a tree like ``params`` (same placements) with None where a leaf keeps its fp32 master on the
    device (the ``fp32_params`` leaves); ``params`` then holds those leaves' compute copies (``master.to(param_dtype)``)
    on the run's device, and their moments live on the host too. None (no tree) otherwise.
    ``peft``: the LoRA setting of a LoRA run (``q38.lora``), else None. Then ``params`` holds adapted nodes (a frozen
    base in the compute dtype plus fp32 adapter matrices) and the moments exist only for the adapter matrices (the
    frozen leaves are None in ``exp_avg`` / ``exp_avg_sq``): the leaves that train are the leaves that have
    moments (``trainable``).

    A state given to ``train_step(..., donate=True)`` is *donated*: that step updates its buffers in place and
    returns the next state over them; reading ``params`` / ``exp_avg`` / ``exp_avg_sq`` of the donated state (as
    ``train_step``, a checkpoint save or a tree map do) raises ``DonatedStateError`` (``donated``)."""

    _params: ModelParams = attrs.field(alias="params")
    _exp_avg: ModelParams = attrs.field(alias="exp_avg")
    _exp_avg_sq: ModelParams = attrs.field(alias="exp_avg_sq")
    step: Tensor
    model_config: ModelConfig
    train_config: TrainConfig
    router_bias: Tensor | None = None
    kernels: KernelConfig = attrs.field(default=DEFAULT_KERNELS, kw_only=True)
    peft: PeftConfig | None = attrs.field(default=None, kw_only=True)
    _master_remainder: ModelParams | None = attrs.field(default=None, kw_only=True, alias="master_remainder")
    _host_master: ModelParams | None = attrs.field(default=None, kw_only=True, alias="host_master")
    # [step number] once donated (a box of its own per instance: evolve and unflatten start undonated)
    _donation: list = attrs.field(factory=list, init=False, eq=False, repr=False, hash=False)

    @property
    def params(self) -> ModelParams:
        """The parameters (a LoRA run's: adapted nodes); refused on a donated state."""
        self.check_not_donated("params")
        return self._params

    @property
    def exp_avg(self) -> ModelParams:
        """AdamW first moments (same tree as ``params``; None at frozen leaves); refused on a donated state."""
        self.check_not_donated("exp_avg")
        return self._exp_avg

    @property
    def exp_avg_sq(self) -> ModelParams:
        """AdamW second moments; refused on a donated state."""
        self.check_not_donated("exp_avg_sq")
        return self._exp_avg_sq

    @property
    def master_remainder(self) -> ModelParams | None:
        """The int16 remainders of bf16 + remainder masters (None: fp32 masters); refused on a donated state."""
        self.check_not_donated("master_remainder")
        return self._master_remainder

    @property
    def host_master(self) -> ModelParams | None:
        """The fp32 masters kept on the host (offloaded optimizer state; None: masters on the device); refused on a
        donated state."""
        self.check_not_donated("host_master")
        return self._host_master

    def host_masters(self) -> list:
        """Per trained leaf (flatten order of the trained leaves of ``params``): its host fp32 master (offloaded) or
        None (its master is the ``params`` leaf)."""
        if self._host_master is None:
            return [None] * sum(self.trainable())
        hm = dict(named_leaves(self.host_master))
        return [hm.get(n) for (n, _), m in zip(named_leaves(self.params), self.trainable()) if m]

    def masters(self) -> list:
        """Per trained leaf (flatten order of the trained leaves of ``params``): its int16 remainder (a bf16 +
        remainder master) or None (an fp32 master)."""
        if self._master_remainder is None:
            return [None] * sum(self.trainable())
        rem = dict(named_leaves(self.master_remainder))
        return [rem.get(n) for (n, _), m in zip(named_leaves(self.params), self.trainable()) if m]

    @property
    def donated(self) -> bool:
        """Whether this state was given to a donated step (its buffers then belong to the state that step
        returned)."""
        return bool(self._donation)

    def donate(self, step: int) -> None:
        """Mark this state donated to the step that makes ``step`` (``train_step(..., donate=True)`` does this
        before it writes any buffer)."""
        self._donation.append(int(step))

    def check_not_donated(self, what: str = "this state") -> None:
        """Raise ``DonatedStateError`` naming the donation when this state was donated."""
        if self._donation:
            raise DonatedStateError(
                f"cannot use {what} of a TrainState donated to train_step(..., donate=True) (the step to "
                f"{self._donation[0]}): that step updated its buffers in place and they now hold the state it "
                "returned; use the returned state (or pass donate=False to keep the input)")

    def trainable(self) -> list[bool]:
        """Per parameter leaf (flatten order of ``params``): whether it trains (has a master, moments, a gradient)."""
        return trainable_mask(self.params)

    @kernels.validator
    def _resolved(self, attribute, value: KernelConfig) -> None:
        if not value.resolved:
            raise ValueError(f"TrainState.kernels must be resolved (resolve_kernels first), got {value}")


def _flatten(s: TrainState):
    # an absent router bias lives in the context (no None leaf), as pytree_node does for optional fields
    # (and an absent remainder tree too: an fp32-master state flattens as it always did)
    extra = [] if s.router_bias is None else [s.router_bias]
    rem = [] if s.master_remainder is None else [s.master_remainder]
    host = [] if s.host_master is None else [s.host_master]
    return [s.params, s.exp_avg, s.exp_avg_sq, s.step, *extra, *rem, *host], (
        s.model_config, s.train_config, bool(extra), s.kernels, s.peft, bool(rem), bool(host))


def _unflatten(children, ctx):
    bias = children[4] if ctx[2] else None
    rem = children[4 + ctx[2]] if ctx[5] else None
    host = children[4 + ctx[2] + ctx[5]] if ctx[6] else None
    return TrainState(*children[:4], model_config=ctx[0], train_config=ctx[1], router_bias=bias, kernels=ctx[3],
                      peft=ctx[4], master_remainder=rem, host_master=host)


def _flatten_with_keys(s: TrainState):
    children, ctx = _flatten(s)
    names = (("params", "exp_avg", "exp_avg_sq", "step") + ("router_bias",) * ctx[2] + ("master_remainder",) * ctx[5]
             + ("host_master",) * ctx[6])
    return [(pytree.GetAttrKey(n), c) for n, c in zip(names, children)], ctx


pytree.register_pytree_node(
    TrainState, _flatten, _unflatten, serialized_type_name="q38.train.core.state.TrainState",
    flatten_with_keys_fn=_flatten_with_keys,
)


def init_state(model_config: ModelConfig, train_config: TrainConfig, *, seed: int = 0, device=None,
               dtype=None, kernels: KernelConfig = DEFAULT_KERNELS) -> TrainState:
    """Fresh state: parameters from ``init_params`` (seed- and path-determined), zero fp32 moments, step 0, running
    ``kernels`` (resolved)."""
    params = init_params(model_config, seed=seed, device=device, dtype=dtype)
    return state_from_params(params, model_config, train_config, kernels=kernels)


def state_from_params(params: ModelParams, model_config: ModelConfig, train_config: TrainConfig, *,
                      kernels: KernelConfig = DEFAULT_KERNELS, peft: PeftConfig | None = None) -> TrainState:
    """The state of ``params`` at step 0: zero moments (``train.moment_dtype``) for every leaf that trains (all of
    them, or with ``peft`` the adapter matrices of ``params``, built by ``q38.lora.add_adapters``).

    ``train.master_dtype: bfloat16_remainder``: each leaf computed in bf16 is split exactly into its bf16 high half
    (the state's ``params`` leaf) and an int16 remainder (``master_remainder``), leaf by leaf; an fp32 leaf is split
    as it is, a bf16 leaf gets a zero remainder (its value is the master).

    ``train.offload_optimizer: true``: each leaf computed in ``param_dtype`` keeps an fp32 copy on the host
    (``host_master``), its moments are made there, and its ``params`` leaf becomes ``master.to(param_dtype)`` on the
    leaf's device (``offload_form``)."""
    if train_config.master_dtype == "bfloat16_remainder" and peft is not None:
        raise ConfigError(LORA_REFUSAL)
    if train_config.offload_optimizer and peft is not None:
        raise ConfigError(OFFLOAD_LORA_REFUSAL)
    params, remainder = remainder_form(params, train_config)
    params, host = offload_form(params, train_config)
    if train_config.moment_dtype == "int8":  # 8-bit block-wise moments (q38.qmoment)
        from q38.qmoment import zeros_like

        first, second = (lambda p: zeros_like(p, True)), (lambda p: zeros_like(p, False))
    else:
        dtype = getattr(torch, train_config.moment_dtype)  # fp32, or bf16 moments (train.moment_dtype)
        first = second = lambda p: torch.zeros_like(p, dtype=dtype)  # noqa: E731
    # moments made like each leaf's master: on the host for an offloaded leaf
    like = params if host is None else _with_host_masters(params, host)
    return TrainState(
        params=params,
        exp_avg=trainable_tree(like, first),
        exp_avg_sq=trainable_tree(like, second),
        step=torch.zeros((), dtype=torch.int64),
        model_config=model_config,
        train_config=train_config,
        router_bias=initial_router_bias(model_config, train_config, params),
        kernels=kernels,
        peft=peft,
        master_remainder=remainder,
        host_master=host,
    )


OFFLOAD_LORA_REFUSAL = ("train.offload_optimizer: true with a peft section: a LoRA run trains only its fp32 adapters "
                        "(a small state) and keeps no master of the base; set train.offload_optimizer: false")


def _with_host_masters(params: ModelParams, host: ModelParams) -> ModelParams:
    from q38.pytree import tree_map_with_path

    hm = {n: t for n, t in named_leaves(host) if t is not None}
    return tree_map_with_path(lambda path, t: hm.get(path, t), params)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _wrap(like, t):
    """``t`` (a local shard) placed like ``like`` (a DTensor), or ``t`` itself when ``like`` is a plain tensor."""
    if not hasattr(like, "to_local"):
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def offload_form(params: ModelParams, train_config: TrainConfig) -> tuple[ModelParams, ModelParams | None]:
    """``(params, host masters)``: with ``offload_optimizer``, every leaf computed in ``param_dtype``
    (``q38.offload.is_offload_path``) copied to the host in fp32 (its master; DTensors shard by shard, placements
    kept) and cast to ``param_dtype`` where it is (its compute copy), the other leaves as they are and None in the
    host tree; otherwise ``(params, None)``."""
    if not train_config.offload_optimizer:
        return params, None
    from q38.offload import HOST, is_offload_path
    from q38.pytree import tree_map_with_path

    masters = {}

    def compute(path, t):
        if not is_offload_path(path, train_config) or not t.is_floating_point():
            return t
        x = _local(t)
        if x.device.type != "meta":
            masters[path] = _wrap(t, x.detach().to(HOST, torch.float32, copy=True))
        else:  # an abstract state (a checkpoint template built on meta): the master abstract too
            masters[path] = _wrap(t, torch.empty(x.shape, dtype=torch.float32, device="meta"))
        return _wrap(t, x.detach().to(train_config.torch_param_dtype))  # round to nearest even, where the leaf is

    new = tree_map_with_path(compute, params)
    return new, tree_map_with_path(lambda path, t: masters.get(path), params)


LORA_REFUSAL = ("train.master_dtype: bfloat16_remainder with a peft section: a LoRA run trains only its fp32 adapters "
                "(a small state) and keeps no master of the base; set train.master_dtype: float32")


def remainder_form(params: ModelParams, train_config: TrainConfig) -> tuple[ModelParams, ModelParams | None]:
    """``(params, remainders)``: with ``master_dtype: bfloat16_remainder``, every leaf computed in bf16 split into
    its bf16 high half and int16 remainder (``q38.remainder``; DTensors split shard by shard, placements kept), the
    other leaves as they are and None in the remainder tree; otherwise ``(params, None)``."""
    if train_config.master_dtype != "bfloat16_remainder":
        return params, None
    from q38 import remainder as rm
    from q38.pytree import tree_map_with_path

    halves = {}

    def high(path, t):
        if not rm.is_remainder_path(path, train_config) or not t.is_floating_point():
            return t
        x = _local(t)
        if x.dtype == torch.bfloat16:  # already bf16: the value is the master, its remainder zero
            h, r = x, torch.zeros(x.shape, dtype=torch.int16, device=x.device)
        else:
            h, r = rm.split(x.to(torch.float32))
        halves[path] = _wrap(t, r)
        return _wrap(t, h)

    new = tree_map_with_path(high, params)
    return new, tree_map_with_path(lambda path, t: halves.get(path), params)


def initial_router_bias(model_config: ModelConfig, train_config: TrainConfig, params) -> Tensor | None:
    """Zeros ``[moe layers, e]`` (main layers, then MTP depths) when ``aux_loss_free``, else None."""
    if not train_config.aux_loss_free:
        return None
    n = model_config.num_hidden_layers + model_config.mtp_num_layers
    device = params.embed.device
    if device.type == "meta":
        device = None
    return torch.zeros(n, model_config.num_experts, dtype=torch.float32, device=device)


def decay_mask(params: ModelParams, train_config: TrainConfig) -> list[bool]:
    """Per trainable leaf (flatten order): whether weight decay applies (not to paths matching ``no_decay``
    patterns)."""
    return [
        not any(fnmatch.fnmatchcase(name, pat) for pat in train_config.no_decay)
        for (name, _), trains in zip(named_leaves(params), trainable_mask(params)) if trains
    ]


def learning_rate(step: int, t: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine / linear decay to ``min_lr_ratio · lr`` or constant.

    ``step`` counts completed updates; the update that makes step ``k + 1`` uses ``learning_rate(k + 1)``."""
    if t.warmup_steps > 0 and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    if t.schedule == "constant":
        return t.lr
    frac = min(1.0, (step - t.warmup_steps) / max(1, t.total_steps - t.warmup_steps))
    floor = t.lr * t.min_lr_ratio
    if t.schedule == "linear":
        return floor + (t.lr - floor) * (1.0 - frac)
    return floor + (t.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))


def frozen_names(state) -> set[str]:
    """The checkpoint keys of a state's frozen leaves (``params.<path>`` of a LoRA run's base; none otherwise)."""
    if getattr(state, "peft", None) is None:
        return set()
    return {f"params.{n}" for (n, _), m in zip(named_leaves(state.params), state.trainable()) if not m}
