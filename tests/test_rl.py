"""Rollouts, rewards and advantages (``q38.rollout``, ``q38.train.run.rl``): the log-probs recorded at sampling equal
the training forward's on the packed rows (max |Δ| ≤ 1e-5, fp32, one process); rewards built in and by
``module:function``; group advantages against hand values; bad rewards and groups of one are one line; one
rollout → reward → advantage → step iteration runs and reports its metrics."""

import math

import pytest
import torch

from q38.decode import Sampling
from q38.errors import ConfigError
from q38.rollout import Completion, rollout
from q38.train.core.state import init_state
from q38.train.core.step_config import TrainConfig
from q38.train.run.rl import (
    RewardError, answer_format, group_advantages, numeric_answer, pack_rollouts, rl_iteration, score,
    trainer_logprobs,
)
from tests.test_policy_loss import CFG

MISMATCH_TOL = 1e-5
PROMPTS = [[5, 17, 3, 90, 41], [7, 2], [150, 33, 8]]  # different lengths: left-aligned feeding exercised


def _state(seed=4):
    return init_state(CFG, TrainConfig(lr=1e-3, warmup_steps=1), seed=seed)


def test_rollout_logprobs_equal_the_trainers_on_packed_rows():
    state = _state()
    s = Sampling(temperature=0.8, top_p=0.95, seed=11)
    comps = rollout(state.params, CFG, PROMPTS, group_size=3, max_new_tokens=7, sampling=s, stop_ids=(4,))
    assert len(comps) == 9 and [c.prompt_index for c in comps] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(len(c.tokens) == len(c.logprobs) >= 1 for c in comps)
    assert len({c.tokens for c in comps}) > 3  # sampled, not one greedy completion repeated
    batch = pack_rollouts(comps, [0.0] * len(comps), row_len=32)
    assert batch["input_ids"].shape[0] < len(comps)  # several documents per row
    lp = trainer_logprobs(state, batch, temperature=0.8)
    mask = batch["labels"] != -100
    assert int(mask.sum()) == sum(len(c.tokens) for c in comps)
    diff = float((lp - batch["old_logprobs"]).abs()[mask].max())
    assert diff <= MISMATCH_TOL, f"max |rollout - trainer log-prob| = {diff:.2e}"
    assert float(batch["old_logprobs"][mask].abs().min()) > 0  # real log-probs, not the zeros of the padding


def test_the_rollout_is_refused_for_a_group_of_one_greedy_or_no_tokens():
    p = _state().params
    for kw, words in (({"group_size": 1}, "group of one"), ({"max_new_tokens": 0}, "max_new_tokens"),
                      ({"sampling": Sampling(temperature=0.0)}, "greedy")):
        args = {"group_size": 2, "max_new_tokens": 3, "sampling": Sampling(temperature=1.0), **kw}
        with pytest.raises(ConfigError, match=words) as e:
            rollout(p, CFG, PROMPTS, **args)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="group of one"):
        group_advantages([1.0, 0.0], 1)


def test_group_advantages_equal_hand_values():
    # group 1: rewards 1, 0, 0 → mean 1/3, std (Bessel) sqrt(1/3) → (2/3)/0.57735 = 1.1547, -0.57735 twice
    a = group_advantages([1.0, 0.0, 0.0, 2.0, 2.0, 2.0], 3, eps=0.0)
    assert a[:3] == pytest.approx([2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)], abs=1e-9)
    assert group_advantages([2.0, 2.0, 2.0], 3) == [0.0, 0.0, 0.0]  # equal rewards: no signal
    assert group_advantages([1.0, 0.0], 2, scale=False) == [0.5, -0.5]


def user_reward(prompt, completion, answer):
    return float(len(completion))


def raising_reward(prompt, completion, answer):
    raise KeyError("boom")


def nan_reward(prompt, completion, answer):
    return float("nan")


def text_reward(prompt, completion, answer):
    return "1"


