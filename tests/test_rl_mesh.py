"""Rollouts and RL iterations on a sharded state (``q38.train.run.rl.mesh_rollout``, ``rl_iteration(mesh=)``) on 2
gloo ranks, FSDP and EP (and CP), on a model unlike tiny: each rank decodes its share of the prompts on its own
shards, and the samples are one process's (the same tokens, log-probs within 1e-5); the recorded log-probs equal
the sharded trainer's (the step's ``mismatch_max`` ≤ 1e-5); one iteration leaves the parameters and moments one
process's iteration leaves (fp32, 1e-5)."""

import pytest
import torch

from q38.decode import Sampling
from q38.parallel.layout import Layout
from q38.pytree import named_leaves
from q38.rollout import rollout
from q38.train.core.state import init_state
from q38.train.core.step_config import TrainConfig
from q38.train.run.rl import rl_iteration
from tests.dist_utils import run_distributed
from tests.test_policy_loss import CFG
from tests.test_rl import PROMPTS

pytestmark = pytest.mark.dist

TOL = 1e-5
TC = TrainConfig(lr=1e-3, warmup_steps=1, aux_loss_coef=0.01)
SAMPLING = Sampling(temperature=0.9, top_p=0.97, seed=13)
PROMPTS4 = PROMPTS + [[61, 9, 140, 3]]  # 4 prompts of 2..5 tokens: 2 per rank, uneven lengths across ranks
KW = {"prompt_texts": ["a", "b", "c", "d"], "answers": [None] * 4, "detokenize": lambda ids: " ".join(map(str, ids)),
      "rewards": ["tests.test_rl:user_reward"], "group_size": 3, "max_new_tokens": 6, "sampling": SAMPLING,
      "row_len": 16}


def _rank_fn(rank, world, layout_name, mesh_sizes):
    from q38.parallel.mesh import make_mesh, shard
    from q38.train.run.rl import mesh_rollout

    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = shard(init_state(CFG, TC, seed=3), mesh)
    comps = mesh_rollout(state, mesh, PROMPTS4, group_size=3, max_new_tokens=6, sampling=SAMPLING)
    held = mesh_rollout(state, mesh, PROMPTS4, group_size=3, max_new_tokens=6, sampling=SAMPLING,
                        hold_gathered=True)
    new, m = rl_iteration(state, PROMPTS4, mesh=mesh, **KW)
    full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in named_leaves(new.params)}
    avg = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in named_leaves(new.exp_avg)}
    return {"comps": comps, "held": held, "metrics": m, "params": full if rank == 0 else None,
            "exp_avg": avg if rank == 0 else None}


CASES = [("fsdp", {"fsdp": 2}), ("fsdp_ep", {"fsdp": 1, "ep": 2}), ("fsdp_cp", {"fsdp": 1, "cp": 2})]


@pytest.mark.parametrize("layout,mesh_sizes", CASES, ids=[c[0] for c in CASES])
def test_rollout_and_one_rl_iteration_on_two_ranks_equal_one_process(layout, mesh_sizes):
    state = init_state(CFG, TC, seed=3)
    one = rollout(state.params, CFG, PROMPTS4, group_size=3, max_new_tokens=6, sampling=SAMPLING)
    new, m1 = rl_iteration(state, PROMPTS4, **KW)
    assert len({c.tokens for c in one}) > 4  # sampled, not one completion repeated
    outs = run_distributed(_rank_fn, 2, layout, mesh_sizes)
    for o in outs:
        for got in (o["comps"], o["held"]):
            assert [(c.prompt_index, c.prompt, c.tokens) for c in got] == \
                   [(c.prompt_index, c.prompt, c.tokens) for c in one]
            err = max(abs(a - b) for g, c in zip(got, one) for a, b in zip(g.logprobs, c.logprobs))
            assert err <= TOL, f"rollout log-probs on {layout} vs one process: {err:.2e}"
        m = o["metrics"]
        assert m["mismatch_max"] <= TOL, f"max |rollout - trainer log-prob| on {layout}: {m['mismatch_max']:.2e}"
        for k in ("reward_mean", "reward_std", "response_length"):
            assert m[k] == m1[k], k
        for k in ("loss", "logprob_diff", "entropy", "grad_norm"):
            assert abs(m[k] - m1[k]) <= TOL, (k, m[k], m1[k])
    got, avg = outs[0]["params"], outs[0]["exp_avg"]
    before = dict(named_leaves(state.params))
    moved = 0
    for (name, want), (_, want_m) in zip(named_leaves(new.params), named_leaves(new.exp_avg)):
        err = float((got[name] - want).abs().max())
        assert err <= TOL, f"{name} after one iteration on {layout}: {err:.2e}"
        assert float((avg[name] - want_m).abs().max()) <= TOL, name
        moved += bool((want - before[name]).abs().max() > 1e-4)
    assert moved >= len(before) - 2  # the iteration trained (an lr of 1e-3 moves nearly every leaf)


