"""Parallel layouts (specs/parallel/*.yaml): validation, placements, golden sharding files, and ``q38 plan``.

Golden files: ``tests/golden/<layout>.json`` hold ``{param path: {"shape", "spec", "placements"}}`` for the tiny
preset on the layout's small mesh (``small_mesh``, read from the YAML). After an intended layout change, regenerate them with

    Q38_UPDATE_GOLDEN=1 pytest tests/test_layout.py -k golden

and review the diff like code.
"""

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from q38 import ModelConfig, abstract_params, count_params, init_params
from q38.layers.kinds import count_by_kind
from q38.model import is_param_info
from q38.cli import plan_cli
from q38.parallel import Layout, LayoutError, format_plan, plan
from q38.parallel.plan import local_numel_grid
from q38.pytree import named_leaves

GOLDEN_DIR = Path(__file__).parent / "golden"
REGENERATE = "Q38_UPDATE_GOLDEN=1 python -m pytest tests/test_layout.py -k golden"
BIG_WORLD = 64  # every shipped layout is validated for the qwen3_8_2_4t preset at this world (or its fixed dims)


def small_mesh(layout: Layout) -> tuple[int, dict[str, int]]:
    """The tiny preset's test mesh of a layout, read from its YAML: every fixed dim shrunk to 2 (tiny has 8
    experts and short rows), the ``-1`` dim taking what makes the world at least 4 (at least 2)."""
    fixed = {n: min(s, 2) for n, s in layout.mesh if s != -1}
    world = math.prod(fixed.values())
    rest = [n for n, s in layout.mesh if s == -1]
    if rest:
        world *= max(2, 4 // world)
    return world, {n: s for n, s in fixed.items() if s != dict(layout.mesh)[n]}


def big_world(layout: Layout) -> int:
    """The world the 2.4T preset is validated at: ``BIG_WORLD``, or the product of the fixed dims if larger."""
    return max(BIG_WORLD, math.prod(s for _, s in layout.mesh if s != -1)) if layout.mesh else 1


@pytest.fixture(scope="module")
def big_cfg():
    return ModelConfig.preset("qwen3_8_2_4t")


def _tiny_layout(name: str) -> tuple[Layout, int]:
    world, overrides = small_mesh(Layout.preset(name))
    return Layout.preset(name).with_mesh(**overrides), world


def _base_dict() -> dict:
    """The fsdp_ep layout as a plain dict (fsdp, rules, ... resolved), for building broken variants."""
    lay = Layout.preset("fsdp_ep")
    return {
        "name": "broken",
        "mesh": dict(lay.mesh),
        "fsdp": list(lay.fsdp),
        "rules": {k: list(v) or None for k, v in lay.rules},
        "compute": {k: list(v) for k, v in lay.compute},
        "activations": {k: list(v) or None for k, v in lay.activations},
    }


# ---- shipped layouts ------------------------------------------------------------------------------------------------


def test_small_mesh_rule():
    """The rule gives the meshes the golden files were written on (a new layout needs no entry anywhere)."""
    assert small_mesh(Layout.preset("single")) == (1, {})
    assert small_mesh(Layout.preset("fsdp")) == (4, {})
    assert small_mesh(Layout.preset("fsdp_ep_cp")) == (8, {})
    assert small_mesh(Layout.preset("qwen3_8_2_4t")) == (8, {"ep": 2})
    assert small_mesh(Layout.preset("hsdp")) == (4, {"fsdp": 2})


@pytest.mark.parametrize("name", Layout.presets())
def test_shipped_layout_validates_tiny(name, tiny_cfg):
    layout, world = _tiny_layout(name)
    pl = layout.validate(tiny_cfg, world)
    assert list(pl) == [p for p, _ in named_leaves(abstract_params(tiny_cfg), is_leaf=is_param_info)]


@pytest.mark.parametrize("name", Layout.presets())
def test_shipped_layout_validates_2_4t(name, big_cfg):
    pl = Layout.preset(name).validate(big_cfg, big_world(Layout.preset(name)))
    assert sum(math.prod(p.shape) for p in pl.values()) == count_params(big_cfg).total_with_mtp


def test_placements_accept_meta_tensors(tiny_cfg):
    layout = Layout.preset("fsdp_ep")
    meta = init_params(tiny_cfg, device="meta")
    assert layout.placements(meta, 4) == layout.placements(abstract_params(tiny_cfg), 4)


def test_fsdp_convention(tiny_cfg):
    pl = Layout.preset("fsdp_ep").validate(tiny_cfg, 4)
    # dense weights: dim 0 over every rank; experts: dim 0 on ep, FSDP on the expert ffn dim; norms replicated
    assert pl["layers.3.mixer.w_q"].mesh_axes_per_dim == (("fsdp", "ep"), ())
    assert pl["layers.0.moe.we_gate_up"].mesh_axes_per_dim == (("ep",), ("fsdp",), ())
    assert pl["layers.0.moe.we_gate_up"].placement_strs() == ["Shard(1)", "Shard(0)"]
    assert pl["layers.0.moe.we_gate_up"].placement_strs(compute=True) == ["Replicate()", "Shard(0)"]
    assert pl["layers.0.moe.we_gate_up"].logical_axes == ("expert", "expert_mlp", "expert_embed")
    assert pl["mtp.layers.0.moe.we_down"].mesh_axes_per_dim == (("ep",), (), ("fsdp",))
    assert pl["layers.0.mixer.w_b"].mesh_axes_per_dim == ((), ("fsdp", "ep"))  # skinny: its d dim
    assert pl["final_norm"].placement_strs() == ["Replicate()", "Replicate()"]


def test_dtensor_placements_and_size_one_dims(tiny_cfg):
    from torch.distributed.tensor import Replicate, Shard

    pp = Layout.preset("fsdp_ep_cp").validate(tiny_cfg, 8)["layers.0.moe.we_gate_up"]
    assert pp.dtensor_placements() == [Shard(1), Shard(1), Shard(0)]  # mesh (fsdp, cp, ep)
    assert pp.dtensor_placements(compute=True) == [Replicate(), Replicate(), Shard(0)]
    pp4 = Layout.preset("fsdp_ep_cp").validate(tiny_cfg, 4)["layers.0.moe.we_gate_up"]  # fsdp = 1
    assert pp4.mesh_axes_per_dim == (("ep",), ("fsdp", "cp"), ())  # the spec as declared ...
    assert pp4.dtensor_placements() == [Replicate(), Shard(1), Shard(0)]  # ... size-1 fsdp → Replicate


def test_activation_rules():
    lay = Layout.preset("fsdp_ep_cp")
    assert lay.batch_mesh_dims == ("fsdp", "ep") and lay.seq_mesh_dims == ("cp",)
    assert Layout.preset("single").batch_mesh_dims == () and Layout.preset("fsdp").seq_mesh_dims == ()


def test_resolve_mesh():
    assert list(Layout.preset("qwen3_8_2_4t").resolve_mesh(1024).items()) == [("fsdp", 16), ("ep", 32), ("cp", 2)]
    assert list(Layout.preset("fsdp_ep_cp").resolve_mesh(16)) == ["fsdp", "cp", "ep"]
    assert Layout.preset("single").resolve_mesh(1) == {}


# ---- golden files ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", Layout.presets())
def test_golden_placements(name, tiny_cfg):
    """Compare exactly with tests/golden/<layout>.json; ``Q38_UPDATE_GOLDEN=1`` rewrites the files."""
    layout, world = _tiny_layout(name)
    got = {p: pp.to_json() for p, pp in layout.validate(tiny_cfg, world).items()}
    path = GOLDEN_DIR / f"{name}.json"
    if os.environ.get("Q38_UPDATE_GOLDEN") == "1":
        GOLDEN_DIR.mkdir(exist_ok=True)
        rows = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in got.items()]  # one line per parameter
        path.write_text("{\n" + ",\n".join(rows) + "\n}\n")
    assert path.is_file(), f"{path} missing (a new layout?): write it with `{REGENERATE}` and review it"
    assert json.loads(path.read_text()) == got, (
        f"{path} differs from the placements of layout {name!r}; if the change is intended, regenerate with "
        f"`{REGENERATE}` and review the diff like code")


