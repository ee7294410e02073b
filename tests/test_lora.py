"""LoRA (q38.lora): step 0 is the base model, only the adapters train, every shipped layout equals one process, the
frozen base costs its storage dtype and nothing else on each rank, and the ``peft`` section is checked up front."""

import attrs
import pytest
import torch

from q38.model_config import ModelConfig
from q38.errors import ConfigError
from q38.layers.common import leaf_generator
from q38.lora import PeftConfig, add_adapters, is_adapter_path, merged_params
from q38.model import init_params, logits
from q38.parallel.layout import Layout
from q38.pytree import named_leaves, tree_map_with_path
from q38.train.core.step_config import TrainConfig
from q38.train.core.state import state_from_params
from q38.train.core.step import loss_and_grads, train_step
from tests.dist_utils import run_distributed

TOL = 1e-5


def _cfg():
    return ModelConfig.preset("tiny").replace(initializer_range=0.1, mtp_num_layers=1)


def _batch(seed=0, b=4, s=32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 384, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    doc = torch.zeros(b, s, dtype=torch.long)
    doc[:, 10:] = 1
    doc[2, 20:] = 2
    return {"input_ids": ids, "labels": labels, "doc_ids": doc}


def _lora_state(tc, peft, *, nonzero_b=False, dtype=None):
    """Base = the seed-0 tiny model; adapters per ``peft``. ``nonzero_b``: B drawn small and nonzero (so A's
    gradients are nonzero too: at B = 0 they vanish)."""
    cfg = _cfg()
    p = add_adapters(init_params(cfg, seed=0), peft, seed=0, base_dtype=dtype)
    if nonzero_b:
        def perturb(path, t):
            if not path.endswith(("lora_b", "shared_b")):
                return t
            return torch.randn(t.shape, generator=leaf_generator(1, path)) * 0.05
        p = tree_map_with_path(perturb, p)
    return state_from_params(p, cfg, tc, peft=peft)


PEFTS = {
    "per_expert": PeftConfig(rank=4, alpha=8, experts="per_expert", mtp=True),
    "shared": PeftConfig(rank=4, alpha=8, experts="shared", mtp=True),
}


@pytest.mark.parametrize("mode", list(PEFTS))
def test_step0_equals_base_model(mode):
    """B = 0: the LoRA run's loss, logits and merged weights are the base model's, bit for bit."""
    cfg, tc = _cfg(), TrainConfig(loss_chunk_size=16)
    base = state_from_params(init_params(cfg, seed=0), cfg, tc)
    lora = _lora_state(tc, PEFTS[mode])
    batch = _batch()
    r0, r = loss_and_grads(base, batch), loss_and_grads(lora, batch)
    assert float(r.loss) == float(r0.loss) and float(r.aux_loss) == float(r0.aux_loss)
    assert float(r.mtp_losses[0]) == float(r0.mtp_losses[0])
    merged = merged_params(lora.params)
    for (n, w), (_, w0) in zip(named_leaves(merged), named_leaves(base.params)):
        assert torch.equal(w, w0), n
    ids = batch["input_ids"]
    assert torch.equal(logits(merged, ids, cfg), logits(base.params, ids, cfg))


def test_adapters_cover_every_target_and_experts_per_expert():
    """Every targeted projection of every layer (MTP included when asked) carries an adapter; expert adapters have
    the expert dim (per expert) or none (shared); the router is not adapted by default."""
    cfg = _cfg()
    for mode, peft in PEFTS.items():
        names = dict(named_leaves(add_adapters(init_params(cfg, seed=0), peft, seed=0)))
        for t in peft.targets:
            holders = [n for n in names if n.endswith(f".{t}.base")]
            n_expect = sum(1 for lt in cfg.layer_types if t in _kind_targets(lt)) + (t in _kind_targets("full_attention"))
            assert len(holders) == n_expect, (mode, t, holders)
        a = names["layers.0.moe.we_gate_up.lora_a" if mode == "per_expert" else "layers.0.moe.we_gate_up.shared_a"]
        b = names["layers.0.moe.we_down.lora_b" if mode == "per_expert" else "layers.0.moe.we_down.shared_b"]
        e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        assert tuple(a.shape) == ((e, 4, d) if mode == "per_expert" else (4, d))
        assert tuple(b.shape) == ((e, d, 4) if mode == "per_expert" else (d, 4))
        assert not any(".w_router." in n for n in names)
        assert "mtp.layers.0.mixer.w_q.lora_a" in names


def _kind_targets(layer_type):
    from q38.lora import ATTENTION_TARGETS, EXPERT_TARGETS, GDN_TARGETS, SHARED_EXPERT_TARGETS

    mixer = ATTENTION_TARGETS if layer_type == "full_attention" else GDN_TARGETS
    return mixer + EXPERT_TARGETS + SHARED_EXPERT_TARGETS


@pytest.mark.parametrize("mode", list(PEFTS))
def test_only_adapters_train(mode):
    """After two steps only adapter matrices changed; the state holds moments only for them; the base is stored in
    the compute dtype (bf16 under the bf16 policy, but the GDN decay A_log and norm weight fp32, as the released
    checkpoints store them) and has no master copy."""
    tc = TrainConfig(loss_chunk_size=16, lr=1e-2, param_dtype="bfloat16")
    s0 = _lora_state(tc, PEFTS[mode], dtype=tc.compute_dtype)
    s = s0
    for i in range(2):
        s, m = train_step(s, _batch(seed=i))
        assert torch.isfinite(m.loss)
    before, after = dict(named_leaves(s0.params)), dict(named_leaves(s.params))
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    adapters = {n for n in before if is_adapter_path(n)}
    assert changed == adapters
    assert {n for n, _ in named_leaves(s.exp_avg)} == adapters == {n for n, _ in named_leaves(s.exp_avg_sq)}
    fp32 = {n for n in before if n.endswith((".mixer.A_log", ".mixer.norm_w"))}
    assert fp32 and all(".mixer." in n for n in fp32)
    for n, t in before.items():
        assert t.dtype == (torch.float32 if n in adapters | fp32 else torch.bfloat16), n


def test_peft_config_refusals():
    for bad, msg in [({"rank": 0}, "peft.rank"), ({"dropout": 0.1}, "not implemented"),
                     ({"targets": ["w_qq"]}, "unknown parameter name"), ({"experts": "some"}, "peft.experts"),
                     ({"method": "dora"}, "peft.method"), ({"rnak": 4}, "unknown key")]:
        with pytest.raises(ConfigError, match=msg):
            PeftConfig.from_dict(bad)
    from q38.train.run.run_config import RunConfig

    cfg = RunConfig.from_dict({"model": "tiny", "peft": {"rank": 8, "targets": ["w_q", "we_down"]}})
    assert cfg.peft.rank == 8 and cfg.peft.targets == ("w_q", "we_down") and cfg.peft.scale == 4.0
    assert RunConfig.from_dict({"model": "tiny"}).peft is None


# ---- every shipped layout equals one process ---------------------------------------------------------------------


def _rank_fn(rank, world, layout_name, mesh_sizes, tc, mode, steps):
    from q38.parallel.mesh import make_mesh, shard, shard_batch, unshard

    cfg = _cfg()
    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = shard(_lora_state(tc, PEFTS[mode], nonzero_b=True), mesh)
    r = loss_and_grads(state, shard_batch(_batch(), mesh, cfg.mtp_num_layers), mesh)
    names = [n for n, _ in named_leaves(state.params) if is_adapter_path(n)]
    grads = {n: g.full_tensor() for n, g in zip(names, r.grads)}  # collective: every rank
    out = {"loss": float(r.loss), "grad_norm": float(r.grad_norm), "grads": grads if rank == 0 else None}
    for i in range(steps):
        state, _ = train_step(state, shard_batch(_batch(seed=i), mesh, cfg.mtp_num_layers), mesh)
    full = dict(named_leaves(unshard(state).params))
    out["params"] = {n: t for n, t in full.items() if is_adapter_path(n)} if rank == 0 else None
    return out


# Every shipped layout; one EP case runs by default, the rest are slow-marked (20-120 s each on the shared 2-core
# machine).
_ALL = [
    ("fsdp_ep", {"fsdp": 1, "ep": 2}, 2, "per_expert"),
    ("fsdp", {"fsdp": 2}, 2, "per_expert"),
    ("fsdp_ep", {"fsdp": 1, "ep": 2}, 2, "shared"),
    ("fsdp_cp", {"fsdp": 1, "cp": 2}, 2, "per_expert"),
    ("fsdp_ep", {"fsdp": 2, "ep": 2}, 4, "per_expert"),
    ("fsdp_cp", {"fsdp": 2, "cp": 2}, 4, "shared"),
    ("fsdp_ep_cp", {"fsdp": 1, "ep": 2, "cp": 2}, 4, "per_expert"),
    ("hsdp", {"dp_replicate": 2, "fsdp": 2}, 4, "per_expert"),
]
CASES = [pytest.param(*c, marks=() if i == 0 else pytest.mark.slow,
                       id=f"{c[0]}-{'x'.join(f'{k}{v}' for k, v in c[1].items())}-{c[3]}") for i, c in enumerate(_ALL)]


@pytest.mark.dist
@pytest.mark.parametrize("layout,mesh_sizes,world,mode", CASES)
def test_lora_layout_matches_single_process(layout, mesh_sizes, world, mode):
    """Loss, every adapter gradient (A and B: B starts nonzero here) and the adapters after one step, against one
    process (fp32): |Δ| ≤ 1e-5 relative to the tensor's largest entry (measured 1.1e-5 absolute on B gradients up
    to 1.5, fsdp_ep shared: the summation order over ranks differs)."""
    tc = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01, lr=1e-3, eps=1e-3)
    ref_state = _lora_state(tc, PEFTS[mode], nonzero_b=True)
    r = loss_and_grads(ref_state, _batch())
    names = [n for n, _ in named_leaves(ref_state.params) if is_adapter_path(n)]
    ref_grads = dict(zip(names, r.grads))
    assert sum(bool(g.abs().sum() > 0) for g in r.grads) == len(names)  # A and B both get gradients
    s = ref_state
    s, _ = train_step(s, _batch(seed=0))
    ref_params = {n: t for n, t in named_leaves(s.params) if is_adapter_path(n)}
    outs = run_distributed(_rank_fn, world, layout, mesh_sizes, tc, mode, 1)
    for o in outs:
        assert abs(o["loss"] - float(r.loss)) <= TOL
        assert abs(o["grad_norm"] - float(r.grad_norm)) <= 1e-4
    for n, g in ref_grads.items():
        assert (outs[0]["grads"][n] - g).abs().max() <= TOL * max(1.0, float(g.abs().max())), n
    for n, p in ref_params.items():
        assert (outs[0]["params"][n] - p).abs().max() <= TOL * max(1.0, float(p.abs().max())), n


