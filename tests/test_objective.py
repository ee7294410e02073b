"""The objective as named terms, the three aux-loss forms (against hand-computed values and a plain-loop reference),
router-bias (aux-loss-free) balancing and the router metrics."""

import math

import attrs

import pytest
import torch

from q38.model import forward
from q38.pytree import named_leaves
from q38.train.core.step_config import TrainConfig
from q38.train.core.objective import Term, default_terms, load_balancing_loss
from q38.train.core.state import init_state
from q38.train.core.step import loss_and_grads, train_step, update_router_bias

TOL = 1e-5


def _cfg(tiny_cfg, **kw):
    kw = {"num_hidden_layers": 2, "layer_types": ("linear_attention", "full_attention"), "mtp_num_layers": 1, **kw}
    return tiny_cfg.replace(initializer_range=0.1, **kw)


def _batch(cfg, b=4, s=24, seed=0):
    """Packed rows with padding (doc -1, label -100) and an unlabelled prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    labels = ids.clone()
    doc = torch.zeros(b, s, dtype=torch.long)
    doc[:, s // 2 :] = 1
    doc[1, -5:] = -1  # padding
    labels[1, -5:] = -100
    labels[0, :6] = -100  # a prompt: real, not labelled
    doc[2, 3 * s // 4 :] = 2
    return {"input_ids": ids, "labels": labels, "doc_ids": doc}


# ---- the aux forms on a toy router: values worked out by hand ------------------------------------------------------
L3 = math.log(3.0)
A = [L3, 0.0]  # softmax [0.75, 0.25]
B = [0.0, L3]  # softmax [0.25, 0.75]


def test_aux_forms_equal_hand_computed_values_on_a_toy_router():
    """E = 2, k = 1. Layer 0 tokens A A A B (sequences {0, 1} and {2, 3}), layer 1 tokens B B B B.

    Layer 0: c = [3, 1], p = [2.5, 1.5], N = 4 → 2·(3/4·2.5/4 + 1/4·1.5/4) = 1.125. Layer 1: c = [0, 4],
    p = [1, 3] → 2·(1·3/4) = 1.5. per_layer = (1.125 + 1.5)/2 = 1.3125. pooled: c = [3, 5], p = [3.5, 4.5], rows 8 →
    2·(3/8·3.5/8 + 5/8·4.5/8) = 1.03125. sequence on layer 0 alone: {A, A}: c = [2, 0], p = [1.5, 0.5], T = 2 →
    2·(1·0.75) = 1.5; {A, B}: c = [1, 1], p = [1, 1] → 2·(0.25 + 0.25) = 1.0; mean 1.25. With both layers: layer 1's
    sequences {B, B} each score 2·(1·0.75) = 1.5, so (1.5 + 1.0 + 1.5 + 1.5)/4 = 1.375."""
    l0 = torch.tensor([A, A, A, B])
    l1 = torch.tensor([B, B, B, B])
    seg = torch.tensor([0, 0, 1, 1])
    assert float(load_balancing_loss((l0,), 2, 1)) == pytest.approx(1.125, abs=1e-6)
    assert float(load_balancing_loss((l0, l1), 2, 1, kind="per_layer")) == pytest.approx(1.3125, abs=1e-6)
    assert float(load_balancing_loss((l0, l1), 2, 1, kind="pooled")) == pytest.approx(1.03125, abs=1e-6)
    assert float(load_balancing_loss((l0,), 2, 1, kind="sequence", segments=seg)) == pytest.approx(1.25, abs=1e-6)
    assert float(load_balancing_loss((l0, l1), 2, 1, kind="sequence", segments=seg)) == pytest.approx(1.375, abs=1e-6)
    # a masked token is not counted: layer 0 without token 3 is {A A A}: c = [3, 0], p = [2.25, 0.75] → 2·0.75 = 1.5
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert float(load_balancing_loss((l0,), 2, 1, mask=mask)) == pytest.approx(1.5, abs=1e-6)


def test_pooling_hides_collapsed_layers_and_per_layer_does_not():
    """Two layers collapsed onto opposite experts: pooled scores k = 1 (like a balanced router), per_layer E = 2."""
    l0 = torch.tensor([[30.0, 0.0]] * 4)
    l1 = torch.tensor([[0.0, 30.0]] * 4)
    assert float(load_balancing_loss((l0, l1), 2, 1, kind="pooled")) == pytest.approx(1.0, abs=1e-6)
    assert float(load_balancing_loss((l0, l1), 2, 1, kind="per_layer")) == pytest.approx(2.0, abs=1e-6)


# ---- the aux loss in the step against a plain-loop reference --------------------------------------------------------
def _loop_aux(router_logits, batch, cfg, kind, tokens):
    """Python loops over tokens: softmax, top-k by sorting, the formulas of q38/train/core/objective.py's docstring."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    ids, labels, doc = batch["input_ids"], batch["labels"], batch["doc_ids"]
    b, s = ids.shape
    counted = [(i, t) for i in range(b) for t in range(s)
               if (doc[i, t] != -1 if tokens == "real" else labels[i, t] != -100)]
    layers = []
    for rl in router_logits:
        rows = rl.reshape(b, s, e).tolist()
        per_tok = {}
        for i, t in counted:
            z = [math.exp(v - max(rows[i][t])) for v in rows[i][t]]
            p = [v / sum(z) for v in z]
            top = sorted(range(e), key=lambda j: -p[j])[:k]
            per_tok[(i, t)] = (p, top)
        layers.append(per_tok)

    def score(toks, per_tok):
        c, p = [0.0] * e, [0.0] * e
        for key in toks:
            probs, top = per_tok[key]
            for j in top:
                c[j] += 1
            for j in range(e):
                p[j] += probs[j]
        n = len(toks)
        return e * sum((c[j] / n) * (p[j] / n) for j in range(e))

    if kind == "per_layer":
        return sum(score(counted, lt) for lt in layers) / len(layers)
    if kind == "sequence":
        seqs = {}
        for i, t in counted:
            seqs.setdefault((i, int(doc[i, t])), []).append((i, t))
        return sum(score(v, lt) for lt in layers for v in seqs.values()) / (len(layers) * len(seqs))
    pooled = {}
    for li, lt in enumerate(layers):
        pooled.update({(li, *key): v for key, v in lt.items()})
    return score(list(pooled), pooled)


