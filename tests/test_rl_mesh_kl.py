"""A KL term to the reference policy on a sharded state (``q38.train.run.rl.mesh_reference_logprobs``,
``rl_iteration(mesh=, loss.kl_coef > 0)``) on 2 gloo ranks, FSDP, EP and CP, on ``tests/test_rl_mesh.py``'s model
(unlike tiny in every dimension): the reference log-probs of a packed batch computed on the mesh (a LoRA state's
base with its adapters off; a full fine-tune's frozen copy sharded as the state is) equal one process's
``reference_logprobs`` within 1e-5, and one iteration with the KL term leaves one process's parameters (1e-5) and
reports its ``kl`` (1e-6). fp32. After the iteration the first Adam moment (a tenth of the gradient) equals one
process's within 1e-7 everywhere and the weights within 1e-5 wherever the gradient exceeds 1e-6: Adam's first step
moves a weight by about lr · g / (|g| + eps), so a gradient of 2e-9 that rounds to 3e-9 on the mesh (seen on CP)
moves its weight by a few percent of lr more or less; the gradient itself agrees."""

import pytest

from q38.parallel.layout import Layout
from q38.pytree import named_leaves
from q38.rollout import rollout
from q38.train.core.policy import PolicyLossConfig
from q38.train.core.state import init_state
from q38.train.run.rl import group_advantages, pack_rollouts, policy_params, reference_logprobs, rl_iteration, \
    trainer_logprobs
from tests.dist_utils import run_distributed
from tests.test_policy_loss import CFG
from tests.test_rl_mesh import KW, PROMPTS4, SAMPLING, TC, _lora_state

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TOL = 1e-5
LOSS = PolicyLossConfig(temperature=SAMPLING.temperature, kl_coef=0.5)


def _full_pair():
    """A full fine-tune's state and a frozen reference of other weights (so the KL is not 0)."""
    return init_state(CFG, TC, seed=3), init_state(CFG, TC, seed=4).params


def _batch(state, params):
    comps = rollout(params, CFG, PROMPTS4, group_size=3, max_new_tokens=6, sampling=SAMPLING)
    return pack_rollouts(comps, group_advantages([float(len(c.tokens)) for c in comps], 3), 16)


def _rank_fn(rank, world, layout_name, mesh_sizes, mode, batch):
    from q38.parallel.mesh import make_mesh, shard
    from q38.train.run.rl import mesh_reference_logprobs

    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    if mode == "lora":
        state, ref = shard(_lora_state(), mesh), None
    else:
        s, r = _full_pair()
        state, ref = shard(s, mesh), shard(r, mesh)
    got = mesh_reference_logprobs(state, batch, mesh, LOSS.temperature, ref)
    new, m = rl_iteration(state, PROMPTS4, mesh=mesh, loss=LOSS, ref_params=ref, **KW)
    full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in named_leaves(new.params)}
    avg = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in named_leaves(new.exp_avg)}
    return {"ref": got, "metrics": m, "params": full if rank == 0 else None, "exp_avg": avg if rank == 0 else None}


CASES = [("fsdp", {"fsdp": 2}, "lora"), ("fsdp_ep", {"fsdp": 1, "ep": 2}, "lora"),
         ("fsdp_cp", {"fsdp": 1, "cp": 2}, "lora"), ("fsdp_ep", {"fsdp": 1, "ep": 2}, "full")]


@pytest.mark.parametrize("layout,mesh_sizes,mode", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_reference_logprobs_and_a_kl_iteration_on_two_ranks_equal_one_process(layout, mesh_sizes, mode):
    if mode == "lora":
        state, ref = _lora_state(), None
    else:
        state, ref = _full_pair()
    batch = _batch(state, policy_params(state))
    want = reference_logprobs(state, batch, LOSS.temperature, ref)
    labelled = batch["labels"] != -100
    assert bool((want[labelled] < 0).all()) and bool((want[~labelled] == 0).all())
    # the reference is not the policy (adapters off / other weights): the comparison can tell them apart
    policy = trainer_logprobs(state, batch, LOSS.temperature)
    assert float((policy - want).abs().max()) > 1e-3
    new, m1 = rl_iteration(state, PROMPTS4, loss=LOSS, ref_params=ref, **KW)
    assert m1["kl"] > 1e-4
    outs = run_distributed(_rank_fn, 2, layout, mesh_sizes, mode, batch)
    for o in outs:
        err = float((o["ref"] - want).abs().max())
        assert o["ref"].shape == want.shape and err <= TOL, f"reference log-probs on {layout} ({mode}): {err:.2e}"
        m = o["metrics"]
        assert abs(m["kl"] - m1["kl"]) <= 1e-6, (m["kl"], m1["kl"])
        assert abs(m["loss"] - m1["loss"]) <= TOL and m["mismatch_max"] <= TOL
    got, avg = outs[0]["params"], outs[0]["exp_avg"]
    moments = dict(named_leaves(new.exp_avg))  # a LoRA state's: its adapters only
    assert len(moments) > 4
    n_kept = n_trained = 0
    for name, w in named_leaves(new.params):
        diff = (got[name] - w).abs()
        if name in moments:
            err_m = float((avg[name] - moments[name]).abs().max())
            assert err_m <= 1e-7, f"{name}'s first moment after one KL iteration on {layout} ({mode}): {err_m:.2e}"
            kept = moments[name].abs() > 1e-7  # |gradient| > 1e-6: see the module's docstring
            n_kept, n_trained = n_kept + int(kept.sum()), n_trained + kept.numel()
            diff = diff[kept]
        err = float(diff.max()) if diff.numel() else 0.0
        assert err <= TOL, f"{name} after one KL iteration on {layout} ({mode}): {err:.2e}"
    # most trained weights are compared (an embedding's rows of tokens absent from the batch get no gradient)
    assert n_kept > n_trained / 2, (n_kept, n_trained)


def _refuse_fn(rank, world):
    from q38.errors import ConfigError
    from q38.parallel.mesh import make_mesh, shard

    mesh = make_mesh(Layout.preset("fsdp").with_mesh(fsdp=2), world)
    s, r = _full_pair()
    state = shard(s, mesh)
    msgs = []
    for ref in (None, r):  # no reference for a full fine-tune; a plain (unsharded) copy on the mesh
        try:
            rl_iteration(state, PROMPTS4, mesh=mesh, loss=LOSS, ref_params=ref, **KW)
            msgs.append(None)
        except ConfigError as e:
            msgs.append(str(e))
    return msgs


def test_a_kl_term_on_a_mesh_without_a_sharded_reference_is_one_line():
    for none, plain in run_distributed(_refuse_fn, 2):
        assert none is not None and "\n" not in none and "ref_params" in none
        assert plain is not None and "\n" not in plain and "shard" in plain
