"""Routing replay (``rollout(record_routes=True)``, ``pack_rollouts`` → ``routes``, ``forward(routes=)``): the
rollout records the experts every MoE main layer chose for each token as it was fed; the training forward routes
by them, index for index, also after an update has moved the weights (when the router's own top-k differs); the
policy loss and every gradient with replay equal a naive forward written here that routes each token to the given
experts by a loop (gates: softmax of the router's current logits at those experts, renormalised); fp32, 1e-5."""

import pytest
import torch
import torch.nn.functional as F

from q38.decode import Sampling
from q38.errors import ConfigError
from q38.model import LayerHooks, forward, head_weight
from q38.pytree import named_leaves
from q38.rollout import rollout
from q38.train.core.policy import PolicyLossConfig, policy_terms
from q38.train.core.state import init_state
from q38.train.core.step import loss_and_grads, train_step
from q38.train.core.step_config import TrainConfig
from q38.train.run.rl import pack_rollouts, rl_iteration
from tests.test_policy_loss import CFG
from tests.test_rl import PROMPTS

TOL = 1e-5
TEMP = 0.9
K = CFG.num_experts_per_tok
SAMPLING = Sampling(temperature=TEMP, seed=21)


def _naive_dispatch(given: torch.Tensor | None, log: list):
    """An ``ExpertDispatch`` written out: records the experts ``moe_apply`` chose for each token (``log``: per MoE
    call, ``[n, k]``) and computes the routed output by a loop over tokens and slots with the experts ``given``
    (``[b, s, layers, k]``; call ``c`` is main layer ``c``; -1 rows and ``given`` None: the router's own top-k),
    gated by the router's probabilities of them, renormalised."""
    def dispatch(x_nd, w_nk, idx_nk, p, cfg, experts, shared):
        layer = len(log)
        log.append(idx_nk.detach().clone())
        probs = torch.softmax((x_nd @ p.w_router.T).float(), dim=-1)
        own = torch.topk(probs.detach(), K, dim=-1).indices
        use = own if given is None else given[:, :, layer].reshape(-1, K).long()
        use = torch.where(use[:, :1] >= 0, use, own)
        f = cfg.moe_intermediate_size
        rows = []
        for n in range(x_nd.shape[0]):
            w = probs[n, use[n]]
            w = w / w.sum()
            y = torch.zeros_like(x_nd[n])
            for j in range(K):
                e = int(use[n, j])
                h = p.we_gate_up[e] @ x_nd[n]
                y = y + w[j] * (p.we_down[e] @ (F.silu(h[:f]) * h[f:]))
            rows.append(y)
        return shared() + torch.stack(rows)

    return dispatch


def _rollout_batch(state):
    comps = rollout(state.params, CFG, PROMPTS, group_size=2, max_new_tokens=5, sampling=SAMPLING,
                    record_routes=True)
    adv = [(-1.0) ** i * (0.4 + 0.2 * i) for i in range(len(comps))]
    return comps, pack_rollouts(comps, adv, row_len=24)


def _used_routes(params, batch, routes):
    """The experts the training forward used per main layer, and its router's own top-k, ``[b, s, layers, k]``."""
    log: list = []
    out = forward(params, batch["input_ids"], CFG, doc_ids=batch["doc_ids"], routes=routes,
                  hooks=LayerHooks(dispatch=_naive_dispatch(routes, log)))
    b, s = batch["input_ids"].shape
    top = [torch.topk(torch.softmax(rl.float(), -1), K, dim=-1).indices.view(b, s, K) for rl in out.router_logits]
    return torch.stack([t.view(b, s, K) for t in log], dim=2), torch.stack(top, dim=2)


def test_the_training_forward_replays_the_rollouts_routing_also_after_an_update():
    state = init_state(CFG, TrainConfig(lr=3e-2, warmup_steps=1), seed=6)
    comps, batch = _rollout_batch(state)
    routes = batch["routes"]
    assert all(c.routes.shape == (len(c.prompt) + len(c.tokens), CFG.num_hidden_layers, K) for c in comps)
    fed = routes[..., 0] >= 0  # [b, s, layers]: tokens the rollout fed (every real token but each last one)
    assert int(fed[..., 0].sum()) == sum(len(c.prompt) + len(c.tokens) - 1 for c in comps)
    # before any update the trainer's own top-k is the rollout's (fp32: equal logits), index for index
    own, _ = _used_routes(state.params, batch, None)
    assert torch.equal(own[fed], routes.long()[fed])
    # an update (twice, a large lr) moves the router: its own top-k now differs, the replayed routing does not
    new = state
    for _ in range(2):
        new, _ = train_step(new, batch, terms=policy_terms(CFG, new.train_config, PolicyLossConfig(temperature=TEMP)))
    own, _ = _used_routes(new.params, batch, None)
    assert not torch.equal(own[fed], routes.long()[fed]), "the update did not change any routing: raise the lr"
    used, top = _used_routes(new.params, batch, routes)
    assert torch.equal(used[fed], routes.long()[fed])
    assert not torch.equal(top[fed], routes.long()[fed])  # the replayed forward's router would choose otherwise
    assert torch.equal(used[~fed], top[~fed])  # unrecorded positions (last tokens, padding) route by their own top-k