@pytest.mark.parametrize("kind,tokens", [("pooled", "real"), ("per_layer", "labelled"), ("sequence", "real"),
                                         ("sequence", "labelled")])
def test_aux_in_the_step_equals_a_loop_reference(tiny_cfg, kind, tokens):
    cfg = _cfg(tiny_cfg)
    batch = _batch(cfg)
    tc = TrainConfig(loss_chunk_size=16, aux_loss_type=kind, aux_loss_tokens=tokens, aux_loss_coef=0.1)
    state = init_state(cfg, tc, seed=0)
    r = loss_and_grads(state, batch)
    with torch.no_grad():
        out = forward(state.params, batch["input_ids"], cfg, doc_ids=batch["doc_ids"])
    want = _loop_aux(out.router_logits, batch, cfg, kind, tokens)
    assert abs(float(r.aux_loss) - want) <= TOL, (float(r.aux_loss), want)
    # global_batch with two micro-batches: the same value and the same gradients as one micro-batch (with one
    # micro-batch the two scopes are the same computation)
    tc2 = tc.replace(aux_loss_scope="global_batch", micro_batches=2)
    r2 = loss_and_grads(init_state(cfg, tc2, seed=0), batch)
    assert abs(float(r2.aux_loss) - want) <= TOL
    for name, a, b in zip([n for n, _ in named_leaves(state.params)], r.grads, r2.grads):
        assert (a - b).abs().max() <= TOL * max(1.0, float(a.abs().max())), name


