"""The pipeline axis (``pp``): a pipelined step equals one process (losses, every gradient, the updated parameters;
pure and donated), a stage holds only its own parameters, the stage split and the schedules, and bad pipeline input
refused in one line."""

import pytest
import torch
import yaml

from q38.model_config import ModelConfig
from q38.parallel.layout import Layout, LayoutError
from q38.parallel.pipeline import Action, balanced_split, bubble_fraction, check_micro_batches, schedule, stage_split
from q38.pytree import named_leaves
from q38.train.core.state import init_state, state_from_params
from q38.train.core.step import loss_and_grads, train_step
from q38.train.core.step_config import TrainConfig
from tests.dist_utils import run_distributed

TOL = 1e-5

DIMS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
TYPES = ("linear_attention", "full_attention", "linear_attention", "full_attention", "linear_attention",
         "full_attention")


def _cfg() -> ModelConfig:
    """Every dimension unlike tiny's; six layers, so each stage (1F1B, and interleaved 2 × 2) runs GDN and attention
    layers; MTP on; an untied head."""
    return ModelConfig.preset("tiny").replace(
        vocab_size=400, hidden_size=40, num_hidden_layers=6, layer_types=TYPES, num_attention_heads=3,
        num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12,
        linear_value_head_dim=12, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=28,
        shared_expert_intermediate_size=20, initializer_range=0.1, mtp_num_layers=1, tie_word_embeddings=False)


def test_the_model_is_unlike_tiny():
    tiny, cfg = ModelConfig.preset("tiny"), _cfg()
    assert [k for k in DIMS if getattr(tiny, k) == getattr(cfg, k)] == []