# ---- checkpoints: adapters + moments + a reference to the base; resume is exact --------------------------------


@pytest.mark.slow  # ~100 s on the shared 2-core machine (three short runs)
def test_lora_run_resumes_bit_identical_and_refuses_another_base(tmp_path):
    from q38.train.io import checkpoint as ck
    from q38.train.io.peft import BaseMismatch
    from q38.train.run.trainer import train
    from tests.run_utils import losses, run_config

    peft = {"rank": 4, "alpha": 8, "mtp": True}
    ref = train(run_config(tmp_path / "ref", steps=4, peft=peft))
    out = tmp_path / "run"
    first = train(run_config(out, steps=2, peft=peft))
    second = train(run_config(out, steps=4, peft=peft))
    assert [r["step"] for r in second] == [3, 4]
    assert losses(first + second) == losses(ref)  # exact
    for key in ("grad_norm", "mtp_1", "aux"):
        assert [r[key] for r in first + second] == [r[key] for r in ref], key
    step = out / "checkpoints" / "step_000004"
    saved = ck.saved_tensors(step)
    assert saved and not any(k.startswith("params.") and not is_adapter_path(k) for k in saved)  # no base weights
    assert any(k.startswith("exp_avg.") and k.endswith(".lora_a") for k in saved)
    assert ck.read_meta(step)["peft"]["base"] == {"init_from": None, "seed": 0}
    with pytest.raises(BaseMismatch, match="trained its adapters on another base"):
        train(run_config(out, steps=6, peft=peft, run={"seed": 1}))