# ---- validation errors ----------------------------------------------------------------------------------------------


def test_new_weight_is_fsdp_sharded_by_default(tiny_cfg):
    """A weight declared with no logical axes and no rule anywhere takes the FSDP role on dim 0 in every FSDP
    layout (and the placement report shows it); a vector stays replicated."""
    from q38.layers.common import ParamInfo

    tree = {"new_proj": ParamInfo((16, 64)), "new_scale": ParamInfo((64,), "ones")}
    pl = Layout.preset("fsdp_ep").placements(tree, 4)
    assert pl["new_proj"].mesh_axes_per_dim == (("fsdp", "ep"), ())
    assert pl["new_proj"].placement_strs() == ["Shard(0)", "Shard(0)"]
    assert pl["new_scale"].placement_strs() == ["Replicate()", "Replicate()"]
    assert Layout.preset("single").placements(tree, 1)["new_proj"].mesh_axes_per_dim == ((), ())


def test_error_undeclared_tensor(tiny_cfg):
    """A live tensor whose path no layer declares cannot be placed: one error names it and the fix."""
    with pytest.raises(LayoutError, match=r"parameter 'layers\.0\.mixer\.w_new' \[4, 4\] has no layer declaration "
                                          r"\(declare it with a ParamInfo"):
        Layout.preset("fsdp").placements({"layers": [{"mixer": {"w_new": torch.zeros(4, 4)}}]}, 2)