def _batch(seed=0, b=4, s=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 400, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[2, -4:] = -100
    doc = torch.zeros(b, s, dtype=torch.long)
    doc[:, 10:] = 1
    doc[3, 17:] = 2
    return {"input_ids": ids, "labels": labels, "doc_ids": doc}


# Uneven explicit split (4 + 2 layers) with FSDP and EP; interleaved 1F1B (2 chunks a rank, automatic split) with FSDP.
PP_EP = """
include: fsdp_ep.yaml
name: pp_ep
mesh: {pp: 2, fsdp: -1, ep: 2}
pipeline: {schedule: 1f1b, stages: [[0, 3], [4, 5]]}
"""
PP_INTERLEAVED = """
include: fsdp.yaml
name: pp_interleaved
mesh: {pp: 2, fsdp: -1}
pipeline: {schedule: interleaved_1f1b, virtual_stages: 2}
"""
# pp × cp: every stage's sequence split over 2 CP ranks (K/V all-gather, conv halo, GDN state carry inside a stage;
# the MTP depths' shifted inputs cross the CP border), 3 + 3 layers (GDN and attention in each stage).
PP_CP = """
include: fsdp_cp.yaml
name: pp_cp
mesh: {pp: 2, fsdp: -1, cp: 2}
pipeline: {schedule: 1f1b, stages: [[0, 2], [3, 5]]}
"""
# pp × ep × cp on 8 ranks: every axis at once (the EP dispatch inside a stage whose sequences CP splits), 3 + 3 layers
PP_EP_CP = """
include: fsdp_ep_cp.yaml
name: pp_ep_cp
mesh: {pp: 2, fsdp: -1, cp: 2, ep: 2}
pipeline: {schedule: 1f1b, stages: [[0, 2], [3, 5]]}
"""
STEPS = 3


def _layout(text: str) -> Layout:
    return Layout.from_dict(yaml.safe_load(text))


def _tc(**kw) -> TrainConfig:
    """``global_batch`` aux scope: with several data ranks, which rows share a micro-batch differs from one process
    (rows are split over ranks first), and the ``micro_batch`` scope's aux depends on it, pipeline or not."""
    return TrainConfig(**{"loss_chunk_size": 16, "aux_loss_coef": 0.01, "lr": 1e-3, "eps": 1e-3,
                          "micro_batches": 2, "aux_loss_scope": "global_batch", **kw})


def _full(g):
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _reference(tc):
    """One process over the steps: each step's terms, then the parameters."""
    state = init_state(_cfg(), tc, seed=0)
    terms = []
    for i in range(STEPS):
        state, m = train_step(state, _batch(seed=i))
        terms.append({k: float(v) for k, v in m.terms.items()})
    return terms, dict(named_leaves(state.params))


def _one_process_grads(tc, params: dict, i: int):
    """One process's terms and gradients of step ``i``'s batch at ``params`` (the pipelined run's parameters then):
    each step's gradients are compared from the same parameters, apart from the rounding drift of the trajectories
    (measured on this model without pp, fsdp × ep on 2 ranks: 7.8e-5 at step 3, from 3.9e-6 at step 1)."""
    cfg = _cfg()
    template = init_state(cfg, tc, seed=0)
    _, spec = torch.utils._pytree.tree_flatten(template.params)
    names = [n for n, _ in named_leaves(template.params)]
    state = state_from_params(torch.utils._pytree.tree_unflatten([params[n] for n in names], spec), cfg, tc)
    r = loss_and_grads(state, _batch(seed=i))
    return {k: float(v) for k, v in r.terms.items()}, dict(zip(names, r.grads))


def _pp_rank(rank, world, text, tc):
    from q38.parallel.mesh import make_mesh, shard, shard_batch, unshard

    cfg = _cfg()
    mesh = make_mesh(_layout(text), world, model=cfg)
    start = shard(init_state(cfg, tc, seed=0), mesh)
    owned = [n for n, _ in named_leaves(start.params)]
    state, steps = start, []
    for i in range(STEPS):
        sb = shard_batch(_batch(seed=i), mesh, cfg.mtp_num_layers)
        r = loss_and_grads(state, sb, mesh)
        params = {n: t.clone() for n, t in named_leaves(unshard(state.params))}  # (the donated run reuses buffers)
        steps.append({"terms": {k: float(v) for k, v in r.terms.items()}, "params": params,
                      "grads": {n: _full(g) for n, g in zip(owned, r.grads)}})
        state, m = train_step(state, sb, mesh)
        steps[-1]["metrics"] = {k: float(v) for k, v in m.terms.items()}
    pure = dict(named_leaves(unshard(state).params))
    donated = start
    for i in range(STEPS):
        donated, _ = train_step(donated, shard_batch(_batch(seed=i), mesh, cfg.mtp_num_layers), mesh, donate=True)
    kinds = {cfg.layer_types[int(n.split(".")[1])] for n in owned if n.startswith("layers.")}
    return {"steps": steps, "pure": pure, "donated": dict(named_leaves(unshard(donated).params)), "owned": owned,
            "kinds": kinds, "start_pure": start.donated}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("text,world", [(PP_EP, 4), (PP_INTERLEAVED, 4), (PP_CP, 4), (PP_EP_CP, 8)],
                         ids=["pp2-fsdp-ep-uneven", "pp2-interleaved-fsdp", "pp2-cp2", "pp2-ep2-cp2-8ranks"])
def test_pipelined_step_equals_one_process(text, world):
    tc = _tc()
    ref_terms, ref_params = _reference(tc)
    outs = run_distributed(_pp_rank, world, text, tc, timeout=900)
    all_names = set(ref_params)
    # each rank holds only its stage's parameters; the two stages together hold every one, once per stage
    by_stage: dict = {}
    for rank, o in enumerate(outs):
        assert set(o["owned"]) < all_names
        assert o["kinds"] == {"linear_attention", "full_attention"}, o["kinds"]  # GDN and attention in each stage
        by_stage.setdefault(frozenset(o["owned"]), []).append(rank)
    assert len(by_stage) == 2
    a, b = by_stage
    assert not (a & b) and (a | b) == all_names
    for i in range(STEPS):
        params, got = {}, {}
        for o in outs:
            params.update(o["steps"][i]["params"])
            got.update(o["steps"][i]["grads"])
        assert set(got) == set(params) == all_names
        terms, grads = _one_process_grads(tc, params, i)
        for o in outs:
            for name in ("loss", "mtp_1", "aux"):
                assert abs(o["steps"][i]["terms"][name] - terms[name]) <= TOL, (i, name)
                assert abs(o["steps"][i]["metrics"][name] - ref_terms[i][name]) <= TOL, (i, name)  # trajectory
        for name, g in grads.items():
            # 8 ranks (pp × ep × cp): relative to the gradient's size, as tests/test_parallel.py's overlap test;
            # a GDN conv weight's gradient (up to 2.6) sums every token over 4 data-and-sequence shards in another
            # order and came 1.08e-5 off (4.2e-6 of its size)
            bound = TOL * (max(1.0, float(g.abs().max())) if world > 4 else 1.0)
            assert (got[name] - g).abs().max() <= bound, (i, name)
    for o in outs:
        for name, p in o["pure"].items():
            assert (p - ref_params[name]).abs().max() <= TOL, name
            assert torch.equal(o["donated"][name], p), name  # donated == pure, bit for bit
        assert o["start_pure"]  # the donated run gave up its input


def _scope_rank(rank, world, text, tc):
    from q38.parallel.mesh import make_mesh, shard, shard_batch

    cfg = _cfg()
    mesh = make_mesh(_layout(text), world, model=cfg)
    state = shard(init_state(cfg, tc, seed=0), mesh)
    r = loss_and_grads(state, shard_batch(_batch(), mesh, cfg.mtp_num_layers), mesh)
    names = [n for n, _ in named_leaves(state.params)]
    return {"terms": {k: float(v) for k, v in r.terms.items()}, "grads": dict(zip(names, map(_full, r.grads)))}


@pytest.mark.dist
@pytest.mark.parametrize("aux", [("pooled", "micro_batch"), ("sequence", "global_batch"), ("per_layer", "micro_batch")])
def test_pipelined_aux_forms_and_scopes_equal_one_process(aux):
    """One data rank per stage (micro-batch scope depends on which rows share a micro-batch), 4 micro-batches."""
    kind, scope = aux
    tc = _tc(aux_loss_type=kind, aux_loss_scope=scope, micro_batches=4)
    text = "{include: fsdp.yaml, name: pp_only, mesh: {pp: 2, fsdp: 1}}"
    state = init_state(_cfg(), tc, seed=0)
    ref = loss_and_grads(state, _batch())
    names = [n for n, _ in named_leaves(state.params)]
    outs = run_distributed(_scope_rank, 2, text, tc)
    got = {**outs[0]["grads"], **outs[1]["grads"]}
    for name in ("loss", "mtp_1", "aux"):
        assert abs(outs[0]["terms"][name] - float(ref.terms[name])) <= TOL, name
    for name, g in zip(names, ref.grads):
        assert (got[name] - g).abs().max() <= TOL, name


@pytest.mark.slow
@pytest.mark.dist
def test_pipelined_sequence_aux_across_cp_shards_equals_one_process():
    """The ``sequence`` aux form, whose per-sequence counts are summed over the CP ranks holding parts of a sequence,
    on pp 2 × cp 2 (one data rank a stage, so micro-batches hold the rows one process gives them): every term and
    gradient of one step within 1e-5."""
    tc = _tc(aux_loss_type="sequence", aux_loss_scope="micro_batch", micro_batches=2)
    state = init_state(_cfg(), tc, seed=0)
    ref = loss_and_grads(state, _batch())
    names = [n for n, _ in named_leaves(state.params)]
    outs = run_distributed(_scope_rank, 4, PP_CP, tc)
    got = {k: v for o in outs for k, v in o["grads"].items()}
    assert set(got) == set(names)
    for o in outs:
        for name in ("loss", "mtp_1", "aux"):
            assert abs(o["terms"][name] - float(ref.terms[name])) <= TOL, name
    for name, g in zip(names, ref.grads):
        assert (got[name] - g).abs().max() <= TOL, name


def _policy_batch():
    """``_batch`` as a policy-gradient batch: per-token rollout log-probs near the model's (so the ratio is clipped on
    both sides), advantages of both signs per document, a reference policy's log-probs 0.3 off."""
    b = _batch()
    g = torch.Generator().manual_seed(7)
    shape = b["input_ids"].shape
    b["old_logprobs"] = -6.0 + 0.6 * (torch.rand(shape, generator=g) - 0.5)
    b["ref_logprobs"] = b["old_logprobs"] + 0.6 * (torch.rand(shape, generator=g) - 0.5)
    sign = torch.where(b["doc_ids"] % 2 == 0, 1.0, -1.0)
    b["advantages"] = sign * (0.5 + torch.arange(shape[0])[:, None] / 4)
    return b


def _policy_rank(rank, world, text, tc, pc):
    from q38.parallel.mesh import make_mesh, shard, shard_batch
    from q38.train.core.policy import policy_terms
    from tests.device_check import FactoryDeviceMode

    cfg = _cfg()
    mesh = make_mesh(_layout(text), world, model=cfg)
    state = shard(init_state(cfg, tc, seed=0), mesh)
    with FactoryDeviceMode() as mode:  # every tensor the pipelined step and the policy terms make names its device
        r = loss_and_grads(state, shard_batch(_policy_batch(), mesh, cfg.mtp_num_layers), mesh,
                           terms=policy_terms(cfg, tc, pc))
    names = [n for n, _ in named_leaves(state.params)]
    return {"terms": {k: float(v) for k, v in r.terms.items()}, "objective": float(r.objective),
            "grads": dict(zip(names, map(_full, r.grads))), "device_calls": mode.calls}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("norm", ["sequence", "token"])
def test_pipelined_policy_objective_equals_one_process(norm):
    """The GRPO / DAPO objective (``policy_terms``: clipped surrogate, k3 KL, the metrics and the aux term) on pp 2 (2
    gloo ranks, 2 micro-batches): every term, the objective and every gradient within 1e-5 of one process; the terms
    run on the last stage, the aux term stage by stage."""
    from q38.train.core.policy import PolicyLossConfig, policy_terms

    tc = _tc()
    pc = PolicyLossConfig(clip_low=0.2, clip_high=0.28, norm=norm, kl_coef=0.2, temperature=0.9)
    state = init_state(_cfg(), tc, seed=0)
    ref = loss_and_grads(state, _policy_batch(), terms=policy_terms(_cfg(), tc, pc))
    assert float(ref.terms["kl"]) > 0 and 0 < float(ref.terms["clip_frac"]) < 1
    outs = run_distributed(_policy_rank, 2, "{include: fsdp.yaml, name: pp_only, mesh: {pp: 2, fsdp: 1}}", tc, pc)
    for o in outs:
        assert o["device_calls"] == [], o["device_calls"]
        assert set(o["terms"]) == set(ref.terms)
        for k, v in ref.terms.items():
            assert abs(o["terms"][k] - float(v)) <= TOL, k
        assert abs(o["objective"] - float(ref.objective)) <= TOL
    got = {**outs[0]["grads"], **outs[1]["grads"]}
    names = [n for n, _ in named_leaves(state.params)]
    assert set(got) == set(names)
    for name, g in zip(names, ref.grads):
        assert (got[name] - g).abs().max() <= TOL, name


def _split_backward_rank(rank, world, overlap):
    """A middle chunk (layers 2-3, an input that needs its gradient) on FSDP 2, its backward split the way
    ``torch.distributed.pipelining``'s zero-bubble schedules split it (``stage_backward_input``, then
    ``stage_backward_weight``), against one ``runtime.grad`` of the same chunk."""
    import torch.utils._pytree as pytree
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from q38.model import forward_chunk
    from q38.parallel.mesh import make_mesh, shard, shard_batch
    from q38.train.core.step import make_layer_hooks, step_runtime

    cfg, tc = _cfg(), _tc(overlap_comm=overlap)
    mesh = make_mesh(_layout("{include: fsdp.yaml, name: f, mesh: {fsdp: 2}}"), world)
    flat, spec = pytree.tree_flatten(shard(init_state(cfg, tc, seed=0), mesh).params)
    sb = shard_batch(_batch(), mesh, cfg.mtp_num_layers)
    x0 = torch.randn(*sb.input_ids.shape, cfg.hidden_size, generator=torch.Generator().manual_seed(0))

    def chunk():
        leaves = [t.detach().requires_grad_() for t in flat]
        rt = step_runtime(mesh, tc)
        p = pytree.tree_unflatten(leaves, spec)
        rt.bind(p, defer_reductions=True)
        x = x0.clone().requires_grad_()
        out = forward_chunk(p, range(2, 4), cfg, x=x, info=rt.seq_info(sb), hooks=make_layer_hooks(rt, tc))
        return leaves, rt, x, out.x.float().pow(2).mean()

    leaves, _, x, loss = chunk()
    _, groups = stage_backward_input([loss], None, [x], iter(leaves))
    stage_backward_weight(iter(leaves), groups)
    split = [t.grad for t in leaves]
    leaves, rt, x, loss = chunk()
    want = rt.grad(loss, leaves)
    n = sum(g is not None for g in want)
    same = all(a is not None and torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(split, want)
               if b is not None)
    return {"found": sum(g is not None for g in split), "want": n, "same": same}


@pytest.mark.dist
def test_torchs_split_backward_finds_q38s_weights_only_without_overlapped_reductions():
    """Why zero-bubble schedules are refused (docs/parallel.md#the-pipeline-axis): with ``train.overlap_comm`` (the
    default) a gathered weight reaches autograd through the runtime's anchor, so the split's weight half finds none
    of the chunk's weights and their gradients are never computed; with it off, the weight half gives every one,
    bit for bit."""
    on, off = (run_distributed(_split_backward_rank, 2, ov)[0] for ov in (True, False))
    assert on["want"] == off["want"] > 0
    assert on["found"] == 0
    assert off["found"] == off["want"] and off["same"]


# ---- the split and the schedules ------------------------------------------------------------------------------------


def test_automatic_split_is_balanced_and_uneven_splits_work():
    # 92 layers over 8 stages (the 2.4T fine-tune's PP8) with the embedding and head counted as a layer each
    ranges = balanced_split([1.0] * 92, 8, 1.0, 1.0)
    sizes = [b - a + 1 for a, b in ranges]
    assert sum(sizes) == 92 and ranges[0][0] == 0 and ranges[-1][1] == 91
    loads = [s + (i == 0) + (i == 7) for i, s in enumerate(sizes)]
    assert max(loads) == 12 and min(loads) >= 11  # 94 units over 8: the best possible largest stage is 12
    chunks = stage_split(_layout(PP_EP), _cfg())
    assert [(c.first, c.last, c.rank) for c in chunks] == [(0, 3, 0), (4, 5, 1)]
    auto = stage_split(_layout(PP_INTERLEAVED), _cfg())
    assert [c.rank for c in auto] == [0, 1, 0, 1] and auto[0].embed and auto[-1].head
    assert [i for c in auto for i in c.layers] == list(range(6))


def _simulate(pp: int, v: int, m: int) -> int:
    """Run every rank's schedule against the dependencies (a forward needs the previous chunk's forward, a backward
    the next chunk's backward); returns the number of time slots used (raises on a deadlock)."""
    orders = [schedule(pp, v, m, r) for r in range(pp)]
    n = pp * v
    done, pos, t = set(), [0] * pp, 0
    while any(p < len(o) for p, o in zip(pos, orders)):
        ready = []
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            a = orders[r][pos[r]]
            dep = None
            if a.kind == "F" and a.chunk > 0:
                dep = ("F", a.chunk - 1, a.mb)
            if a.kind == "B":
                dep = ("B", a.chunk + 1, a.mb) if a.chunk < n - 1 else ("F", a.chunk, a.mb)
            if dep is None or dep in done:
                ready.append((r, a))
        if not ready:
            raise AssertionError(f"deadlock at slot {t}")
        for r, a in ready:
            done.add((a.kind, a.chunk, a.mb))
            pos[r] += 1
        t += 1
    assert len(done) == 2 * n * m
    return t


@pytest.mark.parametrize("pp,v,m", [(2, 1, 2), (4, 1, 4), (4, 1, 8), (2, 2, 2), (4, 2, 8), (3, 3, 6)])
def test_schedules_run_every_chunk_once_without_deadlock(pp, v, m):
    for r in range(pp):
        acts = schedule(pp, v, m, r)
        mine = {c for c in range(pp * v) if c % pp == r}
        assert sorted((a.kind, a.chunk, a.mb) for a in acts) == sorted(
            (k, c, b) for k in "FB" for c in mine for b in range(m))
        # a chunk's backward of a micro-batch comes after its forward
        assert all(acts.index(Action("F", a.chunk, a.mb)) < i for i, a in enumerate(acts) if a.kind == "B")
    slots = _simulate(pp, v, m)
    # unit-time forward and backward: 1F1B takes 2 (m + pp - 1) slots, i.e. its bubble is (pp - 1) / (m + pp - 1)
    if v == 1:
        assert slots == 2 * (m + pp - 1)
        assert abs(1 - 2 * m / slots - bubble_fraction(pp, m)) < 1e-12


def test_one_f_one_b_holds_pp_minus_rank_micro_batches_in_flight():
    pp, m = 4, 8
    for r in range(pp):
        live = most = 0
        for a in schedule(pp, 1, m, r):
            live += 1 if a.kind == "F" else -1
            most = max(most, live)
        assert most == pp - r


# ---- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,message", [
    ("{include: fsdp.yaml, mesh: {pp: 8, fsdp: -1}}",
     r"pp=8 × virtual_stages=1 = 8 stage chunks but the model has 6 layers; every chunk needs a layer"),
    ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}, pipeline: {stages: [[0, 2], [4, 5]]}}",
     r"pipeline.stages misses layer\(s\) \[3\]"),
    ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}, pipeline: {stages: [[0, 3], [3, 5]]}}",
     r"pipeline.stages repeats layer 3"),
    ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}, pipeline: {stages: [[3, 5], [0, 2]]}}", r"not consecutive"),
    ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}, pipeline: {stages: [[0, 5]]}}",
     r"lists 1 layer ranges, but pp=2 × virtual_stages=1 = 2"),
    ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}, pipeline: {schedule: dualpipev}}",
     (r"pipeline.schedule 'dualpipev' is not run by q38 \(it splits each backward into input and weight halves, "
      r"which q38's step cannot: docs/parallel.md#the-pipeline-axis\); use interleaved_1f1b with virtual_stages >= 2 "
      r"to shrink the bubble, or 1f1b")),
    ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}, pipeline: {schedule: zbv}}",
     r"'zbv' is not run by q38 .*use interleaved_1f1b"),
    ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}, pipeline: {schedule: gpipe}}",
     r"'gpipe' is not run by q38 \(all forwards, then all backwards.*\); use 1f1b"),
    ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}, pipeline: {schedule: 2f2b}}",
     r"pipeline.schedule '2f2b' is unknown; use one of 1f1b, interleaved_1f1b"),
    ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}, pipeline: {schedule: 1f1b, virtual_stages: 2}}",
     r"1f1b runs one chunk per rank"),
    ("{include: fsdp.yaml, mesh: {pp: -1, fsdp: 2}}", r"pp=-1; the number of pipeline stages must be stated"),
    ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}, fsdp: [pp, fsdp]}", r"fsdp names 'pp'"),
    ("{include: fsdp.yaml, mesh: {fsdp: -1}, pipeline: {schedule: 1f1b}}", r"a pipeline section needs a 'pp' mesh dim"),
])
def test_bad_pipeline_layouts_are_refused_in_one_line(text, message):
    with pytest.raises(LayoutError, match=message) as e:
        stage_split(Layout.from_dict(yaml.safe_load(text)), _cfg())
    assert "\n" not in str(e.value)


