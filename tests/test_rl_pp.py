"""RL on a pipelined layout (``pp`` > 1) on gloo ranks: ``mesh_rollout`` (the stages of a pipeline group decode the
same share of prompts, each its own layers, the hidden state sent stage to stage and the last stage's logits
broadcast), ``rl_iteration(mesh=)`` (the pipelined step on the packed batch) and a KL term's reference log-probs
(``mesh_reference_logprobs``: a no-grad pipelined forward). On ``tests/test_rl_mesh.py``'s model (unlike tiny in
every dimension) with four layers, so each of the two stages runs a GDN and an attention layer; fp32. The expected
values come from one process's ``rollout`` / ``rl_iteration`` / ``reference_logprobs`` (no mesh, no pipeline): the
same tokens, log-probs within 1e-5, loss within 1e-5, ``mismatch_max`` ≤ 1e-5, first moments within 1e-7 and
weights within 1e-5 wherever |gradient| > 1e-6 (Adam's first step amplifies the rounding of near-zero gradients:
see tests/test_rl_mesh_kl.py). With CP inside a stage (sums split over sequence shards) the first moments are held
within 2e-7 (1.2e-7 seen: a gradient difference of 1.2e-6 on a gradient of norm 10.6)."""

import pytest
import yaml

from q38.parallel.layout import Layout
from q38.parallel.pipeline import stage_split
from q38.pytree import named_leaves
from q38.rollout import rollout
from q38.train.core.policy import PolicyLossConfig
from q38.train.core.state import init_state
from q38.train.core.step_config import TrainConfig
from q38.train.run.rl import group_advantages, pack_rollouts, policy_params, reference_logprobs, rl_iteration, \
    trainer_logprobs
from tests.dist_utils import run_distributed
from tests.test_policy_loss import CFG as _CFG
from tests.test_rl_mesh import KW as _KW
from tests.test_rl_mesh import PROMPTS4, SAMPLING
from tests.test_rl_mesh import _lora_state as _mesh_lora_state

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TOL = 1e-5
CFG = _CFG.replace(num_hidden_layers=4, layer_types=("linear_attention", "full_attention") * 2)
# 2 micro-batches (the pipelined step needs at least pp); global-batch aux scope, so the aux term does not depend on
# which rows share a micro-batch (rows are split over data ranks first)
TC = TrainConfig(lr=1e-3, warmup_steps=1, aux_loss_coef=0.01, micro_batches=2, aux_loss_scope="global_batch")
KW = {**_KW, "row_len": 20}  # 6 packed rows: 2 micro-batches on one process
STAGES = "pipeline: {schedule: 1f1b, stages: [[0, 1], [2, 3]]}"
PP2 = "{include: fsdp.yaml, name: pp2, mesh: {pp: 2, fsdp: 1}, " + STAGES + "}"
# interleaved: 4 chunks of one layer, stage 0 holds layers 0 and 2, stage 1 layers 1 and 3, so a decode step's hidden
# state goes 0 -> 1 -> 0 -> 1 and the last stage's logits come back to stage 0
PP2_V2 = "{include: fsdp.yaml, name: pp2_v2, mesh: {pp: 2, fsdp: 1}, " \
         "pipeline: {schedule: interleaved_1f1b, virtual_stages: 2}}"
PP2_FSDP2 = "{include: fsdp.yaml, name: pp2_fsdp2, mesh: {pp: 2, fsdp: 2}, " + STAGES + "}"
PP2_EP2 = "{include: fsdp_ep.yaml, name: pp2_ep2, mesh: {pp: 2, fsdp: 1, ep: 2}, " + STAGES + "}"
PP2_CP2 = "{include: fsdp_cp.yaml, name: pp2_cp2, mesh: {pp: 2, fsdp: 1, cp: 2}, " + STAGES + "}"
LOSS = PolicyLossConfig(temperature=SAMPLING.temperature, kl_coef=0.5)


def _layout(text: str) -> Layout:
    return Layout.from_dict(yaml.safe_load(text))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _lora_state():
    """A LoRA state whose adapters are off zero (the merged policy differs from its base, the reference)."""
    return _mesh_lora_state(CFG, TC)