# ---- per-rank bytes: the frozen base costs its storage dtype and nothing else ----------------------------------


def _bytes_fn(rank, world, lora):
    from q38.parallel.mesh import make_mesh, shard, shard_batch
    from q38.train.core.state import init_state

    cfg = _cfg()
    tc = TrainConfig(loss_chunk_size=16, param_dtype="bfloat16")
    layout = Layout.preset("fsdp_ep").with_mesh(fsdp=2, ep=2)
    mesh = make_mesh(layout, world)
    state = shard(_lora_state(tc, PEFTS["per_expert"], dtype=tc.compute_dtype) if lora else init_state(cfg, tc), mesh)
    local = lambda t: t.to_local()  # noqa: E731
    by_part = {}
    for part in ("params", "exp_avg", "exp_avg_sq"):
        for n, t in named_leaves(getattr(state, part)):
            key = (part, "adapter" if is_adapter_path(n) else "base", str(t.dtype))
            by_part[key] = by_part.get(key, 0) + local(t).untyped_storage().nbytes()
    shapes = {n: tuple(local(t).shape) for n, t in named_leaves(state.params) if n.startswith("layers.0.moe.we_")}
    from q38.parallel.links import Ledger

    Ledger.reset()
    r = loss_and_grads(state, shard_batch(_batch(), mesh, cfg.mtp_num_layers), mesh)
    rs = Ledger.by_kind.get("reduce_scatter", {"intra": 0, "inter": 0})
    return {"bytes": by_part, "shapes": shapes, "reduce_scatter": rs["intra"] + rs["inter"],
            "grad_bytes": sum(g.to_local().untyped_storage().nbytes() for g in r.grads)}


