"""The layer-kind table (q38/layers/kinds.py) is what the code does: the params each kind declares are the ones
the model initialises (and ``count_params`` counts), its region is the one its apply marks, its recompute flag is
the train setting selective recompute reads. Every test reads the kinds from the table, so a new kind is tested
by adding its record (a model with one layer of every kind: ``every_kind``)."""

import collections
import re

import attrs
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import q38.layers.kinds as kinds
from q38.layers.context import seq_info
from q38.layers.kinds import (MIXER_KINDS, count_by_kind, keep_flags, kept_regions, kind_of, layer_kinds,
                              recompute_modes, regions, selective_mode)
from q38.model import count_params, init_params
from q38.model_config import ConfigError, ModelConfig
from q38.pytree import named_leaves

SMALL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
             num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=96)


def every_kind(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its layers cycling through every kind of the table (at least one layer of each)."""
    names = list(MIXER_KINDS)
    n = max(cfg.num_hidden_layers, len(names))
    return cfg.replace(num_hidden_layers=n, layer_types=tuple(names[i % len(names)] for i in range(n)))


def _configs():
    tiny = ModelConfig.preset("tiny")
    return {"tiny": tiny, "small": tiny.replace(**SMALL), "every_kind": every_kind(tiny),
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
    cfg = every_kind(tiny_cfg.replace(mtp_num_layers=1))
    params = init_params(cfg, seed=0)
    got = layer_kinds(cfg)
    assert [k.name for k in got] == list(cfg.layer_types) + [kinds.MTP_LAYER_TYPE]
    assert all(isinstance(lp.mixer, k.params) for lp, k in zip(params.layers + params.mtp.layers, got))
    for lp, k in zip(params.layers, got):  # a params class of one kind only names it
        if sum(j.params is k.params for j in MIXER_KINDS.values()) == 1:
            assert kind_of(lp.mixer) is k


def test_kind_of_refuses_a_params_class_two_kinds_share(monkeypatch, tiny_cfg):
    """Two kinds may share a params class (the layer's kind is its layer_types entry): then ``kind_of`` cannot
    tell, and says so instead of picking one."""
    first = next(iter(MIXER_KINDS.values()))
    twin = attrs.evolve(first, name="twin_of_" + first.name)
    monkeypatch.setitem(MIXER_KINDS, twin.name, twin)
    p = first.abstract(tiny_cfg)
    sharing = ", ".join(k.name for k in MIXER_KINDS.values() if k.params is first.params)
    with pytest.raises(TypeError, match=re.escape(f"params class of {sharing}: ") + ".*layer_kinds"):
        kind_of(p)
    with pytest.raises(TypeError, match="params class of no layer kind"):
        kind_of(object())


def test_count_by_kind_counts_the_main_layers(tiny_cfg):
    for cfg in _configs().values():
        expect = collections.Counter(cfg.layer_types)  # independent: a plain count of the config's entries
        assert count_by_kind(cfg) == {name: expect.get(name, 0) for name in MIXER_KINDS}
    assert sum(count_by_kind(tiny_cfg).values()) == tiny_cfg.num_hidden_layers


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
    cfg = every_kind(tiny_cfg)
    params = init_params(cfg, seed=0)
    p = params.layers[cfg.layer_types.index(name)].mixer
    x = torch.randn(1, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    from q38.train.core.remat import KernelRegions

    regions_ = KernelRegions()
    with _Regions(regions_) as spy:
        kind.apply(p, x, cfg, attrs.evolve(seq_info(None, 1, 8, "cpu"), region=regions_.enter))
    assert spy.seen - {None} == {kind.region}


def test_recompute_modes_round_trip_through_the_train_flags():
    """Each planner mode gives train flags (``q38 plan --search``'s run config) that name the same mode again, and
    the flags are TrainConfig fields (what q38.train.core.remat reads)."""
    from q38.parallel.budget import recompute_mode
    from q38.train.core.step_config import TrainConfig

    fields = {a.name for a in attrs.fields(TrainConfig)}
    assert {k.keep_flag for k in MIXER_KINDS.values()} <= fields
    modes = recompute_modes()
    assert len(modes) == 2 + 2 ** len(regions()) - 1 and len(set(modes)) == len(modes)  # every set of regions once
    for mode in modes:
        train = {"recompute": mode != "none", **keep_flags(mode)}
        assert recompute_mode(train) == mode
    assert kept_regions(selective_mode(regions())) == set(regions()) == {k.region for k in MIXER_KINDS.values()}
    with pytest.raises(ConfigError, match="recompute mode must be one of"):
        kept_regions("selective_both")


def test_a_region_has_one_keep_flag():
    first = next(iter(MIXER_KINDS.values()))
    with pytest.raises(ValueError, match="one keep flag per region"):
        kinds.check_kinds([first, attrs.evolve(first, name="other", keep_flag="skip_other_recompute")])
    with pytest.raises(ValueError, match="named twice"):
        kinds.check_kinds([first, first])


def test_layer_types_are_the_tables_names(monkeypatch, tiny_cfg):
    """A layer_types entry the table does not name is refused by the config, naming the table's kinds; a kind added
    to the table is accepted (the config reads the table, not a list of its own)."""
    with pytest.raises(ConfigError, match=re.escape(f"layer_types entries must be one of {tuple(MIXER_KINDS)}; "
                                                    "got ['mamba']")):
        tiny_cfg.replace(layer_types=("mamba",) + tiny_cfg.layer_types[1:])
    with pytest.raises(ConfigError, match="layer_types entry 'mamba' is not a layer kind; known kinds: "):
        MIXER_KINDS["mamba"]
    monkeypatch.setitem(MIXER_KINDS, "mamba", attrs.evolve(next(iter(MIXER_KINDS.values())), name="mamba"))
    assert tiny_cfg.replace(layer_types=("mamba",) + tiny_cfg.layer_types[1:]).layer_types[0] == "mamba"


def test_a_config_built_before_the_kinds_load_says_what_to_import():
    """``q38.model_config`` alone has no layer-kind table (the layers register it): building a config there names
    the import to add, instead of cattrs' "While structuring ModelConfig (1 sub-exception)"."""
    import subprocess
    import sys
    from pathlib import Path

    code = "from q38.model_config import ModelConfig; ModelConfig.from_dict({'hidden_size': 40})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: the layer-kind table is not loaded: import q38.model"), last
