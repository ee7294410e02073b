"""What the overlapped backward holds for its async gradient reductions (``train.overlap_comm``), and the plan's line
for it. Backward issues each gathered leaf's reduce-scatter async; a layer's are completed when the next layer's
first is issued, so the full-size gradients of one layer (one gather call) wait for their reduce-scatter at a time,
as FSDP2 keeps one layer's in flight: measured by the runtime's own counter (``Gradients.async_reduce_bytes``, the
most input bytes of the reduce-scatters in flight at once) on 2 gloo ranks, against the largest layer's elements
counted here from the model's shapes, and the plan's "gradients awaiting reduction" item. The schedule keeps the
math: the overlapped step's loss and gradients equal the serial step's bit for bit."""

import pytest
import torch

from q38.model import init_params
from q38.parallel.budget import estimate
from q38.parallel.layout import Layout
from q38.pytree import named_leaves
from q38.train.core.state import init_state
from q38.train.core.step import loss_and_grads
from q38.train.core.step_config import TrainConfig
from tests.dist_utils import run_distributed
from tests.test_donate import CFG, TC, _b

WORLD, LAYOUT = 2, "fsdp"


def _largest_layer_elements() -> int:
    """Elements of the largest layer (a decoder layer or the MTP layer), counted leaf by leaf from the full model:
    under ``fsdp`` every leaf of a layer is gathered whole for compute, so its gradient is full-size."""
    per: dict[str, int] = {}
    for path, t in named_leaves(init_params(CFG, seed=0)):
        parts = path.split(".")
        if "layers" in parts:
            key = ".".join(parts[: parts.index("layers") + 2])
            per[key] = per.get(key, 0) + t.numel()
    return max(per.values())


def _rank_fn(rank, world, overlap):
    from q38.parallel.mesh import make_mesh, shard, shard_batch

    tc = TrainConfig(**{**{k: getattr(TC, k) for k in ("loss_chunk_size", "aux_loss_coef", "lr", "eps")},
                        "overlap_comm": overlap})
    mesh = make_mesh(Layout.preset(LAYOUT), world)
    state = shard(init_state(CFG, tc, seed=0), mesh)
    r = loss_and_grads(state, shard_batch(_b(0), mesh, CFG.mtp_num_layers), mesh)
    return {"loss": r.objective.clone(), "grads": [g.to_local().clone() for g in r.grads],
            "bytes": r.async_reduce_bytes, "async": r.async_reductions}


@pytest.fixture(scope="module")
def runs():
    return {ov: run_distributed(_rank_fn, WORLD, ov) for ov in (True, False)}


def test_one_layer_of_full_gradients_awaits_its_reduction(runs):
    """The most bytes awaiting an async reduce-scatter at once: one layer's full-size fp32 gradients (the runtime
    kept two layers' before, and a non-contiguous gradient twice: beside its chunks' copies), within the replicated
    norms' share (all-reduced, not reduce-scattered: not counted), and the plan's item says the same."""
    full = _largest_layer_elements() * 4
    for o in runs[True]:
        assert o["async"] > 0
        assert 0.97 * full <= o["bytes"] <= full, (o["bytes"], full)
    for o in runs[False]:
        assert o["async"] == o["bytes"] == 0
    b = estimate(CFG, Layout.preset(LAYOUT), WORLD, seq_len=32, rows_per_rank=2, param_dtype="fp32",
                 reduce_dtype="fp32", async_reduce=True)
    items = {it.name: it for it in b.memory}
    assert items["gradients awaiting reduction"].bytes == full
    assert items["gradients awaiting reduction"].transient == items["reduce-scatter staging"].transient == "layer"
    off = estimate(CFG, Layout.preset(LAYOUT), WORLD, seq_len=32, rows_per_rank=2, param_dtype="fp32",
                   reduce_dtype="fp32", async_reduce=False)
    assert "gradients awaiting reduction" not in {it.name for it in off.memory}


def test_overlapped_reductions_keep_the_math_bit_for_bit(runs):
    for on, off in zip(runs[True], runs[False]):
        assert torch.equal(on["loss"], off["loss"])
        assert len(on["grads"]) == len(off["grads"])
        for a, b in zip(on["grads"], off["grads"]):
            assert torch.equal(a, b)


def test_plan_item_in_reduce_dtype():
    """bf16 gradients (``reduce_dtype: bf16``) wait in bf16: half the fp32 item; no item without a gathered layer."""
    kw = dict(seq_len=32, rows_per_rank=2, param_dtype="bf16", async_reduce=True)
    fp32 = {it.name: it.bytes for it in estimate(CFG, Layout.preset(LAYOUT), WORLD, reduce_dtype="fp32", **kw).memory}
    bf16 = {it.name: it.bytes for it in estimate(CFG, Layout.preset(LAYOUT), WORLD, reduce_dtype="bf16", **kw).memory}
    assert fp32["gradients awaiting reduction"] == 2 * bf16["gradients awaiting reduction"] == _largest_layer_elements() * 4
    single = estimate(CFG, Layout.preset("single"), 1, reduce_dtype="fp32", **kw)
    assert "gradients awaiting reduction" not in {it.name for it in single.memory}
