"""Offloaded optimizer state (``train.offload_optimizer: true``, docs/optimizer.md#offloaded-optimizer-state): the fp32
masters and the moments of the leaves computed in ``param_dtype`` live on the host, ``params`` holds their compute
copies in ``param_dtype``, and AdamW steps on the host. On this CPU-only machine the host *is* the device, so what is
tested is the state's form (dtypes, devices, which leaves), the arithmetic (an offload run equals the fp32-master run
bit for bit, one process and 2 gloo ranks), donated == pure, checkpoints (the same tensors as the fp32-master run's;
resumed and converted exactly both ways) and the refusals; the CUDA copy overlap is not exercised here."""

import pytest
import torch

from q38.model_config import ConfigError
from q38.pytree import named_leaves, tree_map
from q38.train.core.state import DonatedStateError, init_state, state_from_params
from q38.train.core.step import train_step
from q38.train.core.step_config import TrainConfig
from tests.dist_utils import run_distributed
from tests.test_donate import CFG, TC, _b, _run, _same_state

FP = TC.replace(param_dtype="bfloat16", reduce_dtype="bfloat16")  # the fp32-master twin of OFF
OFF = FP.replace(offload_optimizer=True)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _masters(state) -> dict:
    """{path: fp32 master} of a state: the host master where offloaded, else the ``params`` leaf."""
    host = dict(named_leaves(state.host_master)) if state.host_master is not None else {}
    return {n: host.get(n, t) for n, t in named_leaves(state.params)}


def _check_form(state, tc=OFF) -> int:
    """The offloaded state's form: every leaf computed in bf16 holds its bf16 compute copy (the round-to-nearest-even
    cast of its host fp32 master), its master and both moments on the cpu device; the fp32_params leaves keep their
    fp32 master in ``params`` and no host master. Returns how many leaves are offloaded."""
    host = dict(named_leaves(state.host_master))
    moments = [dict(named_leaves(m)) for m in (state.exp_avg, state.exp_avg_sq)]
    want_m = getattr(torch, tc.moment_dtype) if tc.moment_dtype != "int8" else None
    for n, p in named_leaves(state.params):
        if tc.compute_dtype(n) == torch.float32:  # *.mixer.A_log, *.mixer.dt_bias: fp32 master on the device
            assert n not in host and p.dtype == torch.float32
            continue
        h = host[n]
        assert p.dtype == torch.bfloat16 and h.dtype == torch.float32 and h.shape == p.shape
        assert _local(h).device == torch.device("cpu")
        assert torch.equal(_local(p), _local(h).to(torch.bfloat16))
        for m in moments:
            if want_m is not None:
                assert m[n].dtype == want_m and _local(m[n]).device == torch.device("cpu")
    assert any(tc.compute_dtype(n) == torch.float32 for n, _ in named_leaves(state.params))
    return len(host)


def _params(seed=1):
    from q38.model import init_params

    return init_params(CFG, seed=seed)


def test_an_offload_run_equals_the_fp32_master_run_bit_for_bit_over_3_steps():
    """Both runs compute with ``master.to(bf16)`` (the fp32 run casts before each gather, the offload run holds that
    cast), get the same bf16 gradients (reduce_dtype bfloat16) and run the same AdamW kernel on the same fp32
    masters and moments: losses, gradients, masters and moments equal bit for bit at every step."""
    p = _params()
    fp = state_from_params(tree_map(lambda t: t.clone(), p), CFG, FP)
    off = state_from_params(tree_map(lambda t: t.clone(), p), CFG, OFF)
    assert _check_form(off) > 40
    sa, la, ga = _run(fp, [_b(0), _b(1), _b(2)], None, donate=True)
    sb, lb, gb = _run(off, [_b(0), _b(1), _b(2)], None, donate=True)
    assert la == lb and len(la) == 3
    assert all(x.dtype == y.dtype and torch.equal(x, y) for s, t in zip(ga, gb) for x, y in zip(s, t))
    assert all(g.dtype == torch.bfloat16 for g, h in zip(gb[0], sb.host_masters()) if h is not None)
    ma, mb = _masters(sa), _masters(sb)
    assert all(torch.equal(ma[n], mb[n]) and mb[n].dtype == torch.float32 for n in ma)
    for m in ("exp_avg", "exp_avg_sq"):
        a, b = dict(named_leaves(getattr(sa, m))), dict(named_leaves(getattr(sb, m)))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert int(sb.step) == 3
    _check_form(sb)
    with pytest.raises(DonatedStateError, match=r"cannot use host_master of a TrainState donated to train_step"):
        off.host_master  # noqa: B018 (the donated input's host masters are the returned state's now)
    # the masters moved: the comparison is not of untouched initial values
    assert not torch.equal(mb["embed"], p.embed)


