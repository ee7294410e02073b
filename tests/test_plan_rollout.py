"""``q38 plan`` prices post-training with rewards (``q38.parallel.budget_rollout``): the rollout's decode caches equal
the bytes of the caches q38's decode builds (prefill, then the decode steps), the reference policy's frozen copy
equals the bytes each rank holds of a real copy of a sharded state (2 gloo ranks, FSDP and EP), the rollout is a
phase of the budget (in the peak), and bad ``--rl-*`` options are one line, exit 2. On a model unlike tiny."""

import pytest
import torch
import yaml

from q38.cli import main
from q38.decode import decode_step, prefill
from q38.model import init_params
from q38.model_config import ConfigError
from q38.parallel.budget import estimate
from q38.parallel.budget_rollout import RolloutPlan
from q38.parallel.layout import Layout
from tests.dist_utils import run_distributed
from tests.model_utils import dims_like_tiny
from tests.test_donate import CFG, TC


def test_the_model_is_unlike_tiny():
    assert dims_like_tiny(CFG) == []


def _items(b, phase="rollout_phase") -> dict:
    return {it.name: it.bytes for it in getattr(b, phase)}


def _tree_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(tree)
               if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_the_planned_rollout_caches_equal_the_caches_decode_builds(dtype):
    """G 3 × 4 prompts of 7 tokens, 9 new tokens: the plan's caches at the prompt and at the end equal the bytes
    of the cache after ``prefill`` and after 8 more decode steps (the 9th sampled token is never fed)."""
    G, P, plen, new = 3, 4, 7, 9
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    b = estimate(CFG, Layout.preset("single"), 1, seq_len=32, rows_per_rank=1, param_dtype=dtype,
                 rl=RolloutPlan(group_size=G, prompts=P, max_new_tokens=new, prompt_len=plen))
    planned = _items(b)
    params = torch.utils._pytree.tree_map(lambda t: t.to(tdtype), init_params(CFG, seed=0))
    prompts = [[(5 * r + j) % CFG.vocab_size for j in range(plen)] for r in range(G * P)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        _, cache, _ = prefill(params, CFG, prompts)
        assert _tree_bytes(cache) == planned["rollout caches at the prompt"]
        for _ in range(new - 1):
            _, cache = decode_step(params, cache, torch.randint(0, CFG.vocab_size, (G * P,), generator=g), CFG)
    assert _tree_bytes(cache) == planned["rollout decode caches"] == planned["the step's new caches"]
    # the rows split over data-parallel ranks like the training batch: 12 rows over fsdp 2 → 6 a rank
    b2 = estimate(CFG, Layout.preset("fsdp"), 2, seq_len=32, rows_per_rank=1, param_dtype=dtype,
                  rl=RolloutPlan(group_size=G, prompts=P, max_new_tokens=new, prompt_len=plen))
    assert 2 * _items(b2)["rollout decode caches"] == planned["rollout decode caches"]


def test_the_rollout_is_a_phase_of_the_peak_and_the_reference_is_in_every_phase():
    base = estimate(CFG, Layout.preset("single"), 1, seq_len=32, rows_per_rank=1, param_dtype="bf16")
    rl = estimate(CFG, Layout.preset("single"), 1, seq_len=32, rows_per_rank=1, param_dtype="bf16",
                  rl=RolloutPlan(group_size=8, prompts=64, max_new_tokens=512, prompt_len=64))
    ref = _items(rl, "memory")["reference policy (frozen copy)"]
    assert ref > 0 and abs(rl.peak_fwd_bwd - base.peak_fwd_bwd - ref) < 1
    assert abs(rl.peak_optimizer - base.peak_optimizer - ref) < 1
    assert rl.peak_phase == "rollout (RL decode)" and rl.peak_bytes == rl.peak_rollout > rl.peak_fwd_bwd
    none = estimate(CFG, Layout.preset("single"), 1, seq_len=32, rows_per_rank=1, param_dtype="bf16",
                    rl=RolloutPlan(group_size=8, prompts=64, max_new_tokens=512, prompt_len=64, reference="none"))
    assert "reference policy (frozen copy)" not in _items(none, "memory")
    assert abs(none.peak_rollout - rl.peak_rollout + ref) < 1


def _frozen_copy_bytes(rank, world, layout_name, mesh_sizes):
    """Each rank's bytes of a frozen bf16 copy of a sharded state's parameters (what a full fine-tune's reference
    holds): the local shard of every DTensor leaf."""
    from q38.parallel.mesh import make_mesh, shard
    from q38.train.core.state import init_state

    mesh = make_mesh(Layout.preset(layout_name).with_mesh(**mesh_sizes), world)
    state = shard(init_state(CFG, TC, seed=1), mesh)
    ref = torch.utils._pytree.tree_map(lambda t: t.detach().to(torch.bfloat16), state.params)
    leaves = torch.utils._pytree.tree_leaves(ref)
    assert all(hasattr(t, "to_local") for t in leaves)  # sharded as the layout shards the parameters
    return sum(t.to_local().numel() * t.to_local().element_size() for t in leaves)


@pytest.mark.dist
@pytest.mark.parametrize("layout,mesh_sizes", [("fsdp", {"fsdp": 2}), ("fsdp_ep", {"fsdp": 1, "ep": 2})])
def test_the_planned_reference_copy_equals_a_real_frozen_copy_on_two_ranks(layout, mesh_sizes):
    held = run_distributed(_frozen_copy_bytes, 2, layout, mesh_sizes)
    b = estimate(CFG, Layout.preset(layout).with_mesh(**mesh_sizes), 2, seq_len=32, rows_per_rank=1,
                 param_dtype="bf16", rl=RolloutPlan(group_size=2, prompts=2, max_new_tokens=4, prompt_len=4))
    assert _items(b, "memory")["reference policy (frozen copy)"] == max(held)
    assert _items(b, "rollout_phase")["reference policy (frozen copy)"] == max(held)


def _model_yaml(tmp_path) -> str:
    p = tmp_path / "model.yaml"
    p.write_text(yaml.safe_dump(CFG.to_dict()))
    return str(p)


def test_q38_plan_prints_the_rollout_and_the_reference(tmp_path, capsys):
    args = ["plan", "--model", _model_yaml(tmp_path), "--layout", "single", "--world", "1", "--seq-len", "64",
            "--dtype", "bf16", "--rl-group-size", "4", "--rl-prompts", "8", "--rl-max-new-tokens", "32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "rollout phase total" in out and "32 prompts" not in out
    assert "8 prompts × G 4 = 32 rows over dp 1: 32 a rank, 32 + 32 tokens each" in out  # prompt: 64 − 32
    assert out.count("reference policy (frozen copy)") == 2  # forward/backward and rollout phases
    assert main(args + ["--lora-rank", "4"]) == 0
    assert "reference policy (base, adapters off)" in capsys.readouterr().out


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("extra,words", [
    (["--rl-group-size", "4"], "add --rl-prompts, --rl-max-new-tokens"),
    (["--rl-group-size", "1", "--rl-prompts", "2", "--rl-max-new-tokens", "4"], "group of one sample"),
    (["--rl-group-size", "2", "--rl-prompts", "2", "--rl-max-new-tokens", "64"], "leaves no prompt"),
    (["--rl-group-size", "2", "--rl-prompts", "2", "--rl-max-new-tokens", "4", "--lora-rank", "4",
      "--rl-reference", "copy"], "adapters off"),
])
def test_bad_rl_plan_options_are_one_line(tmp_path, capsys, extra, words):
    args = ["plan", "--model", _model_yaml(tmp_path), "--layout", "single", "--world", "1", "--seq-len", "64"]
    assert main(args + extra) == 2
    line = _one_line(capsys)
    assert words in line, line


def test_a_rollout_plan_refuses_bad_sizes():
    with pytest.raises(ConfigError, match="prompts must be an integer >= 1"):
        RolloutPlan(group_size=2, prompts=0, max_new_tokens=4)
    with pytest.raises(ConfigError, match="reference must be one of"):
        RolloutPlan(group_size=2, prompts=1, max_new_tokens=4, reference="twin")


def _group(items, name) -> float:
    return sum(it.bytes for it in items if it.transient == name)


def test_the_planned_prefill_and_decode_step_match_the_measured_peaks():
    """The rollout's peaks over the model, measured like an allocator sees them (``tests/mem_utils.PeakMemory``),
    against the plan's groups (``decode_items``): a whole ``rollout`` (prefill is its peak here) within 10 %, one
    sampling + decode step after 300-token prompts within 5 % (planned / measured 0.96 and 1.00 when written)."""
    from q38.decode import Sampling, sampling_probs
    from q38.parallel.budget_rollout import decode_items
    from q38.rollout import rollout, sampled_logprobs
    from tests.mem_utils import PeakMemory

    params = init_params(CFG, seed=0)
    prompts = [[1 + i % 7] * 20 for i in range(4)]
    with PeakMemory(existing=params) as m:
        held = m.live
        rollout(params, CFG, prompts, group_size=3, max_new_tokens=12, sampling=Sampling(temperature=1.0, seed=0))
    items = decode_items(CFG, 12, 20, 12, 4)
    planned = max(_group(items, "prefill"), _group(items, "decode step"))
    assert abs(planned / (m.peak - held) - 1) <= 0.10, (planned, m.peak - held)

    rows, plen = 6, 300
    s = Sampling(temperature=1.0, top_p=0.9)
    with torch.no_grad():
        logits, cache, _ = prefill(params, CFG, [[1 + i % 5] * plen for i in range(rows)])
        del _
        with PeakMemory(existing=(params, cache, logits)) as m:
            before = m.live - _tree_bytes((cache, logits))
            tok = torch.multinomial(sampling_probs(logits, s), 1).view(-1)
            sampled_logprobs(logits, tok, 1.0)
            logits, cache = decode_step(params, cache, tok, CFG)
    planned = _group(decode_items(CFG, rows, plen, 2, 4), "decode step")
    assert abs(planned / (m.peak - before) - 1) <= 0.05, (planned, m.peak - before)


def test_a_rollout_that_does_not_fit_is_named_by_the_fit_line(tmp_path, capsys):
    args = ["plan", "--model", _model_yaml(tmp_path), "--layout", "single", "--world", "1", "--seq-len", "4096",
            "--hardware", "h200", "--rl-group-size", "64", "--rl-prompts", "4096", "--rl-max-new-tokens", "2048"]
    assert main(args) == 0
    out = capsys.readouterr().out
    fit = next(line for line in out.splitlines() if "FIT" in line or line.startswith("fits"))
    assert fit.startswith("DOES NOT FIT") and "in the rollout (RL decode)" in out
    assert "the rollout phase's largest item is" in fit and "fewer prompts or samples per rollout batch" in fit
