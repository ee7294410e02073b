"""GRPO on a toy task raises the held-out reward (docs/rl.md#what-the-loop-does-on-a-toy-task; a sanity check of the
loop, not the arithmetic benchmark the issue asks for).

Model: a small random-init config unlike the tiny preset (no SFT). Task: prompts are random token strings; the
reward of a completion is the fraction of its tokens that equal ``TARGET``. Each iteration samples ``G`` completions
of ``P`` training prompts, normalises rewards per group and takes one AdamW step (``rl_iteration``). Held-out:
``P`` other prompts, ``G`` samples each at a fixed seed, before and after. Prints one table row per (mode, seed).

    python benchmarks/rl_reward.py --iterations 60 --group 8 --seeds 0 1 2
"""

import argparse
import time

import torch

from q38.decode import Sampling
from q38.lora import PeftConfig, add_adapters
from q38.model import init_params
from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)
from q38.rollout import rollout
from q38.train.core.policy import PolicyLossConfig
from q38.train.core.state import state_from_params
from q38.train.core.step_config import TrainConfig
from q38.train.run.rl import policy_params, rl_iteration

TARGET = 7
CFG = ModelConfig(
    model_type="qwen3_8_moe", vocab_size=96, hidden_size=48, num_hidden_layers=2,
    layer_types=("linear_attention", "full_attention"),
    num_attention_heads=8, num_key_value_heads=4, head_dim=12, rope_theta=10_000.0, partial_rotary_factor=0.5,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=6,
    num_experts=12, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=20,
    mtp_num_layers=0, initializer_range=0.1, max_position_embeddings=4096,
)


def target_reward(prompt, completion, answer):
    toks = completion.split()
    return sum(t == str(TARGET) for t in toks) / max(len(toks), 1)


def _prompts(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, CFG.vocab_size, (5,), generator=g).tolist() for _ in range(n)]


def held_out_reward(state, prompts, group_size, max_new):
    comps = rollout(policy_params(state), CFG, prompts, group_size=group_size, max_new_tokens=max_new,
                    sampling=Sampling(temperature=1.0, seed=12345))
    return sum(sum(t == TARGET for t in c.tokens) / len(c.tokens) for c in comps) / len(comps)


def run(mode, seed, iterations, P, G, max_new):
    lr = 3e-3 if mode == "full" else 2e-2
    tc = TrainConfig(lr=lr, warmup_steps=1, grad_clip=1.0)
    params = init_params(CFG, seed=seed)
    peft = None
    if mode == "lora":
        peft = PeftConfig(rank=8, alpha=16)
        params = add_adapters(params, peft, seed=seed)
    state = state_from_params(params, CFG, tc, peft=peft)
    held = _prompts(1000 + seed, P)
    before = held_out_reward(state, held, G, max_new)
    t0 = time.perf_counter()
    train_means = []
    for it in range(iterations):
        state, m = rl_iteration(state, _prompts(seed * 100_000 + it, P), prompt_texts=[""] * P, answers=[None] * P,
                                detokenize=lambda ids: " ".join(map(str, ids)),
                                rewards=["benchmarks.rl_reward:target_reward"], group_size=G, max_new_tokens=max_new,
                                sampling=Sampling(temperature=1.0, seed=seed * 1000 + it), row_len=64,
                                loss=PolicyLossConfig(clip_low=0.2, clip_high=0.28))
        train_means.append(m["reward_mean"])
    after = held_out_reward(state, held, G, max_new)
    k = max(1, iterations // 5)
    print(f"| {mode} | {seed} | {iterations} | {before:.3f} | {after:.3f} | {sum(train_means[:k]) / k:.3f} | "
          f"{sum(train_means[-k:]) / k:.3f} | {time.perf_counter() - t0:.0f} s |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--modes", nargs="+", default=["full", "lora"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print("| mode | seed | iterations | held-out reward before | after | train reward, first fifth | last fifth | "
          "time |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in a.modes:
        for seed in a.seeds:
            run(mode, seed, a.iterations, a.prompts, a.group, a.max_new)


if __name__ == "__main__":
    main()