@pytest.mark.parametrize("tc", [  # (slow: the 2-rank test compares donated with pure in the default suite)
    pytest.param(OFF, marks=pytest.mark.slow),
    pytest.param(OFF.replace(moment_dtype="bfloat16", micro_batches=2), marks=pytest.mark.slow),
    pytest.param(OFF.replace(moment_dtype="int8", grad_clip=None), marks=pytest.mark.slow)],
    ids=["fp32-moments", "bf16-moments-micro2", "int8-moments-noclip"])
def test_donated_equals_pure_bit_for_bit(tc):
    state = init_state(CFG, tc, seed=3)
    pure, lp, gp = _run(state, [_b(0), _b(1)], None, donate=False)
    donated, ld, gd = _run(tree_map(lambda t: t.clone(), state), [_b(0), _b(1)], None, donate=True)
    assert lp == ld and all(torch.equal(x, y) for a, b in zip(gp, gd) for x, y in zip(a, b))
    assert _same_state(pure, donated) == []
    assert _same_state(state, init_state(CFG, tc, seed=3)) == []  # the pure step left its input alone
    _check_form(donated, tc)


def test_checkpoints_are_the_fp32_master_runs_and_resume_and_convert_exactly(tmp_path):
    from q38.cli import main
    from q38.train.io import checkpoint as ck
    from q38.train.io.checkpoint import empty_params, load_checkpoint, save_checkpoint, saved_tensors
    from tests.test_async_save import _tensors

    def save(root, state, tc):
        return save_checkpoint(root, state, {"step": int(state.step), "model_config": CFG.to_dict(),
                                             "train_config": tc.to_dict()})

    p = _params(seed=2)
    off, _ = train_step(state_from_params(tree_map(lambda t: t.clone(), p), CFG, OFF), _b(0), donate=True)
    fp, _ = train_step(state_from_params(tree_map(lambda t: t.clone(), p), CFG, FP), _b(0), donate=True)
    ck_off, ck_fp = save(tmp_path / "off", off, OFF), save(tmp_path / "fp", fp, FP)
    keys = saved_tensors(ck_off)
    assert keys == saved_tensors(ck_fp)  # the same keys, shapes and dtypes: params.<path> the fp32 masters
    assert keys["params.embed"][1] == torch.float32 and not any(k.startswith("host_master") for k in keys)
    t_off, t_fp = _tensors(ck_off), _tensors(ck_fp)
    assert all(torch.equal(t_off[k], t_fp[k]) for k in t_fp)
    # resumed as it was; an fp32-master checkpoint into an offload run, and back
    back, _ = load_checkpoint(ck_off, state_from_params(empty_params(CFG), CFG, OFF))
    assert _same_state(back, off) == []
    _check_form(back)
    from_fp, _ = load_checkpoint(ck_fp, state_from_params(empty_params(CFG), CFG, OFF))
    assert _same_state(from_fp, off) == []
    to_fp, _ = load_checkpoint(ck_off, state_from_params(empty_params(CFG), CFG, FP))
    assert to_fp.host_master is None and _same_state(to_fp, fp) == []
    # a bf16 + remainder checkpoint loads as its joined masters
    rem_tc = FP.replace(master_dtype="bfloat16_remainder")
    rem, _ = load_checkpoint(ck_fp, state_from_params(empty_params(CFG), CFG, rem_tc))
    ck_rem = save(tmp_path / "rem", rem, rem_tc)
    from_rem, _ = load_checkpoint(ck_rem, state_from_params(empty_params(CFG), CFG, OFF))
    assert _same_state(from_rem, off) == []
    # q38 convert --to-hf: the files of the fp32-master export
    for src, out in ((ck_off, "hf-off"), (ck_fp, "hf-fp")):
        assert main(["convert", "--to-hf", str(src), str(tmp_path / out)]) == 0
    files = sorted(q.name for q in (tmp_path / "hf-off").iterdir())
    assert "model.safetensors" in files and all(
        (tmp_path / "hf-off" / f).read_bytes() == (tmp_path / "hf-fp" / f).read_bytes() for f in files)
    # the resumed state steps on as the saved one
    a, _ = train_step(back, _b(1), donate=True)
    b, _ = train_step(off, _b(1), donate=True)
    assert _same_state(a, b) == []
    # an async save in flight keeps its step while donated steps write the host masters in place
    expect = {n: t.clone() for n, t in ck.state_dict_of(a).items()}
    pending = ck.AsyncSave(tmp_path / "async", a, {"step": int(a.step)})
    for i in range(2, 4):
        a, _ = train_step(a, _b(i), donate=True)
    assert not torch.equal(a.host_master.embed, expect["params.embed"])
    got = _tensors(pending.finish())
    assert got.keys() == expect.keys() and all(torch.equal(got[k], expect[k]) for k in expect)


