"""Predicted communication bytes (q38/parallel/budget.py) against benchmarks/comm.py's measurement: every
``torch.distributed`` call of a real ``train_step`` (tiny, fsdp 2 × ep 2, 4 gloo ranks) wrapped to count the bytes
rank 0 receives. FSDP all-gathers (forward and recompute) and gradient reduce-scatters are fixed by the layout and
must match to the byte; the EP all-to-all depends on where the router sends tokens, so the prediction (uniform
routing) is compared with the measured volume within 25 %."""

import collections

import pytest

from q38.model_config import ModelConfig
from q38.parallel.budget import estimate
from q38.parallel.layout import Layout
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("recompute", [False, True])
def test_predicted_comm_bytes_equal_measured(recompute):
    from benchmarks.comm import _rank_fn

    world, fsdp, ep = 4, 2, 2
    r = run_distributed(_rank_fn, world, fsdp, ep, recompute)[0]
    measured = collections.Counter()
    for (kind, _), v in r["counts"].items():
        measured[kind] += v
    b = estimate(ModelConfig.preset("tiny"), Layout.preset("fsdp_ep").with_mesh(fsdp=fsdp, ep=ep), world,
                 seq_len=128, rows_per_rank=2, recompute="full" if recompute else "none", param_dtype="fp32",
                 reduce_dtype="fp32", prefetch=False)
    ag = sum(t.bytes for t in b.comm if t.collective.startswith("all-gather"))
    rs = sum(t.bytes for t in b.comm if t.collective == "reduce-scatter grads")
    a2a = sum(t.bytes for t in b.comm if t.collective.startswith("all-to-all tokens"))
    print(f"recompute={recompute}: all-gather {ag:,.0f} vs {measured['all_gather']:,}; reduce-scatter {rs:,.0f} vs "
          f"{measured['reduce_scatter']:,}; all-to-all {a2a:,.0f} vs {measured['a2a activations']:,}")
    assert ag == measured["all_gather"]
    assert rs == measured["reduce_scatter"]
    assert abs(a2a / measured["a2a activations"] - 1) < 0.25
