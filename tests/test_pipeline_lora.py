"""LoRA on a pipelined layout (``pp``): each stage adds adapters to its own weights only, placed on its own ranks;
the run equals one process's LoRA run (losses and adapters within 1e-5 over steps), a ``q38 train`` run saves,
resumes exactly, and ``q38 convert --to-peft`` / ``--to-hf`` of its checkpoint write what the one-process run's
checkpoint gives."""

import os
import subprocess
import sys

import pytest
import torch

from q38.lora import PeftConfig, is_adapter_path
from q38.model import init_params
from q38.pytree import named_leaves
from q38.train.core.step import train_step
from tests.dist_utils import run_distributed
from tests.test_pipeline import _batch, _cfg, _layout, _tc

TOL = 1e-5
PEFT = PeftConfig(rank=3, alpha=6, experts="per_expert", mtp=True)
# pp 2 × FSDP 2 (adapters sharded inside a stage), the automatic split (3 + 3 layers: GDN and attention in each)
PP_FSDP = "{include: fsdp.yaml, name: pp_fsdp, mesh: {pp: 2, fsdp: -1}}"
STEPS = 3

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _adapters(params) -> dict:
    return {n: t for n, t in named_leaves(params) if is_adapter_path(n)}


def _lora_rank(rank, world, tc):
    from q38.parallel.mesh import init_sharded, make_mesh, shard_batch, unshard
    from q38.train.io.peft import lora_state

    cfg = _cfg()
    mesh = make_mesh(_layout(PP_FSDP), world, model=cfg)
    state = lora_state(init_sharded(cfg, mesh, seed=0), cfg, tc, PEFT, seed=0, mesh=mesh)
    held = [n for n, _ in named_leaves(state.params)]
    terms = []
    for i in range(STEPS):
        state, m = train_step(state, shard_batch(_batch(seed=i), mesh, cfg.mtp_num_layers), mesh)
        terms.append({k: float(v) for k, v in m.terms.items()})
    return {"terms": terms, "adapters": _adapters(unshard(state).params), "held": held}


def test_a_lora_run_on_pp_equals_one_process():
    """pp 2 × FSDP 2 on 4 gloo ranks, 3 steps: every term of every step and every adapter after them within 1e-5 of
    one process; a stage holds only its own layers' weights and adapters."""
    from q38.train.io.peft import lora_state

    tc, cfg = _tc(), _cfg()
    state = lora_state(init_params(cfg, seed=0), cfg, tc, PEFT, seed=0)
    ref = []
    for i in range(STEPS):
        state, m = train_step(state, _batch(seed=i))
        ref.append({k: float(v) for k, v in m.terms.items()})
    want = _adapters(state.params)
    outs = run_distributed(_lora_rank, 4, tc, timeout=600)
    got = {}
    for o in outs:
        assert len(o["held"]) < len(named_leaves(state.params))  # one stage's part
        for i in range(STEPS):
            for name in ("loss", "mtp_1", "aux"):
                assert abs(o["terms"][i][name] - ref[i][name]) <= TOL, (i, name)
        got.update(o["adapters"])
    assert set(got) == set(want)
    moved = 0
    for n, p in want.items():
        assert (got[n] - p).abs().max() <= TOL, n
        moved += bool(n.endswith("lora_b") and p.abs().max() > 0)  # B starts at 0: the run trained it
    assert moved == sum(n.endswith("lora_b") for n in want)


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _st(d) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_q38_train_lora_on_pp_resumes_and_exports_as_one_process(tmp_path):
    """``q38 train`` with ``peft`` on pp 2 (2 torchrun processes, a model unlike tiny): two steps, saved, resumed
    for a third; the logged losses are the one-process LoRA run's (within 1e-5), and ``--to-peft`` / ``--to-hf``
    of its checkpoint equal those of the one-process checkpoint (every adapter / merged tensor within 1e-5)."""
    from q38.cli import main
    from tests.run_utils import REPO, metrics, q38, run_dict, write_config

    layout = tmp_path / "pp2.yaml"
    layout.write_text("{include: fsdp.yaml, name: pp2, mesh: {pp: 2, fsdp: 1}}")
    model = _cfg().to_dict()
    kw = {"model": model, "peft": {"rank": 3, "alpha": 6},  # (adapters on mtp.* have no PEFT module)
          "train": {"micro_batches": 2, "lr": 5e-3, "eps": 1e-3, "warmup_steps": 0, "loss_chunk_size": 16},
          "data": {"batch_size": 2, "seq_len": 24}}

    def cfg(out, steps, lay):
        return write_config(tmp_path / f"{out}-{steps}.yaml", run_dict(tmp_path / out, steps=steps, layout=str(lay),
                                                                        run={"save_every": 2}, **kw))

    def torchrun(path):
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "-m", "q38.cli", "train", str(path)], capture_output=True, text=True, cwd=REPO,
                              env=_env(), timeout=600, check=False)

    for out, steps in (("pp", 2), ("pp", 3), ("straight", 3)):  # pp: stopped after step 2 and resumed
        r = torchrun(cfg(out, steps, layout))
        assert r.returncode == 0, r.stderr[-3000:]
    one = q38("train", str(cfg("one", 3, "single")), timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    pp, ref = metrics(tmp_path / "pp"), metrics(tmp_path / "one")
    assert [m["step"] for m in pp] == [1, 2, 3]
    keys = ("loss", "mtp_1", "aux", "grad_norm")
    assert [[m[k] for k in keys] for m in pp] == [[m[k] for k in keys] for m in metrics(tmp_path / "straight")]
    for a, b in zip(pp, ref):
        for name in ("loss", "mtp_1", "aux"):
            assert abs(a[name] - b[name]) <= TOL, (a["step"], name)
    assert ref[-1]["loss"] < ref[0]["loss"]
    for run in ("pp", "one"):
        assert main(["convert", "--to-peft", str(tmp_path / run), str(tmp_path / f"{run}-adapter")]) == 0
        assert main(["convert", "--to-hf", str(tmp_path / run), str(tmp_path / f"{run}-merged"),
                     "--dtype", "float32"]) == 0
    for kind in ("adapter", "merged"):
        got, want = _st(tmp_path / f"pp-{kind}"), _st(tmp_path / f"one-{kind}")
        assert want and set(got) == set(want), kind
        for k, w in want.items():
            assert got[k].shape == w.shape and (got[k].float() - w.float()).abs().max() <= TOL, (kind, k)
    adapters = _st(tmp_path / "one-adapter")
    assert any(".layers.5." in k for k in adapters) and any(".layers.0." in k for k in adapters)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapters.items())
    assert (tmp_path / "pp-adapter" / "adapter_config.json").read_text() == \
        (tmp_path / "one-adapter" / "adapter_config.json").read_text()
    torch.testing.assert_close(_st(tmp_path / "pp-merged")["model.embed_tokens.weight"],
                               _st(tmp_path / "one-merged")["model.embed_tokens.weight"], rtol=0, atol=0)
