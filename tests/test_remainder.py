"""bf16 + remainder masters (``train.master_dtype: bfloat16_remainder``, docs/optimizer.md#bf16--remainder-masters):
the split is exact on every bit pattern class and its high half is torch's bf16 cast except at exact ties (against
an integer reference written here); a remainder run equals the fp32-master run bit for bit at step 1 from
bf16-representable masters (with ``reduce_dtype: bfloat16``) and stays close after; donated equals pure; a checkpoint
resumes bit for bit (one process and 2 gloo ranks), converts exactly to and from fp32 masters, and exports the
files of the fp32-master checkpoint of the joined masters; the settings it cannot run are refused in one line."""

import pytest
import torch

from q38 import remainder as rm
from q38.model_config import ConfigError
from q38.pytree import named_leaves, tree_map, tree_map_with_path
from q38.train.core.state import init_state, state_from_params
from q38.train.core.step import train_step
from q38.train.core.step_config import TrainConfig
from tests.dist_utils import run_distributed
from tests.test_donate import CFG, TC, _b, _run, _same_state

FP = TC.replace(param_dtype="bfloat16", reduce_dtype="bfloat16")  # the fp32-master twin of REM
REM = FP.replace(master_dtype="bfloat16_remainder")


def _halves_ref(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The design's split in int64 arithmetic on the unsigned bits: ``high = (u + 0x8000) >> 16`` (16 bits, the
    carry out of bit 31 dropped), ``rem = u - (high << 16)`` read modulo 2**32 as a signed value."""
    u = u.to(torch.int64) & 0xFFFFFFFF
    high = ((u + 0x8000) >> 16) & 0xFFFF
    rem = (u - (high << 16)) % (1 << 32)
    rem = torch.where(rem >= 1 << 31, rem - (1 << 32), rem)
    return high, rem


def _bits(values: list[int]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int64) & 0xFFFFFFFF
    return torch.where(t >= 1 << 31, t - (1 << 32), t).to(torch.int32)


def test_split_and_join_are_exact_on_every_bit_pattern_class():
    g = torch.Generator().manual_seed(0)
    random = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 18,), dtype=torch.int64, generator=g).to(torch.int32)
    # every high half (all 65536) with the low halves that matter: 0, 1, just below / at / above the tie, all ones
    hi = torch.arange(1 << 16, dtype=torch.int64)
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    every = _bits(((hi[:, None] << 16) | lows).reshape(-1).tolist())
    special = _bits([0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00008000, 0x7F800000, 0xFF800000,
                     0x7F7FFFFF, 0x7F7F8000, 0xFF7F8000, 0x3F808000, 0xBF808000, 0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF])
    u = torch.cat([random, every, special])
    x = u.view(torch.float32)
    high, rem = rm.split(x)
    assert high.dtype == torch.bfloat16 and rem.dtype == torch.int16 and high.shape == rem.shape == x.shape
    assert torch.equal(rm.join(high, rem).view(torch.int32), u)  # join(split(x)) == x, bit for bit
    want_high, want_rem = _halves_ref(u)
    assert torch.equal(high.view(torch.int16).to(torch.int64) & 0xFFFF, want_high)
    assert torch.equal(rem.to(torch.int64), want_rem) and int(want_rem.min()) >= -32768 and int(want_rem.max()) <= 32767
    # vs torch's round-to-nearest-even cast: equal on every non-NaN value except exact ties (low half 0x8000)
    ours, cast = high.view(torch.int16), x.to(torch.bfloat16).view(torch.int16)
    tie = (u.to(torch.int64) & 0xFFFF) == 0x8000
    nan = torch.isnan(x)
    assert torch.equal(ours[~tie & ~nan], cast[~tie & ~nan])
    assert int((ours[tie & ~nan] != cast[tie & ~nan]).sum()) > 0  # ties do differ (half of them: the even ones)
    # the classes by name: zeros and denormals (the smallest round to zero high halves), inf, negatives
    for bits, want in ((0x80000000, 0x8000), (0x00000001, 0x0000), (0x007FFFFF, 0x0080), (0x7F800000, 0x7F80),
                       (0xFF800000, 0xFF80), (0xBF808000, 0xBF81), (0x3F808000, 0x3F81)):
        h, r = rm.split(_bits([bits]).view(torch.float32))
        assert int(h.view(torch.int16)) & 0xFFFF == want and torch.equal(rm.join(h, r).view(torch.int32), _bits([bits]))


def test_a_fresh_state_holds_the_high_halves_and_the_fp32_params_keep_fp32_masters():
    fp32 = init_state(CFG, TC, seed=4)
    state = init_state(CFG, REM, seed=4)
    rem = dict(named_leaves(state.master_remainder))
    for (n, master), (_, p) in zip(named_leaves(fp32.params), named_leaves(state.params)):
        if REM.compute_dtype(n) == torch.float32:  # *.mixer.A_log, *.mixer.norm_w: an fp32 master, no remainder
            assert n not in rem and p.dtype == torch.float32 and torch.equal(p, master)
        else:
            assert p.dtype == torch.bfloat16 and rem[n].dtype == torch.int16
            assert torch.equal(rm.join(p, rem[n]), master)
    assert any(REM.compute_dtype(n) == torch.float32 for n, _ in named_leaves(state.params))
    assert len(rem) > 0 and state.masters().count(None) == len(named_leaves(state.params)) - len(rem)


def _bf16_masters(seed=1, cfg=CFG):
    """Parameters of CFG whose bf16-computed leaves are bf16-representable, as an HF directory written in bf16
    would load (fp32, exact)."""
    from q38.model import init_params

    p = init_params(cfg, seed=seed)
    return tree_map_with_path(lambda n, t: t if FP.compute_dtype(n) == torch.float32 else t.bfloat16().float(), p)


def _joined(state) -> dict:
    rem = dict(named_leaves(state.master_remainder)) if state.master_remainder is not None else {}
    return {n: rm.join(t, rem[n]) if n in rem else t for n, t in named_leaves(state.params)}


def test_a_remainder_run_equals_the_fp32_master_run_at_step_1_and_stays_close(tmp_path):
    """From bf16-representable masters (an HF directory written in bf16) with reduce_dtype bfloat16 the two runs
    compute with the same bf16 weights, so step 1's losses, gradients (bf16 in both) and updated masters are equal
    bit for bit. After it the remainder run computes with the round-half-up high half where the fp32 run casts
    round-to-nearest-even: they differ exactly at the masters with a tie low half, and the runs drift apart by
    that much (3 steps: losses within 0.05, masters within 1e-3; measured 0.019 and 8.9e-5)."""
    from q38.hf import load_hf, save_hf

    # seed 8: one master after step 1 has a tie low half with an even high half (seeds without one make the
    # step-2 comparison below vacuous; checked by the assertion after it)
    save_hf(tmp_path / "hf", CFG, _bf16_masters(8), dtypes=lambda q: torch.bfloat16)
    _, params = load_hf(tmp_path / "hf", dtype=torch.float32)
    a = state_from_params(params, CFG, FP)
    b = state_from_params(tree_map(lambda t: t.clone(), params), CFG, REM)
    sa, la, ga = _run(a, [_b(0)], None, donate=True)
    sb, lb, gb = _run(b, [_b(0)], None, donate=True)
    assert la == lb
    assert all(x.dtype == y.dtype == torch.bfloat16 and torch.equal(x, y) for x, y in zip(ga[0], gb[0]))
    ja, jb = _joined(sa), _joined(sb)
    assert all(torch.equal(ja[n], jb[n]) for n in ja)
    # the compute weights of step 2 differ exactly at the ties that round to even downwards (an even high half)
    rem = dict(named_leaves(sb.master_remainder))
    downs = 0
    for n, high in named_leaves(sb.params):
        if n in rem:
            u = ja[n].view(torch.int32)
            down = ((u & 0xFFFF) == 0x8000) & (((u >> 16) & 1) == 0)
            assert torch.equal(ja[n].bfloat16().view(torch.int16) != high.view(torch.int16), down)
            downs += int(down.sum())
    assert downs > 0  # the case this test is about occurs
    sa, la2, _ = _run(sa, [_b(1), _b(2)], None, donate=True)
    sb, lb2, _ = _run(sb, [_b(1), _b(2)], None, donate=True)
    assert all(abs(x - y) < 0.05 for p, q in zip(la2, lb2) for x, y in zip(p, q))
    ja, jb = _joined(sa), _joined(sb)
    assert max(float((ja[n] - jb[n]).abs().max()) for n in ja) < 1e-3


@pytest.mark.parametrize("tc", [
    REM, pytest.param(REM.replace(moment_dtype="int8", reduce_dtype="float32"), marks=pytest.mark.slow),
    pytest.param(REM.replace(moment_dtype="bfloat16", micro_batches=2), marks=pytest.mark.slow)],
    ids=["fp32-moments", "int8-moments-fp32-reduce", "bf16-moments-micro2"])
def test_donated_equals_pure_bit_for_bit(tc):
    state = init_state(CFG, tc, seed=3)
    pure, lp, gp = _run(state, [_b(0), _b(1)], None, donate=False)
    donated, ld, gd = _run(tree_map(lambda t: t.clone(), state), [_b(0), _b(1)], None, donate=True)
    assert lp == ld and all(torch.equal(x, y) for a, b in zip(gp, gd) for x, y in zip(a, b))
    assert _same_state(pure, donated) == []
    assert _same_state(state, init_state(CFG, tc, seed=3)) == []  # the pure step left its input alone
    assert all(g.dtype == torch.bfloat16 for g, r in zip(gp[0], state.masters()) if r is not None)


def test_checkpoints_resume_exactly_convert_both_ways_and_export_the_joined_masters(tmp_path):
    from q38.cli import main
    from q38.train.io.checkpoint import empty_params, load_checkpoint, load_params, save_checkpoint, saved_tensors

    def save(root, state, tc):
        return save_checkpoint(root, state, {"step": int(state.step), "model_config": CFG.to_dict(),
                                             "train_config": tc.to_dict()})

    state, _ = train_step(init_state(CFG, REM, seed=2), _b(0), donate=True)
    ck = save(tmp_path / "rem", state, REM)
    keys = saved_tensors(ck)
    assert keys["master_remainder.embed"][1] == torch.int16 and keys["params.embed"][1] == torch.bfloat16
    assert "master_remainder.layers.0.mixer.A_log" not in keys  # an fp32_params leaf: an fp32 master
    assert keys["params.layers.0.mixer.A_log"][1] == torch.float32
    back, _ = load_checkpoint(ck, state_from_params(empty_params(CFG), CFG, REM))
    assert _same_state(back, state) == []
    masters = _joined(state)
    # into an fp32-master run: the joined masters; and load_params (q38 eval, init_from a checkpoint) joins too
    as_fp32, _ = load_checkpoint(ck, state_from_params(empty_params(CFG), CFG, FP))
    assert as_fp32.master_remainder is None
    assert all(torch.equal(t, masters[n]) for n, t in named_leaves(as_fp32.params))
    assert all(torch.equal(t, masters[n]) for n, t in named_leaves(load_params(ck)[1]))
    # and back: an fp32-master checkpoint resumed as bf16 + remainder is split exactly
    ck32 = save(tmp_path / "fp32", as_fp32, FP)
    again, _ = load_checkpoint(ck32, state_from_params(empty_params(CFG), CFG, REM))
    assert _same_state(again, state) == []
    # q38 convert --to-hf: the files of the fp32-master checkpoint of the joined masters
    for dtype in ("float32", None):
        extra = ["--dtype", dtype] if dtype else []
        for src, out in ((ck, f"hf-rem-{dtype}"), (ck32, f"hf-32-{dtype}")):
            assert main(["convert", "--to-hf", str(src), str(tmp_path / out), *extra]) == 0
        files = sorted(p.name for p in (tmp_path / f"hf-rem-{dtype}").iterdir())
        assert "model.safetensors" in files and all(
            (tmp_path / f"hf-rem-{dtype}" / f).read_bytes() == (tmp_path / f"hf-32-{dtype}" / f).read_bytes()
            for f in files)
    # the resumed state steps on as the saved one
    a, _ = train_step(back, _b(1), donate=True)
    b, _ = train_step(state, _b(1), donate=True)
    assert _same_state(a, b) == []


def _two_ranks(rank, world, layout_name, mesh_sizes, ckpt):
    from q38.parallel.layout import Layout
    from q38.parallel.mesh import make_mesh, shard, shard_batch, unshard
    from q38.train.io.checkpoint import empty_params, load_checkpoint, save_checkpoint

    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = shard(init_state(CFG, REM, seed=1), mesh)  # the one-process state's halves, placed
    sb = lambda b: shard_batch(b, mesh, CFG.mtp_num_layers)  # noqa: E731
    pure, lp, _ = _run(state, [_b(0), _b(1)], mesh, donate=False, shard_b=sb)
    don, ld, _ = _run(tree_map(lambda t: t.clone(), state), [_b(0), _b(1)], mesh, donate=True, shard_b=sb)
    pure_vs_donated = _same_state(pure, don)
    save_checkpoint(ckpt, don, {"step": 2, "model_config": CFG.to_dict(), "train_config": REM.to_dict()})
    # (gathered as bf16 bits: gloo has no int16; a replicated leaf's is its own buffer, which step 3 updates)
    whole = tree_map(lambda t: t.clone(), unshard(don.master_remainder))
    assert all(t.dtype == torch.int16 for _, t in named_leaves(whole))
    back, _ = load_checkpoint(f"{ckpt}/step_000002", state_from_params(empty_params(CFG, mesh=mesh), CFG, REM))
    a, la, _ = _run(back, [_b(2)], mesh, donate=True, shard_b=sb)
    b, lb, _ = _run(don, [_b(2)], mesh, donate=True, shard_b=sb)
    sharded = [n for n, t in named_leaves(state.master_remainder) if hasattr(t, "to_local")
               and t.to_local().numel() < t.numel()]
    return {"losses": (lp, ld, la, lb), "pure_vs_donated": pure_vs_donated, "resumed": _same_state(a, b),
            "sharded": len(sharded), "whole": whole}


@pytest.mark.dist
def test_two_ranks_donated_equals_pure_and_resume_is_exact(tmp_path):
    """2 gloo ranks, layout fsdp (every leaf's halves sharded, gathered in bf16 without a cast copy, gradients
    reduce-scattered): ``q38.parallel.shard`` of a one-process state trains, donated equals pure, the checkpoint
    resumes bit for bit, and one process loads that checkpoint as the joined fp32 masters."""
    from q38.train.io.checkpoint import load_params

    out = run_distributed(_two_ranks, 2, "fsdp", {"fsdp": 2}, str(tmp_path))
    for o in out:
        assert o["losses"][0] == o["losses"][1] and o["losses"][2] == o["losses"][3]
        assert o["pure_vs_donated"] == [] and o["resumed"] == [] and o["sharded"] > 0
    # unshard gathers the remainders whole: what one process reads of the 2-rank checkpoint (DCP assembles the
    # shards from the files); and load_params reads it as the fp32 masters joined from those halves
    from q38.train.io.checkpoint import _dcp_load

    whole = dict(named_leaves(out[0]["whole"]))
    halves = {f"{k}.{n}": torch.empty(t.shape, dtype=dt) for n, t in whole.items()
              for k, dt in (("params", torch.bfloat16), ("master_remainder", torch.int16))}
    _dcp_load(halves, tmp_path / "step_000002", collective=False)
    assert all(torch.equal(t, halves[f"master_remainder.{n}"]) for n, t in whole.items())
    _, params, _ = load_params(tmp_path / "step_000002")
    params = dict(named_leaves(params))
    assert all(torch.equal(params[n], rm.join(halves[f"params.{n}"], t)) for n, t in whole.items())


def test_settings_it_cannot_run_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^master_dtype: bfloat16_remainder .* needs param_dtype: bfloat16 "
                                          r"\(got float32\); set train.param_dtype: bfloat16") as e:
        TrainConfig(master_dtype="bfloat16_remainder")
    assert "\n" not in str(e.value)
    from q38.train.run.launch import check_run
    from tests.run_utils import run_config

    cfg = run_config(tmp_path, train={"master_dtype": "bfloat16_remainder", "param_dtype": "bfloat16"},
                     peft={"rank": 2})
    with pytest.raises(ConfigError, match=r"^train.master_dtype: bfloat16_remainder with a peft section: .*"
                                          r"set train.master_dtype: float32$") as e:
        check_run(cfg)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="with a peft section"):
        state_from_params(init_state(CFG, TC).params, CFG, REM, peft=cfg.peft)
    assert TrainConfig(master_dtype="bfloat16_remainder", param_dtype="bfloat16").master_dtype == "bfloat16_remainder"


@pytest.mark.slow  # ~1 min on the shared 2-core machine: four short runs
def test_q38_train_from_a_bf16_hf_dir_matches_fp32_masters_at_step_1_and_resumes_exactly(tmp_path):
    """``q38 train`` with ``init_from`` a Hugging Face directory stored in bf16: the remainder run's first loss is
    the fp32-master run's (reduce_dtype bfloat16), and a run stopped at step 2 and resumed gives the losses of one
    that never stopped."""
    from q38.hf import save_hf
    from q38.train.run.trainer import train
    from tests.run_utils import losses, run_config

    cfg = CFG.replace(vocab_size=288)  # the byte tokenizer's 261 tokens (still unlike tiny's 384)
    save_hf(tmp_path / "hf", cfg, _bf16_masters(cfg=cfg), dtypes=lambda q: torch.bfloat16)
    kw = dict(init_from=str(tmp_path / "hf"), model=cfg.to_dict())
    lean = {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16", "loss_chunk_size": 16}
    rem = {**lean, "master_dtype": "bfloat16_remainder"}
    fp32 = train(run_config(tmp_path / "fp32", steps=1, train=lean, **kw))
    full = train(run_config(tmp_path / "full", steps=3, train=rem, **kw))
    cut = train(run_config(tmp_path / "cut", steps=2, train=rem, run={"save_every": 2}, **kw))
    rest = train(run_config(tmp_path / "cut", steps=3, train=rem, **kw))
    assert losses(fp32) == losses(full)[:1]
    assert [r["step"] for r in rest] == [3] and losses(cut + rest) == losses(full)