def _two_ranks(rank, world, ckpt):
    from q38.parallel.layout import Layout
    from q38.parallel.mesh import make_mesh, shard, shard_batch, unshard
    from q38.train.io.checkpoint import empty_params, load_checkpoint, save_checkpoint

    mesh = make_mesh(Layout.preset("fsdp").with_mesh(fsdp=2), world)
    sb = lambda b: shard_batch(b, mesh, CFG.mtp_num_layers)  # noqa: E731
    fp = shard(init_state(CFG, FP, seed=1), mesh)
    off = shard(init_state(CFG, OFF, seed=1), mesh)  # the one-process state's halves, placed
    n_host = _check_form(off)
    sharded = sum(_local(t).numel() < t.numel() for _, t in named_leaves(off.host_master))
    sa, la, _ = _run(fp, [_b(0), _b(1)], mesh, donate=True, shard_b=sb)
    pure, lp, _ = _run(tree_map(lambda t: t.clone(), off), [_b(0), _b(1)], mesh, donate=False, shard_b=sb)
    sb_, lb, _ = _run(off, [_b(0), _b(1)], mesh, donate=True, shard_b=sb)
    ma, mb = _masters(sa), _masters(sb_)
    masters_equal = all(torch.equal(_local(ma[n]), _local(mb[n])) for n in ma)
    moments_equal = all(torch.equal(_local(x), _local(y)) for m in ("exp_avg", "exp_avg_sq")
                        for (_, x), (_, y) in zip(named_leaves(getattr(sa, m)), named_leaves(getattr(sb_, m))))
    whole = {n: t.clone() for n, t in named_leaves(unshard(sb_.host_master))}
    pure_vs_donated = _same_state(pure, sb_)
    save_checkpoint(ckpt, sb_, {"step": 2, "model_config": CFG.to_dict(), "train_config": OFF.to_dict()})
    back, _ = load_checkpoint(f"{ckpt}/step_000002", state_from_params(empty_params(CFG, mesh=mesh), CFG, OFF))
    a, lx, _ = _run(back, [_b(2)], mesh, donate=True, shard_b=sb)
    b, ly, _ = _run(sb_, [_b(2)], mesh, donate=True, shard_b=sb)
    return {"losses": (la, lb, lp, lx, ly), "masters": masters_equal, "moments": moments_equal,
            "pure_vs_donated": pure_vs_donated, "resumed": _same_state(a, b),
            "n_host": n_host, "sharded": sharded, "whole": whole}


