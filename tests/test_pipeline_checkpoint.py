"""Checkpoints of a pipelined run (``pp``): saved by every stage under the same keys as any run (DCP, one entry per
parameter), so a ``pp`` run resumes exactly, its checkpoint resumes without ``pp`` and the reverse (the same next
loss), and ``q38 convert --to-hf`` exports it as it exports the one-process checkpoint."""

import pytest
import torch

from q38.pytree import named_leaves
from q38.train.core.state import init_state, state_from_params
from q38.train.core.step import train_step
from tests.dist_utils import run_distributed
from tests.test_pipeline import PP_EP, _batch, _cfg, _layout, _tc

NO_PP = "{include: fsdp_ep.yaml, name: no_pp, mesh: {fsdp: -1, ep: 2}}"
TOL = 1e-5

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _meta(state, tc):
    return {"step": int(state.step), "model_config": _cfg().to_dict(), "train_config": tc.to_dict()}


def _train_and_save(rank, world, text, tc, root):
    """Two steps, save, one more step: the third step's loss and the saved checkpoint."""
    from q38.parallel.mesh import make_mesh, shard, shard_batch
    from q38.train.io.checkpoint import save_checkpoint

    cfg = _cfg()
    mesh = make_mesh(_layout(text), world, model=cfg)
    state = shard(init_state(cfg, tc, seed=0), mesh)
    for i in range(2):
        state, _ = train_step(state, shard_batch(_batch(seed=i), mesh, cfg.mtp_num_layers), mesh)
    ck = save_checkpoint(root, state, _meta(state, tc))
    state, m = train_step(state, shard_batch(_batch(seed=2), mesh, cfg.mtp_num_layers), mesh)
    return {"ck": str(ck), "next": {k: float(v) for k, v in m.terms.items()}}


def _resume(rank, world, text, tc, ck):
    """Load ``ck`` into an empty sharded template of ``text``'s mesh and run the third step."""
    from q38.parallel.mesh import make_mesh, shard_batch
    from q38.train.io.checkpoint import empty_params, load_checkpoint

    cfg = _cfg()
    mesh = make_mesh(_layout(text), world, model=cfg)
    template = state_from_params(empty_params(cfg, mesh=mesh), cfg, tc)
    state, meta = load_checkpoint(ck, template)
    held = [n for n, _ in named_leaves(state.params)]
    state, m = train_step(state, shard_batch(_batch(seed=2), mesh, cfg.mtp_num_layers), mesh)
    return {"next": {k: float(v) for k, v in m.terms.items()}, "step": meta["step"], "held": held}


def test_pp_checkpoint_resumes_exactly_and_across_pp_and_no_pp(tmp_path):
    tc = _tc()
    pp_runs = run_distributed(_train_and_save, 4, PP_EP, tc, str(tmp_path / "pp"))
    ck_pp = pp_runs[0]["ck"]
    # the same layout resumes exactly: the same third step, bit for bit
    again = run_distributed(_resume, 4, PP_EP, tc, ck_pp)
    assert all(a["next"] == pp_runs[0]["next"] for a in again) and again[0]["step"] == 2
    assert all(len(a["held"]) < len(named_leaves(init_state(_cfg(), tc).params)) for a in again)  # one stage's part
    # without pp (fsdp × ep on 2 ranks): the same next loss
    no_pp = run_distributed(_resume, 2, NO_PP, tc, ck_pp)
    for name in ("loss", "mtp_1", "aux"):
        assert abs(no_pp[0]["next"][name] - pp_runs[0]["next"][name]) <= TOL, name
    # the reverse: a checkpoint of the run without pp resumes with pp, the same next loss
    plain = run_distributed(_train_and_save, 2, NO_PP, tc, str(tmp_path / "plain"))
    on_pp = run_distributed(_resume, 4, PP_EP, tc, plain[0]["ck"])
    for name in ("loss", "mtp_1", "aux"):
        assert abs(on_pp[0]["next"][name] - plain[0]["next"][name]) <= TOL, name
    # q38 convert --to-hf: a pp checkpoint exports the tensors it holds (the one-process reading of the same keys)
    from safetensors.torch import load_file

    from q38.cli import main
    from q38.train.io.checkpoint import load_params

    out = tmp_path / "hf"
    assert main(["convert", "--to-hf", ck_pp, str(out), "--dtype", "float32"]) == 0
    _, params, _ = load_params(ck_pp)
    hf = {}
    for f in out.glob("*.safetensors"):
        hf.update(load_file(f))
    w = hf["model.embed_tokens.weight"]
    assert torch.equal(w, dict(named_leaves(params))["embed"])
    assert any(k.startswith("mtp.") for k in hf) and "lm_head.weight" in hf


def test_q38_train_with_pp_under_torchrun_matches_one_process_and_resumes_without_pp(tmp_path):
    """``q38 train`` on 2 processes with ``pp: 2`` (torchrun): the logged losses of one process, and its checkpoint
    resumes on one process (layout single) with the one-process run's next loss."""
    import os
    import subprocess
    import sys

    from tests.run_utils import REPO, metrics, q38, run_dict, write_config

    layout = tmp_path / "pp2.yaml"
    layout.write_text("{include: fsdp.yaml, name: pp2, mesh: {pp: 2, fsdp: 1}}")
    train = {"micro_batches": 2, "aux_loss_scope": "global_batch"}

    def cfg(out, steps, lay):
        return write_config(tmp_path / f"{out}.yaml", run_dict(tmp_path / out, steps=steps, layout=str(lay),
                                                                train=train, run={"save_every": 2}))

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                        "q38.cli", "train", str(cfg("pp", 2, layout))], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    one = q38("train", str(cfg("one", 3, "single")), timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    pp_losses = [m["loss"] for m in metrics(tmp_path / "pp")]
    one_losses = [m["loss"] for m in metrics(tmp_path / "one")]
    assert len(pp_losses) == 2 and all(abs(a - b) <= 1e-5 for a, b in zip(pp_losses, one_losses)), (pp_losses,
                                                                                                     one_losses)
    # resume the pp run's checkpoint on one process: its third step is the one-process run's
    res = q38("train", str(cfg("pp", 3, "single")), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert abs(metrics(tmp_path / "pp")[-1]["loss"] - one_losses[2]) <= 1e-5