def _refuse_fn(rank, world):
    from q38.errors import ConfigError
    from q38.parallel.mesh import make_mesh, shard
    from q38.train.run.rl import mesh_rollout

    mesh = make_mesh(Layout.preset("fsdp").with_mesh(fsdp=2), world)
    state = shard(init_state(CFG, TC, seed=3), mesh)
    try:
        mesh_rollout(state, mesh, PROMPTS4[:1], group_size=2, max_new_tokens=2, sampling=SAMPLING)
    except ConfigError as e:
        return str(e)
    return None


def test_a_mesh_rollout_with_fewer_prompts_than_ranks_is_one_line():
    for msg in run_distributed(_refuse_fn, 2):
        assert msg is not None and "\n" not in msg and "prompts_per_iteration" in msg


def _replay_fn(rank, world):
    from q38.parallel.mesh import make_mesh, shard

    mesh = make_mesh(Layout.preset("fsdp_ep").with_mesh(fsdp=1, ep=2), world)
    state = shard(init_state(CFG, TC, seed=3), mesh)
    new, m = rl_iteration(state, PROMPTS4, mesh=mesh, routing_replay=True, updates=2, **KW)
    return {"metrics": m, "params": {n: t.full_tensor() if hasattr(t, "full_tensor") else t
                                     for n, t in named_leaves(new.params)}}


@pytest.mark.slow
def test_routing_replay_on_two_ep_ranks_equals_one_process():
    """Routes recorded by each rank's share of the rollout (EP dispatch in the decode) and replayed in 2 updates on
    the EP mesh: the parameters one process's replayed iteration gives (1e-5)."""
    state = init_state(CFG, TC, seed=3)
    new, m1 = rl_iteration(state, PROMPTS4, routing_replay=True, updates=2, **KW)
    plain, _ = rl_iteration(state, PROMPTS4, updates=2, **KW)
    outs = run_distributed(_replay_fn, 2)
    for o in outs:
        assert o["metrics"]["mismatch_max"] <= TOL and abs(o["metrics"]["loss"] - m1["loss"]) <= TOL
    differs = 0.0
    for name, want in named_leaves(new.params):
        assert float((outs[0]["params"][name] - want).abs().max()) <= TOL, name
        differs = max(differs, float((dict(named_leaves(plain.params))[name] - want).abs().max()))
    assert differs > 1e-6  # replay changed the second update: the comparison could tell


def _lora_state(cfg=CFG, tc=TC):
    """A LoRA state of ``cfg`` whose adapters are off zero (the merged policy differs from its base)."""
    from q38.lora import PeftConfig, add_adapters
    from q38.model import init_params
    from q38.train.core.state import state_from_params

    peft = PeftConfig(rank=4, alpha=8)
    # B moved off zero so the merged policy differs from the base (the merge is exercised)
    from q38.pytree import tree_map_with_path

    p = add_adapters(init_params(cfg, seed=3), peft, seed=1)
    g = torch.Generator().manual_seed(2)
    p = tree_map_with_path(lambda path, t: t + 0.2 * torch.randn(t.shape, generator=g) if path.endswith("lora_b")
                           else t, p)
    return state_from_params(p, cfg, tc, peft=peft)


def _lora_fn(rank, world):
    from q38.parallel.mesh import make_mesh, shard
    from q38.train.run.rl import mesh_rollout

    mesh = make_mesh(Layout.preset("fsdp_ep").with_mesh(fsdp=1, ep=2), world)
    return mesh_rollout(shard(_lora_state(), mesh), mesh, PROMPTS4, group_size=3, max_new_tokens=6,
                        sampling=SAMPLING)


@pytest.mark.slow
def test_a_lora_states_mesh_rollout_samples_what_its_merged_policy_samples():
    """A LoRA state sharded on 2 EP ranks: the adapters merged after each layer's gather give the samples and
    log-probs of one process's merged policy (``policy_params``), which differ from the base's."""
    from q38.lora import base_params
    from q38.train.run.rl import policy_params

    state = _lora_state()
    one = rollout(policy_params(state), CFG, PROMPTS4, group_size=3, max_new_tokens=6, sampling=SAMPLING)
    base = rollout(base_params(state.params), CFG, PROMPTS4, group_size=3, max_new_tokens=6, sampling=SAMPLING)
    assert max(abs(a - b) for g, c in zip(one, base) for a, b in zip(g.logprobs, c.logprobs)) > 1e-3
    for got in run_distributed(_lora_fn, 2):
        assert [c.tokens for c in got] == [c.tokens for c in one]
        assert max(abs(a - b) for g, c in zip(got, one) for a, b in zip(g.logprobs, c.logprobs)) <= TOL