# ---- aux-loss-free balancing ------------------------------------------------------------------------------------------
def test_router_bias_moves_load_toward_balance_and_gates_stay_unbiased():
    from q38.layers.moe import route, select_experts

    g = torch.Generator().manual_seed(0)
    e, k, n = 8, 2, 512
    logits = torch.randn(n, e, generator=g)
    logits[:, :2] += 2.0  # experts 0 and 1 are hot
    bias = torch.zeros(1, e)

    def load(b):
        idx = select_experts(logits, k, b[0])[1]
        return torch.bincount(idx.reshape(-1), minlength=e).float()[None]

    ratios = []
    for _ in range(60):
        ld = load(bias)
        ratios.append(float(ld.max() / ld.mean()))
        bias = update_router_bias(bias, ld, 0.01)
    print(f"\nmax/mean load: step 0 {ratios[0]:.2f}, step 30 {ratios[30]:.2f}, step 59 {ratios[-1]:.2f}")
    assert ratios[0] > 2.5 and ratios[-1] < 1.5
    # selection follows the bias, gate weights come from the unbiased softmax of the chosen experts
    w, idx = route(logits, k, False, bias[0])
    assert not torch.equal(idx, route(logits, k, False)[1])
    assert torch.equal(w, torch.softmax(logits, -1).gather(-1, idx))
    w_n, _ = route(logits, k, True, bias[0])
    assert torch.allclose(w_n, w / w.sum(-1, keepdim=True))


def test_train_step_updates_the_router_bias_from_the_steps_load(tiny_cfg):
    """Bias after one step = ±rate by the sign of (mean load − load) of each expert in each MoE layer, the load
    counted by hand from the routing of the step's real tokens; the router metrics report the same loads."""
    cfg = _cfg(tiny_cfg)
    batch = _batch(cfg)
    tc = TrainConfig(loss_chunk_size=16, aux_loss_free=True, router_bias_rate=0.01, aux_loss_coef=0.0)
    state = init_state(cfg, tc, seed=0)
    assert state.router_bias.shape == (3, cfg.num_experts) and not state.router_bias.any()
    new, m = train_step(state, batch)
    with torch.no_grad():
        out = forward(state.params, batch["input_ids"], cfg, doc_ids=batch["doc_ids"])
    real = (batch["doc_ids"] != -1).reshape(-1)
    loads = torch.stack([torch.bincount(rl.topk(cfg.num_experts_per_tok, -1).indices[real].reshape(-1),
                                        minlength=cfg.num_experts).float() for rl in out.router_logits])
    assert torch.equal(m.router_load, loads)
    want = 0.01 * torch.sign(loads.mean(-1, keepdim=True) - loads)
    assert torch.equal(new.router_bias, want) and new.router_bias.abs().sum() > 0
    d = m.as_dict()
    for i in range(3):
        assert d[f"router_max_mean_{i}"] == pytest.approx(float(loads[i].max() / loads[i].mean()))
        assert d[f"router_idle_{i}"] == int((loads[i] == 0).sum())
    # the next step routes with the bias: its loads are those of the biased top-k
    _, m2 = train_step(new, batch)
    with torch.no_grad():
        out2 = forward(new.params, batch["input_ids"], cfg, doc_ids=batch["doc_ids"], router_bias=new.router_bias)
    loads2 = torch.stack([torch.bincount((torch.softmax(rl, -1) + new.router_bias[i]).topk(2, -1).indices[real]
                                         .reshape(-1), minlength=cfg.num_experts).float()
                          for i, rl in enumerate(out2.router_logits)])
    assert torch.equal(m2.router_load, loads2)


