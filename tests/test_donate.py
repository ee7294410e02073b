"""The donated step (``train_step(..., donate=True)``): the same losses, gradients and updated state as the pure
step, bit for bit, on one process and on every shipped layout (4 gloo ranks); a donated state used again is refused
naming the donation; an async checkpoint in flight keeps the state of its step while donated steps go on."""

import attrs
import pytest
import torch

from q38.model_config import ModelConfig
from q38.parallel.layout import Layout
from q38.pytree import named_leaves, tree_map
from q38.train.core import step as step_mod
from q38.train.core.state import DonatedStateError, init_state
from q38.train.core.step import train_step
from q38.train.core.step_config import TrainConfig
from tests.dist_utils import run_distributed
from tests.test_parallel import CASES, _batch

# Every dimension differs from the tiny preset (hidden 64, 8 experts top-2, 4 layers, vocab 384, attention 4/2 heads
# of 16, GDN 2/4 heads of 16, widths 32), and each is
# even (experts: a multiple of 4) so that every shipped layout's small mesh (2 per dim) shards it.
CFG = ModelConfig(
    model_type="qwen3_8_moe", vocab_size=160, hidden_size=48, num_hidden_layers=2,
    layer_types=("linear_attention", "full_attention"),
    num_attention_heads=8, num_key_value_heads=4, head_dim=12, rope_theta=10_000.0, partial_rotary_factor=0.5,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=6,
    num_experts=12, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=20,
    mtp_num_layers=1, initializer_range=0.1, max_position_embeddings=4096,
)
TC = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01, lr=1e-3, eps=1e-3, grad_clip=0.5, warmup_steps=1)


def _b(seed):
    b = _batch(seed)
    return dict(b, input_ids=b["input_ids"] % CFG.vocab_size, labels=torch.where(b["labels"] >= 0,
                                                                                 b["labels"] % CFG.vocab_size, -100))


def _clone(state):
    return tree_map(lambda t: t.clone(), state)


class _GradTap:
    """Copies of the gradients ``train_step`` got from ``loss_and_grads`` (before any in-place clipping)."""

    def __init__(self, monkeypatch=None):
        self.seen = []
        self.real = step_mod.loss_and_grads

    def __call__(self, *a, **k):
        r = self.real(*a, **k)
        self.seen.append([g.clone() for g in r.grads])
        return r


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _run(state, batches, mesh, donate, shard_b=lambda b: b):
    tap = _GradTap()
    step_mod.loss_and_grads = tap
    try:
        losses = []
        for b in batches:
            state, m = train_step(state, shard_b(b), mesh, donate=donate)
            losses.append((float(m.loss), float(m.grad_norm), float(m.objective)))
    finally:
        step_mod.loss_and_grads = tap.real
    return state, losses, tap.seen


def _same_state(a, b) -> list[str]:
    """Names of the leaves (local shards) that differ in any bit."""
    return [n for (n, x), (_, y) in zip(named_leaves(a), named_leaves(b))
            if not (x is None and y is None) and not torch.equal(_local(x), _local(y))]


@pytest.mark.parametrize("tc", [
    TC, pytest.param(TC.replace(micro_batches=2, weight_decay=0.0, grad_clip=None), marks=pytest.mark.slow),
    pytest.param(TC.replace(aux_loss_free=True), marks=pytest.mark.slow)], ids=["clip", "micro2-noclip", "aux-free"])
def test_donated_equals_pure_bit_for_bit_on_one_process(tc):
    state = init_state(CFG, tc, seed=3)
    batches = [_b(i) for i in range(2)]
    pure, lp, gp = _run(state, batches, None, donate=False)
    start = _clone(state)
    donated, ld, gd = _run(start, batches, None, donate=True)
    assert lp == ld
    assert all(torch.equal(x, y) for a, b in zip(gp, gd) for x, y in zip(a, b))
    assert _same_state(pure, donated) == []
    assert int(donated.step) == 2
    # the pure step left its input alone; the donated one wrote into its input's buffers
    assert _same_state(state, init_state(CFG, tc, seed=3)) == []
    assert start.donated and donated.params.embed.data_ptr() == start._params.embed.data_ptr()


