"""The plan's gradient accumulator follows the buffers the step keeps (docs/plan.md#what-the-budget-counts): the
number of gradient-sized buffers alive while a later micro-batch runs its backward, and while its gradients are added
into the sum, counted on the step itself (weak references to every gradient tensor the micro-batch loop holds, by
storage) on one process and on a pipelined mesh (2 gloo ranks), against ``budget_memory.accumulator_buffers`` /
``ACCUMULATE_BUFFERS`` and the items ``estimate`` prices with them. On a model unlike ``tiny`` in every dimension."""

import weakref

import pytest
import torch
import yaml

from q38.model_config import ModelConfig
from q38.parallel.budget import estimate
from q38.parallel.budget_memory import ACCUMULATE_BUFFERS, accumulator_buffers
from q38.parallel.layout import Layout
from q38.pytree import tree_leaves
from q38.train.core.state import init_state
from q38.train.core.step import loss_and_grads
from q38.train.core.step_config import TrainConfig
from tests.dist_utils import run_distributed

DIMS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
PP = "{include: fsdp.yaml, name: pp2, mesh: {pp: 2, fsdp: 1}}"


def _cfg() -> ModelConfig:
    return ModelConfig.preset("tiny").replace(
        vocab_size=300, hidden_size=48, num_hidden_layers=3,
        layer_types=("linear_attention", "full_attention", "linear_attention"), num_attention_heads=3,
        num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12,
        linear_value_head_dim=10, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20,
        shared_expert_intermediate_size=24, mtp_num_layers=1, tie_word_embeddings=False)


def test_the_model_is_unlike_tiny():
    tiny, cfg = ModelConfig.preset("tiny"), _cfg()
    assert [k for k in DIMS if getattr(tiny, k) == getattr(cfg, k)] == []


def _batch(rows: int, seq: int = 16) -> dict:
    ids = torch.randint(0, 300, (rows, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _counting(monkeypatch):
    """Wrap the step's runtime ``grad`` and the micro-batch ``accumulate``: record, in order, the bytes of gradient
    buffers alive (distinct storages among the micro-batch gradients and the sums ``accumulate`` took and returned)
    when a backward starts (``("B", bytes)``)
    and at the end of each accumulation, while the old sum, the micro-batch's gradients and the new sum are all
    still referenced (``("A", bytes)``)."""
    import q38.train.core.step as step_mod
    from q38.train.core import pipeline_step

    made, events = [], []

    def alive() -> int:
        seen = {}
        for ref in made:
            t = ref()
            if t is not None:
                t = getattr(t, "_local_tensor", t)
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def keep(ts):
        made.extend(weakref.ref(t) for t in ts if t is not None)

    real_runtime, real_acc = step_mod.step_runtime, pipeline_step.accumulate

    def runtime(*a, **k):
        rt = real_runtime(*a, **k)
        real_grad = rt.grad

        def grad(*ga, **gk):
            events.append(("B", alive()))
            return real_grad(*ga, **gk)

        rt.grad = grad
        return rt

    def accumulate(acc, g, dtype):  # g: the trained leaves' gradients (a chunk's input gradients are not summed)
        keep(g)
        out = real_acc(acc, g, dtype)
        keep(out)
        events.append(("A", alive()))
        return out

    monkeypatch.setattr(step_mod, "step_runtime", runtime)
    monkeypatch.setattr(step_mod, "_accumulate", accumulate)
    monkeypatch.setattr(pipeline_step, "accumulate", accumulate)
    return events


def _expected(m: int, pipelined: bool) -> list[tuple[str, int]]:
    out = []
    for k in range(m):
        out += [("B", accumulator_buffers(k, pipelined)), ("A", ACCUMULATE_BUFFERS if k else 1)]
    return out


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_one_process_accumulator_is_priced_as_the_step_holds_it(monkeypatch, m):
    cfg = _cfg()
    state = init_state(cfg, TrainConfig(micro_batches=m, grad_clip=None), seed=0)
    unit = sum(t.numel() * 4 for t in tree_leaves(state.params))  # one fp32 gradient of every trained leaf
    events = _counting(monkeypatch)
    loss_and_grads(state, _batch(4 if m != 3 else 3), None)
    assert [(kind, n / unit) for kind, n in events] == _expected(m, pipelined=False)
    # the plan prices exactly those buffers: through the backward, and while the last micro-batch is added in
    b = estimate(cfg, Layout.preset("single"), 1, seq_len=16, rows_per_rank=4 if m != 3 else 3, micro_batches=m,
                 param_dtype="fp32", reduce_dtype="fp32", adamw_impl="foreach")
    by = {it.name: it.bytes for it in b.memory}
    assert by.get("gradient accumulator", 0) == accumulator_buffers(m - 1) * unit
    acc = {it.name: it.bytes for it in b.accumulate_phase}
    grads = sum(acc.get(n, 0) for n in ("gradient sum", "micro-batch gradients", "new gradient sum"))
    assert grads == (ACCUMULATE_BUFFERS * unit if m > 1 else 0)
    if m > 1:
        state_bytes = by["master weights"] + by["optimizer moments"]
        assert b.peak_accumulate == state_bytes + grads


def _pp_worker(rank, world, m):
    import pytest as _pytest

    from q38.parallel.mesh import init_sharded, make_mesh, shard_batch
    from q38.train.core.state import state_from_params

    cfg = _cfg()
    mesh = make_mesh(Layout.from_dict(yaml.safe_load(PP)), world, model=cfg)
    tc = TrainConfig(micro_batches=m, grad_clip=None, aux_loss_scope="global_batch")
    state = state_from_params(init_sharded(cfg, mesh, seed=0), cfg, tc)
    trained = [getattr(t, "_local_tensor", t) for t in tree_leaves(state.params)]
    unit = sum(t.numel() * 4 for t in trained if t.numel())
    with _pytest.MonkeyPatch.context() as mp:
        events = _counting(mp)
        loss_and_grads(state, shard_batch(_batch(m), mesh, cfg.mtp_num_layers), mesh)
    return mesh.pp_rank, [(kind, n / unit) for kind, n in events]


def test_pipelined_accumulator_is_priced_as_the_step_holds_it():
    """Each pipeline rank: the sum alone through each later backward (the gradients of a backward are local to it),
    the three buffers while a micro-batch's are added; and the plan's rank items use that rule."""
    m = 3
    for stage, events in run_distributed(_pp_worker, 2, m):
        # the no-grad counting pass takes no gradients; then one backward per micro-batch
        assert events == _expected(m, pipelined=True), (stage, events)
    cfg = _cfg()
    b = estimate(cfg, Layout.from_dict(yaml.safe_load(PP)), 2, seq_len=16, rows_per_rank=m, micro_batches=m,
                 param_dtype="fp32", reduce_dtype="fp32", adamw_impl="foreach")
    one = estimate(cfg, Layout.preset("single"), 1, seq_len=16, rows_per_rank=m, micro_batches=m, param_dtype="fp32",
                   reduce_dtype="fp32", adamw_impl="foreach")
    unit = {it.name: it.bytes for it in one.memory}["gradient accumulator"] / accumulator_buffers(m - 1)
    worst = max(b.pipeline, key=lambda r: r.peak_bytes)
    by = {it.name: it.bytes for it in b.memory}
    assert by["gradient accumulator"] == pytest.approx(unit * worst.param_share * accumulator_buffers(1, True))
    acc = {it.name: it.bytes for it in b.accumulate_phase}
    assert acc["gradient sum"] + acc["micro-batch gradients"] + acc["new gradient sum"] == pytest.approx(
        ACCUMULATE_BUFFERS * unit * worst.param_share)
