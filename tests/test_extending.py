"""docs/extending.md, exercised: the recipes for a new weight and a new kernel (the layout and loss-term recipes
are exercised by tests/test_layout.py and tests/test_objective.py, named in the guide)."""

import pytest

from q38.config import ConfigError
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