def test_too_few_micro_batches_are_refused():
    with pytest.raises(LayoutError, match=r"pp=2 with 1f1b needs at least 2 micro-batches \(train.micro_batches=1\)"):
        check_micro_batches(_layout(PP_EP), 1)
    with pytest.raises(LayoutError, match=r"interleaved_1f1b runs micro-batches in rounds of pp=2, but "
                                          r"train.micro_batches=3; set it to a multiple of 2"):
        check_micro_batches(_layout(PP_INTERLEAVED), 3)
    check_micro_batches(_layout(PP_EP), 3)  # 1F1B takes any m >= pp


def test_q38_train_refuses_bad_pipeline_input_in_one_line_before_any_process(capsys, monkeypatch, tmp_path):
    from q38.cli import main
    from tests.run_utils import run_dict, write_config

    cfg = str(write_config(tmp_path / "run.yaml", run_dict(tmp_path / "out", steps=2)))  # a 2-layer model
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    cases = [
        ("{include: fsdp.yaml, mesh: {pp: 4, fsdp: -1}}", [], "4 stage chunks but the model has 2 layers"),
        ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}, pipeline: {stages: [[0, 0], [0, 1]]}}", [],
         "pipeline.stages repeats layer 0"),
        ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}}", [], "needs at least 2 micro-batches"),
        ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}, pipeline: {schedule: zero_bubble}}", [],
         "'zero_bubble' is not run by q38"),
        ("{include: fsdp.yaml, mesh: {pp: 2, fsdp: -1}}", ["--set", "train.micro_batches=2", "--set", "data.eval_split=0.1"],
         "evaluation on a layout with a pipeline axis"),
    ]
    for i, (text, extra, needle) in enumerate(cases):
        layout = tmp_path / f"pp{i}.yaml"
        layout.write_text(text)
        rc = main(["train", cfg, "--set", f"layout={layout}", *extra])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.count("\n") == 0 and "Traceback" not in err, err
        assert needle in err and err.startswith("q38 train [rank 0]: error:"), err
    assert not (tmp_path / "out").exists()  # refused before anything was written