def test_error_params_table_is_gone():
    d = _base_dict()
    d["params"] = {"embed": ["vocab", "embed"]}
    with pytest.raises(LayoutError, match=r"a layout no longer lists parameters \('params'\): each parameter declares"):
        Layout.from_dict(d)


def test_error_axes_rank_mismatch():
    from q38.layers.common import ParamInfo

    with pytest.raises(ValueError, match=r"ParamInfo of shape \[384, 64\] declares 1 logical axes \['vocab'\]"):
        ParamInfo((384, 64), axes=("vocab",))


@pytest.mark.parametrize("axes,rules,fsdp,fsdp_dim,expected", [
    (("vocab", "embed"), {}, (), 0, ((), ())),  # no rule, no FSDP role: replicated
    (("vocab", "embed"), {}, ("fsdp", "ep"), 0, (("fsdp", "ep"), ())),  # the FSDP role on the FSDP dim
    (("vocab", "embed"), {}, ("fsdp",), None, ((), ())),  # no FSDP dim (a vector, say): never FSDP-sharded
    (("expert", "expert_mlp", "d"), {"expert": ("ep",)}, ("fsdp", "cp", "ep"), 1, (("ep",), ("fsdp", "cp"), ())),
    (("expert", "expert_mlp", "d"), {"expert": ("fsdp",)}, ("fsdp",), 1, (("fsdp",), (), ())),  # role used up
    (("heads", "d"), {"heads": ("tp",)}, ("fsdp",), 0, (("fsdp", "tp"), ())),  # rule + role, in mesh order
])
def test_logical_to_spec(axes, rules, fsdp, fsdp_dim, expected):
    from q38.parallel.layout import logical_to_spec

    assert logical_to_spec(axes, rules, fsdp, fsdp_dim, ("fsdp", "cp", "tp", "ep")) == expected


def test_logical_to_spec_refuses_colliding_mesh_dims():
    from q38.parallel.layout import AxisCollision, logical_to_spec

    with pytest.raises(AxisCollision, match=r"mesh dim 'ep' shards both dim 0 and dim 1"):
        logical_to_spec(("expert", "expert_mlp"), {"expert": ("ep",), "expert_mlp": ("ep",)})


def test_new_mesh_dim_is_data(tiny_cfg):
    """A mesh dim the code has never heard of (tp) is placed by the rules alone."""
    d = {"name": "tp", "mesh": {"fsdp": -1, "tp": 2}, "fsdp": "fsdp",
         "rules": {"heads_q": "tp", "kv": "tp", "attn_in": "tp", "expert": "fsdp"},
         "activations": {"batch": ["fsdp", "tp"]}}
    pl = Layout.from_dict(d).validate(tiny_cfg, 4)
    assert pl["layers.3.mixer.w_q"].mesh_axes_per_dim == (("fsdp", "tp"), ())
    assert pl["layers.3.mixer.w_o"].mesh_axes_per_dim == (("fsdp",), ("tp",))
    assert pl["layers.0.mixer.w_qkv"].mesh_axes_per_dim == (("fsdp",), ())


def test_error_unknown_mesh_dim():
    d = _base_dict()
    d["mesh"] = {"fsdp": -1}
    d["activations"] = {"batch": "fsdp"}
    d["compute"] = {}
    with pytest.raises(LayoutError, match=r"fsdp names mesh dim 'ep', which the mesh does not have "
                                          r"\(the mesh is fsdp=-1\)"):
        Layout.from_dict(d)
    d["fsdp"] = "fsdp"
    with pytest.raises(LayoutError, match=r"rules\['expert'\] names mesh dim 'ep', which the mesh does not have "
                                          r"\(the mesh is fsdp=-1\)"):
        Layout.from_dict(d)


