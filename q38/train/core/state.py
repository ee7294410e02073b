"""``TrainState``: parameters, AdamW moments and the step count, with the static configs as pytree metadata."""

import fnmatch
import math

import attrs
import torch
import torch.utils._pytree as pytree
from torch import Tensor

from q38.model_config import ModelConfig
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
    extra = [] if s.router_bias is None else [s.router_bias]
    return [s.params, s.exp_avg, s.exp_avg_sq, s.step, *extra], (s.model_config, s.train_config, bool(extra),
                                                                  s.kernels, s.peft)


def _unflatten(children, ctx):
    bias = children[4] if ctx[2] else None
    return TrainState(*children[:4], model_config=ctx[0], train_config=ctx[1], router_bias=bias, kernels=ctx[3],
                      peft=ctx[4])


def _flatten_with_keys(s: TrainState):
    names = ("params", "exp_avg", "exp_avg_sq", "step", "router_bias")
    children, ctx = _flatten(s)
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
    them, or with ``peft`` the adapter matrices of ``params``, built by ``q38.lora.add_adapters``)."""
    if train_config.moment_dtype == "int8":  # 8-bit block-wise moments (q38.qmoment)
        from q38.qmoment import zeros_like

        first, second = (lambda p: zeros_like(p, True)), (lambda p: zeros_like(p, False))
    else:
        dtype = getattr(torch, train_config.moment_dtype)  # fp32, or bf16 moments (train.moment_dtype)
        first = second = lambda p: torch.zeros_like(p, dtype=dtype)  # noqa: E731
    return TrainState(
        params=params,
        exp_avg=trainable_tree(params, first),
        exp_avg_sq=trainable_tree(params, second),
        step=torch.zeros((), dtype=torch.int64),
        model_config=model_config,
        train_config=train_config,
        router_bias=initial_router_bias(model_config, train_config, params),
        kernels=kernels,
        peft=peft,
    )


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
