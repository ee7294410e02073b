"""The mixer kinds' table (q38/layers/kinds.py) is what the code does: the params each kind declares are the ones
the model initialises (and ``count_params`` counts), its region is the one its apply marks, its recompute flag is
the train setting selective recompute reads."""

import re

import attrs
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from q38.model_config import LAYER_TYPES, ConfigError, ModelConfig
from q38.layers.context import seq_info
from q38.layers.kinds import MIXER_KINDS, RECOMPUTE_MODES, kept_regions, kind_of, layer_kinds
from q38.model import count_params, init_params
from q38.pytree import named_leaves

SMALL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
             num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=96)


def _configs():
    tiny = ModelConfig.preset("tiny")
    return {"tiny": tiny, "small": tiny.replace(**SMALL),
            "tied_no_mtp": tiny.replace(tie_word_embeddings=True, mtp_num_layers=0),
            "mtp2_untied": tiny.replace(tie_word_embeddings=False, mtp_num_layers=2)}


@pytest.mark.parametrize("name", list(_configs()))
def test_count_params_is_the_numel_of_a_real_init(name):
    """``count_params`` (summed over the declared shapes) equals the element count of an initialised tree; active
    counts ``k`` of ``e`` routed experts per MoE layer."""
    cfg = _configs()[name]
    leaves = [(p, t) for p, t in named_leaves(init_params(cfg, seed=0)) if t is not None]
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    main = [(p, t) for p, t in leaves if not p.startswith("mtp.")]
    mtp = [(p, t) for p, t in leaves if p.startswith("mtp.")]
    active = lambda ls: sum(t.numel() // e * k if ".moe.we_" in p else t.numel() for p, t in ls)  # noqa: E731
    c = count_params(cfg)
    assert (c.total, c.mtp_total) == (sum(t.numel() for _, t in main), sum(t.numel() for _, t in mtp))
    assert (c.active, c.mtp_active) == (active(main), active(mtp))


def test_each_layer_holds_its_kinds_params(tiny_cfg):
    params = init_params(tiny_cfg.replace(mtp_num_layers=1), seed=0)
    assert [kind_of(lp.mixer).name for lp in params.layers] == list(tiny_cfg.layer_types)
    assert [kind_of(lp.mixer) for lp in params.layers + params.mtp.layers] == layer_kinds(tiny_cfg.replace(
        mtp_num_layers=1))
    assert {type(lp.mixer) for lp in params.layers} == {MIXER_KINDS[t].params for t in tiny_cfg.layer_types}


class _Regions(TorchDispatchMode):
    """Records the step's region (``KernelRegions.current``) at every op."""

    def __init__(self, regions):
        super().__init__()
        self.regions, self.seen = regions, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(self.regions.current)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(MIXER_KINDS))
def test_a_kinds_region_is_the_one_its_apply_marks(tiny_cfg, name):
    kind = MIXER_KINDS[name]
    params = init_params(tiny_cfg, seed=0)
    p = next(lp.mixer for lp in params.layers if kind_of(lp.mixer) is kind)
    x = torch.randn(1, 8, tiny_cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    from q38.train.core.remat import KernelRegions

    regions = KernelRegions()
    with _Regions(regions) as spy:
        kind.apply(p, x, tiny_cfg, attrs.evolve(seq_info(None, 1, 8, "cpu"), region=regions.enter))
    assert spy.seen - {None} == {kind.region}


def test_recompute_modes_round_trip_through_the_train_flags():
    """Each planner mode gives train flags (``q38 plan --search``'s run config) that name the same mode again, and
    the flags are TrainConfig fields (what q38.train.core.remat reads)."""
    from q38.parallel.budget import recompute_mode
    from q38.train.core.step_config import TrainConfig

    fields = {a.name for a in attrs.fields(TrainConfig)}
    assert {k.keep_flag for k in MIXER_KINDS.values()} <= fields
    for mode in RECOMPUTE_MODES:
        train = {"recompute": mode != "none", **{k.keep_flag: k.region in kept_regions(mode) for k in
                                                  MIXER_KINDS.values()}}
        assert recompute_mode(train) == mode
    assert kept_regions("selective_both") == {k.region for k in MIXER_KINDS.values()}


def test_layer_types_are_the_tables_names(tiny_cfg):
    with pytest.raises(ConfigError, match=re.escape(f"layer_types entries must be one of {LAYER_TYPES}; "
                                                    "got ['mamba']")):
        tiny_cfg.replace(layer_types=("mamba",) + tiny_cfg.layer_types[1:])
