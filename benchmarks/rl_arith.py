"""GRPO after a brief SFT on arithmetic chat data raises the held-out reward (issue 51's must-show; docs/rl.md).

1. Data, generated here deterministically from ``--data-seed``: every question ``a + b`` and ``a - b`` (``a`` in
   0..``--max-a``, ``b`` in 0..``--max-b``) as a chat turn ``"37 + 8 ="`` answered ``"45"``, shuffled and cut into
   three disjoint sets: SFT conversations (``sft.jsonl``, the chat JSONL ``q38 train`` reads), RL prompts and
   held-out prompts with their ``answer`` (``rl_prompts.jsonl``, ``held_out.jsonl``: the prompts files ``q38 rl``
   reads, written for reuse).
2. SFT: ``q38 train`` (its API, ``q38.train.run.trainer.train``) for ``--sft-steps`` steps from a random init of
   ``benchmarks/models/arith.yaml`` (every dimension unlike the tiny preset's; attention, GDN, MoE), byte tokenizer,
   assistant turns trained. With ``--work DIR`` the data and the SFT run stay in DIR, and a second call finds the
   finished SFT run there (``q38 train`` resumes it: nothing left to train) and goes straight to GRPO.
3. GRPO from that checkpoint, full fine-tune and LoRA, ``--seeds`` each: ``rl_loop`` for ``--iterations``
   iterations of ``--prompts-per-iteration`` RL prompts × ``--group`` samples at temperature 1, reward
   ``numeric_answer`` (1 when the completion's last number is the answer, else 0), one AdamW step an iteration
   (constant lr, no weight decay), token-level normalisation, clip 0.2 / 0.28, no KL.
4. Held-out, before and after each GRPO run, on the same prompts: the mean reward of ``--group`` samples a prompt
   at temperature 1 with one fixed sampling seed (``--eval-seed``), and the greedy exact-answer rate. Train reward:
   the mean over the first and the last fifth of the iterations.

Prints the SFT'd model's held-out numbers, one table row per (mode, seed), then each run's train reward by
iteration. One process, ``--threads`` intra-op threads.

    python benchmarks/rl_arith.py --work /tmp/rl_arith   # the table of docs/rl.md and benchmarks/README.md
    python benchmarks/rl_arith.py --quick                # a smoke run (a few steps of each; numbers meaningless)
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "benchmarks" / "models" / "arith.yaml"
REWARDS = ("numeric_answer",)


# ---- data ------------------------------------------------------------------------------------------------------

def problems(max_a: int, max_b: int, seed: int) -> list[tuple[str, str]]:
    """Every ``(question, answer)`` of ``a + b`` and ``a - b``, ``a`` in 0..max_a, ``b`` in 0..max_b, shuffled by
    seed."""
    out = [(f"{a} {op} {b} =", str(a + b if op == "+" else a - b))
           for a in range(max_a + 1) for b in range(max_b + 1) for op in "+-"]
    random.Random(seed).shuffle(out)
    return out


def split(items, n_rl: int, n_held: int):
    """Three disjoint sets: (SFT, RL prompts, held-out prompts), the last two of the sizes given."""
    if n_rl + n_held >= len(items):
        raise SystemExit(f"rl_arith: {n_rl} RL + {n_held} held-out prompts leave no SFT data of {len(items)}")
    return items[n_rl + n_held:], items[:n_rl], items[n_rl:n_rl + n_held]


def write_jsonl(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def sft_record(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


# ---- SFT ---------------------------------------------------------------------------------------------------------

def sft(data: Path, out: Path, steps: int, batch: int, lr: float, seed: int) -> Path:
    """``q38 train`` on the SFT conversations; returns its last checkpoint."""
    from q38.train.io.checkpoint import latest_checkpoint
    from q38.train.run.run_config import RunConfig
    from q38.train.run.trainer import train

    cfg = RunConfig.from_dict({
        "model": str(MODEL), "layout": "single",
        "data": {"path": str(data), "tokenizer": "byte", "seq_len": 256, "batch_size": batch},
        "train": {"lr": lr, "warmup_steps": min(20, steps // 5), "total_steps": steps, "schedule": "cosine",
                  "weight_decay": 0.01, "loss_chunk_size": 256},
        "run": {"steps": steps, "seed": seed, "out_dir": str(out), "log_every": max(1, steps // 4),
                "save_every": 0, "eval_every": 0, "progress": False},
    }, source="rl_arith")
    train(cfg)
    return latest_checkpoint(out / "checkpoints")


# ---- evaluation --------------------------------------------------------------------------------------------------

class Chat:
    """The byte tokenizer and what the loop needs from it: a question as a chat prompt (assistant turn opened), a
    completion's text (special tokens left out), the stop ids."""

    def __init__(self):
        from q38.train.data.chat import render_chat_prompt
        from q38.train.data.tokenizer import load_tokenizer, stop_token_ids
        from q38.train.run.generate import answer_text, special_ids

        self.tok = load_tokenizer("byte")
        self._render, self._answer, self._skip = render_chat_prompt, answer_text, special_ids(self.tok)
        self.stop_ids = list(stop_token_ids(self.tok))

    def encode(self, question: str) -> list[int]:
        return list(self._render([{"role": "user", "content": question}], self.tok, add_generation_prompt=True))

    def text(self, ids) -> str:
        return self._answer(self.tok, ids, skip=self._skip)[0]