def test_rewards_built_in_user_and_bad_ones():
    assert numeric_answer("", "so 3 + 4 = 7", "7") == 1.0 and numeric_answer("", "7 or 8", "7") == 0.0
    assert numeric_answer("", "no number", "7") == 0.0 and numeric_answer("", "x = 2.50", "2.5") == 1.0
    assert answer_format("", "work\nAnswer: 12\n", None) == 1.0 and answer_format("", "Answer is 12", None) == 0.0
    comps = [Completion(0, (1,), (2, 3), (-1.0, -1.0), True), Completion(1, (1,), (2,), (-1.0,), True)]
    texts = ["Answer: 5", "6"]
    got = score(["numeric_answer", "answer_format", "tests.test_rl:user_reward"], ["p0", "p1"], ["5", "5"],
                comps, texts)
    assert got == [1.0 + 1.0 + 9.0, 0.0 + 0.0 + 1.0]
    for spec, words in (("tests.test_rl:raising_reward", "raised KeyError"), ("tests.test_rl:nan_reward", "nan"),
                        ("tests.test_rl:text_reward", "'1', not a finite number")):
        with pytest.raises(RewardError, match=words) as e:
            score([spec], ["p0", "p1"], ["5", "5"], comps, texts)
        assert "\n" not in str(e.value) and "prompt 0 ('p0')" in str(e.value) and spec in str(e.value)
    with pytest.raises(RewardError, match="no reference answer"):
        score(["numeric_answer"], ["p0", "p1"], [None, "5"], comps, texts)
    with pytest.raises(ConfigError, match="module:function"):
        score(["nonsense"], ["p0"], ["5"], comps[:1], texts[:1])
    with pytest.raises(ConfigError, match="cannot be loaded"):
        score(["tests.test_rl:missing"], ["p0"], ["5"], comps[:1], texts[:1])