def _naive_objective(params, batch, pc):
    """Token-normalised clipped surrogate on the naive replayed forward: full logits, log-softmax / TEMP."""
    out = forward(params, batch["input_ids"], CFG, doc_ids=batch["doc_ids"],
                  hooks=LayerHooks(dispatch=_naive_dispatch(batch["routes"], [])))
    logp_all = torch.log_softmax((out.hidden @ head_weight(params).T) / TEMP, dim=-1)
    lab = batch["labels"]
    mask = lab[:, 1:] != -100
    logp = logp_all[:, :-1].gather(-1, lab[:, 1:].clamp(min=0)[..., None]).squeeze(-1)[mask]
    old, adv = batch["old_logprobs"][:, 1:][mask], batch["advantages"][:, 1:][mask]
    ratio = torch.exp(logp - old)
    surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - pc.clip_low, 1 + pc.clip_high) * adv)
    return -surr.sum() / mask.sum()


@pytest.mark.slow  # the naive forward loops over every token and slot (~12 s)
def test_loss_and_grads_with_replay_equal_a_naive_forward_on_the_given_experts():
    state = init_state(CFG, TrainConfig(lr=3e-2, warmup_steps=1), seed=6)
    _, batch = _rollout_batch(state)
    pc = PolicyLossConfig(clip_low=0.2, clip_high=0.28, temperature=TEMP)
    moved, _ = train_step(state, batch, terms=policy_terms(CFG, state.train_config, pc))  # routing now differs
    g = torch.Generator().manual_seed(1)
    mask = batch["labels"] != -100
    batch = dict(batch, old_logprobs=torch.where(mask, batch["old_logprobs"] + 0.4 * torch.rand(mask.shape,
                                                                                               generator=g) - 0.2, 0))
    r = loss_and_grads(moved, batch, terms=policy_terms(CFG, moved.train_config, pc, aux=False))
    leaves = [t.detach().clone().requires_grad_(True) for _, t in named_leaves(moved.params)]
    params = torch.utils._pytree.tree_unflatten(leaves, torch.utils._pytree.tree_structure(moved.params))
    want = _naive_objective(params, batch, pc)
    assert abs(float(r.objective) - float(want.detach())) <= TOL
    want_g = torch.autograd.grad(want, leaves, allow_unused=True)
    for (name, _), got, exp in zip(named_leaves(moved.params), r.grads, want_g):
        exp = torch.zeros_like(got) if exp is None else exp
        err = float((got - exp).abs().max())
        assert err <= TOL, f"{name}: {err:.2e}"
    # and without replay the step's loss is another one (the routing it would use differs)
    plain = loss_and_grads(moved, {k: v for k, v in batch.items() if k != "routes"},
                           terms=policy_terms(CFG, moved.train_config, pc, aux=False))
    assert abs(float(plain.objective) - float(want.detach())) > 1e-6


def test_rl_iteration_with_replay_reports_and_bad_routes_are_one_line():
    state = init_state(CFG, TrainConfig(lr=1e-3, warmup_steps=1), seed=6)
    kw = {"prompt_texts": ["a", "b", "c"], "answers": [None] * 3, "detokenize": lambda ids: " ".join(map(str, ids)),
          "rewards": ["tests.test_rl:user_reward"], "group_size": 2, "max_new_tokens": 4, "sampling": SAMPLING,
          "row_len": 24}
    new, d = rl_iteration(state, PROMPTS, routing_replay=True, updates=2, **kw)
    assert d["mismatch_max"] <= TOL and int(new.step) == 2
    _, batch = _rollout_batch(state)
    for bad, words in ((batch["routes"][:, :, :1], "main layers, top-k"),
                       (batch["routes"].clone().fill_(CFG.num_experts), "experts")):
        with pytest.raises(ConfigError, match=words) as e:
            loss_and_grads(state, dict(batch, routes=bad), terms=policy_terms(CFG, state.train_config,
                                                                              PolicyLossConfig(temperature=TEMP)))
        assert "\n" not in str(e.value)