def held_out(state, chat: Chat, items, group: int, max_new: int, seed: int) -> dict:
    """Mean reward of ``group`` samples a prompt at temperature 1 (sampling seed ``seed``), their exact-answer rate
    (the same number while the reward is ``numeric_answer`` alone) and the greedy exact-answer rate, on ``items``."""
    from q38.decode import Sampling, generate
    from q38.rollout import rollout
    from q38.train.run.rl import numeric_answer, policy_params, score

    params, cfg = policy_params(state), state.model_config
    prompts, qs, answers = [chat.encode(q) for q, _ in items], [q for q, _ in items], [a for _, a in items]
    comps = rollout(params, cfg, prompts, group_size=group, max_new_tokens=max_new,
                    sampling=Sampling(temperature=1.0, seed=seed), stop_ids=chat.stop_ids,
                    router_bias=state.router_bias)
    rew = score(REWARDS, qs, answers, comps, [chat.text(c.tokens) for c in comps])
    greedy = generate(params, cfg, prompts, max_new_tokens=max_new, sampling=Sampling(temperature=0.0),
                      stop_ids=chat.stop_ids, router_bias=state.router_bias)
    exact = [numeric_answer(q, chat.text(o), a) for q, a, o in zip(qs, answers, greedy)]
    sampled_exact = [numeric_answer(qs[c.prompt_index], chat.text(c.tokens), answers[c.prompt_index]) for c in comps]
    return {"reward": sum(rew) / len(rew), "exact": sum(exact) / len(exact),
            "sampled_exact": sum(sampled_exact) / len(sampled_exact)}


# ---- GRPO --------------------------------------------------------------------------------------------------------

def rl_state(ck: Path, mode: str, lr: float, iterations: int, seed: int, rank: int):
    """A fresh train state (step 0, zero moments) from the SFT checkpoint's weights: all of them trained
    (``full``) or LoRA adapters of ``rank`` beside the frozen SFT weights (``lora``)."""
    from q38.hf_config import load_model_config
    from q38.lora import PeftConfig, add_adapters
    from q38.train.core.state import init_state, state_from_params
    from q38.train.core.step_config import TrainConfig
    from q38.train.io.checkpoint import load_checkpoint

    mc = load_model_config(str(MODEL))
    sft_state, _ = load_checkpoint(ck, init_state(mc, TrainConfig(), seed=0))
    tc = TrainConfig(lr=lr, warmup_steps=0, total_steps=iterations, schedule="constant", weight_decay=0.0,
                     grad_clip=1.0, loss_chunk_size=256)
    if mode == "full":
        return state_from_params(sft_state.params, mc, tc)
    peft = PeftConfig(rank=rank, alpha=2 * rank)
    return state_from_params(add_adapters(sft_state.params, peft, seed=seed), mc, tc, peft=peft)


def grpo(state, chat: Chat, items, *, iterations: int, prompts: int, group: int, max_new: int, seed: int,
         verbose: bool = False):
    """``rl_loop`` over the RL prompts; returns (state, train reward means by iteration)."""
    from q38.decode import Sampling
    from q38.train.core.policy import PolicyLossConfig
    from q38.train.run.rl import PromptRecord, progress_line, rl_loop

    records = [PromptRecord(q, a) for q, a in items]
    row_len = max(len(chat.encode(q)) for q, _ in items) + max_new
    means, new = [], state
    # rows of 4 of the longest prompt + completion: a few completions packed a row
    for new, m, _ in rl_loop(state, records, encode=chat.encode, detokenize=chat.text, rewards=list(REWARDS),
                             iterations=iterations, prompts_per_iteration=prompts, group_size=group,
                             max_new_tokens=max_new, sampling=Sampling(temperature=1.0, seed=seed * 100_003),
                             row_len=row_len * 4, stop_ids=chat.stop_ids,
                             loss=PolicyLossConfig(clip_low=0.2, clip_high=0.28, norm="token")):
        means.append(m["reward_mean"])
        if verbose:
            print(progress_line(m), flush=True)
    return new, means


