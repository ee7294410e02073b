"""Mixed precision (docs/parallel.md#mixed-precision), torch's AdamW kernels, FSDP reshard-after-forward, tensors on their
inputs' device (docs/testing.md#device-correctness-without-a-gpu), and loss terms with no valid targets."""

import functools
import math

import attrs
import pytest
import torch

from q38.model_config import ConfigError, ModelConfig
from q38.pytree import named_leaves, tree_leaves
from q38.train.core.step_config import TrainConfig
from q38.train.core.optim import adamw_step
from q38.train.core.state import decay_mask, init_state
from q38.train.core.step import loss_and_grads, train_step
from tests.device_check import FactoryDeviceMode
from tests.dist_utils import run_distributed
from tests.test_parallel import _batch, _cfg

BF16 = dict(param_dtype="bfloat16")
# Mesh vs one device, both under the bf16 policy. For scale: on one device, micro_batches 2 vs 1 (only the bf16
# summation order changes) already differs by up to 2.1e-2 (median 8e-3) in ‖Δg‖ / ‖g‖; measured mesh values are
# printed by the test and quoted in the report.
GRAD_REL_BF16 = 5e-2  # ‖Δg‖ / ‖g‖ per leaf
# ‖p_mesh - p_ref‖ / ‖p_ref - p_init‖ over all leaves after 2 steps (relative to the update). Adam turns a tiny
# gradient's sign into a full ±lr step, so bf16 summation-order noise on near-zero gradients moves whole updates:
# measured 0.11 before, 0.21 after the objective counted every real token in the aux loss (fsdp 2).
PARAM_TOL_BF16 = 3e-1


# ---- configuration ------------------------------------------------------------------------------------------------


def test_precision_fields_default_to_fp32_and_unknown_dtypes_are_one_clear_error():
    tc = TrainConfig()
    assert (tc.param_dtype, tc.reduce_dtype, tc.reshard_after_forward) == ("float32", "float32", True)
    for field, bad in (("param_dtype", "bf16x"), ("reduce_dtype", "float16")):
        with pytest.raises(ConfigError, match=f"{field} must be one of .*float32.*bfloat16"):
            TrainConfig(**{field: bad})


# ---- the optimizer ------------------------------------------------------------------------------------------------


