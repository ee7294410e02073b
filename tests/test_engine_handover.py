"""The hand-over loop of docs/rl.md#rollouts-in-an-external-engine, run with a stand-in engine (no vLLM or SGLang
installs on CPU): colocated, the engine wakes, takes ``hf_weights`` of the current policy through ``load_weights``
(every name and shape checked against the Hugging Face checkpoint index q38 writes for the model), and sleeps while
q38 trains; asynchronously, a rollout one step behind shows what the mismatch metric then measures (the policy's lag,
not numerics) and that the objective's ratio to ``old_logprobs`` sees it. On a model unlike tiny."""

import json

import pytest
import torch
from safetensors import safe_open

from q38.decode import Sampling
from q38.hf import INDEX_FILE, hf_weights, save_hf
from q38.rollout import rollout
from q38.train.core.policy import PolicyLossConfig, policy_terms
from q38.train.core.step import train_step
from q38.train.run.rl import pack_rollouts, policy_params, rl_iteration, trainer_logprobs
from tests.test_policy_loss import CFG
from tests.test_rl import MISMATCH_TOL, PROMPTS, _lora_state, _state

SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


class StandInEngine:
    """What the loop needs of a serving engine: ``sleep`` / ``wake_up`` (colocated: the engine's memory is free
    while q38 trains) and ``load_weights(pairs)`` (vLLM's and SGLang's form). It records what it loaded and checks
    each pair against the checkpoint index the engine was started from: a known name, the index's shape and dtype,
    and that one call brings every tensor."""

    def __init__(self, hf_dir):
        index = json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"]
        self.expected = {}
        for name, file in index.items():
            with safe_open(str(hf_dir / file), "pt") as f:
                t = f.get_slice(name)
                self.expected[name] = (tuple(t.get_shape()), t.get_dtype())
        self.awake, self.loaded, self.calls = True, {}, 0

    def sleep(self):
        self.awake = False

    def wake_up(self):
        self.awake = True

    def load_weights(self, weights):
        assert self.awake, "load_weights on a sleeping engine"
        seen = []
        for name, t in weights:
            assert name in self.expected, f"{name}: not in the checkpoint index"
            shape, dtype = self.expected[name]
            assert tuple(t.shape) == shape, f"{name}: shape {tuple(t.shape)}, index {shape}"
            assert SAFETENSORS_DTYPES[t.dtype] == dtype, f"{name}: {t.dtype}, index {dtype}"
            self.loaded[name] = t.clone()
            seen.append(name)
        assert sorted(seen) == sorted(self.expected) and len(seen) == len(set(seen)), "one call, every tensor once"
        self.calls += 1


def _engine(tmp_path, state, dtype):
    d = save_hf(tmp_path / "hf", CFG, policy_params(state), max_shard_bytes=1 << 16,
                dtypes=lambda q: dtype)  # several shards: the engine reads the index
    assert (d / INDEX_FILE).is_file()
    return StandInEngine(d)


def _iteration(state, seed):
    return rl_iteration(state, PROMPTS, prompt_texts=["a", "b", "c"], answers=[None] * 3,
                        detokenize=lambda ids: " ".join(map(str, ids)), rewards=["tests.test_rl:user_reward"],
                        group_size=2, max_new_tokens=4, sampling=Sampling(temperature=1.0, seed=seed), row_len=32)


def test_the_stand_in_engine_takes_a_merged_lora_policy(tmp_path):
    """One hand-over, no training: every pair of a LoRA policy's ``hf_weights`` matches the index's names, shapes and
    dtypes (fp32 here), and a pair the index does not hold is refused."""
    state = _lora_state()
    engine = _engine(tmp_path, state, torch.float32)
    engine.load_weights(hf_weights(CFG, policy_params(state), dtype=torch.float32))
    assert engine.calls == 1 and len(engine.loaded) == len(engine.expected)
    try:
        engine.load_weights([("model.layers.0.not_a_weight", torch.zeros(1))])
    except AssertionError as e:
        assert "not in the checkpoint index" in str(e)
    else:
        raise AssertionError("the stand-in engine took a name outside the index")


@pytest.mark.slow
def test_colocated_handover_loop_with_a_stand_in_engine(tmp_path):
    """Full fine-tune and LoRA (merged): two iterations of wake → load_weights → (rollout) → sleep → train; the
    engine's weights after each hand-over are the policy's, in the checkpoint's dtype."""
    for state in (_state(), _lora_state()):
        engine = _engine(tmp_path / str(state.peft is not None), state, torch.bfloat16)
        for i in range(2):
            engine.wake_up()
            engine.load_weights(hf_weights(CFG, policy_params(state), dtype=torch.bfloat16))
            for name, t in hf_weights(CFG, policy_params(state), dtype=torch.bfloat16):
                assert torch.equal(engine.loaded[name], t), name
            engine.sleep()  # here the engine would have generated the rollouts; q38's own decode stands in
            state, _ = _iteration(state, seed=i)
        assert engine.calls == 2


def test_a_one_step_lag_is_what_the_mismatch_then_measures():
    """Asynchronous: the rollout for update k comes from the weights of update k - 1. Its recorded log-probs equal
    the lagged policy's (≤ 1e-5) but not the trained one's: the mismatch measures the lag, and the ratio of the first
    update is not 1 (the importance correction of the clipped objective acts)."""
    lagged = _state()
    current, _ = _iteration(lagged, seed=0)
    comps = rollout(lagged.params, CFG, PROMPTS, group_size=2, max_new_tokens=4,
                    sampling=Sampling(temperature=1.0, seed=7))
    batch = pack_rollouts(comps, [(-1.0) ** i for i in range(len(comps))], row_len=32)
    mask = batch["labels"] != -100
    own = float((trainer_logprobs(lagged, batch) - batch["old_logprobs"]).abs()[mask].max())
    lag = float((trainer_logprobs(current, batch) - batch["old_logprobs"]).abs()[mask].max())
    assert own <= MISMATCH_TOL < 1e-3 < lag, (own, lag)
    _, m = train_step(current, batch, terms=policy_terms(CFG, current.train_config, PolicyLossConfig()))
    d = m.as_dict()
    assert abs(d["ratio_mean"] - 1.0) > 1e-4 and d["logprob_diff"] > 1e-4