@pytest.mark.slow  # ~110 s: two 4-rank runs
@pytest.mark.dist
def test_frozen_base_costs_its_storage_dtype_only_on_each_rank():
    """4 gloo ranks, fsdp_ep (fsdp 2 × ep 2), bf16 policy: each rank holds its base shard in bf16 (2 bytes a value)
    and nothing else for it (no fp32 master, no moments, no gradient, no reduction); the adapters are fp32 with fp32
    moments, expert adapters split over ep with their experts."""
    cfg = _cfg()
    peft = PEFTS["per_expert"]
    base_numel = sum(t.numel() for t in named_leaves_values(init_params(cfg, seed=0, device="meta")))
    outs = run_distributed(_bytes_fn, 4, True)
    full = run_distributed(_bytes_fn, 4, False)
    e, r = cfg.num_experts, peft.rank
    for o, f in zip(outs, full):
        b = o["bytes"]
        assert set(b) == {("params", "base", "torch.bfloat16"), ("params", "base", "torch.float32"),
                          ("params", "adapter", "torch.float32"), ("exp_avg", "adapter", "torch.float32"),
                          ("exp_avg_sq", "adapter", "torch.float32")}
        # the base in bf16 (A_log and the GDN norm fp32, train.fp32_params) is half of the full fine-tune's fp32
        # master shard of the same weights but those, with no moments
        assert (b[("params", "base", "torch.bfloat16")] * 2 + b[("params", "base", "torch.float32")]
                == f["bytes"][("params", "base", "torch.float32")])
        assert b[("exp_avg", "adapter", "torch.float32")] == b[("params", "adapter", "torch.float32")]
        assert o["shapes"]["layers.0.moe.we_gate_up.lora_a"][0] == e // 2  # EP-split with the experts
        assert o["shapes"]["layers.0.moe.we_gate_up.base"][0] == e // 2
        assert o["shapes"]["layers.0.moe.we_gate_up.lora_b"][-1] == r
        # gradients exist (and are reduce-scattered) for the adapters only: bytes measured by the collectives' ledger
        assert o["grad_bytes"] == b[("params", "adapter", "torch.float32")]
        assert 0 < o["reduce_scatter"] < f["reduce_scatter"] / 5, (o["reduce_scatter"], f["reduce_scatter"])
    per_rank = [f["bytes"][("params", "base", "torch.float32")] for f in full]
    assert sum(per_rank) >= base_numel * 4  # (norms are replicated: ≥)


