"""CP exchanges started early (``train.overlap_comm``) keep the math: fsdp_cp 1x2 and fsdp_ep_cp 1x2x2 equal one
process (losses, gradients, updated parameters), and ``Gradients.cp_early`` shows each layer's exchanges were
started before the compute that does not need them (none with overlap off)."""

import pytest

from q38.model_config import ModelConfig
from q38.layers.kinds import MTP_LAYER_TYPE
from q38.parallel.layout import Layout
from q38.pytree import named_leaves
from q38.train.core.step_config import TrainConfig
from q38.train.core.state import init_state
from q38.train.core.step import loss_and_grads, train_step
from tests.dist_utils import run_distributed
from tests.test_parallel import GTOL, TOL, _batch, _cfg, _reference

pytestmark = pytest.mark.dist

# Started early per layer call: attention 4 (token indices, doc ids at its start; K, V after their projection),
# GDN 3 (conv-halo doc ids at its start, conv input after its projection, the state carry's doc ends before the core).
EARLY_PER_LAYER = {"full_attention": 4, "linear_attention": 3}


def _early_per_forward(cfg: ModelConfig) -> int:
    kinds = list(cfg.layer_types) + [MTP_LAYER_TYPE] * cfg.mtp_num_layers
    return sum(EARLY_PER_LAYER[k] for k in kinds)


def _rank_fn(rank, world, layout_name, mesh_sizes, tc):
    from q38.parallel.mesh import make_mesh, shard, shard_batch, unshard

    cfg = _cfg()
    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = shard(init_state(cfg, tc, seed=0), mesh)
    r = loss_and_grads(state, shard_batch(_batch(), mesh, cfg.mtp_num_layers), mesh)
    grads = {n: g.full_tensor() for (n, _), g in zip(named_leaves(state.params), r.grads)}  # collective: every rank
    out = {"loss": float(r.loss), "mtp": float(r.mtp_losses[0]), "aux": float(r.aux_loss), "early": r.cp_early,
           "grads": grads if rank == 0 else None}
    state, _ = train_step(state, shard_batch(_batch(seed=0), mesh, cfg.mtp_num_layers), mesh)
    params = dict(named_leaves(unshard(state).params))
    out["params"] = params if rank == 0 else None
    return out


CASES = [("fsdp_cp", {"fsdp": 1, "cp": 2}, 2, True), ("fsdp_ep_cp", {"fsdp": 1, "ep": 2, "cp": 2}, 4, True),
         ("fsdp_cp", {"fsdp": 1, "cp": 2}, 2, False)]


@pytest.mark.parametrize("layout,mesh_sizes,world,overlap", CASES,
                         ids=["fsdp_cp-1x2", "fsdp_ep_cp-1x2x2", "fsdp_cp-1x2-serial"])
def test_cp_exchanges_started_early_keep_the_math(layout, mesh_sizes, world, overlap):
    tc = TrainConfig(loss_chunk_size=16, aux_loss_coef=0.01, lr=1e-3, eps=1e-3, overlap_comm=overlap)
    ref = _reference(tc, 1)
    outs = run_distributed(_rank_fn, world, layout, mesh_sizes, tc)
    for o in outs:
        assert abs(o["loss"] - ref["loss"]) <= TOL and abs(o["aux"] - ref["aux"]) <= TOL
        assert abs(o["mtp"] - ref["mtp"][0]) <= TOL
        assert o["early"] == (_early_per_forward(_cfg()) if overlap else 0)
    for name, g in ref["grads"].items():
        assert (outs[0]["grads"][name] - g).abs().max() <= GTOL, name
    for name, p in ref["params"].items():
        assert (outs[0]["params"][name] - p).abs().max() <= TOL, name
