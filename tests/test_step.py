"""The training objective and train_step: every term reaches the gradients, accumulation and recompute are exact."""

import attrs
import pytest
import torch
import torch.nn.functional as F

import q38
from q38.model import forward, head_weight, init_params, shift_tokens
from q38.pytree import named_leaves, tree_leaves
from q38.train.core.step_config import TrainConfig
from q38.train.core.objective import load_balancing_loss
from q38.train.core.state import init_state, state_from_params
from q38.train.core.step import loss_and_grads, train_step

TOL = 1e-5


def _cfg(tiny_cfg, **kw):
    return tiny_cfg.replace(initializer_range=0.1, **kw)


def _two_layers(tiny_cfg, **kw):
    """One GDN and one full-attention layer (MTP kept): every layer kind once, for the checks that hold per layer
    (accumulation, recompute, offload, MTP scaling, determinism); the tiny preset's two further GDN layers would
    only repeat them."""
    return _cfg(tiny_cfg, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"), **kw)


def _batch(cfg, gen, b=4, s=48, packed=True):
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt
    labels[1, -7:] = -100  # padding
    doc = torch.zeros(b, s, dtype=torch.long)
    if packed:
        doc[:, s // 3 :] = 1
        doc[b - 1, 2 * s // 3 :] = 2
    return {"input_ids": ids, "labels": labels, "doc_ids": doc}


def _grads(state, batch):
    return dict(zip([n for n, _ in named_leaves(state.params)], loss_and_grads(state, batch).grads))


def test_every_parameter_receives_a_nonzero_gradient(tiny_cfg, gen):
    cfg = _cfg(tiny_cfg, mtp_num_layers=2)
    state = init_state(cfg, TrainConfig(loss_chunk_size=16), seed=0)
    grads = _grads(state, _batch(cfg, gen))
    dead = [name for name, g in grads.items() if not bool(g.abs().sum() > 0)]
    assert not dead, f"parameters without gradient: {dead}"
    assert any(n.startswith("mtp.layers.1.") for n in grads)  # depth 2 exists and is trained


def _reference_losses(cfg, params, batch):
    """Plain loop reference: full logits, per-depth shift loops, HF-style CE."""
    ids, labels, doc = batch["input_ids"], batch["labels"], batch["doc_ids"]
    out = forward(params, ids, cfg, doc_ids=doc)
    w = head_weight(params)
    b, s = ids.shape

    def ce(hidden, shift):
        tot, cnt = 0.0, 0
        for i in range(b):
            for t in range(s - shift):
                if doc[i, t + shift] != doc[i, t] or labels[i, t + shift] == -100:
                    continue
                tot = tot + F.cross_entropy((hidden[i, t] @ w.T)[None], labels[i, t + shift][None])
                cnt += 1
        return tot / cnt

    main = ce(out.hidden, 1)
    mtp = [ce(h, 1 + d) for d, h in enumerate(out.mtp_hidden, start=1)]
    return main, mtp


def test_mtp_and_main_loss_equal_loop_reference(tiny_cfg, gen):
    cfg = _cfg(tiny_cfg, mtp_num_layers=2)
    state = init_state(cfg, TrainConfig(loss_chunk_size=7), seed=1)
    batch = _batch(cfg, gen, b=2, s=30)
    r = loss_and_grads(state, batch)
    main, mtp = _reference_losses(cfg, state.params, batch)
    assert abs(float(r.loss) - float(main)) <= TOL
    assert len(r.mtp_losses) == 2
    for got, want in zip(r.mtp_losses, mtp):
        assert abs(float(got) - float(want)) <= TOL


def test_doubling_mtp_factor_doubles_mtp_gradients(tiny_cfg, gen):
    cfg = _two_layers(tiny_cfg, mtp_num_layers=2)
    batch = _batch(cfg, gen)
    # The MTP layers' routers also feed the aux loss (which does not scale), so it is switched off here.
    g1 = _grads(init_state(cfg, TrainConfig(mtp_loss_scaling_factor=0.1, aux_loss_coef=0.0), seed=0), batch)
    g2 = _grads(init_state(cfg, TrainConfig(mtp_loss_scaling_factor=0.2, aux_loss_coef=0.0), seed=0), batch)
    mtp_names = [n for n in g1 if n.startswith("mtp.")]
    assert mtp_names
    for n in mtp_names:
        assert torch.allclose(g2[n], 2 * g1[n], atol=1e-7, rtol=1e-5), n


def test_aux_loss_equals_transformers(gen):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    logits = tuple(torch.randn(24, 8, generator=gen) for _ in range(3))
    mask = torch.ones(2, 12)
    mask[0, 9:] = 0
    mask[1, :2] = 0
    ref = load_balancing_loss_func(logits, 8, 2, None)
    assert abs(float(load_balancing_loss(logits, 8, 2)) - float(ref)) <= TOL
    ref_m = load_balancing_loss_func(logits, 8, 2, mask)
    assert abs(float(load_balancing_loss(logits, 8, 2, mask.reshape(-1))) - float(ref_m)) <= TOL


@pytest.mark.parametrize("scope", ["global_batch"])
def test_four_micro_batches_equal_one_big_batch(tiny_cfg, gen, scope):
    cfg = _two_layers(tiny_cfg)
    batch = _batch(cfg, gen, b=4)
    # eps = 1e-3 keeps Adam's first update Lipschitz in the gradient (with eps ~ 0 it is sign(g) · lr, which turns
    # 1e-9 rounding noise in near-zero gradients into lr-sized differences).
    base = TrainConfig(aux_loss_scope=scope, aux_loss_coef=0.01, loss_chunk_size=16, lr=1e-2, eps=1e-3)
    g1 = loss_and_grads(init_state(cfg, base, seed=0), batch).grads
    g4 = loss_and_grads(init_state(cfg, base.replace(micro_batches=4), seed=0), batch).grads
    for a, b in zip(g1, g4):
        assert (a - b).abs().max() <= TOL
    s1, m1 = train_step(init_state(cfg, base, seed=0), batch)
    s4, m4 = train_step(init_state(cfg, base.replace(micro_batches=4), seed=0), batch)
    assert abs(float(m1.loss) - float(m4.loss)) <= TOL
    assert abs(float(m1.aux_loss) - float(m4.aux_loss)) <= TOL
    for a, b in zip(tree_leaves(s1.params), tree_leaves(s4.params)):
        assert (a - b).abs().max() <= TOL


def test_recompute_and_offload_give_identical_gradients(tiny_cfg, gen):
    cfg = _two_layers(tiny_cfg)
    batch = _batch(cfg, gen)
    params = init_params(cfg, seed=2)
    variants = [
        TrainConfig(),
        TrainConfig(recompute=True),
        TrainConfig(recompute=True, skip_flash_attn_recompute=True, skip_gdn_recompute=True),
        TrainConfig(offload_activations=True),
        TrainConfig(recompute=True, offload_activations=True),
    ]
    ref = None
    for tc in variants:
        r = loss_and_grads(state_from_params(params, cfg, tc), batch)
        if ref is None:
            ref = r
            continue
        assert float(r.loss) == pytest.approx(float(ref.loss), abs=1e-6)
        for a, b in zip(ref.grads, r.grads):
            assert (a - b).abs().max() <= 1e-6


def test_loss_falls_over_10_steps_and_inputs_are_not_mutated(tiny_cfg, gen):
    # At lr 1e-2 the loss on this one batch is below a tenth of its start after 10 steps (the check asks for half).
    cfg = _two_layers(tiny_cfg)
    batch = _batch(cfg, gen, b=2, s=32, packed=False)
    ids = torch.randint(0, 40, (2, 32), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone()}
    before = {k: v.clone() for k, v in batch.items()}
    state = init_state(cfg, TrainConfig(lr=1e-2, warmup_steps=2, total_steps=10, loss_chunk_size=32), seed=0)
    p0 = [t.clone() for t in tree_leaves(state.params)]
    losses = []
    s = state
    for _ in range(10):
        s, m = train_step(s, batch)
        losses.append(float(m.loss))
    assert losses[-1] < 0.5 * losses[0]
    for k in batch:
        assert torch.equal(batch[k], before[k])
    for a, b in zip(p0, tree_leaves(state.params)):
        assert torch.equal(a, b)
    assert int(state.step) == 0 and int(s.step) == 10


def test_train_step_is_deterministic(tiny_cfg, gen):
    cfg = _two_layers(tiny_cfg)
    batch = _batch(cfg, gen)
    a, ma = train_step(init_state(cfg, TrainConfig(), seed=5), batch)
    b, mb = train_step(init_state(cfg, TrainConfig(), seed=5), batch)
    assert float(ma.loss) == float(mb.loss)
    for x, y in zip(tree_leaves(a), tree_leaves(b)):
        assert torch.equal(x, y)


def test_nan_loss_stops_or_skips(tiny_cfg, gen):
    cfg = _cfg(tiny_cfg)
    batch = _batch(cfg, gen)
    state = init_state(cfg, TrainConfig(), seed=0)
    bad = attrs.evolve(state, params=attrs.evolve(state.params, final_norm=torch.full_like(state.params.final_norm, float("nan"))))
    with pytest.raises(FloatingPointError, match="step 1"):
        train_step(bad, batch)
    skipped = attrs.evolve(bad, train_config=TrainConfig(nan_policy="skip"))
    s2, m = train_step(skipped, batch)
    assert m.skipped and int(s2.step) == 1
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(s2.params), tree_leaves(bad.params)) if not a.isnan().any())


def test_shift_never_crosses_documents():
    x = torch.arange(10)[None]
    doc = torch.tensor([[0] * 4 + [1] * 6])
    assert shift_tokens(x, doc, 1, -100).tolist() == [[1, 2, 3, -100, 5, 6, 7, 8, 9, -100]]
    assert shift_tokens(x, doc, 2, 0).tolist() == [[2, 3, 0, 0, 6, 7, 8, 9, 0, 0]]


def test_recompute_reruns_layers_and_skip_options_keep_kernel_outputs(tiny_cfg, gen):
    """Counting kernel calls: recompute re-runs the GDN solve and attention in backward; skip_gdn_recompute and
    skip_flash_attn_recompute keep those outputs instead (the gradients are checked equal above)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = {"gdn": 0, "attn": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if "linalg_solve_triangular" in name:
                self.n["gdn"] += 1
            if "scaled_dot_product" in name and "backward" not in name:
                self.n["attn"] += 1
            return func(*args, **(kwargs or {}))

    cfg = _two_layers(tiny_cfg, mtp_num_layers=0)
    batch = _batch(cfg, gen, packed=False)
    params = init_params(cfg, seed=2)
    counts = {}
    for name, tc in {
        "plain": TrainConfig(),
        "recompute": TrainConfig(recompute=True),
        "skip_gdn": TrainConfig(recompute=True, skip_gdn_recompute=True),
        "skip_attn": TrainConfig(recompute=True, skip_flash_attn_recompute=True),
    }.items():
        with Count() as c:
            loss_and_grads(state_from_params(params, cfg, tc), batch)
        counts[name] = c.n
    assert counts["recompute"]["gdn"] > counts["plain"]["gdn"]
    assert counts["recompute"]["attn"] > counts["plain"]["attn"]
    assert counts["skip_gdn"]["gdn"] == counts["plain"]["gdn"] and counts["skip_gdn"]["attn"] == counts["recompute"]["attn"]
    assert counts["skip_attn"]["attn"] == counts["plain"]["attn"] and counts["skip_attn"]["gdn"] == counts["recompute"]["gdn"]


def test_the_step_is_importable_from_q38_train():
    """The mission's call: ``q38.train.train_step(params, batch, mesh)``, with ``params`` the whole TrainState."""
    import inspect

    import q38.train
    from q38.train.core.state import TrainState, init_state
    from q38.train.core.step import train_step

    assert q38.train.train_step is train_step and q38.train.init_state is init_state
    assert q38.train.TrainState is TrainState
    assert list(inspect.signature(train_step).parameters)[:3] == ["params", "batch", "mesh"]
    with pytest.raises(AttributeError):
        q38.train.no_such_name


def test_a_term_set_without_aux_steps_and_reports_its_own_terms(tiny_cfg, gen):
    """Metrics are the terms the step ran plus the step's scalars: no term is assumed (an objective without the
    load-balancing term steps and logs no ``aux``)."""
    from q38.train.core.objective import default_terms

    cfg = _cfg(tiny_cfg)
    tc = TrainConfig(lr=1e-3, warmup_steps=0)
    terms = tuple(t for t in default_terms(cfg, tc) if t.name != "aux")
    state, m = train_step(init_state(cfg, tc, seed=0), _batch(cfg, gen), None, terms)
    d = m.as_dict()
    assert "aux" not in d and m.aux_loss is None
    assert set(m.terms) == {t.name for t in terms} and d["loss"] == float(m.loss)
    assert int(state.step) == 1


def test_the_shape_hook_checks_the_entry_point(tiny_cfg):
    """train_step is type-checked under the test-time jaxtyping + beartype hook (it is not exempted)."""
    from jaxtyping import TypeCheckError

    with pytest.raises(TypeCheckError, match="params"):
        train_step({"not": "a train state"}, {}, None)