def test_one_rl_iteration_trains_and_reports():
    state = _state()
    before = state.params.embed.clone()
    texts = ["a", "b", "c"]
    new, d = rl_iteration(state, PROMPTS, prompt_texts=texts, answers=[None] * 3,
                          detokenize=lambda ids: " ".join(map(str, ids)), rewards=["tests.test_rl:user_reward"],
                          group_size=3, max_new_tokens=5, sampling=Sampling(temperature=1.0, seed=3), row_len=32)
    assert int(new.step) == 1 and not torch.equal(new.params.embed, before)
    assert d["mismatch_max"] <= MISMATCH_TOL and d["logprob_diff"] <= MISMATCH_TOL
    assert d["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and d["reward_std"] > 0 and d["response_length"] >= 1
    assert {"loss", "kl", "clip_frac", "entropy", "reward_mean"} <= set(d)


def _lora_state(seed=4):
    from q38.lora import PeftConfig, add_adapters
    from q38.model import init_params
    from q38.train.core.state import state_from_params

    peft = PeftConfig(rank=4, alpha=8)
    p = add_adapters(init_params(CFG, seed=seed), peft, seed=1)
    return state_from_params(p, CFG, TrainConfig(lr=1e-2, warmup_steps=1), peft=peft)


def test_lora_rollouts_match_and_the_base_is_the_reference_policy():
    """A LoRA run: rollouts from the merged adapters equal the step's unmerged forward; its reference log-probs
    (adapters off) equal a plain model of the same base weights; KL is 0 before the adapters move, > 0 after."""
    from q38.train.core.policy import PolicyLossConfig
    from q38.train.run.rl import policy_params, reference_logprobs

    state = _lora_state()
    comps = rollout(policy_params(state), CFG, PROMPTS, group_size=2, max_new_tokens=5,
                    sampling=Sampling(temperature=1.0, seed=5))
    batch = pack_rollouts(comps, [0.0] * len(comps), row_len=32)
    mask = batch["labels"] != -100
    plain = trainer_logprobs(_state(), batch)  # the same base weights (seed 4), no adapters: an independent path
    assert float((reference_logprobs(state, batch) - plain).abs()[mask].max()) <= 1e-6
    kw = dict(prompt_texts=["a", "b", "c"], answers=[None] * 3, detokenize=lambda ids: " ".join(map(str, ids)),
              rewards=["tests.test_rl:user_reward"], group_size=3, max_new_tokens=5, row_len=32,
              loss=PolicyLossConfig(kl_coef=0.1))
    new, d1 = rl_iteration(state, PROMPTS, sampling=Sampling(temperature=1.0, seed=3), **kw)
    assert d1["mismatch_max"] <= MISMATCH_TOL and d1["kl"] == pytest.approx(0.0, abs=1e-6)
    _, d2 = rl_iteration(new, PROMPTS, sampling=Sampling(temperature=1.0, seed=4), **kw)
    assert d2["mismatch_max"] <= MISMATCH_TOL and d2["kl"] > 1e-9


def test_a_kl_term_without_a_reference_is_refused_for_a_full_fine_tune():
    from q38.train.core.policy import PolicyLossConfig

    with pytest.raises(ConfigError, match="reference parameters"):
        rl_iteration(_state(), PROMPTS, prompt_texts=["a", "b", "c"], answers=[None] * 3, detokenize=str,
                     rewards=["tests.test_rl:user_reward"], group_size=2, max_new_tokens=2, row_len=32,
                     sampling=Sampling(temperature=1.0), loss=PolicyLossConfig(kl_coef=0.1))


def _encode(text):
    return [(ord(ch) * 7) % CFG.vocab_size for ch in text]


def test_prompts_file_and_a_loop_that_resumes_exactly(tmp_path):
    """Two iterations in one go equal one, a stop, and one more from the returned state (iteration cursor and
    sampling seed follow from the iteration index)."""
    from q38.errors import DataError
    from q38.train.run.rl import load_prompts, rl_loop

    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "1+2=", "answer": 3}\n\n{"prompt": "4+4=", "answer": "8"}\n{"prompt": "9-3="}\n')
    recs = load_prompts(f)
    assert [r.answer for r in recs] == ["3", "8", None]
    with pytest.raises(DataError, match="line 4 has no `answer`") as e:
        load_prompts(f, rewards=["numeric_answer"])
    assert "\n" not in str(e.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"text": "y"}\n')
    with pytest.raises(DataError, match="line 2"):
        load_prompts(bad)
    kw = dict(encode=_encode, detokenize=lambda ids: " ".join(map(str, ids)),
              rewards=["tests.test_rl:user_reward"], prompts_per_iteration=2, group_size=2, max_new_tokens=4,
              sampling=Sampling(temperature=1.0, seed=9), row_len=32)
    both = list(rl_loop(_state(), recs, iterations=2, **kw))
    first = list(rl_loop(_state(), recs, iterations=1, **kw))
    (state1, m1, nxt), = first
    (state2, m2, _), = rl_loop(state1, recs, iterations=1, start_iteration=nxt, **kw)
    assert [m["iteration"] for _, m, _ in both] == [0, 1] and m1["iteration"] == 0 and m2["iteration"] == 1
    assert m2["reward_mean"] == both[1][1]["reward_mean"] and m2["loss"] == both[1][1]["loss"]
    assert torch.equal(state2.params.embed, both[1][0].params.embed) and int(state2.step) == 2
    # the same through a checkpoint on disk, loaded into a state of other weights
    from q38.pytree import named_leaves
    from q38.train.run.rl import load_rl_checkpoint, save_rl_checkpoint

    path = save_rl_checkpoint(tmp_path / "ck", state1, nxt)
    loaded, it = load_rl_checkpoint(path, _state(seed=9))
    assert it == 1
    (state3, m3, _), = rl_loop(loaded, recs, iterations=1, start_iteration=it, **kw)
    assert m3["loss"] == both[1][1]["loss"] and m3["reward_mean"] == both[1][1]["reward_mean"]
    for (n, a), (_, b) in zip(named_leaves(state3), named_leaves(both[1][0])):
        assert torch.equal(a, b), n


def test_streamed_weights_load_into_transformers_and_give_q38s_logits():
    """After one LoRA RL step (adapters non-zero), ``hf_weights`` of the merged policy, loaded into transformers'
    model by name (strict: every key, nothing extra), gives q38's logits."""
    pytest.importorskip("transformers")
    from q38.hf import hf_weights
    from q38.hf_config import hf_config_dict
    from q38.model import forward, head_weight
    from q38.train.run.rl import policy_params
    from tests.test_hf_parity import LOGIT_TOL, _hf_classes

    state, _ = rl_iteration(_lora_state(), PROMPTS, prompt_texts=["a", "b", "c"], answers=[None] * 3,
                            detokenize=lambda ids: " ".join(map(str, ids)), rewards=["tests.test_rl:user_reward"],
                            group_size=2, max_new_tokens=4, sampling=Sampling(temperature=1.0, seed=1), row_len=32)
    from q38.pytree import named_leaves

    assert any(float(x.abs().max()) > 0 for n, x in named_leaves(state.params) if n.endswith(".lora_b"))
    params = policy_params(state)
    config_cls, model_cls = _hf_classes(CFG)
    d = {k: v for k, v in hf_config_dict(CFG).items() if k not in ("model_type", "architectures", "q38_model_type")}
    hf = model_cls(config_cls(**d)).eval()
    pairs = list(hf_weights(CFG, params))
    assert len({n for n, _ in pairs}) == len(pairs)
    missing, unexpected = hf.load_state_dict(dict(pairs), strict=False)
    assert not unexpected and not [k for k in missing if not k.startswith("mtp.")]
    ids = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = forward(params, ids, CFG).hidden @ head_weight(params).T
        got = hf(input_ids=ids).logits
    assert float((got - want).abs().max()) <= LOGIT_TOL