def _reference_adamw(params, grads, ms, vs, decay, *, step, lr, b1, b2, eps, wd, scale):
    """The per-leaf fp32 loop q38 used before torch's kernels (the independent reference)."""
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    out = []
    for p, g, m, v, dec in zip(params, grads, ms, vs, decay):
        g = g.float() * scale
        m = m * b1 + g * (1 - b1)
        v = v * b2 + g * g * (1 - b2)
        upd = (m / bc1) / ((v / bc2).sqrt() + eps)
        if dec and wd:
            upd = upd + wd * p
        out.append((p - lr * upd, m, v))
    return out


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_torch_adamw_kernels_match_the_reference_update(impl):
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (3,), (4, 2, 3), (0, 4), (1,)]
    params = [torch.randn(s, generator=g) for s in shapes]
    ms = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    vs = [torch.rand(s, generator=g) * 0.01 for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    decay = [True, False, True, True, False]
    kw = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    before = [t.clone() for t in params + ms + vs + grads]
    for step in (1, 5):
        scale = torch.tensor(0.37)
        new_p, new_m, new_v = adamw_step(params, grads, ms, vs, decay, step=step, grad_scale=scale, impl=impl, **kw)
        ref = _reference_adamw(params, grads, ms, vs, decay, step=step, lr=kw["lr"], b1=kw["beta1"],
                               b2=kw["beta2"], eps=kw["eps"], wd=kw["weight_decay"], scale=scale)
        for (rp, rm, rv), p, m, v in zip(ref, new_p, new_m, new_v):
            for got, want in ((p, rp), (m, rm), (v, rv)):
                assert got.shape == want.shape and ((got - want).abs() <= 1e-6).all()
    assert all(torch.equal(a, b) for a, b in zip(before, params + ms + vs + grads))  # inputs untouched


def test_bf16_policy_step_changes_every_element_with_a_gradient(tiny_cfg):
    """At lr 2e-5 bf16 storage froze 71 % of elements (issue #8); fp32 masters move every one that has a gradient
    (and weight decay moves the decayed ones even where the gradient is 0)."""
    tc = TrainConfig(lr=2e-5, weight_decay=0.1, warmup_steps=0, schedule="constant", loss_chunk_size=64, **BF16)
    cfg = tiny_cfg.replace(initializer_range=0.1)
    state = init_state(cfg, tc, seed=0)
    batch = _batch(b=4, s=16)
    r = loss_and_grads(state, batch)
    grads = r.grads
    new, _ = train_step(state, batch)
    scale = min(1.0, tc.grad_clip / (float(r.grad_norm) + 1e-6)) if tc.grad_clip is not None else 1.0
    for (name, p), q, g, dec in zip(named_leaves(state.params), tree_leaves(new.params), grads,
                                    decay_mask(state.params, tc)):
        assert p.dtype == q.dtype == torch.float32, name  # masters stay fp32
        moved = q != p
        # The exact first AdamW step in fp64 (m̂ = g, v̂ = g²): an element must move unless that step is below fp32's
        # resolution at p (Adam's part and decoupled decay can cancel; measured: 1 element of 24,576 in embed).
        gs = g.double() * scale
        delta = tc.lr * (gs / (gs.abs() + tc.eps) + (tc.weight_decay * p.double() if dec else 0.0))
        resolvable = delta.abs() > 2 * torch.finfo(torch.float32).eps * p.double().abs()
        need = ((g != 0) | torch.tensor(dec)) & resolvable
        assert int(need.sum()) >= 0.99 * need.numel(), f"{name}: the resolvable set is too small to test"
        assert bool(moved[need].all()), f"{name}: {int((~moved[need]).sum())} of {int(need.sum())} did not change"
    assert all(m.dtype == torch.float32 for m in tree_leaves(new.exp_avg) + tree_leaves(new.exp_avg_sq))


@pytest.mark.slow
def test_bf16_policy_tracks_fp32_over_100_steps(tiny_cfg):
    """Tiny preset, 100 steps over a fixed cycle of 10 batches, fp32 vs the bf16 policy from the same init, for three
    init seeds.

    Single runs are chaotic: this model is very sensitive to weight rounding (fp32 compute on bf16-*rounded* initial
    weights already changes the gradients by 29 % median ‖Δg‖/‖g‖, about as much as the bf16 policy: 32 %), and a
    rounding-level reorder of one fp32 op moves the fp32 run's last-cycle loss by 3 %. Measured last-cycle gaps
    (bf16 − fp32) / fp32 over seeds 0–7: −9.8 % … +3.0 % (mean −2.0 %) on commit 7055dfc, and −0.2 % … +10.8 %
    (mean +4.8 %) after the hand-written norm / SwiGLU backwards, whose two halves alone gave means of −2.0 % and
    +0.5 % over seeds 1–4 (no systematic effect could be separated from the spread). So a single seed cannot
    carry a tight bound. What must hold, for every seed: the loss over each cycle of 10 batches within 15 %
    (relative) of fp32's and a fall of more than 4 nats; over the three seeds: the mean last-cycle gap within
    10 % (seeds 0–2 measured: +7.2 % and −1.1 % on the two commits above). Lost updates are tested directly by the
    first-step test above. About 2 min on an idle 2-core machine, hence slow."""
    cfg = tiny_cfg.replace(initializer_range=0.1)
    last_gaps = []
    for seed in (0, 1, 2):
        states, losses = {}, {"float32": [], "bfloat16": []}
        for dt in losses:
            tc = TrainConfig(lr=3e-3, warmup_steps=10, total_steps=100, loss_chunk_size=64, param_dtype=dt)
            states[dt] = init_state(cfg, tc, seed=seed)
        for i in range(100):
            batch = _batch(seed=i % 10, b=4, s=16)
            for dt in losses:
                states[dt], m = train_step(states[dt], batch)
                losses[dt].append(float(m.loss))
        cyc = {dt: [sum(v[c : c + 10]) / 10 for c in range(0, 100, 10)] for dt, v in losses.items()}
        rel = [(b - a) / a for a, b in zip(cyc["float32"], cyc["bfloat16"])]
        print(f"seed {seed}: cycle means fp32", cyc["float32"], "bf16", cyc["bfloat16"], "relative gaps", rel)
        assert max(abs(r) for r in rel) <= 0.15, seed
        assert cyc["bfloat16"][0] - cyc["bfloat16"][-1] > 4.0, seed
        last_gaps.append(rel[-1])
    assert abs(sum(last_gaps) / len(last_gaps)) <= 0.10, last_gaps


def test_checkpoint_resume_under_the_bf16_policy_is_identical(tmp_path, tiny_cfg):
    from q38.train.io import checkpoint as ck

    # one GDN and one attention layer: a bitwise resume does not depend on the depth
    cfg = tiny_cfg.replace(initializer_range=0.1, mtp_num_layers=0, num_hidden_layers=2,
                           layer_types=("linear_attention", "full_attention"))
    tc = TrainConfig(lr=1e-3, loss_chunk_size=64, **BF16)
    batches = [_batch(seed=i, b=4, s=16) for i in range(4)]
    straight = init_state(cfg, tc, seed=0)
    for b in batches:
        straight, _ = train_step(straight, b)
    half = init_state(cfg, tc, seed=0)
    for b in batches[:2]:
        half, _ = train_step(half, b)
    meta = {"step": int(half.step), "model_config": cfg.to_dict(), "train_config": tc.to_dict(),
            "param_dtype": "float32", "data": None}
    path = ck.save_checkpoint(tmp_path / "checkpoints", half, meta)
    resumed, _ = ck.load_checkpoint(path, init_state(cfg, tc, seed=1))
    assert all(t.dtype == torch.float32 for t in tree_leaves(resumed.params) + tree_leaves(resumed.exp_avg))
    for b in batches[2:]:
        resumed, _ = train_step(resumed, b)
    for tree in ("params", "exp_avg", "exp_avg_sq"):
        for (n, a), b in zip(named_leaves(getattr(straight, tree)), tree_leaves(getattr(resumed, tree))):
            assert torch.equal(a, b), f"{tree}.{n}"


# ---- empty loss terms ---------------------------------------------------------------------------------------------


def test_all_ignored_labels_give_zero_loss_not_nan(tiny_cfg):
    cfg = tiny_cfg.replace(initializer_range=0.1)
    state = init_state(cfg, TrainConfig(loss_chunk_size=64), seed=0)
    batch = _batch(b=4, s=16)
    batch = dict(batch, labels=torch.full_like(batch["labels"], -100))
    new, m = train_step(state, batch)
    d = m.as_dict()
    assert d["loss"] == 0.0 and d["tokens"] == 0 and d["mtp_1"] == 0.0 and d["mtp_1_tokens"] == 0
    assert not d["skipped"] and math.isfinite(d["objective"]) and math.isfinite(d["grad_norm"])
    assert all(bool(torch.isfinite(p).all()) for p in tree_leaves(new.params))


def test_mtp_depth_2_over_two_token_documents(tiny_cfg):
    """Every document has 2 tokens: only the main loss (target t + 1) has targets; MTP depths 1 and 2 (targets
    t + 2, t + 3) have none anywhere, so their terms are 0 with count 0 (they were NaN: 0 / 0)."""
    cfg = tiny_cfg.replace(initializer_range=0.1, mtp_num_layers=2)
    state = init_state(cfg, TrainConfig(loss_chunk_size=64), seed=0)
    b, s = 4, 16
    batch = _batch(b=b, s=s)
    batch = dict(batch, labels=batch["input_ids"].clone(), doc_ids=(torch.arange(s) // 2).expand(b, s).contiguous())
    _, m = train_step(state, batch)  # nan_policy: stop would raise on a NaN
    d = m.as_dict()
    assert d["mtp_1"] == d["mtp_2"] == 0.0 and d["mtp_1_tokens"] == d["mtp_2_tokens"] == 0
    assert d["tokens"] == b * s // 2 and d["loss"] > 0 and math.isfinite(d["objective"]) and not d["skipped"]


# ---- on a mesh: the bf16 policy matches one device; reshard after forward; devices ---------------------------------


def _policy_rank_fn(rank, world, layout_name, mesh_sizes, tc, steps):
    import torch.distributed as dist

    from q38.parallel.layout import Layout
    from q38.parallel.mesh import make_mesh, shard, shard_batch, unshard

    seen = {"all_gather": set(), "reduce_scatter": set()}
    for name in seen:  # record the dtypes the FSDP collectives move (this forked child only)
        orig = getattr(dist, name)

        def spy(out, inp, *a, _orig=orig, _name=name, **k):
            seen[_name].add((out[0] if isinstance(out, list) else inp[0] if isinstance(inp, list) else out).dtype)
            return _orig(out, inp, *a, **k)

        setattr(dist, name, spy)
    cfg = _cfg()
    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = shard(init_state(cfg, tc, seed=0), mesh)
    r = loss_and_grads(state, shard_batch(_batch(), mesh, cfg.mtp_num_layers), mesh)
    grads = {n: g.full_tensor() for (n, _), g in zip(named_leaves(state.params), r.grads)}
    for i in range(steps):
        state, _ = train_step(state, shard_batch(_batch(seed=i), mesh, cfg.mtp_num_layers), mesh)
    params = dict(named_leaves(unshard(state).params))
    return {"loss": float(r.loss), "grads": grads if rank == 0 else None, "params": params if rank == 0 else None,
            "dtypes": {k: sorted(str(d) for d in v) for k, v in seen.items()}}


@functools.lru_cache(maxsize=None)
def _policy_reference(tc, steps):  # depends only on its arguments: computed once for both layouts (read only)
    state = init_state(_cfg(), tc, seed=0)
    r = loss_and_grads(state, _batch())
    grads = dict(zip([n for n, _ in named_leaves(state.params)], r.grads))
    for i in range(steps):
        state, _ = train_step(state, _batch(seed=i))
    return {"loss": float(r.loss), "grads": grads, "params": dict(named_leaves(state.params))}


@pytest.mark.dist
@pytest.mark.parametrize("layout,mesh_sizes,world", [("fsdp", {"fsdp": 2}, 2), ("fsdp_ep", {"fsdp": 1, "ep": 2}, 2)])
def test_bf16_policy_layout_matches_one_device_bf16(layout, mesh_sizes, world):
    """Same policy on one device and on the mesh. bf16 matmul outputs (weight gradients included) are rounded per
    rank before the fp32 reduce-scatter, and each rank's bf16 backward sums in another order, so gradients agree
    to a few bf16 ulps compounded through the layers: ‖Δg‖/‖g‖ <= GRAD_REL_BF16 per leaf; loss 1e-3; the
    2-step update of all parameters agrees to PARAM_TOL_BF16 of its own size. Measured: see the report."""
    tc = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01, lr=1e-3, eps=1e-3, **BF16)
    ref = _policy_reference(tc, 2)
    outs = run_distributed(_policy_rank_fn, world, layout, mesh_sizes, tc, 2)
    o = outs[0]
    rel = {n: float((o["grads"][n] - g).norm() / g.norm().clamp(min=1e-12)) for n, g in ref["grads"].items()}
    init = dict(named_leaves(init_state(_cfg(), tc, seed=0).params))  # updates: Δp = p_after - p_init
    diff = torch.cat([(o["params"][n] - p).flatten() for n, p in ref["params"].items()]).norm()
    upd = float(diff / torch.cat([(p - init[n]).flatten() for n, p in ref["params"].items()]).norm())
    print(f"bf16 {layout}: |Δloss| {abs(o['loss'] - ref['loss']):.2e}, max rel grad err {max(rel.values()):.2e} "
          f"({max(rel, key=rel.get)}), rel update err {upd:.2e}")
    assert abs(o["loss"] - ref["loss"]) <= 1e-3
    for name, r in rel.items():
        assert r <= GRAD_REL_BF16, name
    assert all(p.dtype == o["params"][n].dtype == torch.float32 for n, p in ref["params"].items())
    assert upd <= PARAM_TOL_BF16
    if layout == "fsdp":  # gathers move bf16, gradients are reduce-scattered in reduce_dtype (fp32)
        assert o["dtypes"] == {"all_gather": ["torch.bfloat16"], "reduce_scatter": ["torch.float32"]}


def _reshard_rank_fn(rank, world, tc):
    import torch.utils._pytree as pytree

    from q38.model import forward
    from q38.parallel.layout import Layout
    from q38.parallel.mesh import make_mesh, shard, shard_batch
    from q38.train.core.step import make_layer_hooks, step_runtime

    cfg = _cfg()
    mesh = make_mesh(Layout.preset("fsdp").with_mesh(fsdp=2), world)
    state = shard(init_state(cfg, tc, seed=0), mesh)
    mb = shard_batch(_batch(), mesh, cfg.mtp_num_layers)
    runtime = step_runtime(mesh, tc)
    flat, spec = pytree.tree_flatten(state.params)
    leaves = [t.detach().requires_grad_(True) for t in flat]
    p = pytree.tree_unflatten(leaves, spec)
    runtime.bind(p)
    out = forward(p, mb.input_ids, cfg, mtp_input_ids=mb.mtp_inputs, info=runtime.seq_info(mb),
                  hooks=make_layer_hooks(runtime, tc))
    live = runtime.live_gathered_bytes()  # at the end of the forward, before any backward
    loss = out.hidden.float().square().mean() + sum(h.float().square().mean() for h in out.mtp_hidden)
    loss = loss + sum(r.float().square().mean() for r in out.router_logits)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    nbytes = torch.tensor([], dtype=tc.torch_param_dtype).element_size()
    layer = max(sum(t.numel() for t in pytree.tree_leaves(lp)) * nbytes for lp in [*p.layers, *p.mtp.layers])
    total = sum(t.numel() for t in flat) * nbytes
    full = {n: (g.full_tensor() if g is not None else None) for (n, _), g in zip(named_leaves(p), grads)}
    return {"live": live, "layer": layer, "total": total, "regathers": runtime.regathers(), "grads": full}


@pytest.mark.dist
@pytest.mark.parametrize("param_dtype", ["bfloat16"])
def test_fsdp_reshard_after_forward_keeps_at_most_two_layers_gathered(param_dtype):
    """Live gathered-parameter bytes at the end of the forward (storage still allocated, whoever holds it): within
    two decoder layers' worth with recompute off (reshard after forward) and on; ``reshard_after_forward: false``
    keeps far more (the measure sees the difference). Gradients are bitwise those of the kept-gathered run."""
    base = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01, param_dtype=param_dtype)
    runs = {
        "reshard": base,
        "recompute": base.replace(recompute=True),
        "keep": base.replace(reshard_after_forward=False),
    }
    res = {k: run_distributed(_reshard_rank_fn, 2, tc)[0] for k, tc in runs.items()}
    layer = res["reshard"]["layer"]
    assert res["reshard"]["live"] <= 2 * layer, (res["reshard"]["live"], layer)
    assert res["recompute"]["live"] <= 2 * layer, (res["recompute"]["live"], layer)
    assert res["keep"]["live"] > 3 * layer  # without resharding most of the model stays gathered
    assert res["reshard"]["regathers"] > 0 and res["keep"]["regathers"] == 0
    print({k: (r["live"], r["regathers"]) for k, r in res.items()}, "layer", layer, "model", res["keep"]["total"])
    for n, g in res["keep"]["grads"].items():
        got = res["reshard"]["grads"][n]
        assert (got is None and g is None) or torch.equal(got, g), n


def _device_rank_fn(rank, world, layout_name, mesh_sizes, tc):
    from q38.parallel.layout import Layout
    from q38.parallel.mesh import make_mesh, shard, shard_batch

    cfg = _cfg()
    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = shard(init_state(cfg, tc, seed=0), mesh)
    batch = shard_batch(_batch(), mesh, cfg.mtp_num_layers)
    with FactoryDeviceMode() as mode:
        train_step(state, batch, mesh)
    return sorted(set(mode.calls))


DEVICE_CASES = [
    ("fsdp", {"fsdp": 2}, 2, {}),
    ("fsdp_ep", {"fsdp": 1, "ep": 2}, 2, {"enable_ep_balance": True}),  # EP dispatch and the balance copies
    ("fsdp_cp", {"fsdp": 1, "cp": 2}, 2, {"recompute": True}),
]


def test_one_device_step_creates_no_tensor_without_a_device():
    tc = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01, micro_batches=2, **BF16)
    state = init_state(_cfg(), tc, seed=0)
    with FactoryDeviceMode() as mode:
        train_step(state, _batch())
    assert mode.calls == []


