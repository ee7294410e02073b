"""A LoRA run over a frozen block-FP8 base (``peft.base_dtype: fp8``; q38.fp8.Fp8Weight): step 0 is the base model
as an independent dequantizer reads the stored bits and scales; a block-FP8 checkpoint's bytes are kept as
released; only adapters train; a mesh equals one process; the base costs one byte a value plus its scales on each
rank; the plan prices it."""

import math

import attrs
import pytest
import torch

from q38.fp8 import FP8_MAX, Fp8Format, Fp8Weight, default_quantized
from q38.layers.common import materialize
from q38.lora import PeftConfig, is_adapter_path, merged_params
from q38.model import declared_info, init_params, logits
from q38.model_config import ModelConfig
from q38.parallel.layout import Layout
from q38.pytree import named_leaves, tree_map_with_path
from q38.train.core.state import state_from_params
from q38.train.core.step import loss_and_grads, train_step
from q38.train.core.step_config import TrainConfig
from q38.train.io.peft import build_fp8_base, fp8_base, lora_state
from tests.dist_utils import run_distributed
from tests.test_lora import _cfg  # the same tiny model as the compute-dtype LoRA tests

BLOCK = (16, 16)  # small blocks, so the tiny model's matrices hold several (and partial ones: 4 x 64 gates are not)
PEFT = PeftConfig(rank=4, alpha=8, mtp=True, base_dtype="fp8")


