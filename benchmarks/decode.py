"""Decoding on CPU, side by side in one run on the same checkpoint: a long prompt through ``prefill`` (one pass of
the sequence form) vs ``feed`` (one decode step per token), and greedy decoding with ``--speculative K`` MTP drafts
vs plain greedy decoding (tokens/s, the mean accepted length, and whether the tokens are the same).

    python benchmarks/decode.py [--source RUN_DIR | --train-steps 200] [--prompt-len 512] [--new-tokens 64]
                                [--ks 1,2,3] [--batch 1] [--repeats 3] [--threads 1]

Without ``--source`` it first trains the embedded default run (the tiny model, one MTP depth, on the shipped corpus)
for ``--train-steps`` steps into a temporary directory, so that the MTP head has learnt something: a random head is
accepted about once per vocabulary size. The prompts are text of the shipped corpus (byte tokenizer). Each
measurement is the median of ``--repeats`` runs, interleaved (one of each form in turn); printed as wall seconds
and CPU seconds of the process (``time.process_time``: the fair measure on a shared machine), each with its ratio.
Never asserted in tests.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from q38.decode import empty_cache, feed, generate, left_aligned, prefill  # noqa: E402
from q38.speculative import speculative_generate  # noqa: E402


def load(source: str):
    """The checkpoint's parameters as decoding takes them, its model config and router bias."""
    import attrs

    from q38.train.run.generate import inference_params
    from q38.train.run.inference import load_state, open_source
    from q38.train.run.launch import WorldInfo, check_run

    src = open_source(source, {"layout": "single"})
    world = WorldInfo.from_env()
    state = load_state(attrs.evolve(src), world, "cpu", check_run(src.cfg, 1, "cpu"), None)
    return inference_params(state), src.cfg.model, state.router_bias


def corpus_text(n_bytes: int, skip: int = 0) -> list[int]:
    """``n_bytes`` bytes of the shipped corpus' text (its records joined), from byte ``skip`` on."""
    lines = (ROOT / "q38/train/data/corpus/tiny.jsonl").read_text().splitlines()
    text = "\n".join(json.loads(line)["text"] for line in lines if line.strip()).encode()
    return list(text[skip:skip + n_bytes])


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", help="a q38 run directory or checkpoint with MTP heads (default: train one)")
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    source = a.source
    if source is None:
        source = tempfile.mkdtemp(prefix="q38_decode_bench_")
        print(f"training the default tiny run for {a.train_steps} steps into {source} ...", flush=True)
        subprocess.run([sys.executable, "-m", "q38.cli", "train", "--set", f"run.steps={a.train_steps}",
                        "--set", f"run.out_dir={source}", "--set", "run.eval_every=0", "--set", "run.log_every=50",
                        "--set", f"train.total_steps={a.train_steps}"],
                       check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL)
    params, cfg, bias = load(source)
    print(f"model: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers {cfg.layer_types}, vocab "
          f"{cfg.vocab_size}, MTP depths {cfg.mtp_num_layers}; torch threads {a.threads}")

    # ---- prefill vs token by token ----
    prompt = [corpus_text(a.prompt_len, skip=1000 * r) for r in range(a.batch)]
    rows = {"prefill": [], "feed": []}
    with torch.no_grad():
        for _ in range(a.repeats):
            (pl, _, _), w, c = timed(lambda: prefill(params, cfg, prompt, router_bias=bias))
            rows["prefill"].append((w, c))
            tokens, active = left_aligned(prompt)
            (fl, _), w, c = timed(lambda: feed(params, empty_cache(cfg, a.batch), tokens, cfg, active=active,
                                              router_bias=bias))
            rows["feed"].append((w, c))
    diff = (pl - fl[:, -1]).abs().max().item()
    pw, pc = (statistics.median(x[i] for x in rows["prefill"]) for i in (0, 1))
    fw, fc = (statistics.median(x[i] for x in rows["feed"]) for i in (0, 1))
    print(f"\nprompt of {a.prompt_len} tokens x {a.batch} rows (max |Δ last logits| {diff:.1e})")
    print(f"{'':<26}{'wall s':>9}{'cpu s':>9}{'tok/s (wall)':>14}")
    print(f"{'token by token (feed)':<26}{fw:>9.3f}{fc:>9.3f}{a.prompt_len * a.batch / fw:>14.0f}")
    print(f"{'prefill (one pass)':<26}{pw:>9.3f}{pc:>9.3f}{a.prompt_len * a.batch / pw:>14.0f}")
    print(f"prefill speed-up: {fw / pw:.1f}x wall, {fc / pc:.1f}x cpu")

    # ---- speculative vs plain greedy ----
    ks = [int(k) for k in a.ks.split(",")]
    prompts = [corpus_text(64, skip=5000 + 777 * r) for r in range(a.batch)]
    forms = ["plain"] + [f"k={k}" for k in ks]
    times: dict = {f: [] for f in forms}
    outs: dict = {}
    stats: dict = {}
    for _ in range(a.repeats):
        for f in forms:
            if f == "plain":
                o, w, c = timed(lambda: generate(params, cfg, prompts, max_new_tokens=a.new_tokens,
                                                 router_bias=bias))
            else:
                (o, st), w, c = timed(lambda: speculative_generate(params, cfg, prompts, k=int(f[2:]),
                                                                   max_new_tokens=a.new_tokens, router_bias=bias))
                stats[f] = st
            outs[f] = o
            times[f].append((w, c))
    n = sum(len(o) for o in outs["plain"])
    print(f"\ngreedy decoding: {a.new_tokens} new tokens x {a.batch} rows after a 64-token prompt")
    print(f"{'':<8}{'wall s':>9}{'cpu s':>9}{'tok/s':>9}{'x plain':>9}{'accepted len':>14}{'same tokens':>13}")
    bw = statistics.median(x[0] for x in times["plain"])
    for f in forms:
        w, c = (statistics.median(x[i] for x in times[f]) for i in (0, 1))
        acc = f"{stats[f].mean_accepted_length:.3f}" if f in stats else "1"
        print(f"{f:<8}{w:>9.3f}{c:>9.3f}{n / w:>9.1f}{bw / w:>9.2f}{acc:>14}{str(outs[f] == outs['plain']):>13}")


if __name__ == "__main__":
    main()