def test_each_stage_runs_both_layer_kinds_and_the_model_is_pipelinable():
    for text in (PP2, PP2_FSDP2, PP2_EP2, PP2_CP2):
        chunks = stage_split(_layout(text), CFG)
        assert len(chunks) == 2
        for c in chunks:
            assert {CFG.layer_types[i] for i in c.layers} == {"linear_attention", "full_attention"}
    assert not CFG.tie_word_embeddings and CFG.num_experts % 2 == 0
    # the interleaved layout: one layer a chunk, the stages alternating, the head on stage 1
    assert [(c.rank, list(c.layers), c.embed, c.head) for c in stage_split(_layout(PP2_V2), CFG)] == \
           [(0, [0], True, False), (1, [1], False, False), (0, [2], False, False), (1, [3], False, True)]


def _state_on(mesh, mode: str):
    from q38.parallel.mesh import shard

    if mode == "lora":
        return shard(_lora_state(), mesh), None
    state = shard(init_state(CFG, TC, seed=3), mesh)
    return state, (shard(init_state(CFG, TC, seed=4).params, mesh) if mode == "kl" else None)


def _gather_state(new) -> dict:
    """This rank's stage's parameters and first moments, whole."""
    from q38.parallel.mesh import unshard

    return {"params": {n: _full(t) for n, t in named_leaves(unshard(new.params))},
            "exp_avg": {n: _full(t) for n, t in named_leaves(unshard(new.exp_avg))}}


def _rank_fn(rank, world, text, mode, batch):
    from q38.parallel.mesh import make_mesh
    from q38.train.run.rl import mesh_reference_logprobs, mesh_rollout

    mesh = make_mesh(_layout(text), world, model=CFG)
    state, ref = _state_on(mesh, mode)
    out = {"pp_rank": mesh.pp_rank}
    if mode != "kl":
        out["comps"] = mesh_rollout(state, mesh, PROMPTS4, group_size=3, max_new_tokens=6, sampling=SAMPLING)
    if mode == "plain":
        out["held"] = mesh_rollout(state, mesh, PROMPTS4, group_size=3, max_new_tokens=6, sampling=SAMPLING,
                                   hold_gathered=True)
    loss = None
    if batch is not None:
        out["ref"] = mesh_reference_logprobs(state, batch, mesh, LOSS.temperature, ref)
        loss = LOSS
    new, out["metrics"] = rl_iteration(state, PROMPTS4, mesh=mesh, loss=loss, ref_params=ref, **KW)
    out.update(_gather_state(new))
    return out


def _one_process(mode: str):
    """``(state, reference params, policy the rollout samples from)`` on one process."""
    if mode == "lora":
        state = _lora_state()
        return state, None, policy_params(state)
    state = init_state(CFG, TC, seed=3)
    return state, (init_state(CFG, TC, seed=4).params if mode == "kl" else None), state.params


def _check(outs, mode, m1, new, one=None, label=""):
    for o in outs:
        for got in [o[k] for k in ("comps", "held") if k in o]:
            assert [(c.prompt_index, c.prompt, c.tokens) for c in got] == \
                   [(c.prompt_index, c.prompt, c.tokens) for c in one]
            err = max(abs(a - b) for g, c in zip(got, one) for a, b in zip(g.logprobs, c.logprobs))
            assert err <= TOL, f"rollout log-probs on {label} vs one process: {err:.2e}"
        m = o["metrics"]
        # a LoRA state samples from its merged weights and trains unmerged: one process's own mismatch (1.8e-5 here)
        limit = TOL if mode != "lora" else m1["mismatch_max"] + 1e-6
        assert m["mismatch_max"] <= limit, f"max |rollout - trainer log-prob| on {label}: {m['mismatch_max']:.2e}"
        for k in ("reward_mean", "reward_std", "response_length"):
            assert m[k] == m1[k], k
        for k in ("loss", "logprob_diff", "entropy", "grad_norm"):
            assert abs(m[k] - m1[k]) <= TOL, (k, m[k], m1[k])
        if mode != "plain":
            assert abs(m["kl"] - m1["kl"]) <= 1e-6, (m["kl"], m1["kl"])
    got, avg = {}, {}
    for o in outs:  # each stage holds its own layers: together, every parameter
        got.update(o["params"])
        avg.update(o["exp_avg"])
    moments = dict(named_leaves(new.exp_avg))  # a LoRA state's: its adapters only
    assert set(got) == {n for n, _ in named_leaves(new.params)} and set(avg) == set(moments)
    compared = total = 0
    for name, w in named_leaves(new.params):
        diff = (got[name] - w).abs()
        if name in moments:
            err_m = float((avg[name] - moments[name]).abs().max())
            assert err_m <= (2e-7 if "cp" in label else 1e-7), f"{name}'s first moment after one iteration on {label}: {err_m:.2e}"
            kept = moments[name].abs() > 1e-7  # |gradient| > 1e-6: see the module's docstring
            compared, total = compared + int(kept.sum()), total + kept.numel()
            diff = diff[kept]
        err = float(diff.max()) if diff.numel() else 0.0
        assert err <= TOL, f"{name} after one iteration on {label}: {err:.2e}"
    assert compared > total / 2  # most weights compared (the embedding's unused rows have no gradient)