# ---- the plan ---------------------------------------------------------------------------------------------------------


def test_the_plan_prices_each_stage_by_hand_count():
    """``q38 plan`` on a pp layout: each stage's share of the parameter elements, the activations the schedule keeps
    in flight, the bubble and the point-to-point bytes, against counts made here."""
    from q38.model import abstract_params, count_params
    from q38.parallel.budget import estimate
    from q38.parallel.pipeline import owns
    from q38.parallel.pipeline_plan import backward_peaks, in_flight_layers

    cfg, layout = _cfg(), _layout(PP_EP)
    chunks = stage_split(layout, cfg)
    m, rows, seq = 4, 4, 24
    from q38.parallel.hardware import Hardware

    kw = {"seq_len": seq, "rows_per_rank": rows, "micro_batches": m, "param_dtype": "fp32", "reduce_dtype": "fp32",
          "adamw_impl": "foreach", "hardware": Hardware.load("h200")}
    b = estimate(cfg, layout, 4, **kw)
    one = estimate(cfg, layout.stage_layout().with_mesh(fsdp=1, ep=2), 2, **kw)  # the whole model on one stage
    numel = {p: i.numel for p, i in named_leaves(abstract_params(cfg), is_leaf=lambda x: hasattr(x, "numel"))
             if i is not None}
    assert sum(numel.values()) == count_params(cfg).total_with_mtp
    # fsdp × ep = 2 shards every dense leaf evenly and splits the experts: a rank holds half of each leaf but the
    # norms (replicated); shares by hand
    placements = layout.stage_layout().with_mesh(fsdp=1, ep=2).placements(abstract_params(cfg), {"fsdp": 1, "ep": 2})
    local = {p: numel[p] / placements[p].shard_factor for p in numel}
    for r, row in enumerate(b.pipeline):
        share = sum(n for p, n in local.items() if owns(chunks, r, p)) / sum(local.values())
        assert abs(row.param_share - share) < 1e-12
        assert row.layers == ((0, 3),) if r == 0 else row.layers == ((4, 5),)
    assert abs(sum(row.param_share for row in b.pipeline) - 1) < 1e-12
    # 1F1B: stage 0 holds p = 2 micro-batches of its 4 layers, stage 1 one of its 2
    assert [in_flight_layers(chunks, 2, 1, m, r) for r in range(2)] == [8, 2]
    assert backward_peaks(chunks, 2, 1, m, 0)[0] == (8, False)
    # p2p: stage 0 sends each micro-batch's residual stream and MTP embedding forward, stage 1 their gradients back
    bundle = (rows // m) * seq * cfg.hidden_size * (1 + cfg.mtp_num_layers) * 4
    assert [row.p2p_bytes for row in b.pipeline] == [2 * m * bundle, 0]
    # the step's compute: the slowest stage's share of the one-stage compute, times the bubble factor (m + p - 1) / m
    # (the stages' compute adds up to the one-stage compute, which already holds the aux counts' forward)
    assert one.flops.aux_forward > 0 and one.compute_s > 0
    assert sum(row.compute_s for row in b.pipeline) == pytest.approx(one.compute_s)
    assert b.compute_s == pytest.approx(max(row.compute_s for row in b.pipeline) * (m + 1) / m)
    # state items are the stage's share of the whole model's
    by_one = {it.name: it.bytes for it in one.memory}
    worst = max(b.pipeline, key=lambda row: row.peak_bytes)
    by = {it.name: it.bytes for it in b.memory}
    assert by["master weights"] == pytest.approx(by_one["master weights"] * worst.param_share)
    assert abs(bubble_fraction(2, m) - 1 / (m + 1)) < 1e-12 and abs(bubble_fraction(4, 8, 2) - 1.5 / 9.5) < 1e-12


def test_the_plans_range_of_a_pp_step_holds_its_midpoint():
    """The step's range over the profile's efficiency and bus-bandwidth ranges brackets the midpoint on a pp layout
    too: a stage's compute keeps the whole model's per-op spread and its collectives their own share at each end
    (the merged plan priced a pp stage's collectives at the whole model's bytes at both ends, so a 10.3 s step had a
    range of 13.2-16.8 s)."""
    from q38.parallel.budget import estimate
    from q38.parallel.hardware import Hardware

    cfg, layout = _cfg(), _layout(PP_EP)
    kw = {"seq_len": 24, "rows_per_rank": 4, "micro_batches": 4, "param_dtype": "bf16", "reduce_dtype": "fp32",
          "adamw_impl": "foreach", "hardware": Hardware.load("h100")}
    b = estimate(cfg, layout, 4, **kw)
    fast, slow = b.step_range
    assert b.pipeline and fast < b.step_s < slow
    assert all(t.fast_s <= t.seconds <= t.slow_s for t in b.comm)
    one = estimate(cfg, layout.stage_layout().with_mesh(fsdp=1, ep=2), 2, **kw)
    ratio = (one.step_at("slow") - one.step_at("fast")) / one.step_s
    assert 0 < (slow - fast) / b.step_s <= 2 * ratio  # the same order of spread as the one-stage step's
