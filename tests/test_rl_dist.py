"""The policy-gradient objective on 2 gloo ranks (FSDP, EP, CP) gives the single-process loss, KL and gradients
(fp32, 1e-5), with sequence-level normalisation (a global sequence count; CP splits sequences) on a batch of real
rollouts; and the rollout's recorded log-probs equal the sharded training forward's on every rank (max |Δ| ≤ 1e-5,
EP included)."""

import pytest
import torch

from q38.decode import Sampling
from q38.parallel.layout import Layout
from q38.pytree import named_leaves
from q38.rollout import rollout
from q38.batch import IGNORE_INDEX
from q38.train.core.objective import Term
from q38.train.core.policy import PolicyLossConfig, policy_terms, token_logprobs
from q38.train.core.state import init_state
from q38.train.core.step import loss_and_grads
from q38.train.core.step_config import TrainConfig
from q38.train.run.rl import pack_rollouts
from tests.dist_utils import run_distributed
from tests.test_policy_loss import CFG
from tests.test_rl import PROMPTS

pytestmark = pytest.mark.dist

TOL = 1e-5
TEMP = 0.9
TC = TrainConfig(loss_chunk_size=8, aux_loss_coef=0.01, lr=1e-3, warmup_steps=1)
PC = PolicyLossConfig(clip_low=0.2, clip_high=0.28, norm="sequence", kl_coef=0.2, temperature=TEMP)


def _batch():
    """Real rollouts (G = 3), advantages of both signs, a reference 0.3 off; rows padded to an even count."""
    state = init_state(CFG, TC, seed=5)
    comps = rollout(state.params, CFG, PROMPTS, group_size=3, max_new_tokens=6,
                    sampling=Sampling(temperature=TEMP, seed=2))
    adv = [(-1.0) ** i * (0.5 + 0.1 * i) for i in range(len(comps))]
    g = torch.Generator().manual_seed(0)
    ref = [[lp + 0.3 * (2 * float(torch.rand((), generator=g)) - 1) for lp in c.logprobs] for c in comps]
    b = pack_rollouts(comps, adv, row_len=24, ref_logprobs=ref)
    if b["input_ids"].shape[0] % 2:  # one padding row: every row split over 2 ranks has an equal share
        b = {k: torch.cat([v, torch.full_like(v[:1], {"labels": IGNORE_INDEX, "doc_ids": -1}.get(k, 0))])
             for k, v in b.items()}
    return b


def _mismatch_term(store: list) -> Term:
    """Reports nothing (weight 0, value 0); records this rank's max |trainer log-prob − rollout log-prob|."""
    def fn(ti):
        t = ti.mb.targets.reshape(-1)
        valid = torch.nonzero(t != IGNORE_INDEX).flatten()
        h = ti.out.hidden.detach().reshape(-1, ti.out.hidden.shape[-1]).index_select(0, valid)
        lp, _ = token_logprobs(h, ti.w_head.detach(), t.index_select(0, valid), temperature=TEMP)
        old = ti.mb.extra["old_logprobs"].reshape(-1).index_select(0, valid)
        store.append((float((lp - old).abs().max()) if valid.numel() else 0.0, int(valid.numel())))
        return ti.out.hidden.detach().sum() * 0

    return Term("mismatch", 0.0, fn)


def _rank_fn(rank, world, layout_name, mesh_sizes, batch):
    from q38.parallel.mesh import make_mesh, shard, shard_batch

    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = shard(init_state(CFG, TC, seed=5), mesh)
    from tests.device_check import FactoryDeviceMode

    store: list = []
    sb = shard_batch(batch, mesh, CFG.mtp_num_layers)
    with FactoryDeviceMode() as mode:  # every tensor the step and the policy terms make names its device
        r = loss_and_grads(state, sb, mesh, terms=(*policy_terms(CFG, TC, PC), _mismatch_term(store)))
    names = [n for n, _ in named_leaves(state.params)]
    grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in zip(names, r.grads)}
    return {"terms": {k: float(v) for k, v in r.terms.items()}, "objective": float(r.objective),
            "grads": grads if rank == 0 else None, "mismatch": store, "device_calls": mode.calls}


CASES = [("fsdp", {"fsdp": 2}), ("fsdp_ep", {"fsdp": 1, "ep": 2}), ("fsdp_cp", {"fsdp": 1, "cp": 2})]


