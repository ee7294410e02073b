"""Checkpoints at the scale of the model: resume, ``init_from`` (q38 or Hugging Face), export and import never hold
a whole parameter where the rank's shard is smaller, and give exactly what the whole-model paths give.

The allocation check is a dispatch mode that records the shape of every tensor any aten op returns on a rank (the
load's own buffers, DCP's ``torch.load`` of saved chunks, the HF reader's casts: the HF files are bf16 and the load
fp32, so every tensor read from them passes through a cast the mode sees). It knows nothing of q38's loaders; its
own test shows it flags the whole-model paths."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import torch.utils._pytree as pytree

from q38.model_config import ModelConfig
from q38.hf import load_hf, save_hf
from q38.parallel.layout import Layout
from q38.pytree import named_leaves, tree_map
from q38.train.core.step_config import TrainConfig
from tests.dist_utils import run_distributed
from tests.test_hf_parity import CFG_A, _random_params
from tests.test_hf_parity import CFG_NEXT as _NEXT

pytestmark = pytest.mark.dist
# Sizes chosen so that no parameter's full shape is also the shape of an HF tensor the loader legitimately reads
# whole (one routed expert's [f, d] / [d, f], the grouped in_proj_qkvz / in_proj_ba).
CFG_NEXT = _NEXT.replace(num_attention_heads=2, head_dim=12, shared_expert_intermediate_size=28)


def _storages(tree) -> set[int]:
    out = set()
    for t in pytree.tree_leaves(tree):
        t = getattr(t, "_local_tensor", t)  # a DTensor: its local shard
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            out.add(t.untyped_storage().data_ptr())
    return out


class Shapes(TorchDispatchMode):
    """The shape of every tensor an aten op returns on storage that none of its inputs had before the op: new
    memory (``empty``, casts, copies, DCP's ``torch.load`` setting a read buffer), not views or in-place updates of
    existing memory. ``meta`` tensors allocate nothing and are left out."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = _storages((args, kwargs))
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            t = getattr(t, "_local_tensor", t)
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in before:
                self.seen.add(tuple(t.shape))
        return out


def _checked(params, legit: frozenset = frozenset()) -> list[str]:
    """Parameters whose shard is smaller than the parameter, except those whose full shape is also some
    parameter's shard shape (e.g. w_qkv [80, 48] and embed's half, on 2 ranks) or in ``legit`` (the chunks a
    checkpoint was saved in): allocating that shape is then legitimate."""
    shards = {tuple(t._local_tensor.shape) for _, t in named_leaves(params)} | set(legit)
    return [n for n, t in named_leaves(params)
            if tuple(t._local_tensor.shape) != tuple(t.shape) and tuple(t.shape) not in shards]


def _full_where_sharded(params, seen: set, legit: frozenset = frozenset()) -> list[str]:
    """Checked parameters (``_checked``) whose full shape was allocated."""
    full = {n: tuple(t.shape) for n, t in named_leaves(params)}
    return [n for n in _checked(params, legit) if full[n] in seen]


def _saved_chunks(ck_dir) -> frozenset:
    """The shapes of the chunks a DCP checkpoint holds (what a resharding load reads one at a time)."""
    import pickle

    with open(Path(ck_dir) / ".metadata", "rb") as fh:  # the test's own checkpoint: trusted
        md = pickle.load(fh)
    return frozenset(tuple(c.sizes) for m in md.state_dict_metadata.values() for c in getattr(m, "chunks", ()))


def _mesh(layout: str, sizes: dict, world: int):
    from q38.parallel.mesh import make_mesh

    return make_mesh(Layout.preset(layout).with_mesh(**sizes), world)


def _locals(tree) -> dict:
    return {n: t._local_tensor.clone() if hasattr(t, "_local_tensor") else t.clone() for n, t in named_leaves(tree)}


def _bf16_hf(tmp_path: Path, cfg: ModelConfig, name: str = "hf") -> Path:
    params = tree_map(lambda t: t.to(torch.bfloat16), _random_params(cfg, seed=3))
    return save_hf(tmp_path / name, cfg, params, max_shard_bytes=40_000)


# ---- init_from a Hugging Face directory --------------------------------------------------------------------------------


def _hf_rank(rank, world, layout, sizes, hf_dir):
    from q38.parallel.mesh import shard
    from q38.train.io.hf_io import load_hf_sharded

    mesh = _mesh(layout, sizes, world)
    with Shapes() as rec:
        _, params = load_hf_sharded(hf_dir, mesh, dtype=torch.float32)
    _, full = load_hf(hf_dir, dtype=torch.float32)
    ref = shard(full, mesh)
    got, want = _locals(params), _locals(ref)
    return {"full": _full_where_sharded(params, rec.seen), "sharded": len(_checked(params)),
        "diff": [n for n in want if not torch.equal(got[n], want[n])]}


HF_CASES = [
    ("qwen35", "fsdp", {"fsdp": 2}, 2), ("qwen35", "fsdp_ep", {"fsdp": 1, "ep": 2}, 2),
    ("qwen35", "fsdp_cp", {"fsdp": 1, "cp": 2}, 2), ("qwen35", "fsdp", {"fsdp": 4}, 4),
    ("qwen35", "fsdp_ep", {"fsdp": 2, "ep": 2}, 4), ("qwen35", "fsdp_ep_cp", {"fsdp": 1, "ep": 2, "cp": 2}, 4),
    ("next", "fsdp", {"fsdp": 2}, 2), ("next", "fsdp_ep", {"fsdp": 1, "ep": 2}, 2),
    ("next", "fsdp_ep_cp", {"fsdp": 1, "ep": 2, "cp": 2}, 4),
]


@pytest.mark.parametrize("model,layout,sizes,world", HF_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[3]}ranks" for c in HF_CASES])
def test_init_from_hf_reads_only_slices_and_equals_load_then_shard(tmp_path, model, layout, sizes, world):
    """Qwen3.5 (fused main-layer experts, per-expert MTP experts, flat GDN projections) and Qwen3-Next (per-expert
    experts, grouped qkvz / ba): each rank's shards equal ``shard(load_hf(...))`` exactly, and no rank allocates a
    whole parameter whose shard is smaller."""
    hf_dir = _bf16_hf(tmp_path, CFG_A if model == "qwen35" else CFG_NEXT)
    outs = run_distributed(_hf_rank, world, layout, sizes, str(hf_dir))
    for r, o in enumerate(outs):
        assert o["diff"] == [], f"rank {r}: shards differ from load_hf + shard: {o['diff']}"
        assert o["full"] == [], f"rank {r} allocated whole parameters: {o['full']}"
        assert o["sharded"] > 10  # the check looked at sharded parameters


FP8_CASES = [("fsdp_ep", {"fsdp": 2, "ep": 2}, 4)]  # FSDP rows cut 16-row blocks; EP splits the experts


@pytest.mark.parametrize("layout,sizes,world", FP8_CASES, ids=[f"{c[0]}-{c[2]}ranks" for c in FP8_CASES])
def test_init_from_fp8_reads_only_slices_and_their_scales(tmp_path, layout, sizes, world):
    """A block-FP8 directory (released layout, written by the test-side writer of test_released_formats; 16x8 blocks,
    so shards cut blocks): each rank's shards equal ``shard(load_hf(...))``, and no rank allocates a whole
    parameter whose shard is smaller (it reads its slice's e4m3 values and the scales of the blocks they touch)."""
    from tests.test_released_formats import _to_fp8_dir

    fp8 = _to_fp8_dir(_bf16_hf(tmp_path, CFG_A), tmp_path / "fp8", (16, 8))
    outs = run_distributed(_hf_rank, world, layout, sizes, str(fp8))
    for r, o in enumerate(outs):
        assert o["diff"] == [], f"rank {r}: shards differ from load_hf + shard: {o['diff']}"
        assert o["full"] == [], f"rank {r} allocated whole parameters: {o['full']}"
        assert o["sharded"] > 0


def _old_paths_rank(rank, world, hf_dir, ck_dir):
    """The whole-model paths (load_hf then shard; a full template then shard) under the same recorder."""
    from q38.parallel.mesh import shard
    from q38.train.io.checkpoint import empty_params, load_checkpoint
    from q38.train.core.state import state_from_params

    mesh = _mesh("fsdp", {"fsdp": 2}, world)
    with Shapes() as rec:
        params = shard(load_hf(hf_dir, dtype=torch.float32)[1], mesh)
    hf_flagged = _full_where_sharded(params, rec.seen)
    with Shapes() as rec:
        state = shard(state_from_params(empty_params(CFG_A), CFG_A, TrainConfig()), mesh)
        load_checkpoint(ck_dir, state)
    return hf_flagged, _full_where_sharded(state.params, rec.seen)


def test_the_allocation_check_flags_the_whole_model_paths(tmp_path):
    from q38.train.io.checkpoint import write_checkpoint
    from q38.train.core.state import init_state

    hf_dir = _bf16_hf(tmp_path, CFG_A)
    write_checkpoint(tmp_path / "ck", init_state(CFG_A, TrainConfig()), {"step": 0, "model_config": CFG_A.to_dict()})
    hf_flagged, resume_flagged = run_distributed(_old_paths_rank, 2, str(hf_dir), str(tmp_path / "ck"))[0]
    assert "layers.0.moe.we_gate_up" in hf_flagged and "embed" in hf_flagged
    assert "layers.0.moe.we_gate_up" in resume_flagged and "embed" in resume_flagged


# ---- resume and init_from a q38 checkpoint ----------------------------------------------------------------------------


def _random_state(cfg, mesh):
    """A sharded state with distinct values everywhere (params, both moments, step)."""
    from q38.parallel.mesh import init_sharded
    from q38.train.core.state import state_from_params

    st = state_from_params(init_sharded(cfg, mesh, seed=5), cfg, TrainConfig())
    from torch.distributed.tensor import distribute_tensor

    for i, (m1, m2) in enumerate(zip(pytree.tree_leaves(st.exp_avg), pytree.tree_leaves(st.exp_avg_sq))):
        g = torch.Generator().manual_seed(100 + i)  # the same full values on every rank; each keeps its block
        for m, draw in ((m1, torch.randn), (m2, torch.rand)):
            full = draw(tuple(m.shape), generator=g)
            m._local_tensor.copy_(distribute_tensor(full, m.device_mesh, m.placements, src_data_rank=None)._local_tensor)
    st.step.fill_(7)
    return st


def _save_rank(rank, world, layout, sizes, ck_dir):
    from q38.parallel.mesh import unshard
    from q38.train.io.checkpoint import write_checkpoint

    st = _random_state(CFG_A, _mesh(layout, sizes, world))
    write_checkpoint(ck_dir, st, {"step": 7, "model_config": CFG_A.to_dict(), "train_config": {}})
    full = unshard(st)
    return _locals(full) if rank == 0 else None


def _resume_rank(rank, world, layout, sizes, ck_dir):
    from q38.parallel.mesh import unshard
    from q38.train.io.checkpoint import empty_params, load_checkpoint, load_params
    from q38.train.core.state import state_from_params

    mesh = _mesh(layout, sizes, world)
    with Shapes() as rec:
        template = state_from_params(empty_params(CFG_A, mesh=mesh), CFG_A, TrainConfig())
        state, _ = load_checkpoint(ck_dir, template)
    legit = _saved_chunks(ck_dir)
    resume_full = _full_where_sharded(state.params, rec.seen, legit)
    with Shapes() as rec:
        _, params, _ = load_params(ck_dir, mesh=mesh)
    init_full = _full_where_sharded(params, rec.seen, legit)
    return {"resume_full": resume_full, "init_full": init_full, "checked": len(_checked(state.params, legit)),
            "state": _locals(unshard(state)),
            "params": _locals(unshard(params))}


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    """One checkpoint saved on 4 ranks × fsdp_ep (the same for every test that reads it): its directory and rank 0's
    unsharded view of what was saved. The tests only read it; teardown checks that none of them changed a byte."""
    ck_dir = tmp_path_factory.mktemp("saved4") / "ck"
    saved = run_distributed(_save_rank, 4, "fsdp_ep", {"fsdp": 2, "ep": 2}, str(ck_dir))[0]
    assert [p.name for p in ck_dir.parent.iterdir() if p.name.startswith(".")] == []  # no temporary left behind
    files = {p: p.read_bytes() for p in sorted(ck_dir.rglob("*")) if p.is_file()}
    yield ck_dir, saved
    assert {p: p.read_bytes() for p in sorted(ck_dir.rglob("*")) if p.is_file()} == files


RESUME_CASES = [("fsdp", {"fsdp": 4}, 4), ("fsdp_ep", {"fsdp": 2, "ep": 2}, 4),
                ("fsdp_ep_cp", {"fsdp": 1, "ep": 2, "cp": 2}, 4), ("fsdp", {"fsdp": 2}, 2)]


@pytest.mark.parametrize("layout,sizes,world", RESUME_CASES, ids=[f"{c[0]}-{c[2]}ranks" for c in RESUME_CASES])
def test_resume_and_init_from_q38_load_into_shards(saved4, layout, sizes, world):
    """Saved on 4 ranks × fsdp_ep; loaded on this layout: bit-identical state, and no rank allocates a whole
    parameter whose shard is smaller (on resume: params and both moments; on init_from: params)."""
    ck_dir, saved = saved4
    outs = run_distributed(_resume_rank, world, layout, sizes, str(ck_dir))
    for r, o in enumerate(outs):
        assert o["resume_full"] == [] and o["init_full"] == [], f"rank {r}: {o['resume_full']} {o['init_full']}"
        assert o["checked"] > 10
    got = outs[0]["state"]
    assert set(got) == set(saved)
    assert [n for n in saved if not torch.equal(got[n], saved[n])] == []
    assert all(torch.equal(outs[0]["params"][n], saved[f"params.{n}"]) for n in outs[0]["params"])


def test_a_sharded_checkpoint_resumes_in_one_process(saved4):
    from q38.train.io.checkpoint import load_checkpoint
    from q38.train.core.state import init_state

    ck_dir, saved = saved4
    state, meta = load_checkpoint(ck_dir, init_state(CFG_A, TrainConfig()))
    assert meta["step"] == 7
    got = _locals(state)
    assert [n for n in saved if not torch.equal(got[n], saved[n])] == []


# ---- export and import -------------------------------------------------------------------------------------------------


def _digest(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _export_rank(rank, world, ck_dir, out, dtype):
    from q38.train.io.hf_io import export_checkpoint

    with Shapes() as rec:
        export_checkpoint(ck_dir, out, dtype=dtype, max_shard_bytes=40_000)
    return rec.seen


@pytest.mark.parametrize("world", [1, 2, 3])
def test_export_is_byte_identical_to_save_hf_on_any_number_of_ranks(tmp_path, saved4, world):
    """``export_checkpoint`` (each rank writes every world-th file) writes the bytes ``save_hf`` writes from the whole
    parameters in one process; the files load in q38 to the saved parameters."""
    from q38.train.io.checkpoint import load_params
    from q38.train.io.hf_io import export_checkpoint

    ck_dir = saved4[0]
    _, params, _ = load_params(ck_dir, dtype=torch.bfloat16)
    ref = save_hf(tmp_path / "ref", CFG_A, params, max_shard_bytes=40_000)
    out = tmp_path / "out"
    if world == 1:
        export_checkpoint(ck_dir, out, dtype=torch.bfloat16, max_shard_bytes=40_000)
    else:
        run_distributed(_export_rank, world, str(ck_dir), str(out), torch.bfloat16)
    assert len(list(ref.glob("*.safetensors"))) > world  # several files: the split is exercised
    assert _digest(out) == _digest(ref)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind


def test_export_loads_in_transformers_with_q38_logits(tmp_path, saved4):
    """The export of a sharded checkpoint, loaded by transformers' ``from_pretrained``: logits within 1e-4 of q38's."""
    pytest.importorskip("transformers")
    import q38
    from q38.train.io.checkpoint import load_params
    from q38.train.io.hf_io import export_checkpoint
    from tests.test_hf_parity import _hf_from_pretrained

    ck_dir = saved4[0]
    export_checkpoint(ck_dir, tmp_path / "hf", dtype=torch.float32)
    _, params, _ = load_params(ck_dir)
    ids = torch.randint(0, CFG_A.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = torch.nn.functional.linear(q38.forward(params, ids, CFG_A).hidden, q38.head_weight(params))
        got = _hf_from_pretrained(CFG_A, tmp_path / "hf")(input_ids=ids).logits
    assert (got - want).abs().max().item() <= 1e-4


def _import_rank(rank, world, src, out):
    from q38.train.io.hf_io import import_hf

    import_hf(src, out)


@pytest.mark.parametrize("world", [1, 2])
def test_import_streams_to_the_checkpoint_load_hf_gives(tmp_path, world):
    """``import_hf`` (each tensor read when DCP writes it; under 2 ranks each writes a share) gives a checkpoint whose
    parameters equal ``load_hf``'s, with zero moments at step 0, that resumes as a TrainState."""
    from q38.train.io.checkpoint import load_checkpoint, load_params
    from q38.train.io.hf_io import import_hf
    from q38.train.core.state import init_state

    src = _bf16_hf(tmp_path, CFG_NEXT)
    out = tmp_path / "ck"
    if world == 1:
        import_hf(src, out)
    else:
        run_distributed(_import_rank, world, str(src), str(out))
    _, want = load_hf(src)
    cfg, got, meta = load_params(out)
    assert cfg == CFG_NEXT and meta["step"] == 0 and meta["param_dtype"] == "bfloat16"
    w, g = dict(named_leaves(want)), dict(named_leaves(got))
    assert set(w) == set(g) and all(torch.equal(w[n], g[n]) and g[n].dtype == torch.bfloat16 for n in w)
    state, _ = load_checkpoint(out, init_state(CFG_NEXT, TrainConfig(), dtype=torch.bfloat16))
    assert int(state.step) == 0 and all(float(t.abs().max()) == 0.0 for t in pytree.tree_leaves(state.exp_avg))


def test_a_bad_hf_file_on_one_rank_is_one_error_on_every_rank(tmp_path):
    """A tensor that cannot be read on one rank (a shard file cut after its header was checked) stops every rank
    with an error naming the rank, instead of one rank raising while the others wait in a collective."""
    hf_dir = _bf16_hf(tmp_path, CFG_A)
    outs = run_distributed(_bad_file_rank, 2, str(hf_dir))
    assert outs[0][0] != "ok" and outs[1][0] != "ok"
    assert "rank 1" in outs[0][1] and "RankFailed" == outs[0][0]


def _bad_file_rank(rank, world, hf_dir):
    import q38.hf as hf
    from q38.train.io.hf_io import load_hf_sharded

    if rank == 1:  # this rank's reads fail, as a file cut between the header check and the read would
        def broken(self, key, index):
            raise OSError(f"{key}: unexpected end of file")

        hf.HFReader._read = broken
    try:
        load_hf_sharded(hf_dir, _mesh("fsdp", {"fsdp": 2}, world), dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "ok", ""


# ---- run.save_hf -------------------------------------------------------------------------------------------------------


def _save_hf_run(rank, world, out):
    import os

    from q38.train.run.trainer import train
    from tests.run_utils import run_config

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        train(run_config(out, steps=2, layout="fsdp" if world > 1 else "single",
                         run={"save_hf": True, "save_every": 1, "save_hf_every": 1}))
    finally:
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(k, None)


@pytest.mark.parametrize("world", [1, 2])
def test_run_save_hf_exports_each_checkpoint_from_every_rank(tmp_path, world):
    """``run.save_hf`` with ``save_hf_every: 1``: ``out_dir/hf/step_<n>`` for every checkpoint, holding that
    checkpoint's parameters (in the run's compute dtype: fp32 here), loadable by ``load_hf``, and the run's
    tokenizer files with ``generation_config.json``."""
    from q38.train.io.checkpoint import load_params
    from q38.train.run.trainer import train
    from tests.run_utils import run_config

    out = tmp_path / "run"
    if world == 1:
        _save_hf_run(0, 1, str(out))
    else:
        run_distributed(_save_hf_run, world, str(out))
    for step in (1, 2):
        cfg, got = load_hf(out / "hf" / f"step_{step:06d}")
        _, want, meta = load_params(out / "checkpoints" / f"step_{step:06d}")
        assert meta["step"] == step
        w, g = dict(named_leaves(want)), dict(named_leaves(got))
        assert set(w) == set(g) and all(torch.equal(w[n], g[n]) for n in w)
        # the run's byte tokenizer and where generation stops (<|eos|> 258, <|im_end|> 260), written once
        d = out / "hf" / f"step_{step:06d}"
        assert json.loads((d / "config.json").read_text())["eos_token_id"] == 258
        assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [258, 260]
        assert (d / "tokenizer.json").is_file()
    with pytest.raises(Exception, match="save_hf_every is set but run.save_hf is false"):
        train(run_config(tmp_path / "bad", steps=1, run={"save_hf_every": 1}))


def test_convert_to_hf_under_torchrun_equals_one_process(tmp_path, saved4):
    """``torchrun --nproc_per_node 2 -m q38.cli convert --to-hf``: each worker writes its share of the files; the
    directory equals the one-process ``q38 convert --to-hf`` byte for byte."""
    import os
    import subprocess
    import sys

    from q38.cli import main
    from tests.run_utils import REPO

    ck_dir = saved4[0]
    assert main(["convert", "--to-hf", str(ck_dir), str(tmp_path / "one"), "--max-shard-bytes", "40000"]) == 0
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                        "q38.cli", "convert", "--to-hf", str(ck_dir), str(tmp_path / "two"), "--max-shard-bytes",
                        "40000"], capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("q38 convert: wrote") == 1  # rank 0 reports
    assert _digest(tmp_path / "two") == _digest(tmp_path / "one") and len(_digest(tmp_path / "one")) > 3