def test_router_bias_is_checkpointed_and_convert_refuses_to_drop_it_silently(tiny_cfg, tmp_path, capsys):
    from q38.cli import main
    from q38.train.io.checkpoint import load_checkpoint, save_checkpoint

    cfg = _cfg(tiny_cfg)
    tc = TrainConfig(aux_loss_free=True)
    state = init_state(cfg, tc, seed=0)
    state = attrs.evolve(state, router_bias=torch.randn(3, cfg.num_experts))
    meta = {"step": 0, "model_config": cfg.to_dict(), "train_config": tc.to_dict(), "param_dtype": "float32"}
    path = save_checkpoint(tmp_path / "run" / "checkpoints", state, meta)
    loaded, _ = load_checkpoint(path, init_state(cfg, tc, seed=1))
    assert torch.equal(loaded.router_bias, state.router_bias)
    # a run without the bias resumed with aux_loss_free on: parameters load, the bias starts at zero
    plain = init_state(cfg, TrainConfig(), seed=2)
    meta0 = dict(meta, train_config=TrainConfig().to_dict())
    p0 = save_checkpoint(tmp_path / "run0" / "checkpoints", plain, meta0)
    resumed, _ = load_checkpoint(p0, init_state(cfg, tc, seed=1))
    assert not resumed.router_bias.any() and torch.equal(resumed.params.embed, plain.params.embed)

    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "router bias" in err and "--drop-router-bias" in err
    assert not (tmp_path / "hf").exists()
    assert main(["convert", "--to-hf", "--drop-router-bias", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()


# ---- the objective as named terms ------------------------------------------------------------------------------------
def test_a_toy_extra_term_is_one_function_and_one_weight(tiny_cfg):
    """``z`` = mean squared final hidden state over valid targets: it enters the objective with its weight, its
    gradient is added, and it appears under its name in the metrics and the progress line."""
    from q38.train.run.trainer import Throughput, format_metrics

    cfg = _cfg(tiny_cfg)
    batch = _batch(cfg)
    tc = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01, micro_batches=2)
    state = init_state(cfg, tc, seed=0)

    def z(ti):  # a partial: sum over this micro-batch's valid targets / the step's global count
        keep = ti.mb.targets != -100
        return ti.out.hidden[keep].pow(2).sum() / ti.step.n_main

    terms = (*default_terms(cfg, tc), Term("z", 0.5, z))
    base = loss_and_grads(state, batch)
    r = loss_and_grads(state, batch, terms=terms)

    import torch.utils._pytree as pytree

    from q38.batch import prepare_batch

    flat, spec = pytree.tree_flatten(state.params)
    leaves = [t.detach().requires_grad_() for t in flat]
    out = forward(pytree.tree_unflatten(leaves, spec), batch["input_ids"], cfg, doc_ids=batch["doc_ids"])
    keep = prepare_batch(batch["input_ids"], batch["labels"], batch["doc_ids"], 1).targets != -100
    z_ref = out.hidden[keep].pow(2).sum() / keep.sum()
    gz = torch.autograd.grad(z_ref, leaves, allow_unused=True)
    z_ref = z_ref.detach()
    assert abs(float(r.terms["z"]) - float(z_ref)) <= TOL
    assert abs(float(r.objective) - (float(base.objective) + 0.5 * float(z_ref))) <= TOL
    for a, b, g in zip(r.grads, base.grads, gz):
        want = b if g is None else b + 0.5 * g
        assert (a - want).abs().max() <= TOL * max(1.0, float(want.abs().max()))
    _, m = train_step(state, batch, terms=terms)
    d = m.as_dict()
    assert d["z"] == pytest.approx(float(z_ref), abs=TOL) and {"loss", "mtp_1", "aux"} <= d.keys()
    line = format_metrics(1, d, Throughput(0, 1.0, None), terms=list(m.terms))
    assert "| z " in line and "| aux " in line and "| load " in line


def test_objective_and_router_bias_create_tensors_on_their_inputs_device(tiny_cfg):
    """docs/testing.md#device-correctness-without-a-gpu for the objective's own code: no factory call in q38/train/core/objective.py,
    q38/train/core/step.py or q38/train/core/state.py without ``device=`` during a step with every aux form and the router
    bias (nccl refuses CPU tensors; gloo would not notice)."""
    import sys

    from torch.overrides import TorchFunctionMode

    factories = {torch.tensor, torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.eye}
    ours = ("q38/train/core/objective.py", "q38/train/core/step.py", "q38/train/core/state.py")

    class Record(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.bad = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in factories and "device" not in kwargs:
                caller = sys._getframe(1)
                if caller.f_code.co_filename.replace("\\", "/").endswith(ours):
                    self.bad.add(f"{func.__name__} at {caller.f_code.co_filename}:{caller.f_lineno}")
            return func(*args, **kwargs)

    cfg = _cfg(tiny_cfg)
    batch = _batch(cfg)
    for kind in ("pooled", "per_layer", "sequence"):
        tc = TrainConfig(loss_chunk_size=16, aux_loss_type=kind, aux_loss_scope="global_batch", micro_batches=2,
                         aux_loss_free=True)
        state = init_state(cfg, tc, seed=0)
        with Record() as rec:
            train_step(state, batch)
        assert not rec.bad, sorted(rec.bad)