def test_error_mesh_dim_twice_on_one_tensor(tiny_cfg):
    d = _base_dict()
    d["rules"]["expert_mlp"] = "ep"
    with pytest.raises(LayoutError, match=r"parameter 'layers\.0\.moe\.we_gate_up' \(layers\.\*\.moe\.we_gate_up\): "
                                          r"mesh dim 'ep' shards both dim 0 \(expert\) and dim 1 \(expert_mlp\)"):
        Layout.from_dict(d).validate(tiny_cfg, 4)


def test_error_indivisible_and_uneven_opt_in(tiny_cfg):
    d = _base_dict()
    d["mesh"] = {"fsdp": -1, "ep": 3}
    d["fsdp"] = "fsdp"  # dense over fsdp only
    with pytest.raises(LayoutError) as e:
        Layout.from_dict(d).validate(tiny_cfg, 6)
    msg = str(e.value)
    assert msg.startswith("layout 'broken' on mesh fsdp=2 × ep=3: parameter 'layers.0.moe.we_gate_up' dim 0 (expert, "
                          "size 8) is sharded over mesh dims ep=3 = 3 ranks, and 8 is not divisible by 3 (and 9 more "
                          "alike, e.g. 'layers.0.moe.we_down') (change the rule or the mesh sizes, or list the "
                          "parameter under 'uneven' to accept torch.chunk shards)")
    assert "\n" not in msg
    d["uneven"] = ["*.moe.we_*"]
    pp = Layout.from_dict(d).validate(tiny_cfg, 6)["layers.0.moe.we_gate_up"]
    assert pp.uneven and [pp.local_shape((0, c))[0] for c in range(3)] == [3, 3, 2]


def test_error_world_size_mismatch():
    with pytest.raises(LayoutError, match=r"mesh fsdp=-1 × ep=2 needs a world size divisible by 2 .* WORLD_SIZE=3"):
        Layout.preset("fsdp_ep").resolve_mesh(3)
    with pytest.raises(LayoutError, match=r"mesh fsdp=2 × ep=2 has 4 ranks, but WORLD_SIZE=8"):
        Layout.preset("fsdp_ep").with_mesh(fsdp=2).resolve_mesh(8)


def test_error_rule_out_of_mesh_order():
    d = _base_dict()
    d["rules"]["vocab"] = ["ep", "fsdp"]
    with pytest.raises(LayoutError, match=r"rules\['vocab'\] = \['ep', 'fsdp'\] lists mesh dims out of mesh order"):
        Layout.from_dict(d)
    d = _base_dict()
    d["fsdp"] = ["ep", "fsdp"]
    with pytest.raises(LayoutError, match=r"fsdp = \['ep', 'fsdp'\] lists mesh dims out of mesh order"):
        Layout.from_dict(d)


def test_error_small_static_mistakes():
    d = _base_dict()
    d["rules"]["expet"] = "ep"
    with pytest.raises(LayoutError, match=r"rules\['expet'\] is for a logical axis no parameter declares "
                                          r"\(did you mean 'expert'\?\)"):
        Layout.from_dict(d)
    d = _base_dict()
    d["mesh"] = {"fsdp": -1, "Ep!": 2}
    with pytest.raises(LayoutError, match=r"mesh dim name 'Ep!' must be a lowercase identifier"):
        Layout.from_dict(d)
    d = _base_dict()
    d["activations"] = {"batch": "fsdp"}
    with pytest.raises(LayoutError, match=r"mesh dim\(s\) \['ep'\] carry no activations"):
        Layout.from_dict(d)
    d = _base_dict()
    d["compute"] = {"expert": "fsdp"}
    with pytest.raises(LayoutError, match=r"compute\['expert'\] = \['fsdp'\] must be a leading part of rules\['expert'\]"):
        Layout.from_dict(d)
    with pytest.raises(LayoutError, match=r"unknown parallel layout 'fsdp_epp' \(did you mean 'fsdp_ep'\?\); "
                                          r"known layouts: " + ", ".join(Layout.presets())):
        Layout.preset("fsdp_epp")