@pytest.mark.dist
def test_two_ranks_fsdp_equal_the_fp32_master_run_and_resume_exactly(tmp_path):
    """2 gloo ranks, layout fsdp (every leaf sharded: the host masters and moments shard like the weights): the
    offload run's losses, masters and moments equal the fp32-master run's bit for bit; donated equals pure; the
    checkpoint resumes bit for bit and one process reads it as the fp32 masters."""
    from q38.train.io.checkpoint import load_params

    out = run_distributed(_two_ranks, 2, str(tmp_path))
    for o in out:
        la, lb, lp, lx, ly = o["losses"]
        assert la == lb == lp and lx == ly
        assert o["masters"] and o["moments"] and o["resumed"] == [] and o["pure_vs_donated"] == []
        assert o["n_host"] > 40 and o["sharded"] > 0
    _, params, _ = load_params(tmp_path / "step_000002")
    params = dict(named_leaves(params))
    assert all(torch.equal(params[n], t) for n, t in out[0]["whole"].items())


def test_settings_it_cannot_run_are_refused_in_one_line(tmp_path):
    from q38.train.run.launch import check_run
    from tests.run_utils import run_config

    for kw, pattern in (({}, r"^offload_optimizer: true .* needs param_dtype: bfloat16 \(got float32\); "
                             r"set train.param_dtype: bfloat16, or offload_optimizer: false$"),
                        ({"param_dtype": "bfloat16", "master_dtype": "bfloat16_remainder"},
                         r"^offload_optimizer: true keeps fp32 masters on the host, .* set master_dtype: float32 "
                         r"\(got bfloat16_remainder\) or offload_optimizer: false$")):
        with pytest.raises(ConfigError, match=pattern) as e:
            TrainConfig(offload_optimizer=True, **kw)
        assert "\n" not in str(e.value)
    cfg = run_config(tmp_path, train={"offload_optimizer": True, "param_dtype": "bfloat16"}, peft={"rank": 2})
    with pytest.raises(ConfigError, match=r"^train.offload_optimizer: true with a peft section: .*"
                                          r"set train.offload_optimizer: false$") as e:
        check_run(cfg)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="with a peft section"):
        state_from_params(init_state(CFG, TC).params, CFG, OFF, peft=cfg.peft)
    assert TrainConfig(offload_optimizer=True, param_dtype="bfloat16").offload_optimizer


@pytest.mark.slow  # ~1 min on the shared 2-core machine: three short runs
def test_q38_train_equals_the_fp32_master_run_and_resumes_exactly(tmp_path):
    """``q38 train`` with ``offload_optimizer: true``: the losses of the fp32-master run (reduce_dtype bfloat16) at
    every step, and a run stopped at step 2 (checkpoint saved, donated steps after it) and resumed gives them too."""
    from q38.train.run.trainer import train
    from tests.run_utils import losses, run_config

    cfg = CFG.replace(vocab_size=288)  # the byte tokenizer's 261 tokens (still unlike tiny's 384)
    lean = {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16", "loss_chunk_size": 16}
    off = {**lean, "offload_optimizer": True}
    fp32 = train(run_config(tmp_path / "fp32", steps=3, train=lean, model=cfg.to_dict()))
    cut = train(run_config(tmp_path / "cut", steps=2, train=off, run={"save_every": 2}, model=cfg.to_dict()))
    rest = train(run_config(tmp_path / "cut", steps=3, train=off, model=cfg.to_dict()))
    assert [r["step"] for r in rest] == [3] and losses(cut + rest) == losses(fp32) and len(losses(fp32)) == 3
