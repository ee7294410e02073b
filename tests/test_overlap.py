"""Communication overlap (``train.overlap_comm``) keeps the math: every layout of ``tests/test_parallel.py`` equals one
process with the next layer's gathers prefetched (in forward, and in backward for the layer recomputed next) and the
gradient reductions issued async (waited after backward), recompute on, full or selective (the on-by-default,
recompute-off schedule is ``test_layout_matches_single_process``); and with overlap off. The counters show the overlap
really happened, and gathers over several mesh dims run as one collective."""

import pytest

from q38.parallel.layout import Layout
from q38.pytree import named_leaves
from q38.train.core.step_config import TrainConfig
from q38.train.core.state import init_state
from q38.train.core.step import loss_and_grads, train_step
from tests.dist_utils import run_distributed
from tests.test_parallel import CASES, GTOL, TOL, _batch, _cfg, _reference

pytestmark = pytest.mark.dist


def _rank_fn(rank, world, layout_name, mesh_sizes, tc):
    from q38.parallel.mesh import make_mesh, shard, shard_batch, unshard
    from q38.parallel.runtime import mesh_runtime

    cfg = _cfg()
    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = shard(init_state(cfg, tc, seed=0), mesh)
    r = loss_and_grads(state, shard_batch(_batch(), mesh, cfg.mtp_num_layers), mesh)
    rt = mesh_runtime(mesh, tc)
    rt.bind(state.params)
    steps = {n: [(st.kind, st.names, st.sizes) for st in rt.collectives(t)] for n, t in named_leaves(state.params)}
    # Prefetched: every leaf of the layers after the first (and of the MTP block) whose first gather is even; in
    # backward (recompute), those of every main layer: each is recomputed after the layer (or MTP depth) after it.
    even = [n for n, s in steps.items() if next((sz is None for k, _, sz in s if k == "gather"), False)]
    ahead = [n for n in even if n.startswith("layers.") and not n.startswith("layers.0.") or n.startswith("mtp.")]
    behind = [n for n in even if n.startswith("layers.")]
    grads = {n: g.full_tensor() for n, g in zip(steps, r.grads)}  # collective: every rank
    out = {"loss": float(r.loss), "mtp": float(r.mtp_losses[0]), "aux": float(r.aux_loss),
           "grads": grads if rank == 0 else None,
           "prefetched": r.prefetched, "async": r.async_reductions, "steps": steps, "ahead": len(ahead),
           "prefetched_backward": r.prefetched_backward, "behind": len(behind) if tc.recompute else 0,
           "reduced": sum(1 for s in steps.values() if s), "mesh": tuple(mesh.sizes)}
    state, _ = train_step(state, shard_batch(_batch(seed=0), mesh, cfg.mtp_num_layers), mesh)
    params = dict(named_leaves(unshard(state).params))
    out["params"] = params if rank == 0 else None
    return out


def _check(outs, ref, overlap):
    for o in outs:
        assert abs(o["loss"] - ref["loss"]) <= TOL and abs(o["aux"] - ref["aux"]) <= TOL
        assert abs(o["mtp"] - ref["mtp"][0]) <= TOL
        if overlap:  # every evenly gathered leaf of the next layer was prefetched; every reduction was async
            assert o["prefetched"] == o["ahead"] > 0
            assert o["prefetched_backward"] == o["behind"]
            assert o["async"] == o["reduced"] > 0
        else:
            assert o["prefetched"] == o["prefetched_backward"] == o["async"] == 0
        for name, s in o["steps"].items():  # at most one gather and one all-reduce per leaf (all shards even)
            assert [k for k, _, _ in s] in ([], ["gather"], ["sum"], ["gather", "sum"]), (name, s)
    for name, g in ref["grads"].items():
        assert (outs[0]["grads"][name] - g).abs().max() <= GTOL, name
    for name, p in ref["params"].items():
        assert (outs[0]["params"][name] - p).abs().max() <= TOL, name


# The default suite runs three of the cases (one per kind of gather: one dim, several dims and cp, replicated dims);
# the others are slow-marked (.ci/run runs them). tests/test_parallel.py runs every case with overlap on, no recompute.
_DEFAULT = {("fsdp", 2), ("fsdp_ep_cp", 4), ("hsdp", 4)}
OVERLAP_CASES = [c if (c[0], c[2]) in _DEFAULT else pytest.param(*c, marks=pytest.mark.slow) for c in CASES]


@pytest.mark.parametrize("layout,mesh_sizes,world", OVERLAP_CASES,
                         ids=[f"{c[0]}-{'x'.join(f'{k}{v}' for k, v in c[1].items())}" for c in CASES])
def test_overlap_with_recompute_matches_single_process(layout, mesh_sizes, world):
    tc = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01, lr=1e-3, eps=1e-3, recompute=True)
    assert tc.overlap_comm and tc.fsdp_prefetch is None  # on by default, the prefetch following it
    outs = run_distributed(_rank_fn, world, layout, mesh_sizes, tc)
    _check(outs, _reference(tc, 1), overlap=True)
    assert all(o["behind"] > 0 for o in outs)  # the backward prefetch happened (every layout gathers the layers)


def test_backward_prefetch_with_selective_recompute_matches_single_process():
    """Selective recompute (the attention kernel's outputs kept) still recomputes each layer, gathers included:
    the next layer's gathers are prefetched as its recompute begins, on the layout with EP, CP and flattened
    gathers."""
    tc = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01, lr=1e-3, eps=1e-3, recompute=True,
                     skip_flash_attn_recompute=True)
    outs = run_distributed(_rank_fn, 4, "fsdp_ep_cp", {"fsdp": 1, "ep": 2, "cp": 2}, tc)
    _check(outs, _reference(tc, 1), overlap=True)
    assert all(o["behind"] > 0 for o in outs)


@pytest.mark.parametrize("layout,mesh_sizes,world", [("fsdp_ep_cp", {"fsdp": 1, "ep": 2, "cp": 2}, 4),
                                                     ("hsdp", {"dp_replicate": 2, "fsdp": 2}, 4)],
                         ids=["fsdp_ep_cp-1x2x2", "hsdp-2x2"])
def test_serial_schedule_matches_single_process(layout, mesh_sizes, world):
    """``overlap_comm: false``: no prefetch, reductions waited in backward; the flattened gathers are used either
    way (the dense weights of fsdp_ep_cp 1x2x2 are sharded over cp and ep: one all-gather over both)."""
    tc = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01, lr=1e-3, eps=1e-3, overlap_comm=False)
    outs = run_distributed(_rank_fn, world, layout, mesh_sizes, tc)
    _check(outs, _reference(tc, 1), overlap=False)
    steps, order = outs[0]["steps"], outs[0]["mesh"]
    if layout == "fsdp_ep_cp":
        both = tuple(n for n in order if n in ("cp", "ep"))
        assert steps["embed"] == [("gather", both, None)]
        assert any(s == [("gather", both, None)] for n, s in steps.items() if ".attn" in n or "mixer" in n)
    else:  # HSDP: gather over fsdp, all-reduce the reduced shard over dp_replicate
        assert steps["embed"] == [("gather", ("fsdp",), None), ("sum", ("dp_replicate",), None)]