# ---- main --------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, numbers meaningless")
    ap.add_argument("--max-a", type=int, default=99, help="the first operand: 0..max-a")
    ap.add_argument("--max-b", type=int, default=9, help="the second operand: 0..max-b")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--rl-prompts", type=int, default=512)
    ap.add_argument("--held-out", type=int, default=256)
    ap.add_argument("--sft-steps", type=int, default=500)
    ap.add_argument("--sft-batch", type=int, default=8, help="rows of 256 tokens a step")
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--iterations", type=int, default=15)
    ap.add_argument("--prompts-per-iteration", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--lr-full", type=float, default=1e-4)
    ap.add_argument("--lr-lora", type=float, default=2e-4)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    ap.add_argument("--eval-seed", type=int, default=12345, help="the held-out sampling seed (before and after)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--verbose", action="store_true", help="print rl_loop's progress line every iteration")
    ap.add_argument("--work", help="keep the data and the SFT run here (default: a temporary directory)")
    a = ap.parse_args(argv)
    if a.quick:
        a.max_a, a.max_b, a.rl_prompts, a.held_out, a.sft_steps, a.iterations = 9, 9, 16, 8, 4, 2
        a.prompts_per_iteration, a.group, a.seeds = 2, 2, a.seeds[:1]
    torch.set_num_threads(a.threads)
    sft_items, rl_items, held_items = split(problems(a.max_a, a.max_b, a.data_seed), a.rl_prompts, a.held_out)
    with tempfile.TemporaryDirectory(prefix="q38_rl_arith_") as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = write_jsonl(work / "sft.jsonl", [sft_record(q, ans) for q, ans in sft_items])
        write_jsonl(work / "rl_prompts.jsonl", [{"prompt": q, "answer": ans} for q, ans in rl_items])
        write_jsonl(work / "held_out.jsonl", [{"prompt": q, "answer": ans} for q, ans in held_items])
        from q38.train.io.checkpoint import latest_checkpoint

        had = latest_checkpoint(work / "sft" / "checkpoints") if (work / "sft" / "checkpoints").is_dir() else None
        t0 = time.perf_counter()
        ck = sft(data, work / "sft", a.sft_steps, a.sft_batch, a.sft_lr, a.data_seed)
        t_sft = time.perf_counter() - t0
        how = f"{t_sft:.0f} s" if had is None else f"found in {work} (from {had.name}), {t_sft:.0f} s"
        chat = Chat()
        base = held_out(rl_state(ck, "full", a.lr_full, a.iterations, 0, a.lora_rank), chat, held_items, a.group,
                        a.max_new, a.eval_seed)
        print(f"SFT: {len(sft_items)} conversations, {a.sft_steps} steps of {a.sft_batch} x 256 tokens, "
              f"{how}; held-out ({len(held_items)} prompts): reward {base['reward']:.3f}, "
              f"greedy exact {base['exact']:.3f}, sampled exact {base['sampled_exact']:.3f}", flush=True)
        curves = []
        print("| mode | seed | iterations | held-out reward before | after | greedy exact before | after | "
              "train reward, first fifth | last fifth | time |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for mode in a.modes:
            for seed in a.seeds:
                lr = a.lr_full if mode == "full" else a.lr_lora
                state = rl_state(ck, mode, lr, a.iterations, seed, a.lora_rank)
                t0 = time.perf_counter()
                state, means = grpo(state, chat, rl_items, iterations=a.iterations, prompts=a.prompts_per_iteration,
                                    group=a.group, max_new=a.max_new, seed=seed, verbose=a.verbose)
                dt = time.perf_counter() - t0
                after = held_out(state, chat, held_items, a.group, a.max_new, a.eval_seed)
                k = max(1, a.iterations // 5)
                print(f"| {mode} | {seed} | {a.iterations} | {base['reward']:.3f} | {after['reward']:.3f} | "
                      f"{base['exact']:.3f} | {after['exact']:.3f} | {sum(means[:k]) / k:.3f} | "
                      f"{sum(means[-k:]) / k:.3f} | {dt:.0f} s |", flush=True)
                curves.append(f"{mode} seed {seed}: " + " ".join(f"{m:.3f}" for m in means))
        print("train reward by iteration:\n" + "\n".join(curves))
    return 0


if __name__ == "__main__":
    sys.exit(main())