CASES = [("pp2", PP2, 2), ("pp2-interleaved", PP2_V2, 2), ("pp2-fsdp2", PP2_FSDP2, 4), ("pp2-ep2", PP2_EP2, 4), ("pp2-cp2", PP2_CP2, 4)]


@pytest.mark.parametrize("label,text,world", CASES, ids=[c[0] for c in CASES])
def test_rollout_and_one_rl_iteration_on_pp_equal_one_process(label, text, world):
    """Rollouts (layers gathered per step, and held) give one process's completions token for token; one iteration
    gives its metrics and update."""
    state, _, policy = _one_process("plain")
    one = rollout(policy, CFG, PROMPTS4, group_size=3, max_new_tokens=6, sampling=SAMPLING)
    assert len({c.tokens for c in one}) > 4  # sampled, not one completion repeated
    new, m1 = rl_iteration(state, PROMPTS4, **KW)
    outs = run_distributed(_rank_fn, world, text, "plain", None)
    assert sorted(o["pp_rank"] for o in outs) == sorted(list(range(2)) * (world // 2))
    _check(outs, "plain", m1, new, one, label)


def _batch(policy):
    comps = rollout(policy, CFG, PROMPTS4, group_size=3, max_new_tokens=6, sampling=SAMPLING)
    return pack_rollouts(comps, group_advantages([float(len(c.tokens)) for c in comps], 3), 16)


KL_CASES = [("pp2", PP2, 2, "lora"), ("pp2", PP2, 2, "kl"), ("pp2-fsdp2", PP2_FSDP2, 4, "kl"),
            ("pp2-cp2", PP2_CP2, 4, "kl")]


@pytest.mark.parametrize("label,text,world,mode", KL_CASES,
                         ids=[f"{c[0]}-{'lora-base' if c[3] == 'lora' else 'full-frozen-copy'}" for c in KL_CASES])
def test_reference_logprobs_and_a_kl_iteration_on_pp_equal_one_process(label, text, world, mode):
    """The reference's log-probs of a packed batch (a LoRA state's base; a full fine-tune's frozen copy sharded as
    the state is) equal one process's ``reference_logprobs``; one KL iteration gives its ``kl`` (1e-6), loss and
    update; the LoRA state's rollout (adapters merged layer by layer) samples what its merged policy samples."""
    state, ref, policy = _one_process(mode)
    batch = _batch(policy)
    want = reference_logprobs(state, batch, LOSS.temperature, ref)
    labelled = batch["labels"] != -100
    assert bool((want[labelled] < 0).all()) and bool((want[~labelled] == 0).all())
    assert float((trainer_logprobs(state, batch, LOSS.temperature) - want).abs().max()) > 1e-3  # not the policy
    new, m1 = rl_iteration(state, PROMPTS4, loss=LOSS, ref_params=ref, **KW)
    assert m1["kl"] > 1e-4
    one = rollout(policy, CFG, PROMPTS4, group_size=3, max_new_tokens=6, sampling=SAMPLING)
    outs = run_distributed(_rank_fn, world, text, mode, batch)
    for o in outs:
        err = float((o["ref"] - want).abs().max())
        assert o["ref"].shape == want.shape and err <= TOL, f"reference log-probs on {label} ({mode}): {err:.2e}"
    _check(outs, mode, m1, new, one if mode == "lora" else None, f"{label} ({mode})")


def _refuse_fn(rank, world):
    from q38.errors import ConfigError
    from q38.parallel.mesh import make_mesh, shard

    mesh = make_mesh(_layout(PP2), world, model=CFG)
    state = shard(init_state(CFG, TC, seed=3), mesh)
    try:
        rl_iteration(state, PROMPTS4, mesh=mesh, routing_replay=True, **KW)
    except ConfigError as e:
        return str(e)
    return None


def test_routing_replay_on_pp_is_one_line():
    for msg in run_distributed(_refuse_fn, 2):
        assert msg is not None and "\n" not in msg and "pp > 1" in msg and "routing_replay" in msg