@pytest.mark.dist
@pytest.mark.parametrize("layout,mesh_sizes,world,extra", DEVICE_CASES, ids=[c[0] for c in DEVICE_CASES])
def test_mesh_step_creates_no_tensor_without_a_device(layout, mesh_sizes, world, extra):
    """Real gloo steps under FactoryDeviceMode (tests/device_check.py says why this stands in for nccl/hccl).
    With the EP fixes reverted (load count, all-to-all receive buffer, idx/pick) this fails, naming
    q38/parallel/runtime.py lines."""
    tc = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01, **BF16, **extra)
    calls = run_distributed(_device_rank_fn, world, layout, mesh_sizes, tc)
    assert calls == [[]] * world, calls


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp_ep_cp", "qwen3_8_2_4t"])
def test_ep_cp_step_creates_no_tensor_without_a_device(layout):
    """The 4-rank shipped layouts (the production one with its uneven embedding shards), EP balance on."""
    tc = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01, enable_ep_balance=True, **BF16)
    calls = run_distributed(_device_rank_fn, 4, layout, {"fsdp": 1, "ep": 2, "cp": 2}, tc)
    assert calls == [[]] * 4, calls


def test_convert_to_hf_writes_the_compute_dtype_of_the_run(tmp_path, tiny_cfg):
    """Checkpoints hold fp32 masters; ``q38 convert --to-hf`` of a bf16-policy run writes each tensor in its compute
    dtype: bf16, except the leaves ``train.fp32_params`` keeps fp32 (GDN ``A_log`` and norm, as Qwen3.5 checkpoints
    ship them), and a bf16 config; ``--dtype`` still overrides every tensor."""
    import json
    import struct

    from q38.cli import main
    from q38.train.io import checkpoint as ck

    tc = TrainConfig(**BF16)
    state = init_state(tiny_cfg, tc, seed=0)
    meta = {"step": 0, "model_config": tiny_cfg.to_dict(), "train_config": tc.to_dict(), "param_dtype": "float32",
            "data": None}
    path = ck.save_checkpoint(tmp_path / "checkpoints", state, meta)
    for args, want in (([], "BF16"), (["--dtype", "float32"], "F32")):
        out = tmp_path / f"hf_{want}"
        assert main(["convert", "--to-hf", str(path), str(out), *args]) == 0
        for f in out.glob("*.safetensors"):
            raw = f.read_bytes()
            header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
            kept = {k for k in header if k.endswith(("linear_attn.A_log", "linear_attn.norm.weight"))}
            assert kept, f"{f}: no A_log / GDN norm"  # tiny has GDN layers
            assert {v["dtype"] for k, v in header.items() if k != "__metadata__" and k not in kept} == {want}, f
            assert {header[k]["dtype"] for k in kept} == {"F32"}, f
        assert json.loads((out / "config.json").read_text())["dtype"] == {"BF16": "bfloat16", "F32": "float32"}[want]


def test_run_dtype_bfloat16_means_the_bf16_policy():
    from q38.train.run.trainer import RunConfig

    cfg = RunConfig.from_dict({"model": "tiny", "run": {"dtype": "bfloat16"}})
    assert (cfg.train.param_dtype, cfg.train.reduce_dtype) == ("bfloat16", "float32")
    with pytest.raises(ConfigError, match="run.dtype 'bfloat16' and train.param_dtype 'float32' disagree"):
        RunConfig.from_dict({"model": "tiny", "run": {"dtype": "bfloat16"}, "train": {"param_dtype": "float32"}})
    with pytest.raises(ConfigError, match="param_dtype must be one of .*use bfloat16"):
        RunConfig.from_dict({"model": "tiny", "run": {"dtype": "float16"}})