def test_error_duplicate_yaml_key(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("include: fsdp.yaml\nrules:\n  expert: fsdp\n  expert: null\n")
    with pytest.raises(LayoutError, match=r"duplicate key 'expert'"):
        Layout.from_yaml(p)


# ---- a new layout is data only -------------------------------------------------------------------------------------


def test_new_layout_yaml_without_code_change(tmp_path, tiny_cfg):
    (tmp_path / "experts_on_fsdp.yaml").write_text(
        "# experts split over fsdp (kept local in compute), their ffn dim over ep\n"
        "include: fsdp_ep.yaml\n"
        "name: experts_on_fsdp\n"
        "rules: {expert: fsdp, expert_mlp: ep}\n"
        "compute: {expert: fsdp}\n"
    )
    layout = Layout.load(tmp_path / "experts_on_fsdp.yaml")
    pl = layout.validate(tiny_cfg, 4)
    assert pl["layers.0.moe.we_gate_up"].placement_strs() == ["Shard(0)", "Shard(1)"]
    assert pl["layers.0.moe.we_gate_up"].placement_strs(compute=True) == ["Shard(0)", "Replicate()"]
    assert pl["embed"].placement_strs() == ["Shard(0)", "Shard(0)"]  # the rest is inherited from fsdp_ep
    report = plan(tiny_cfg, layout, 4)
    assert report.experts.mesh_dims == ("fsdp",) and list(report.experts.experts_of_rank(3)) == [4, 5, 6, 7]


# ---- local shapes and the plan -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,items,mesh", [
    ((7, 5), (0, None), (2, 3)),
    ((11, 3), (0, 0), (2, 3)),  # nested uneven split of one dim
    ((5, 13, 2), (1, 0, 1), (2, 2, 4)),
    ((3,), (0, 0), (4, 2)),  # more shards than elements: empty shards
])
def test_local_numel_matches_dtensor(shape, items, mesh):
    """Pins our chunk arithmetic to DTensor's (private) helper, for the torch version in pyproject."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements = [Replicate() if d is None else Shard(d) for d in items]
    grid = local_numel_grid(shape, items, mesh)
    for idx in range(math.prod(mesh)):
        coord = list(torch.unravel_index(torch.tensor(idx), mesh))
        local, _ = _compute_local_shape_and_global_offset(shape, mesh, [int(c) for c in coord], placements)
        assert int(grid[tuple(coord)]) == math.prod(local)


def _expected_rank0_numel_2_4t(c: ModelConfig) -> tuple[int, int]:
    """Hand-written per-rank parameter count of the production layout on 1024 ranks (fsdp 16 × ep 32 × cp 2):
    dense weights split 1024 ways on their largest dim, routed experts 32 ways on e and 32 ways on the ffn dim,
    norms and biases whole. Returns (rank 0 = the fullest rank, the last CP rank of the vocab split)."""
    d, W = c.hidden_size, 1024
    vocab_rows = -(-(c.vocab_size // 512) // 2)  # 248320 / (fsdp·ep) = 485 rows, then ceil over cp → 243
    vocab_rows_last = c.vocab_size // 512 - vocab_rows  # 242 on CP rank 1
    hc, gc = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = (2 * hc * d + 2 * gc * d + d * hc) // W + 2 * c.head_dim
    nv = c.linear_num_value_heads
    gdn = (c.linear_conv_dim * d + c.linear_value_dim * d + 2 * nv * d + c.linear_conv_dim * c.linear_conv_kernel_dim
           + d * c.linear_value_dim) // W + 2 * nv + c.linear_value_head_dim
    moe = (c.num_experts * d + 3 * c.shared_expert_intermediate_size * d + d) // W
    moe += (c.num_experts // 32) * 3 * (c.moe_intermediate_size // 32) * d
    layer = 2 * d + moe
    n_full, n_lin = count_by_kind(c)["full_attention"], count_by_kind(c)["linear_attention"]
    body = n_full * attn + n_lin * gdn + c.num_hidden_layers * layer + d
    mtp = 3 * d + 2 * d * d // W + c.mtp_num_layers * (attn + layer)
    full = 2 * vocab_rows * d + body + mtp
    return full, full - 2 * (vocab_rows - vocab_rows_last) * d


def test_plan_2_4t_on_1024_ranks(big_cfg):
    t0 = time.perf_counter()
    report = plan(big_cfg, Layout.preset("qwen3_8_2_4t"), 1024, model_name="qwen3_8_2_4t")
    assert time.perf_counter() - t0 < 60
    fullest, emptiest = _expected_rank0_numel_2_4t(big_cfg)
    assert report.numel_rank0 == report.numel_max == fullest
    assert report.numel_min == emptiest
    assert report.param_bytes_max == report.grad_bytes_max == 4 * fullest
    assert report.optimizer_bytes_max == 8 * fullest
    assert report.total_params == count_params(big_cfg).total_with_mtp
    assert report.experts.per_rank == 16 and list(report.experts.experts_of_rank(1023)) == list(range(496, 512))
    assert list(report.experts.experts_of_rank(3)) == list(range(16, 32))  # ep is the middle mesh dim: stride cp 2
    # one gathered layer: a GDN layer's dense weights whole + 16 local experts whole
    c = big_cfg
    d = c.hidden_size
    gdn_layer = (c.linear_conv_dim * d + 2 * c.linear_value_dim * d + 2 * c.linear_num_value_heads * d
                 + c.linear_conv_dim * c.linear_conv_kernel_dim + 2 * c.linear_num_value_heads
                 + c.linear_value_head_dim + 2 * d + c.num_experts * d + 3 * c.shared_expert_intermediate_size * d + d
                 + 16 * 3 * c.moe_intermediate_size * d)
    assert report.largest_layer == "layers.0" and report.largest_layer_bytes == 4 * gdn_layer
    text = format_plan(report)
    assert "fsdp=16 × ep=32 × cp=2" in text and "*.moe.we_gate_up" in text


def test_plan_single_has_no_traffic(tiny_cfg):
    r = plan(tiny_cfg, Layout.preset("single"), 1, param_dtype=torch.bfloat16)
    assert r.numel_max == r.total_params == count_params(tiny_cfg).total_with_mtp
    # bf16 policy: fp32 masters, grads and moments; the gathered (compute-form) layer in bf16
    assert r.param_bytes_max == r.grad_bytes_max == 4 * r.total_params and r.comm_bytes == 0
    assert r.optimizer_bytes_max == 8 * r.total_params
    assert r.largest_layer_bytes == 2 * plan(tiny_cfg, Layout.preset("single"), 1).largest_layer_bytes // 4
    assert r.experts.mesh_dims == () and r.experts.per_rank == tiny_cfg.num_experts


def test_plan_traffic_fsdp(tiny_cfg):
    """Plain FSDP on 4 ranks: every sharded weight is gathered (3/4 of it received), norms all-reduced."""
    r = plan(tiny_cfg, Layout.preset("fsdp"), 4)
    pl = Layout.preset("fsdp").validate(tiny_cfg, 4)
    sharded = sum(math.prod(p.shape) for p in pl.values() if p.shard_factor > 1)
    replicated = sum(math.prod(p.shape) for p in pl.values() if p.shard_factor == 1)
    assert r.allgather_fwd_bytes == r.reduce_scatter_bytes == 4 * sharded * 3 // 4
    assert r.all_reduce_bytes == 4 * math.ceil(2 * 3 / 4 * replicated)
    # bf16 policy: gathers move half the bytes, reductions follow reduce_dtype
    rb = plan(tiny_cfg, Layout.preset("fsdp"), 4, param_dtype=torch.bfloat16)
    assert 2 * rb.allgather_fwd_bytes == r.allgather_fwd_bytes and rb.reduce_scatter_bytes == r.reduce_scatter_bytes
    rbb = plan(tiny_cfg, Layout.preset("fsdp"), 4, param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert 2 * rbb.reduce_scatter_bytes == r.reduce_scatter_bytes
    assert r.numel_max == sharded // 4 + replicated


def test_plan_cli(capsys, tmp_path):
    assert plan_cli(["--model", "tiny", "--layout", "fsdp_ep", "--world", "4", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "layout fsdp_ep · world 4 = fsdp=2 × ep=2" in out and "\n  params          bf16  " in out
    assert plan_cli(["--model", "tiny", "--layout", "fsdp_ep", "--world", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "WORLD_SIZE=3" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("include: fsdp_ep.yaml\nrules: {expert_mlp: ep}\n")
    assert plan_cli(["--model", "tiny", "--layout", str(bad), "--world", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mesh dim 'ep' shards both dim 0 (expert) and dim 1 (expert_mlp)" in err
    assert plan_cli(["--model", "tiny", "--layout", "qwen3_8_2_4t", "--world", "8", "--mesh", "ep=2"]) == 0
    capsys.readouterr()