def named_leaves_values(tree):
    return [t for _, t in named_leaves(tree)]


# ---- the plan prices a LoRA run: checked against measured per-rank peaks on 4 gloo ranks ------------------------


def _measure_lora(rank, world, recompute):
    from q38.kernels import DEFAULT_KERNELS
    from q38.parallel.mesh import make_mesh, shard, shard_batch
    from q38.train.io.peft import lora_state
    from tests.mem_utils import PeakMemory

    cfg = ModelConfig.preset("tiny")
    tc = TrainConfig(loss_chunk_size=256, recompute=recompute == "full")
    state = lora_state(init_params(cfg, seed=0), cfg, tc, PEFTS["per_expert"], seed=0,
                       kernels=DEFAULT_KERNELS.replace(experts="grouped_mm"))
    ids = torch.randint(0, cfg.vocab_size, (8 * world, 128), generator=torch.Generator().manual_seed(0))
    mesh = make_mesh(Layout.preset("fsdp_ep").with_mesh(fsdp=2, ep=2), world)
    state = shard(state, mesh)
    batch = shard_batch({"input_ids": ids, "labels": ids}, mesh, cfg.mtp_num_layers)
    with PeakMemory(state) as pm:
        train_step(state, batch, mesh)
    return pm.peak


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_plan_prices_a_lora_run_within_15_percent(recompute):
    from q38.parallel.budget import estimate

    measured = max(run_distributed(_measure_lora, 4, recompute))
    layout = Layout.preset("fsdp_ep").with_mesh(fsdp=2, ep=2)
    b = estimate(ModelConfig.preset("tiny"), layout, 4, seq_len=128, rows_per_rank=8, recompute=recompute,
                 param_dtype="fp32", reduce_dtype="fp32", loss_chunk_tokens=256, aux_global=False, prefetch=False,
                 packed_rows=False, peft=PEFTS["per_expert"])
    full = estimate(ModelConfig.preset("tiny"), layout, 4, seq_len=128, rows_per_rank=8, recompute=recompute,
                    param_dtype="fp32", reduce_dtype="fp32", loss_chunk_tokens=256, aux_global=False,
                    prefetch=False, packed_rows=False)
    ratio = b.peak_bytes / measured
    print(f"LoRA fsdp_ep 4 ranks recompute {recompute}: predicted {b.peak_bytes:,.0f} B, measured {measured:,} B, "
          f"ratio {ratio:.3f}; full fine-tune predicted {full.peak_bytes:,.0f} B")
    assert abs(ratio - 1) <= 0.15, ratio
    rs = lambda bud: sum(c.bytes for c in bud.comm if c.collective.startswith("reduce-scatter"))  # noqa: E731
    assert rs(b) < rs(full) / 5  # only the adapters' gradients are reduced (0.11 of the full fine-tune here)