def test_reusing_a_donated_state_is_refused_naming_the_donation(tmp_path):
    from q38.train.io.checkpoint import save_checkpoint

    state = init_state(CFG, TC, seed=0)
    new, _ = train_step(state, _b(0), donate=True)
    assert state.donated and not new.donated
    msg = r"donated to train_step\(\.\.\., donate=True\) \(the step to 1\)"
    with pytest.raises(DonatedStateError, match=msg):
        train_step(state, _b(1))
    with pytest.raises(DonatedStateError, match=msg):
        train_step(state, _b(1), donate=True)
    with pytest.raises(DonatedStateError, match=msg):
        state.params  # noqa: B018
    with pytest.raises(DonatedStateError, match=msg):
        state.exp_avg_sq  # noqa: B018
    with pytest.raises(DonatedStateError, match=msg):
        save_checkpoint(tmp_path, state, {"step": 1})
    assert not (tmp_path / "step_000001").exists()
    # the returned state trains on (and evolving it gives an undonated state)
    newer, _ = train_step(new, _b(1), donate=True)
    assert int(newer.step) == 2 and not attrs.evolve(newer, step=newer.step).donated


def test_an_async_save_in_flight_keeps_its_step_while_donated_steps_write(tmp_path):
    from q38.train.io import checkpoint as ck
    from tests.test_async_save import _tensors

    state, _ = train_step(init_state(CFG, TC, seed=0), _b(0), donate=True)
    expect = {n: t.clone() for n, t in ck.state_dict_of(state).items()}
    save = ck.AsyncSave(tmp_path, state, {"step": 1})
    for i in range(1, 3):  # the buffers the save was given are overwritten in place
        state, _ = train_step(state, _b(i), donate=True)
    assert not torch.equal(state.params.embed, expect["params.embed"])
    got = _tensors(save.finish())
    assert got.keys() == expect.keys() and all(torch.equal(got[k], expect[k]) for k in expect)


def _layout_fn(rank, world, layout_name, mesh_sizes, steps):
    from q38.parallel.mesh import make_mesh, shard, shard_batch

    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = shard(init_state(CFG, TC, seed=1), mesh)
    batches = [_b(i) for i in range(steps)]
    sb = lambda b: shard_batch(b, mesh, CFG.mtp_num_layers)  # noqa: E731
    pure, lp, gp = _run(state, batches, mesh, donate=False, shard_b=sb)
    donated, ld, gd = _run(_clone(state), batches, mesh, donate=True, shard_b=sb)
    grads_same = all(torch.equal(_local(x), _local(y)) for a, b in zip(gp, gd) for x, y in zip(a, b))
    return {"losses": (lp, ld), "grads_same": grads_same, "n_grads": sum(len(a) for a in gd),
            "state_diff": _same_state(pure, donated), "updated": _same_state(state, donated) != []}


# Every shipped layout on 4 ranks: the equivalence suite's 4-rank cases, plus fsdp over 4 and the production layout
# (fsdp × ep × cp) shrunk to ep 2 × cp 2; `single` is the one-process test above.
LAYOUTS_4 = [c for c in CASES if c[2] == 4] + [("fsdp", {"fsdp": 4}, 4),
                                                ("qwen3_8_2_4t", {"fsdp": 1, "ep": 2, "cp": 2}, 4)]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout,mesh_sizes,world", LAYOUTS_4,
                         ids=[f"{c[0]}-{'x'.join(f'{k}{v}' for k, v in c[1].items())}" for c in LAYOUTS_4])
def test_donated_equals_pure_bit_for_bit_on_every_layout(layout, mesh_sizes, world):
    outs = run_distributed(_layout_fn, world, layout, mesh_sizes, 2)
    for o in outs:
        assert o["losses"][0] == o["losses"][1]
        assert o["grads_same"] and o["n_grads"] > 0
        assert o["state_diff"] == []
        assert o["updated"]