def _batch(seed=0, b=4, s=32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 384, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    doc = torch.zeros(b, s, dtype=torch.long)
    doc[:, 10:] = 1
    return {"input_ids": ids, "labels": labels, "doc_ids": doc}


def _region(seed=0):
    return lambda path, info, index: materialize(info, path, seed=seed, dtype=torch.float32, index=index)


def _fp8_state(tc, *, mesh=None, block=BLOCK, peft=PEFT, nonzero_b=False):
    cfg = _cfg()
    base = build_fp8_base(cfg, region=_region(), quantized=default_quantized, block=block,
                          dtype=tc.compute_dtype, mesh=mesh)
    state = lora_state(base, cfg, tc, peft, seed=0, mesh=mesh)
    if nonzero_b:
        import attrs

        from q38.layers.common import leaf_generator

        def perturb(path, t):
            if not path.endswith(("lora_b", "shared_b")):
                return t
            full = torch.randn(t.shape, generator=leaf_generator(1, path)) * 0.05
            if hasattr(t, "to_local"):
                from torch.distributed.tensor import DTensor, distribute_tensor

                assert isinstance(t, DTensor)
                return distribute_tensor(full, t.device_mesh, t.placements)
            return full
        state = attrs.evolve(state, params=tree_map_with_path(perturb, state.params))
    return state


def _dequantize_reference(bits: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """Written from the format: ``W[r, c] = float(e4m3(q[r, c])) * scale_inv[r // bo, c // bi]``, one block at a
    time (not q38's vectorised dequantizer)."""
    bo, bi = block
    q = bits.view(torch.float8_e4m3fn).to(torch.float32)
    out = torch.empty_like(q)
    *lead, o, i = q.shape
    for e in range(math.prod(lead)):
        qe, se, oe = q.reshape(-1, o, i)[e], scale.reshape(-1, *scale.shape[-2:])[e], out.reshape(-1, o, i)[e]
        for r in range(0, o, bo):
            for c in range(0, i, bi):
                oe[r:r + bo, c:c + bi] = qe[r:r + bo, c:c + bi] * se[r // bo, c // bi]
    return out


def _fp8_leaves(params):
    """``{weight path: Fp8Weight}`` of a tree (under an adapter or not)."""
    out = {}
    tree_map_with_path(lambda p, x: out.__setitem__(p.removesuffix(".base"), x) if isinstance(x, Fp8Weight) else x,
                       params, is_leaf=lambda x: isinstance(x, Fp8Weight))
    return out


def test_fp8_base_step0_is_the_dequantized_base_model():
    """Every projection the release quantizes is held as e4m3 bits + fp32 block scales (amax / 448, checked here);
    step 0's loss, MTP loss and logits equal those of the base model whose weights are this test's own block-by-block
    dequantization of the stored bits (fp32 compute: bit for bit), and that dequantization is within e4m3's
    rounding (2^-4 relative, plus a subnormal step) of the fp32 base."""
    cfg, tc = _cfg(), TrainConfig(loss_chunk_size=16)
    state = _fp8_state(tc)
    fp8 = _fp8_leaves(state.params)
    assert fp8 and set(fp8) == {n for n, _ in named_leaves(init_params(cfg, seed=0, device="meta"))
                                if default_quantized(n)}
    base = dict(named_leaves(init_params(cfg, seed=0)))
    ref = {}
    for path, w in fp8.items():
        assert w.bits.dtype == torch.uint8 and w.scale_inv.dtype == torch.float32 and w.block == BLOCK
        full = base[path]
        *lead, o, i = full.shape
        go, gi = -(-o // 16), -(-i // 16)
        assert tuple(w.scale_inv.shape) == (*lead, go, gi)
        pad = torch.zeros(*lead, go * 16, gi * 16)
        pad[..., :o, :i] = full
        amax = pad.reshape(*lead, go, 16, gi, 16).abs().amax(dim=(-3, -1))
        assert torch.equal(w.scale_inv, amax / FP8_MAX), path
        ref[path] = _dequantize_reference(w.bits, w.scale_inv, BLOCK)
        step = w.scale_inv.repeat_interleave(16, -2)[..., :o, :].repeat_interleave(16, -1)[..., :i] * 2.0 ** -9
        assert ((ref[path] - full).abs() <= full.abs() * 2.0 ** -4 + step).all(), path
    ref_params = tree_map_with_path(lambda p, t: ref.get(p, t), init_params(cfg, seed=0))
    batch = _batch(b=2, s=16)
    r0 = loss_and_grads(state_from_params(ref_params, cfg, tc), batch)
    r = loss_and_grads(state, batch)
    assert float(r.loss) == float(r0.loss) and float(r.mtp_losses[0]) == float(r0.mtp_losses[0])
    merged = merged_params(state.params)
    for (n, m), (_, w0) in zip(named_leaves(merged), named_leaves(ref_params)):
        assert torch.equal(m, w0), n
    ids = batch["input_ids"]
    assert torch.equal(logits(merged, ids, cfg), logits(ref_params, ids, cfg))


def test_fp8_base_only_adapters_train_and_hold_state():
    """bf16 policy, two steps: only adapter matrices change; moments exist for them only; the base's bits (uint8)
    and scales (fp32) and its other frozen leaves (bf16; A_log and the GDN norm fp32) are untouched."""
    tc = TrainConfig(loss_chunk_size=16, lr=1e-2, param_dtype="bfloat16")
    s0 = _fp8_state(tc)
    s = s0
    for i in range(2):  # (step 1 moves B only: A's gradient is zero while B is)
        s, m = train_step(s, _batch(seed=i, b=2, s=16))
        assert torch.isfinite(m.loss)
    before, after = dict(named_leaves(s0.params)), dict(named_leaves(s.params))
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    adapters = {n for n in before if is_adapter_path(n)}
    assert changed == adapters
    assert {n for n, _ in named_leaves(s.exp_avg)} == adapters == {n for n, _ in named_leaves(s.exp_avg_sq)}
    for n, t in before.items():
        fp32 = n.endswith((".scale_inv", ".mixer.A_log", ".mixer.norm_w"))
        want = (torch.float32 if n in adapters or fp32 else torch.uint8 if n.endswith(".bits") else torch.bfloat16)
        assert t.dtype == want, n


def test_fp8_checkpoint_keeps_its_bytes(tmp_path):
    """A block-FP8 Hugging Face checkpoint (written by q38 in the released layout, 16 x 16 blocks; fused main-layer
    experts, per-expert MTP experts) read as an FP8 base: every quantized leaf's bits and scales are the file's
    (read here with safetensors), so the base is bit-exact to the release, in the checkpoint's block size."""
    from safetensors import safe_open

    from q38.hf import fp8_dtypes, open_hf, save_hf

    cfg = _cfg()
    out = save_hf(tmp_path / "hf", cfg, init_params(cfg, seed=0), dtypes=fp8_dtypes(lambda q: torch.float32),
                  fp8=Fp8Format(block=BLOCK))
    src = open_hf(out)
    base = fp8_base(cfg, str(out), seed=0, dtype=torch.float32)
    fp8 = _fp8_leaves(base)
    assert set(fp8) == {n for n in src.leaf_rules() if default_quantized(n)}
    files = {}

    def tensor(key):
        f = src.index[key]
        if f not in files:
            files[f] = safe_open(str(out / f), framework="pt")
        return files[f].get_tensor(key)

    for path, w in fp8.items():
        assert w.block == BLOCK
        rule, _ = src.leaf_rules()[path]
        if len(rule.hf) == 1:  # a 2-D weight or fused experts: the tensor as stored
            assert torch.equal(w.bits, tensor(rule.hf[0]).view(torch.uint8)), path
            assert torch.equal(w.scale_inv, tensor(rule.hf[0] + "_scale_inv")), path
        else:  # per-expert MTP experts: gate, up (rows stacked) / down, expert by expert
            e = w.bits.shape[0]
            per = len(rule.hf) // e
            for x in range(e):
                keys = rule.hf[x * per:(x + 1) * per]
                assert torch.equal(w.bits[x], torch.cat([tensor(k).view(torch.uint8) for k in keys])), path
                assert torch.equal(w.scale_inv[x], torch.cat([tensor(k + "_scale_inv") for k in keys])), path


# ---- a mesh equals one process; the base's bytes per rank ---------------------------------------------------------


def _layout_fn(rank, world, layout_name, mesh_sizes, tc):
    from q38.parallel.mesh import make_mesh, shard_batch

    cfg = _cfg()
    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = _fp8_state(tc, mesh=mesh, nonzero_b=True)
    r = loss_and_grads(state, shard_batch(_batch(), mesh, cfg.mtp_num_layers), mesh)
    names = [n for n, _ in named_leaves(state.params) if is_adapter_path(n)]
    grads = {n: g.full_tensor() for n, g in zip(names, r.grads)}
    return {"loss": float(r.loss), "grad_norm": float(r.grad_norm), "grads": grads if rank == 0 else None}


_LAYOUTS = [("fsdp_ep", {"fsdp": 1, "ep": 2}, 2), ("fsdp", {"fsdp": 2}, 2), ("fsdp_ep", {"fsdp": 2, "ep": 2}, 4)]


@pytest.mark.dist
@pytest.mark.parametrize("layout,mesh_sizes,world", [
    pytest.param(*c, marks=() if i == 0 else pytest.mark.slow,
                 id=f"{c[0]}-{'x'.join(f'{k}{v}' for k, v in c[1].items())}")
    for i, c in enumerate(_LAYOUTS)])
def test_fp8_base_layout_matches_single_process(layout, mesh_sizes, world):
    """Each rank builds its own shards of the bits and scales (quantizing only the blocks it touches); gathered in
    uint8 / fp32 and dequantized after the gather: loss and every adapter gradient equal one process (fp32; 1e-5
    relative to the tensor's largest entry, as the compute-base test: the summation order over ranks differs)."""
    tc = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01)
    ref = _fp8_state(tc, nonzero_b=True)
    r = loss_and_grads(ref, _batch())
    names = [n for n, _ in named_leaves(ref.params) if is_adapter_path(n)]
    outs = run_distributed(_layout_fn, world, layout, mesh_sizes, tc)
    for o in outs:
        assert abs(o["loss"] - float(r.loss)) <= 1e-5
        assert abs(o["grad_norm"] - float(r.grad_norm)) <= 1e-4
    for n, g in zip(names, r.grads):
        assert (outs[0]["grads"][n] - g).abs().max() <= 1e-5 * max(1.0, float(g.abs().max())), n


def _bytes_fn(rank, world, fp8=True):
    from q38.parallel.links import Ledger
    from q38.parallel.mesh import make_mesh, shard, shard_batch

    cfg = _cfg()
    tc = TrainConfig(loss_chunk_size=16, param_dtype="bfloat16")
    mesh = make_mesh(Layout.preset("fsdp_ep").with_mesh(fsdp=2, ep=2), world)
    if fp8:
        state = _fp8_state(tc, mesh=mesh)
    else:  # the same LoRA run over a bf16 base
        base = build_fp8_base(cfg, region=_region(), quantized=lambda p: False, block=BLOCK, dtype=torch.bfloat16)
        state = shard(lora_state(base, cfg, tc, attrs.evolve(PEFT, base_dtype="compute"), seed=0), mesh)
    by_part = {}
    for part in ("params", "exp_avg", "exp_avg_sq"):
        for n, t in named_leaves(getattr(state, part)):
            kind = "adapter" if is_adapter_path(n) else "bits" if n.endswith(".bits") else \
                "scale" if n.endswith(".scale_inv") else "other"
            key = (part, kind, str(t.dtype))
            by_part[key] = by_part.get(key, 0) + t.to_local().untyped_storage().nbytes()
    from q38.parallel.mesh import local_index

    numel = {"bits": 0, "weight_shard": 0}
    for n, t in named_leaves(state.params):
        if n.endswith(".bits"):  # the shard of the bits is the weight's own shard under the layout
            info = declared_info(n.removesuffix(".bits").removesuffix(".base"))
            pl = mesh.layout.placements_of_shapes([(n, info)], mesh.sizes)[n].dtensor_placements()
            numel["bits"] += t.to_local().numel()
            numel["weight_shard"] += math.prod(s.stop - s.start for s in local_index(info.shape, mesh, pl))
    Ledger.reset()
    r = loss_and_grads(state, shard_batch(_batch(), mesh, cfg.mtp_num_layers), mesh)
    gathered = Ledger.by_kind.get("all_gather", {"intra": 0, "inter": 0})
    if not fp8:
        return {"all_gather": gathered["intra"] + gathered["inter"]}
    grad_bytes = sum(g.to_local().untyped_storage().nbytes() for g in r.grads)
    return {"bytes": by_part, "numel": numel, "grad_bytes": grad_bytes,
            "all_gather": gathered["intra"] + gathered["inter"]}


@pytest.mark.slow  # ~15-30 s: two 4-rank runs
@pytest.mark.dist
def test_fp8_base_costs_one_byte_a_value_plus_scales_on_each_rank():
    """4 gloo ranks, fsdp_ep (fsdp 2 x ep 2), bf16 policy: each rank holds its shard of every quantized projection as
    1 byte a value (uint8 bits) plus fp32 block scales (a 16 x 16 block: 4 / 256 bytes a value), and nothing else
    for it: no master, no moments, no gradient (gradients are the adapters' only)."""
    cfg = _cfg()
    outs = run_distributed(_bytes_fn, 4)
    bf16 = run_distributed(_bytes_fn, 4, False)
    quantized = sum(t.numel() for n, t in named_leaves(init_params(cfg, seed=0, device="meta"))
                    if default_quantized(n))
    total_bits = 0
    for o, c in zip(outs, bf16):
        # the step's all-gathers move the projections' bits (1 byte) where a bf16 base moves 2 (and the same
        # adapters, skinny gates, norms and embeddings, which are a large share of this tiny model): measured 0.70
        print(f"all-gather bytes: FP8 base {o['all_gather']:,}, bf16 base {c['all_gather']:,}")
        assert o["all_gather"] < 0.75 * c["all_gather"]
        b = o["bytes"]
        assert set(b) == {("params", "bits", "torch.uint8"), ("params", "scale", "torch.float32"),
                          ("params", "other", "torch.bfloat16"), ("params", "other", "torch.float32"),  # A_log, norm
                          ("params", "adapter", "torch.float32"), ("exp_avg", "adapter", "torch.float32"),
                          ("exp_avg_sq", "adapter", "torch.float32")}, sorted(b)
        assert b[("params", "bits", "torch.uint8")] == o["numel"]["bits"]  # one byte a value
        # scales: at most one fp32 per 16 x 16 block touched, i.e. ~4/256 byte a value (partial blocks: more)
        assert b[("params", "scale", "torch.float32")] <= b[("params", "bits", "torch.uint8")] * 4 / 256 * 4
        assert o["grad_bytes"] == b[("params", "adapter", "torch.float32")]
        assert o["numel"]["bits"] == o["numel"]["weight_shard"]
        total_bits += o["numel"]["bits"]
    assert total_bits >= quantized  # every value is held somewhere (replicated over a mesh dim: more than once)


@pytest.mark.slow  # ~10-25 s: three short runs of the trainer
def test_fp8_base_run_resumes_bit_identical(tmp_path):
    """The trainer with ``peft.base_dtype: fp8`` (fresh base, quantized as each rank draws it): 2 steps then a resume
    to 3 equal 3 straight steps exactly; the checkpoint holds no base bits or scales."""
    from q38.train.io import checkpoint as ck
    from q38.train.run.trainer import train
    from tests.run_utils import losses, run_config

    peft = {"rank": 4, "alpha": 8, "base_dtype": "fp8"}
    ref = train(run_config(tmp_path / "ref", steps=3, peft=peft))
    out = tmp_path / "run"
    first = train(run_config(out, steps=2, peft=peft))
    second = train(run_config(out, steps=3, peft=peft))
    assert [r["step"] for r in second] == [3]
    assert losses(first + second) == losses(ref)
    assert [r["grad_norm"] for r in first + second] == [r["grad_norm"] for r in ref]
    saved = ck.saved_tensors(out / "checkpoints" / "step_000003")
    assert saved and not any(k.endswith((".bits", ".scale_inv", ".base")) for k in saved)


def test_fp8_base_from_a_q38_checkpoint_is_refused(tmp_path):
    from q38.errors import ConfigError
    from q38.lora import check_runnable

    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(ConfigError, match="export it first"):
        check_runnable(PEFT, str(tmp_path))
    check_runnable(PEFT, None)  # a fresh base: runs


# ---- the plan prices an FP8-base LoRA run: checked against measured per-rank peaks on 4 gloo ranks ------------------


def _measure_fp8(rank, world, recompute):
    from q38.kernels import DEFAULT_KERNELS
    from q38.parallel.mesh import make_mesh, shard_batch
    from tests.mem_utils import PeakMemory

    cfg = ModelConfig.preset("tiny")
    tc = TrainConfig(loss_chunk_size=256, recompute=recompute == "full")
    mesh = make_mesh(Layout.preset("fsdp_ep").with_mesh(fsdp=2, ep=2), world)
    base = fp8_base(cfg, None, seed=0, dtype=torch.float32, mesh=mesh)
    state = lora_state(base, cfg, tc, PeftConfig(rank=4, alpha=8, base_dtype="fp8"), seed=0, mesh=mesh,
                       kernels=DEFAULT_KERNELS.replace(experts="grouped_mm"))
    ids = torch.randint(0, cfg.vocab_size, (8 * world, 128), generator=torch.Generator().manual_seed(0))
    batch = shard_batch({"input_ids": ids, "labels": ids}, mesh, cfg.mtp_num_layers)
    with PeakMemory(state) as pm:
        train_step(state, batch, mesh)
    return pm.peak


@pytest.mark.slow  # ~10 s: one 4-rank run per mode
@pytest.mark.dist
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_plan_prices_an_fp8_base_lora_run_within_20_percent(recompute):
    """``q38 plan``'s peak for a LoRA run over a block-FP8 base (fp32 compute, fsdp_ep 2 x 2) against the measured
    per-rank peak of live tensor storage: within 20 % (measured: 1.150 without recompute, 1.092 with full recompute;
    the plan over-counts: it holds the layer's dequantized base beside its merged weights)."""
    from q38.parallel.budget import estimate

    measured = max(run_distributed(_measure_fp8, 4, recompute))
    layout = Layout.preset("fsdp_ep").with_mesh(fsdp=2, ep=2)
    b = estimate(ModelConfig.preset("tiny"), layout, 4, seq_len=128, rows_per_rank=8, recompute=recompute,
                 param_dtype="fp32", reduce_dtype="fp32", loss_chunk_tokens=256, aux_global=False, prefetch=False,
                 packed_rows=False, peft=PeftConfig(rank=4, alpha=8, base_dtype="fp8"))
    ratio = b.peak_bytes / measured
    print(f"LoRA FP8 base fsdp_ep 4 ranks recompute {recompute}: predicted {b.peak_bytes:,.0f} B, measured "
          f"{measured:,} B, ratio {ratio:.3f}")
    assert abs(ratio - 1) <= 0.20, ratio


@pytest.mark.slow  # ~25-40 s: two searches over 16 H200 (one without pruning)
def test_pruned_search_keeps_every_fitting_candidate():
    """``search(prune=True)`` (what ``fewest_ranks`` runs: a factorisation is priced at its least-memory settings
    first and dropped when those do not fit) finds exactly the fitting candidates of the full search, LoRA over an
    FP8 base, Qwen3.5-35B-A3B on 16 H200 under a 40 GiB cap."""
    from q38.parallel.budget import GIB, Hardware
    from q38.parallel.search import search

    cfg, hw = ModelConfig.preset("qwen3_5_35b_a3b"), Hardware.load("h200")
    kw = dict(seq_len=4096, global_batch=16, memory_cap=40 * GIB, peft=PeftConfig(rank=16, base_dtype="fp8"))
    key = lambda cands: sorted((c.mesh, c.ep_dispatch, c.budget.micro_batches, c.budget.recompute)  # noqa: E731
                               for c in cands)
    full, _ = search(cfg, 16, hw, **kw)
    pruned, _ = search(cfg, 16, hw, prune=True, **kw)
    assert key(pruned) == key(full) and len(full) > 0


def test_trainer_runs_an_fp8_base_from_a_block_fp8_checkpoint(tmp_path):
    """``q38 train`` with ``init_from`` a block-FP8 Hugging Face directory and ``peft.base_dtype: fp8``: the step-1
    loss equals that of a compute-base LoRA run (fp32) from this test's own dequantization of the checkpoint, written
    back as an fp32 checkpoint (the same model, bit for bit)."""
    from safetensors import safe_open

    from q38.hf import fp8_dtypes, save_hf
    from q38.train.run.trainer import train
    from tests.run_utils import losses, run_config, small_model_dict

    cfg = ModelConfig.from_dict(small_model_dict())
    fp8_dir = save_hf(tmp_path / "fp8", cfg, init_params(cfg, seed=3), dtypes=fp8_dtypes(lambda q: torch.float32),
                      fp8=Fp8Format(block=BLOCK))
    tensors = {}
    for f in sorted(fp8_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
    deq = {}
    for k, t in tensors.items():
        if k.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            deq[k] = _dequantize_reference(t.view(torch.uint8), tensors[k + "_scale_inv"], BLOCK)
        else:
            deq[k] = t
    import json
    import shutil

    from safetensors.torch import save_file

    ref_dir = tmp_path / "deq"
    ref_dir.mkdir()
    hf_cfg = json.loads((fp8_dir / "config.json").read_text())
    hf_cfg.pop("quantization_config")
    (ref_dir / "config.json").write_text(json.dumps(hf_cfg))
    save_file(deq, str(ref_dir / "model.safetensors"))
    for f in fp8_dir.iterdir():  # tokenizer / generation files, if any
        if f.suffix not in (".safetensors", ".json") or f.name == "generation_config.json":
            shutil.copy(f, ref_dir / f.name)
    peft = {"rank": 4, "alpha": 8}
    common = dict(steps=1, model=str(fp8_dir), train={"lr": 3e-3, "warmup_steps": 0})
    got = train(run_config(tmp_path / "a", init_from=str(fp8_dir), peft=dict(peft, base_dtype="fp8"), **common))
    ref = train(run_config(tmp_path / "b", init_from=str(ref_dir), peft=peft, **dict(common, model=str(ref_dir))))
    assert losses(got) == losses(ref)


def test_plan_combines_base_and_adapter_stats_exactly():
    """The LoRA plan's statistics of base + adapters, combined from each set's (one ``param_stats`` pass less per
    layout the search prices), equal ``param_stats`` over both sets at once (tiny on fsdp_ep; Qwen3.8-2.4T on 64
    ranks, fsdp 1 x cp 4 x ep 16)."""
    import attrs

    from q38.lora import adapter_info
    from q38.model import abstract_params, is_param_info
    from q38.parallel import lora_budget
    from q38.parallel.param_stats import param_stats
    from q38.parallel.search import candidate_layout

    peft = PeftConfig(rank=16)
    for name, world in (("tiny", 4), ("qwen3_8_2_4t", 64)):
        cfg = ModelConfig.preset(name)
        lay = Layout.from_dict(candidate_layout(cfg, *((2, 1, 2) if world == 4 else (1, 4, 16))), source=name)
        mesh = lay.resolve_mesh(world)
        pl = lay.placements(abstract_params(cfg), mesh)
        ls = lora_budget._lora_stats(cfg, lay, mesh, peft, pl, True, 2)
        leaves = named_leaves(abstract_params(cfg), is_leaf=is_param_info)
        infos = {f"{p}.{k}": adapter_info(i, k, 16) for p, i in leaves
                 if i is not None and peft.adapts(p) for k in ("lora_a", "lora_b")}
        exact = param_stats({**pl, **lay.placements_of_shapes(list(infos.items()), mesh)}, mesh, True)
        for f in attrs.fields(type(exact)):
            a, b = getattr(exact, f.name), getattr(ls.all, f.name)
            if isinstance(a, dict):
                assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-9 * max(1.0, a[k]) for k in a), f.name
            else:
                assert a == b, f.name


def test_plan_flops_of_a_lora_run():
    """The plan's FLOPs of an unmerged LoRA run against the full fine-tune's (tiny, one layout): the LM head loses its
    weight gradient (1 of its 4 products); the routed experts (MTP's included here) lose theirs (a third of 3 × their
    forward) and gain their adapters' GEMMs, 3 × 2·k·r·(in + out) a token per expert matrix; adapting the router adds
    its adapter's GEMMs and never gives the router its weight gradient back (hand counts from the config)."""
    from q38.parallel.budget import estimate

    cfg = ModelConfig.preset("tiny")
    layout = Layout.preset("fsdp_ep").with_mesh(fsdp=2, ep=2)
    kw = dict(seq_len=128, rows_per_rank=8, recompute="none", param_dtype="fp32", reduce_dtype="fp32")
    full = estimate(cfg, layout, 4, **kw).flops
    r = 4
    lora = estimate(cfg, layout, 4, peft=PeftConfig(rank=r, mtp=True), **kw).flops
    tokens = 8 * 128
    d, e, k, f = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    layers = cfg.num_hidden_layers + cfg.mtp_num_layers
    adapters = 3 * 2 * k * r * ((d + 2 * f) + (f + d)) * layers * tokens
    assert lora.head == full.head * 3 / 4
    assert lora.experts == pytest.approx(full.experts * 2 / 3 + adapters, rel=1e-12)
    with_router = PeftConfig(rank=r, mtp=True, targets=(*PeftConfig().targets, "w_router"))
    routed = estimate(cfg, layout, 4, peft=with_router, **kw).flops
    assert routed.dense - lora.dense == pytest.approx(3 * 2 * r * (d + e) * layers * tokens, rel=1e-12)
