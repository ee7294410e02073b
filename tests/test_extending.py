"""docs/extending.md, exercised: the recipes for a new weight, a new layer type and a new kernel (the layout and
loss-term recipes are exercised by tests/test_layout.py and tests/test_objective.py, named in the guide)."""

import pytest

from q38.model_config import ConfigError
from q38.layers.common import ParamInfo
from q38.parallel import Layout


def test_a_new_weight_reaches_every_layout(tiny_cfg):
    """A new layer weight declared with role-named axes (no layout edited) is FSDP-sharded on its fsdp_dim in every
    FSDP layout and replicated in `single`."""
    tree = {"layers": [{"mixer": {"w_new": ParamInfo((1024, 32), axes=("new_out", "embed"), fsdp_dim=0)}}]}
    for name in Layout.presets():
        lay = Layout.preset(name)
        world = 1
        for _, s in lay.mesh:
            world *= s if s > 0 else 2
        pp = lay.placements(tree, world)["layers.0.mixer.w_new"]
        assert pp.mesh_axes_per_dim == (tuple(lay.fsdp), ()), name


def test_a_new_kernel_is_one_registry_entry(monkeypatch):
    """Registering a toy GDN implementation makes it choosable, preferred by auto where it runs, and refused with a
    message where it does not (before anything is allocated)."""
    import q38.kernels as k

    toy = k.KernelImpl(devices=("cpu",), cp=False, packed=True, backward=True, note="toy")
    monkeypatch.setitem(k.REGISTRY, "gdn", {"toy": toy, **k.REGISTRY["gdn"]})
    assert k.resolve_kernels(k.KernelConfig(), device="cpu").gdn == "toy"  # auto: first that supports the run
    assert k.resolve_kernels(k.KernelConfig(), device="cpu", cp=True).gdn == "torch"  # toy has no CP
    with pytest.raises(ConfigError, match=r"kernels.gdn: toy does not support context parallelism"):
        k.resolve_kernels(k.KernelConfig(gdn="toy"), device="cpu", cp=True)


def test_a_new_layer_type_is_one_record(monkeypatch, tiny_cfg, tmp_path):
    """The recipe "Add a layer type": a toy mixer (one weight, ``y = x Wᵀ`` inside its own kernel region) written as
    an attrs params class, an abstract function, an apply function and one ``MixerKind`` record in
    ``q38.layers.kinds.MIXER_KINDS`` with its name in ``q38.model_config.LAYER_TYPES``, and no other change, is accepted in
    ``layer_types``, initialised and run by the
    model, counted by ``count_params``, priced by ``step_flops`` and ``q38 plan``'s budget, placed by a layout (its
    new axis takes the FSDP role) and written to and read back from a Hugging Face checkpoint."""
    import attrs
    import torch
    import torch.nn.functional as F
    from torch import Tensor

    import q38.model_config
    import q38.layers.kinds as kinds
    from q38.flops import step_flops
    from q38.hf import load_hf, save_hf
    from q38.layers.hf_keys import renames
    from q38.model import abstract_params, count_params, forward, init_params
    from q38.parallel.budget import estimate
    from q38.pytree import named_leaves, pytree_node

    @pytree_node
    @attrs.frozen
    class ToyParams:
        w_mix: Tensor  # [d, d]

    def abstract_toy(cfg):
        return ToyParams(w_mix=ParamInfo((cfg.hidden_size, cfg.hidden_size), std=cfg.initializer_range,
                                         axes=("toy_out", "embed")))

    def toy_apply(p, x, cfg, info):
        with info.region("toy"):
            return F.linear(x, p.w_mix)

    def toy_flops(cfg, w):
        return kinds.MixerFlops(terms={"dense": 2 * w.tokens * cfg.hidden_size**2}, kernel=("dense",))

    def toy_saved(cfg, w):
        x = w.tokens * cfg.hidden_size * w.act_bytes
        return kinds.MixerSaved(core=x, rest=0.0, widest=x, kept=x)

    toy = kinds.MixerKind(
        name="toy_mixer", params=ToyParams, abstract=abstract_toy, apply=toy_apply, region="toy",
        keep_flag="skip_toy_recompute", flops=toy_flops, saved=toy_saved,
        cp_exchange=lambda cfg, w: kinds.CPExchange(collective="toy exchange", bytes=0.0, calls=2, recompute_calls=3),
        hf_rules=lambda cfg, layout, qp, hp, shapes: renames({"w_mix": "toy_mixer.weight"}, qp, hp, shapes),
    )
    monkeypatch.setitem(kinds.MIXER_KINDS, "toy_mixer", toy)
    monkeypatch.setattr(q38.model_config, "LAYER_TYPES", (*q38.model_config.LAYER_TYPES, "toy_mixer"))

    cfg = tiny_cfg.replace(layer_types=("toy_mixer",) + tiny_cfg.layer_types[1:])
    params = init_params(cfg, seed=0)
    assert isinstance(params.layers[0].mixer, ToyParams)
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(forward(params, ids, cfg).hidden).all()
    leaves = [(p, t) for p, t in named_leaves(params) if t is not None]
    assert count_params(cfg).total == sum(t.numel() for p, t in leaves if not p.startswith("mtp."))
    base = step_flops(tiny_cfg, 1, 8).dense - step_flops(cfg, 1, 8).dense
    assert base != 0  # the toy's formula replaced layer 0's
    b = estimate(cfg, Layout.preset("fsdp"), 2, seq_len=8, rows_per_rank=1)
    assert b.peak_bytes > 0
    pp = Layout.preset("fsdp").placements(abstract_params(cfg), 2)["layers.0.mixer.w_mix"]
    assert pp.mesh_axes_per_dim == (("fsdp",), ())  # its axes take the FSDP role

    save_hf(tmp_path / "hf", cfg, params)
    cfg2, back = load_hf(tmp_path / "hf")
    assert cfg2.layer_types[0] == "toy_mixer"
    assert torch.equal(back.layers[0].mixer.w_mix, params.layers[0].mixer.w_mix)