@pytest.mark.parametrize("layout,mesh_sizes", CASES, ids=[c[0] for c in CASES])
def test_policy_objective_and_rollout_logprobs_on_two_ranks(layout, mesh_sizes):
    batch = _batch()
    state = init_state(CFG, TC, seed=5)
    ref = loss_and_grads(state, batch, terms=policy_terms(CFG, TC, PC))
    outs = run_distributed(_rank_fn, 2, layout, mesh_sizes, batch)
    for o in outs:
        assert o["device_calls"] == [], o["device_calls"]
        for k in ("loss", "kl", "aux", "logprob_diff", "clip_frac", "ratio_mean", "entropy"):
            assert abs(o["terms"][k] - float(ref.terms[k])) <= TOL, k
        assert abs(o["objective"] - float(ref.objective)) <= TOL
        assert sum(n for _, n in o["mismatch"]) > 0
        worst = max(m for m, _ in o["mismatch"])
        assert worst <= TOL, f"max |rollout - trainer log-prob| = {worst:.2e} on {layout}"
        assert abs(o["terms"]["mismatch_max"] - float(ref.terms["mismatch_max"])) <= 1e-6
    # the step's max over ranks equals the max over the ranks' own maxima recorded by the test's term
    assert abs(outs[0]["terms"]["mismatch_max"] - max(m for o in outs for m, _ in o["mismatch"])) <= 1e-6
    assert float(ref.terms["kl"]) > 0 and float(ref.terms["loss"]) != 0
    names = [n for n, _ in named_leaves(state.params)]
    for name, g in zip(names, ref.grads):
        err = float((outs[0]["grads"][name] - g).abs().max())
        assert err <= TOL, f"{name}: {err:.2e}"


def _noisy(batch):
    """``batch`` with its recorded log-probs moved by up to ±0.4 (seeded): a mismatch of ~0.4 whose largest token
    lies on one rank, so a sum or mean over ranks would not give it."""
    g = torch.Generator().manual_seed(7)
    mask = batch["labels"] != IGNORE_INDEX
    noise = (torch.rand(batch["old_logprobs"].shape, generator=g) * 2 - 1) * 0.4
    return dict(batch, old_logprobs=torch.where(mask, batch["old_logprobs"] + noise, batch["old_logprobs"]))


def _max_rank_fn(rank, world, layout_name, mesh_sizes, batch):
    from q38.parallel.mesh import make_mesh, shard, shard_batch

    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = shard(init_state(CFG, TC, seed=5), mesh)
    store: list = []
    r = loss_and_grads(state, shard_batch(batch, mesh, CFG.mtp_num_layers), mesh,
                       terms=(*policy_terms(CFG, TC, PC), _mismatch_term(store)))
    return {"max": float(r.terms["mismatch_max"]), "mean": float(r.terms["logprob_diff"]),
            "own": max((m for m, _ in store), default=0.0)}


@pytest.mark.parametrize("layout,mesh_sizes", CASES, ids=[c[0] for c in CASES])
def test_mismatch_max_is_a_max_over_every_rank(layout, mesh_sizes):
    """The step's ``mismatch_max`` on 2 ranks equals one process's within 1e-6, and one process's equals the max
    over every labelled token written here (trainer log-probs of the packed rows minus the recorded ones)."""
    from q38.train.run.rl import trainer_logprobs

    batch = _noisy(_batch())
    state = init_state(CFG, TC, seed=5)
    one = loss_and_grads(state, batch, terms=policy_terms(CFG, TC, PC))
    mask = batch["labels"] != IGNORE_INDEX
    naive = float((trainer_logprobs(state, batch, TEMP) - batch["old_logprobs"]).abs()[mask].max())
    assert float(one.terms["mismatch_max"]) == pytest.approx(naive, abs=1e-6)
    assert naive > 1.5 * float(one.terms["logprob_diff"])  # a max, not the mean
    outs = run_distributed(_max_rank_fn, 2, layout, mesh_sizes, batch)
    own = sorted(o["own"] for o in outs)
    assert own[0] < own[1] - 1e-3  # the ranks' maxima differ: a sum or a mean over ranks would not be the max
    for o in outs:
        assert abs(o["max"] - float(one.terms["mismatch_max"])) <= 1e-6, layout