def test_a_rollout_past_its_memory_is_priced_and_refused_up_front():
    """The price bounds the cache a decode of that length really holds (summed here from the cache's tensors), and
    a budget below it is one line before any step."""
    from q38.decode import decode_step, empty_cache
    from q38.rollout import rollout_bytes

    state = _state()
    price = rollout_bytes(CFG, PROMPTS, 2, 6, torch.float32)
    cache = empty_cache(CFG, 6, dtype=torch.float32)
    for _ in range(max(len(p) for p in PROMPTS) + 6):
        _, cache = decode_step(state.params, cache, torch.zeros(6, dtype=torch.long), CFG)
    held = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(cache))
    assert held <= price <= held + 6 * (2 * 4 * CFG.vocab_size + 64)
    with pytest.raises(ConfigError, match="more than the") as e:
        rollout(state.params, CFG, PROMPTS, group_size=2, max_new_tokens=6, sampling=Sampling(temperature=1.0),
                max_bytes=price - 1)
    assert "\n" not in str(e.value) and "prompts per iteration" in str(e.value)
    assert len(rollout(state.params, CFG, PROMPTS, group_size=2, max_new_tokens=6,
                       sampling=Sampling(temperature=1.0), max_bytes=price)) == 6


def test_several_updates_per_rollout_batch_move_the_ratio_and_print_a_progress_line():
    from q38.train.core.policy import PolicyLossConfig
    from q38.train.run.rl import progress_line

    kw = dict(prompt_texts=["a", "b", "c"], answers=[None] * 3, detokenize=lambda ids: " ".join(map(str, ids)),
              rewards=["tests.test_rl:user_reward"], group_size=3, max_new_tokens=5, row_len=32,
              sampling=Sampling(temperature=1.0, seed=3), loss=PolicyLossConfig(clip_low=0.01, clip_high=0.01))
    s = _state()
    one, d1 = rl_iteration(s, PROMPTS, **kw)
    three, d3 = rl_iteration(_state(), PROMPTS, updates=3, **kw)
    assert int(one.step) == 1 and int(three.step) == 3
    assert d1["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and d1["clip_frac"] == 0
    assert abs(d3["ratio_mean"] - 1.0) > 1e-4 and d3["clip_frac"] > 0 and d3["logprob_diff"] > 1e-4
    # the mismatch is the first update's (the rollout's weights), not the third's (which measures learning)
    assert d3["mismatch_mean"] == d1["logprob_diff"] and d3["mismatch_max"] == d1["mismatch_max"]
    assert d3["mismatch_mean"] <= MISMATCH_TOL < d3["logprob_diff"]
    line = progress_line(d3)
    assert "\n" not in line and "reward" in line and "kl" in line
    assert f"mismatch max {d3['mismatch_max']:.2e} mean {d3['mismatch_mean']:.2e}" in line
    with pytest.raises(ConfigError, match="rl.updates"):
        rl_iteration(_state(), PROMPTS, updates=0, **kw)


def test_inverse_cdf_draws_equal_hand_values():
    """``sample_at``: the first token whose cumulative probability passes u · total, never a token top-k or top-p
    removed; probabilities here 0.5, 0.3, 0.2 (logits log p, temperature 1)."""
    from q38.decode import sample_at

    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(5, 3)
    u = torch.tensor([0.0, 0.49, 0.51, 0.81, 0.999999], dtype=torch.float64)
    assert sample_at(logits, Sampling(temperature=1.0), u).tolist() == [0, 0, 1, 2, 2]
    assert sample_at(logits, Sampling(temperature=1.0, top_k=2), u).tolist() == [0, 0, 0, 1, 1]  # 0.625, 0.375
    assert sample_at(logits, Sampling(temperature=0.0), u).tolist() == [0] * 5