@pytest.mark.slow  # ~10 s (three searches over 8-256 devices; ~7 min before the search was pruned)
def test_fewest_ranks_lora_against_full_fine_tune():
    """The search's fewest-devices answer for Qwen3.5-35B-A3B under a 60 GiB cap (measured: full fine-tune 32 H200,
    LoRA 8 with a bf16 or an FP8 base): LoRA fits on fewer devices; an FP8 base needs no more than a bf16 one."""
    from q38.parallel.budget import GIB, Hardware
    from q38.parallel.search import fewest_ranks

    cfg = ModelConfig.preset("qwen3_5_35b_a3b")
    hw = Hardware.load("h200")
    kw = dict(seq_len=4096, memory_cap=60 * GIB, recompute_modes=("full",), ep_dispatches=("flat",))
    full = fewest_ranks(cfg, hw, 256, **kw)
    lora = fewest_ranks(cfg, hw, 256, peft=PeftConfig(rank=16), **kw)
    fp8 = fewest_ranks(cfg, hw, 256, peft=PeftConfig(rank=16, base_dtype="fp8"), **kw)
    assert lora is not None and full is not None and fp8 is not None
    print(f"fewest h200 at 60 GiB: full {full[0]}, LoRA bf16 base {lora[0]}, LoRA fp8 base {fp8[0]}")
    assert lora[0] < full[0] and fp8[0] <= lora[0]
    assert lora[1].budget.peak_bytes <= 60 * GIB


@pytest.mark.parametrize("source", ["hf", "seed"])
def test_a_lora_run_keeps_the_fp32_leaves_of_its_base_in_fp32(tmp_path, source):
    """Under the bf16 policy a LoRA run's frozen base is bf16 but for ``train.fp32_params`` (A_log, the GDN norm):
    those keep the exact fp32 values the Hugging Face checkpoint stores (read here with safetensors itself), or
    that a fresh fp32 init draws; rounding them to bf16 on the way in (a decay-rate error in every token) would
    change their bits."""
    from safetensors import safe_open

    from q38.hf import save_hf
    from q38.train.io.peft import lora_state
    from q38.train.run.run_config import RunConfig
    from q38.train.run.trainer import _initial_params
    from tests.run_utils import run_dict, small_model_dict

    cfg = ModelConfig.from_dict(small_model_dict())
    sections = {"train": {"param_dtype": "bfloat16"}, "peft": {"rank": 2, "alpha": 4}}
    if source == "hf":
        save_hf(tmp_path / "base", cfg, init_params(cfg, seed=3))  # every tensor fp32 in the files
        sections["init_from"] = str(tmp_path / "base")
    rc = RunConfig.from_dict(run_dict(tmp_path / "out", **sections))
    state = lora_state(_initial_params(rc, "cpu", rc.train.compute_dtype), rc.model, rc.train, rc.peft, seed=0)
    params = dict(named_leaves(state.params))
    kept = {n: t for n, t in params.items() if n.endswith((".mixer.A_log", ".mixer.norm_w"))}
    assert kept and all(t.dtype == torch.float32 for t in kept.values())
    assert params["layers.0.mixer.w_qkv.base"].dtype == torch.bfloat16
    if source == "hf":
        stored = None
        for file in sorted((tmp_path / "base").glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key.endswith("layers.0.linear_attn.A_log"):
                        stored = f.get_tensor(key)
        assert stored.dtype == torch.float32
        assert torch.equal(kept["layers.0.mixer.A_log"], stored)
        assert not torch.equal(stored.to(torch.bfloat16).float(), stored)  # the test can tell the two apart
    else:
        fresh = dict(named_leaves(init_params(cfg, seed=rc.run.seed)))
        for n, t in kept.items():
            assert torch.equal(t, fresh[n]), n
