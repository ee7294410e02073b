"""``q38`` command line: ``train``, ``eval``, ``generate``, ``rl``, ``plan``, ``convert``, ``init-hf``, ``prepare-data``,
``kernels``.

Bad input ends with a one-line error naming the problem and the fix (exit code 2), never a traceback.
"""

import argparse
import os
import re
import sys
import traceback
from pathlib import Path

from q38.errors import reading

DEBUG_HELP = "  --debug (any command; or Q38_DEBUG=1): print the traceback of an error (for bug reports)"


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises (one-line error through ``main``) instead of printing usage and exiting; every
    subcommand's parser is one (all of q38's argument parsing lives in this module)."""

    def error(self, message):
        raise ValueError(f"{message} (see `{self.prog} --help`)")


def _int_at_least(lo: int, what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be {what}, got {v}")
        return v
    return parse


PLAN_DTYPES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")  # q38.parallel.plan.DTYPES' names


positive_int = _int_at_least(1, "a positive integer")  # argparse ``type=``: the error names the option
nonnegative_int = _int_at_least(0, "an integer >= 0")


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def check_file_args(*options: tuple[str, str | None, bool]) -> None:
    """``(option, value, always_a_path)``: each value that names a file (always, or when it looks like a path:
    a ``.yaml`` / ``.yml`` / ``.json`` suffix or a directory part) exists; else one line naming the option and file."""
    for option, value, always in options:
        if value is None:
            continue
        p = Path(value)
        if (always or p.suffix in (".yaml", ".yml", ".json") or len(p.parts) > 1) and not p.exists():
            raise FileNotFoundError(f"{option} {value}: file not found" + ("" if always else
                                                                          "; name a preset or an existing file"))


def _train(argv: list[str]) -> int:
    p = OneLineParser(prog="q38 train", description="Train from a YAML run config (default: specs/train/tiny.yaml). "
                "Resumes from the latest checkpoint in run.out_dir; SIGTERM / Ctrl-C saves a checkpoint and exits.")
    p.add_argument("config", nargs="?", help="run config YAML (default: the embedded tiny run)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set run.steps=50 (repeatable)")
    a = p.parse_args(argv)
    from q38.train.run.trainer import RunConfig, train

    cfg = RunConfig.from_yaml(a.config, _overrides(a.set))
    train(cfg)
    return 0


def _overrides(pairs: list[str]) -> dict:
    """``--set SECTION.KEY=VALUE`` pairs → overrides (values parsed as YAML)."""
    import yaml

    out = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise ValueError(f"--set expects SECTION.KEY=VALUE, got {kv!r}")
        try:
            out[k] = yaml.safe_load(v)
        except yaml.YAMLError:
            out[k] = v
    return out


SOURCE_HELP = ("a q38 run directory, its checkpoints directory or one checkpoint (full or LoRA; the newest that "
               "verifies), or a Hugging Face checkpoint directory")


def _eval(argv: list[str]) -> int:
    p = OneLineParser(prog="q38 eval", description="Evaluate a checkpoint on held-out data: the objective's terms "
                      "(loss, MTP depths, aux) and per-token statistics (targets, accuracy, perplexity). One process, "
                      "or every rank under torchrun (q38 launch ... eval) on the checkpoint's layout.")
    p.add_argument("source", help=SOURCE_HELP)
    p.add_argument("--data", required=True, help="held-out data: a JSONL file (text or chat records, as data.path "
                   "reads them), builtin:NAME, a prepared directory or a Megatron PREFIX; tokenized with the "
                   "source's data.tokenizer, data.seq_len and data.train_on")
    p.add_argument("--batch-size", type=positive_int, default=None, help="rows per data-parallel rank per eval "
                   "batch (default: data.eval_batch_size, else data.batch_size); the last batch is padded")
    p.add_argument("--max-batches", type=nonnegative_int, default=0, help="evaluate the first N global batches "
                   "only (default 0: every row)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a setting of the source's run config, e.g. --set data.seq_len=512, "
                   "--set layout=fsdp (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON record instead of the table")
    a = p.parse_args(argv)
    import json

    from q38.train.run.inference import evaluate

    check_file_args(("--data", a.data, not a.data.startswith("builtin:") and not Path(a.data + ".idx").exists()))
    rec = evaluate(a.source, a.data, batch_size=a.batch_size, max_batches=a.max_batches,
                   overrides=_overrides(a.set), progress=sys.stdout.isatty())
    if os.environ.get("RANK", "0") not in ("", "0"):
        return 0
    if a.json:
        print(json.dumps(rec))
        return 0
    at = f"step {rec['step']} of {rec['source']}" if rec["step"] is not None else rec["source"]
    print(f"q38 eval: {at} on {rec['data']} ({rec['eval_batches']} batches of {rec['eval_batch_size']} rows per "
          "rank)")
    for k, v in rec.items():
        if k.startswith("eval_") and k not in ("eval_batches", "eval_batch_size"):
            print(f"  {k[5:]:<10} {v:.6g}" if isinstance(v, float) else f"  {k[5:]:<10} {v}")
    return 0


class _InOrder(argparse.Action):
    """Appends ``(kind, value)`` to one shared list, so prompts of different options keep their command-line order."""

    def __init__(self, *args, kind: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kind = kind

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items = list(getattr(namespace, self.dest) or [])
        items.append((self.kind, values))
        setattr(namespace, self.dest, items)


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= v < 1 << 63:
        raise argparse.ArgumentTypeError(f"a seed is an integer from 0 to 2**63 - 1, got {v}")
    return v


def _generate(argv: list[str]) -> int:
    p = OneLineParser(prog="q38 generate", description="Sample from a checkpoint: greedy (the default) or with a "
                      "temperature, top-k and top-p, from text prompts and chat messages (rendered by the "
                      "checkpoint's chat template) in any mix, run as one batch. One process.")
    p.add_argument("source", help=SOURCE_HELP)
    p.add_argument("--prompt", dest="inputs", action=_InOrder, kind="text", metavar="TEXT",
                   help="a text prompt, continued as it is (repeatable)")
    p.add_argument("--chat", dest="inputs", action=_InOrder, kind="chat", metavar="MESSAGE",
                   help="a user message, rendered with the tokenizer's chat template (ChatML without one) and an "
                   "assistant turn opened (repeatable)")
    p.add_argument("--prompts", dest="inputs", action=_InOrder, kind="file", metavar="FILE",
                   help="a JSONL file: {\"text\": ...} prompts and {\"messages\": [...]} chats (rendered with the "
                   "chat template, an assistant turn opened); repeatable, and mixed with --prompt and --chat in the "
                   "order given")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="at most this many tokens per answer "
                   "(default 64); a prompt and its answer must fit the model's max_position_embeddings")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sample from "
                   "softmax(logits / temperature)")
    p.add_argument("--top-k", type=nonnegative_int, default=0, help="sample from the k most likely tokens only "
                   "(default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of most likely tokens "
                   "whose probability reaches this (default 1: all); applied after --top-k")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the draws (sampling only)")
    p.add_argument("--system", default=None, help="--chat: a system message before each user message")
    p.add_argument("--stop", action="append", default=[], metavar="STRING", help="end an answer when its text "
                   "contains STRING, and cut the answer before it (repeatable)")
    p.add_argument("--keep-special-tokens", action="store_true", help="show special tokens (end of turn, end of "
                   "text, ...) in the answers' text (default: left out, as transformers' skip_special_tokens)")
    p.add_argument("--no-eos-stop", action="store_true", help="keep sampling after the end-of-sequence token")
    p.add_argument("--speculative", type=int, default=None, metavar="K", help="draft K tokens per main-model pass with "
                   "the checkpoint's MTP heads and verify them in one pass (greedy: the same tokens as plain greedy "
                   "decoding; sampled: the speculative-sampling rule, distributed as plain sampling); reports the "
                   "mean accepted length")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a setting of the source's run config, e.g. --set data.tokenizer=DIR")
    p.add_argument("--json", action="store_true", help="print one JSON record per prompt (its index and origin, the "
                   "prompt, prompt and output ids, the answer's text, why it stopped) instead of the text")
    a = p.parse_args(argv)
    if not a.inputs:
        raise ValueError("give at least one prompt: --prompt TEXT, --chat MESSAGE or --prompts FILE (see `q38 "
                         "generate --help`)")
    import json

    from q38.train.run.generate import generate_from

    check_file_args(*(("--prompts", v, True) for kind, v in a.inputs if kind == "file"))
    recs = generate_from(a.source, inputs=a.inputs, system=a.system, max_new_tokens=a.max_new_tokens,
                         temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                         stop_at_eos=not a.no_eos_stop, stop=a.stop, skip_special_tokens=not a.keep_special_tokens,
                         overrides=_overrides(a.set), speculative=a.speculative)
    for r in recs:
        print(json.dumps(r) if a.json else _labelled(r))
    if a.speculative is not None:
        passes = sum(r["speculative"]["passes"] for r in recs)
        tokens = sum(r["speculative"]["tokens"] for r in recs)
        print(f"q38 generate: speculative k={a.speculative}: {tokens} tokens from {passes} verification passes, "
              f"mean accepted length {tokens / max(passes, 1):.3f}", file=sys.stderr)
    return 0


def _rl(argv: list[str]) -> int:
    p = OneLineParser(prog="q38 rl", description="Post-train with rewards (GRPO / DAPO, docs/rl.md): sample groups "
                      "of completions of a prompts file, reward them, take policy-gradient steps, checkpoint. One "
                      "process, or every rank under torchrun (the source's layout or --set layout=...); running it "
                      "again with the same --out resumes exactly.")
    p.add_argument("source", help=SOURCE_HELP)
    p.add_argument("--prompts", required=True, metavar="FILE", help="JSONL: {\"prompt\": TEXT, \"answer\": ...} "
                   "per line (answer needed by numeric_answer)")
    p.add_argument("--out", required=True, metavar="DIR", help="where checkpoints go (DIR/checkpoints)")
    p.add_argument("--reward", action="append", required=True, metavar="NAME",
                   help="numeric_answer, answer_format or module:function; repeatable (rewards add)")
    p.add_argument("--iterations", type=positive_int, default=10, help="rollout + update rounds (default 10)")
    p.add_argument("--prompts-per-iteration", type=positive_int, default=8, help="prompts per round (default 8)")
    p.add_argument("--group-size", type=positive_int, default=8, help="samples per prompt, >= 2 (default 8)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="per completion (default 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, > 0 (default 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the draws (iteration i uses seed + i)")
    p.add_argument("--clip-low", type=float, default=0.2, help="ratio clip below 1 (default 0.2)")
    p.add_argument("--clip-high", type=float, default=0.2, help="ratio clip above 1 (default 0.2; DAPO 0.28)")
    p.add_argument("--norm", default="token", help="token (DAPO, default) or sequence (GRPO) normalisation")
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the reference (a LoRA run's base; "
                   "default 0)")
    p.add_argument("--updates", type=positive_int, default=1, help="optimizer steps per rollout batch (default 1)")
    p.add_argument("--routing-replay", action="store_true", help="record each token's experts at sampling and "
                   "route the training forward by them (gates from the router's current logits)")
    p.add_argument("--save-every", type=nonnegative_int, default=0, help="checkpoint every N iterations (default "
                   "0: at the end only)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a setting of the source's run config, e.g. --set train.lr=1e-6")
    a = p.parse_args(argv)
    from q38.train.core.policy import PolicyLossConfig
    from q38.train.run.rl import rl_from

    check_file_args(("--prompts", a.prompts, True))
    loss = PolicyLossConfig(clip_low=a.clip_low, clip_high=a.clip_high, norm=a.norm, kl_coef=a.kl_coef,
                            temperature=a.temperature)
    rl_from(a.source, a.prompts, a.out, rewards=a.reward, iterations=a.iterations,
            prompts_per_iteration=a.prompts_per_iteration, group_size=a.group_size, max_new_tokens=a.max_new_tokens,
            temperature=a.temperature, top_p=a.top_p, seed=a.seed, loss=loss, updates=a.updates,
            routing_replay=a.routing_replay, save_every=a.save_every, overrides=_overrides(a.set), log=lambda line: print(line, flush=True))
    return 0


def _labelled(rec: dict) -> str:
    """A generate record as text: ``[i] ORIGIN: PROMPT`` (a chat: its last message, after its role), then
    ``[i] answer: TEXT``, and a blank line."""
    if "prompt" in rec:
        shown = rec["prompt"]
    else:
        last = rec["messages"][-1]
        shown = f"{last['role']}: {last.get('content') or ''}"
    return f"[{rec['index']}] {rec['from']}: {shown}\n[{rec['index']}] answer: {rec['text']}\n"


def _add_budget_args(ap) -> None:
    """The ``q38 plan`` options of the budget and the search (``q38.parallel.search.BudgetQuery``)."""
    ap.add_argument("--hardware", help="hardware profile: a name under specs/hardware (h200, ascend_910b) or a YAML")
    ap.add_argument("--train", help="run config whose data/train settings to plan (default: specs/train/<model>.yaml "
                                    "when it exists)")
    ap.add_argument("--seq-len", type=positive_int, help="tokens per sequence")
    ap.add_argument("--global-batch", type=positive_int, help="sequences per step over all data-parallel ranks")
    ap.add_argument("--micro-batches", type=positive_int, help="micro-batches per step")
    ap.add_argument("--recompute", type=_recompute_mode, metavar="MODE",
                    help="activation recompute mode: none, full, or selective_ + the kernel regions whose outputs are "
                    "kept, joined by + (e.g. selective_attention+gdn)")
    ap.add_argument("--param-dtype", choices=("bf16", "fp16", "fp32", "bfloat16", "float16", "float32"),
                    help="compute/gather dtype (default: the run config's train.param_dtype or run.dtype, else fp32 "
                         "as q38 train)")
    ap.add_argument("--reduce-dtype", choices=("bf16", "fp32", "bfloat16", "float32"),
                    help="gradient reduce dtype (default: the run config's train.reduce_dtype, else fp32)")
    ap.add_argument("--gdn-kernel", choices=("fla", "torch"), help="GDN implementation to plan activations for "
                                                                   "(default: the run config's kernels.gdn when it "
                                                                   "names one, else torch)")
    ap.add_argument("--doc-len", type=positive_int, help="tokens per document in packed rows, what block-sparse and "
                    "per-document attention kernels skip (default 2048; docs/plan.md)")
    ap.add_argument("--efficiencies", help="JSON-lines file of measured kernel efficiencies (benchmarks/gpu.sh "
                    "writes it) over the --hardware profile's")
    ap.add_argument("--search", action="store_true", help="search layouts for --world ranks of --hardware")
    ap.add_argument("--memory-cap", type=positive_float,
                    help="GiB per device (default: 90%% of the hardware's HBM)")
    ap.add_argument("--lora-rank", type=positive_int, help="plan a LoRA run of this rank (else the run config's "
                                                           "peft section, if any; docs/finetuning.md#lora)")
    ap.add_argument("--lora-base-dtype", choices=("compute", "fp8"),
                    help="LoRA: the frozen base in the compute dtype or in block-FP8")
    ap.add_argument("--fewest-ranks", action="store_true", help="with --search: the fewest devices of --hardware "
                    "(whole nodes, doubling, up to --world) that fit: LoRA and full fine-tune, each optimizer state")
    ap.add_argument("--moment-dtype", choices=("float32", "bfloat16", "int8"),
                    help="AdamW moments (default: the run config's train.moment_dtype, else float32)")
    ap.add_argument("--master-dtype", choices=("float32", "bfloat16_remainder"),
                    help="master weights (default: the run config's train.master_dtype, else float32)")
    ap.add_argument("--offload-optimizer", action="store_const", const=True, default=None,
                    help="masters and moments in host memory, AdamW on the host (default: the run config's "
                         "train.offload_optimizer)")
    ap.add_argument("--pure-step", action="store_true", help="price the optimizer phase of the pure train_step "
                    "(the library default) instead of the donated step the trainer runs")
    ap.add_argument("--rl-group-size", type=positive_int, metavar="G", help="RL: price the rollout of G samples per "
                    "prompt and the reference policy (with --rl-prompts, --rl-max-new-tokens; docs/plan.md)")
    ap.add_argument("--rl-prompts", type=positive_int, help="RL: prompts per rollout batch (all ranks)")
    ap.add_argument("--rl-max-new-tokens", type=positive_int, help="RL: new tokens per sample at most")
    ap.add_argument("--rl-prompt-len", type=positive_int, help="RL: tokens of the longest prompt (default: seq_len "
                    "less --rl-max-new-tokens, the longest a training row takes)")
    ap.add_argument("--rl-reference", choices=("copy", "logprobs", "none"),
                    help="RL reference policy: a frozen copy of the parameters (default for a full fine-tune), "
                    "precomputed log-probs, or none (no KL term); LoRA: the base with adapters off by default")
    ap.add_argument("--out", help="where --search writes the best layout and its run config, --fewest-ranks each "
                    "row's in a subdirectory (a new or empty directory, or one it wrote before); without it nothing "
                    "is written")
    ap.add_argument("--overwrite", action="store_true", help="--search: write into a non-empty --out it did not write "
                    "(never a run or checkpoint directory)")
    ap.add_argument("--finetune", action="store_true", help="--out writes a full fine-tune (init_from, your data and "
                    "tokenizer, fine-tune steps and schedule; a LoRA plan is one already; docs/plan.md)")
    ap.add_argument("--init-from", help="--out: the fine-tune's base model (a Hugging Face directory or q38 "
                    "checkpoint); implies --finetune; else written as a placeholder to fill")
    ap.add_argument("--data", help="--out: data.path of the written run (else a fine-tune's is a placeholder to fill)")
    ap.add_argument("--tokenizer", help="--out: data.tokenizer of the written run (else --init-from's tokenizer when "
                    "it has one, or a placeholder to fill)")
    ap.add_argument("--steps", type=positive_int, help="--out: run.steps and train.total_steps of the written run "
                    "(a fine-tune of a pre-training config: default 1000)")


def _recompute_mode(text: str) -> str:
    """argparse ``type=`` of ``--recompute``: one of the modes the layer kinds define (read when the option is given,
    not when the parser is built: they import torch, which ``--help`` does not)."""
    from q38.parallel.budget import RECOMPUTE_MODES

    if text not in RECOMPUTE_MODES:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(RECOMPUTE_MODES)})")
    return text


BUDGET_ARGS = ("hardware", "train", "seq_len", "global_batch", "micro_batches", "recompute", "param_dtype",
               "gdn_kernel", "search", "lora_rank", "lora_base_dtype", "doc_len", "efficiencies", "moment_dtype",
               "master_dtype", "offload_optimizer", "pure_step", "rl_group_size", "rl_prompts",
               "rl_max_new_tokens", "rl_prompt_len", "rl_reference")  # any of them set: q38 plan prints the budget (or the search) after the plan


def _rl_plan(ns):
    """``q38 plan``'s ``--rl-*`` options as a ``RolloutPlan`` (None: no RL); the three sizes go together."""
    sizes = {"--rl-group-size": ns.rl_group_size, "--rl-prompts": ns.rl_prompts,
             "--rl-max-new-tokens": ns.rl_max_new_tokens}
    if not any(sizes.values()) and ns.rl_prompt_len is None and ns.rl_reference is None:
        return None
    missing = [k for k, v in sizes.items() if v is None]
    if missing:
        raise ValueError(f"pricing RL needs {', '.join(sizes)} together; add {', '.join(missing)}")
    if ns.fewest_ranks:
        raise ValueError("--fewest-ranks does not price RL (its rows mix LoRA and full fine-tunes, whose references "
                         "differ); drop --fewest-ranks or the --rl-* options")
    from q38.parallel.budget_rollout import RolloutPlan

    return RolloutPlan(group_size=ns.rl_group_size, prompts=ns.rl_prompts, max_new_tokens=ns.rl_max_new_tokens,
                       prompt_len=ns.rl_prompt_len, reference=ns.rl_reference)


def plan_cli(args: list[str]) -> int:
    """``q38 plan --model <preset|yaml> --layout <preset|yaml> --world N [--dtype bf16] [--mesh ep=8,cp=2]``.

    Prints the report; an invalid model, layout or world size prints one line on stderr and returns 2.
    """
    # argparse errors and the argument checks below: one line through main (exit 2)
    ap = OneLineParser(prog="q38 plan", description="Per-rank memory and traffic of a layout on the meta device; with --hardware also FLOPs, "
                       "step time and MFU; with --search the layouts that fit, ranked.")
    ap.add_argument("--model", required=True, help="model preset name, q38 YAML, HF config.json or checkpoint dir")
    ap.add_argument("--layout", help="parallel layout preset name or YAML path (optional with --search)")
    ap.add_argument("--world", type=positive_int, required=True, help="number of ranks (WORLD_SIZE)")
    ap.add_argument("--dtype", choices=sorted(PLAN_DTYPES),
                    help="alias of --param-dtype (masters and moments are fp32; grads in --reduce-dtype)")
    ap.add_argument("--optimizer-states", type=nonnegative_int, default=2, help="fp32 optimizer values per parameter")
    ap.add_argument("--mesh", default="", help="override mesh sizes, e.g. ep=8,cp=2")
    _add_budget_args(ap)
    try:
        ns = ap.parse_args(args)
    except SystemExit as e:
        return int(e.code or 0)
    from q38.hf_config import load_model_config
    from q38.model_config import ConfigError
    from q38.parallel.layout import Layout, LayoutError
    from q38.parallel.plan import DTYPES, format_plan, plan
    from q38.parallel.precision import format_precision
    from q38.parallel.plan_out import RunChoices
    from q38.parallel.search import BudgetQuery, budget_report, query_precision
    from q38.train.io.dirs import check_output_dir

    check_file_args(("--model", ns.model, False), ("--layout", ns.layout, False), ("--train", ns.train, True),
                    ("--hardware", ns.hardware, False), ("--efficiencies", ns.efficiencies, True))
    if not ns.search:  # options only the search reads would be ignored
        for opt, v in (("--memory-cap", ns.memory_cap), ("--overwrite", ns.overwrite),
                       ("--fewest-ranks", ns.fewest_ranks), ("--out", ns.out)):
            if v:
                raise ValueError(f"{opt} applies only to q38 plan --search; add --search or drop {opt}")
    if ns.out is None:  # options only what --out writes reads would be ignored
        for opt, v in (("--finetune", ns.finetune), ("--init-from", ns.init_from), ("--data", ns.data),
                       ("--tokenizer", ns.tokenizer), ("--steps", ns.steps)):
            if v:
                raise ValueError(f"{opt} sets what q38 plan --search --out writes; add --search --out DIR or drop "
                                 f"{opt}")
    if ns.dtype and ns.param_dtype and DTYPES[ns.dtype] != DTYPES[ns.param_dtype]:
        raise ValueError(f"--dtype {ns.dtype} and --param-dtype {ns.param_dtype} disagree; --dtype is an alias of "
                         "--param-dtype: give one")
    rl = _rl_plan(ns)
    query = BudgetQuery(world=ns.world, model=str(ns.model), layout=ns.layout, train=ns.train, hardware=ns.hardware,
                        seq_len=ns.seq_len, global_batch=ns.global_batch, micro_batches=ns.micro_batches,
                        recompute=ns.recompute, param_dtype=ns.param_dtype or ns.dtype, reduce_dtype=ns.reduce_dtype,
                        gdn_kernel=ns.gdn_kernel, search=ns.search, memory_cap=ns.memory_cap, out=ns.out,
                        overwrite=ns.overwrite, lora_rank=ns.lora_rank, lora_base_dtype=ns.lora_base_dtype,
                        fewest_ranks=ns.fewest_ranks, doc_len=ns.doc_len, efficiencies=ns.efficiencies,
                        moment_dtype=ns.moment_dtype, master_dtype=ns.master_dtype,
                        offload_optimizer=ns.offload_optimizer, pure_step=ns.pure_step, rl=rl,
                        choices=RunChoices(finetune=ns.finetune, init_from=ns.init_from, data=ns.data,
                                           tokenizer=ns.tokenizer, steps=ns.steps))
    try:
        if ns.train:  # the whole run config is checked as `q38 train` checks it; the plan reads its data/train settings
            from q38.parallel.search import _train_defaults
            from q38.train.run.run_config import RunConfig

            _train_defaults(query, str(ns.model))  # the file itself: found, YAML, a mapping
            model = str(Path(ns.model).resolve()) if Path(ns.model).exists() else ns.model
            with reading("--train", ns.train):
                RunConfig.from_yaml(ns.train, overrides={"model": model}, placeholders="ignore")  # --model: the plan's
        with reading("--model", ns.model):
            cfg = load_model_config(ns.model)
        if ns.hardware:  # a bad profile is one line before anything is printed or priced
            from q38.parallel.hardware import Hardware

            with reading("--hardware", ns.hardware):
                Hardware.load(ns.hardware)
        prec = query_precision(query)  # the one dtype story of every section below
        if ns.layout is None and ns.train and not ns.search:  # the run config's own layout
            import attrs
            import yaml

            from q38.parallel.plan_out import layout_beside

            raw_layout = (yaml.safe_load(Path(ns.train).read_text()) or {}).get("layout")
            if raw_layout:
                ns.layout = layout_beside(str(raw_layout), Path(ns.train).parent)
                query = attrs.evolve(query, layout=ns.layout)
        if ns.layout is None:
            if not ns.search:
                raise LayoutError("--layout is required (a preset name or YAML path), unless --search finds one")
            print(format_precision(prec))
            return budget_report(query, cfg, None, check_output_dir)
        with reading("--layout", ns.layout):
            layout = Layout.load(ns.layout)
        if ns.mesh:
            try:
                sizes = {k.strip(): int(v) for k, v in (kv.split("=") for kv in ns.mesh.split(","))}
            except ValueError:
                raise LayoutError(f"--mesh expects name=size pairs separated by commas, got {ns.mesh!r}") from None
            layout = layout.with_mesh(**sizes)
        report = plan(
            cfg, layout, ns.world, param_dtype=DTYPES[prec.param], optimizer_state_factor=ns.optimizer_states,
            model_name=str(ns.model), reduce_dtype=DTYPES[prec.reduce],
        )
        if any(getattr(ns, k) for k in BUDGET_ARGS):  # one set of figures: the budget's, for the run as configured
            print(format_plan(report, precision=prec, budget_follows=True))
            print()
            return budget_report(query, cfg, layout, check_output_dir)
    except (LayoutError, ConfigError) as e:
        print(f"q38 plan: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(format_plan(report))  # its own figures: a full state, fp32 masters and moments
    return 0


def _dtype(name: str | None):
    import torch

    if name is None:
        return None
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    name = aliases.get(name, name)
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be float32, bfloat16 or float16 (or fp8: block-FP8, for convert --to-hf and "
                         f"init-hf), got {name!r}")
    return getattr(torch, name)


def _convert(argv: list[str]) -> int:
    p = OneLineParser(prog="q38 convert", description="Convert between q38 checkpoints and Hugging Face safetensors "
                      "(and a LoRA run's adapters to the PEFT format).")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--to-hf", action="store_true", help="SRC is a q38 run / checkpoints / checkpoint directory; of a "
                   "LoRA run, the merged model (base + scale * B @ A) is written")
    g.add_argument("--from-hf", action="store_true", help="SRC is a Hugging Face checkpoint directory")
    g.add_argument("--to-peft", action="store_true", help="SRC is a LoRA run / checkpoints / checkpoint directory: "
                   "its adapters as a Hugging Face PEFT adapter (adapter_config.json + adapter_model.safetensors, "
                   "routed experts as target_parameters)")
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--dtype", default=None, help="cast parameters (float32, bfloat16, float16), or --to-hf fp8: "
                   "block-FP8 (128x128 e4m3 blocks with weight_scale_inv, as the released -FP8 checkpoints); "
                   "default: --to-hf writes each tensor in the dtype of the Hugging Face checkpoint the run started "
                   "from (block-FP8 again for an FP8 source), else in the run's compute dtype "
                   "(train_config.param_dtype) with train.fp32_params in fp32; --to-peft writes the adapters' fp32 "
                   "masters; --from-hf keeps the stored dtype (block-FP8 weights dequantized to fp32)")
    p.add_argument("--base", default=None,
                   help="--to-hf / --to-peft of a LoRA run: where its base (the init_from it was trained on) is now, "
                   "if it moved; checked against the hash the checkpoint recorded (default: the recorded path)")
    p.add_argument("--drop-router-bias", action="store_true",
                   help="--to-hf / --to-peft: export a run trained with aux_loss_free without its router bias (the HF "
                   "format has none, so the exported model routes by the plain top-k)")
    p.add_argument("--mtp-num-layers", type=int, default=None,
                   help="--from-hf: override the MTP depth (0 for a checkpoint saved without mtp.* weights)")
    p.add_argument("--mtp-shared-layer", action="store_true",
                   help="--from-hf: run the checkpoint's one MTP layer (mtp.layers.0) at every depth of "
                   "--mtp-num-layers, as vLLM and SGLang draft with it")
    p.add_argument("--overwrite", action="store_true",
                   help="--to-hf / --to-peft: replace an existing non-empty OUT_DIR (never the source, nor the run's "
                   "base, data or tokenizer, nor one inside or holding any of them)")
    p.add_argument("--max-shard-bytes", type=int, default=None,
                   help="--to-hf: largest safetensors file (default 5e9, as transformers writes)")
    p.add_argument("--tokenizer", default=None,
                   help="--to-hf / --to-peft: the tokenizer written into the export (byte, a Hugging Face tokenizer "
                   "directory, or none); default: the one the run used (data.tokenizer), or the tokenizer of the "
                   "Hugging Face directory an imported checkpoint came from")
    p.add_argument("--merge-onto", choices=("trained", "original"), default=None,
                   help="--to-hf of a LoRA run with peft.base_dtype: fp8 whose base was not a block-FP8 checkpoint "
                   "(quantized at load): merge the adapters onto the block-FP8 (dequantized) values the run trained "
                   "on (trained, default) or onto the base as stored (original); the same for any other LoRA run")
    a = p.parse_args(argv)
    from q38.train.run.launch import cpu_process_group

    with cpu_process_group() as world:  # under torchrun every rank writes its share of the output
        return _convert_files(a, lead=world.rank == 0)


def _convert_files(a, *, lead: bool) -> int:
    from pathlib import Path

    from q38.hf import DEFAULT_MAX_SHARD_BYTES
    from q38.train.io.checkpoint import read_meta, resolve_checkpoint
    from q38.train.io.hf_io import FP8, SOURCE, export_checkpoint, import_hf

    dtype = FP8 if a.dtype == "fp8" else _dtype(a.dtype)
    if dtype == FP8 and not a.to_hf:
        raise ValueError("--dtype fp8 writes block-FP8 with --to-hf; --from-hf reads an FP8 checkpoint by itself "
                         "(dequantized), --to-peft writes the adapters in float32 / bfloat16 / float16: drop --dtype "
                         "or give one of those")
    if a.from_hf and a.base is not None:
        raise ValueError("--base names the base of a LoRA run for --to-hf / --to-peft; --from-hf takes none")
    if a.merge_onto is not None and not a.to_hf:
        raise ValueError("--merge-onto chooses the base of the merged export of a LoRA run (--to-hf); drop it")
    if a.from_hf and a.tokenizer is not None:
        raise ValueError("--tokenizer names the tokenizer an export (--to-hf / --to-peft) holds; --from-hf takes none")
    if a.to_peft and a.max_shard_bytes is not None:
        raise ValueError("--max-shard-bytes: a PEFT adapter is one adapter_model.safetensors (what PEFT reads); drop "
                         "it")
    out = Path(a.out)
    if a.to_hf or a.to_peft:
        say = (lambda line: print(f"q38 convert: note: {line}", file=sys.stderr)) if lead else None
        ck = resolve_checkpoint(a.src, on_skip=say)
        meta = read_meta(ck)
        if (meta.get("train_config") or {}).get("aux_loss_free") and not a.drop_router_bias:
            raise ValueError(
                f"{ck} was trained with aux_loss_free: its routing uses a per-expert router bias (train state), and "
                "the Qwen3.5 / Qwen3-Next Hugging Face format has no router bias, so the exported "
                "model would route by the plain top-k; pass --drop-router-bias to export without it"
            )
        lora = bool(meta.get("peft"))
        if a.to_peft and not lora:
            raise ValueError(f"{ck} is not a LoRA checkpoint (its meta.json has no peft entry): it holds a whole "
                             "model, not adapters; export it with --to-hf")
        if a.base is not None and not lora:
            raise ValueError(f"--base names the base of a LoRA run, but {ck} is not a LoRA checkpoint; drop --base")
        if a.merge_onto is not None and not lora:
            raise ValueError(f"--merge-onto chooses the base of a LoRA run's merged export, but {ck} is not a LoRA "
                             "checkpoint; drop --merge-onto")
        _check_export_target(Path(a.src), ck, out, a.overwrite, meta, a.base, a.tokenizer)
        extras = _export_extras(a.tokenizer, meta, ck)
        bare = (f"{ck} names no tokenizer: the export holds none (pass --tokenizer byte or DIR to add one)"
                if extras is None and a.tokenizer is None and lead else None)  # said once the export is written
        what = f"step {meta.get('step')} of {ck}"
        if a.to_peft:
            from q38.train.io.peft_export import export_peft

            export_peft(ck, out, dtype=dtype, base=a.base, extras=extras)
            if lead:
                print(f"q38 convert: wrote {out} (PEFT LoRA adapter, rank {meta['peft'].get('rank')}, {what})")
            if bare:
                say(bare)
            return 0
        if dtype is None:  # checkpoints hold fp32 masters: export in the source's dtypes, else the compute dtype
            dtype = SOURCE
        shard = a.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES
        if lora:
            from q38.train.io.peft_export import export_merged, merge_description

            onto = a.merge_onto or "trained"
            export_merged(ck, out, dtype=dtype, max_shard_bytes=shard, base=a.base, merge_onto=onto, extras=extras)
            what = f"merged: {merge_description(meta, onto, a.base)} + the adapters of {what}"
        else:
            export_checkpoint(ck, out, dtype=dtype, max_shard_bytes=shard, extras=extras)
        if lead:
            print(f"q38 convert: wrote {out} (Hugging Face safetensors, {meta['model_config'].get('model_type')}, "
                  f"{what})")
        if bare:
            say(bare)
        return 0
    src = Path(a.src)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not a Hugging Face checkpoint directory (no config.json)")
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new output directory (nothing is overwritten)")
    from q38.train.io.dirs import check_output_dir, check_safetensors_dir

    check_output_dir(out, (src,), what="OUT_DIR", role="source")  # never inside the Hugging Face directory it reads

    check_safetensors_dir(src, "convert --from-hf")
    cfg, _ = import_hf(src, out, dtype=dtype, mtp_num_layers=a.mtp_num_layers,
                       mtp_shared_layer=True if a.mtp_shared_layer else None)
    if lead:
        print(f"q38 convert: wrote {out} (q38 checkpoint, {cfg.model_type}, from {src}); "
              f"start a run from it with `init_from: {out}`")
    return 0


def _export_extras(spec: str | None, meta: dict, ck):
    """The tokenizer files, ``generation_config.json`` and token ids of an export of the checkpoint ``ck`` (its
    ``meta``): of ``--tokenizer`` (``none``: no tokenizer), else of the tokenizer the checkpoint recorded; None when
    it recorded none."""
    from q38.model_config import ModelConfig
    from q38.train.data.export_files import export_extras, recorded_tokenizer

    if spec == "none":
        return None
    recorded = recorded_tokenizer(meta)
    if spec is None and recorded is None:
        return None
    use = spec or recorded
    if use != "byte" and not Path(use).exists():
        raise FileNotFoundError(f"the tokenizer {use} {'the run used ' if spec is None else ''}is not there; pass "
                                "--tokenizer with where it is now (byte, a tokenizer directory), or --tokenizer none")
    cfg = ModelConfig.from_dict(meta["model_config"], source=f"{ck}/meta.json")
    return export_extras(use, cfg.vocab_size, cfg.max_position_embeddings)


def _check_export_target(src, ck, out, overwrite: bool, meta: dict, base, tokenizer: str | None = None) -> None:
    """``convert --to-hf`` / ``--to-peft`` never writes into its source nor into anything the run references (its
    base, also as ``--base``, its model source, data and tokenizer: ``run_inputs``, and ``--tokenizer``), with or
    without ``--overwrite``, nor over an existing non-empty OUT_DIR without ``--overwrite`` (the export itself is
    built in a temporary directory and renamed, see ``save_hf``)."""
    from q38.train.io.dirs import check_output_dir, run_inputs

    check_output_dir(out, (src, ck), what="OUT_DIR", overwrite=overwrite, role="source")
    refs = run_inputs(meta.get("run_config"), meta) + ([("base (--base)", Path(base))] if base is not None else [])
    if tokenizer not in (None, "byte", "none"):
        refs.append(("tokenizer (--tokenizer)", Path(tokenizer)))
    for role, path in refs:
        check_output_dir(out, (path,), what="OUT_DIR", overwrite=overwrite, role=f"run's {role}")


def _init_hf(argv: list[str]) -> int:
    p = OneLineParser(prog="q38 init-hf", description="Initialise a model and save it as a Hugging Face checkpoint "
                "(a small starting point for trying the fine-tuning workflow).")
    p.add_argument("--model", default="tiny", help="model preset name or YAML (default: tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32",
                   help="float32, bfloat16, float16, or fp8: block-FP8 projections (128x128 blocks with "
                   "weight_scale_inv), the other tensors bf16 and train.fp32_params' defaults (A_log, the GDN norm) "
                   "fp32")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing non-empty OUT_DIR (never a run or checkpoint directory)")
    p.add_argument("--tokenizer", default="byte",
                   help="the tokenizer written beside the weights (with generation_config.json and the token ids of "
                   "config.json): byte (default), a Hugging Face tokenizer directory, or none")
    p.add_argument("out")
    a = p.parse_args(argv)
    from q38.hf import save_hf
    from q38.hf_config import load_model_config
    from q38.model import init_params
    from q38.train.io.dirs import check_output_dir

    out = Path(a.out)
    model = Path(a.model)
    check_output_dir(out, [model] if model.exists() else [], what="OUT_DIR", overwrite=a.overwrite)
    cfg = load_model_config(a.model)
    if a.seed < 0 or a.seed >= 1 << 63:
        raise ValueError(f"--seed {a.seed}: a seed is an integer from 0 to 2**63 - 1")
    extras = None
    if a.tokenizer != "none":
        from q38.train.data.export_files import export_extras

        tok = Path(a.tokenizer)
        if a.tokenizer != "byte":
            check_output_dir(out, [tok] if tok.exists() else [], what="OUT_DIR", overwrite=a.overwrite)
        extras = export_extras(a.tokenizer, cfg.vocab_size, cfg.max_position_embeddings)
    from q38.model import check_host_memory

    check_host_memory(cfg, bytes_per_param=_dtype(a.dtype).itemsize if a.dtype != "fp8" else 4,  # one process holds all
                      what=f"init-hf --model {a.model}", fix="choose smaller sizes, or a machine with more memory")
    if a.dtype == "fp8":
        from q38.fp8 import block_misaligned
        from q38.hf import fp8_dtypes

        off = block_misaligned(cfg, (128, 128))
        if off:
            raise ValueError(f"--dtype fp8: {a.model} has widths that are not multiples of the 128x128 FP8 block "
                             f"({', '.join(off)}), so its weights' blocks would not line up with the checkpoint's (a "
                             "peft.base_dtype: fp8 run refuses it); use --model tiny_fp8 (a toy preset whose widths "
                             "are multiples of 128) or a model YAML whose widths are")
        from q38.train.core.step_config import TrainConfig

        keep = TrainConfig(param_dtype="bfloat16").compute_dtype  # bf16, the fp32_params defaults fp32
        save_hf(out, cfg, init_params(cfg, seed=a.seed), dtypes=fp8_dtypes(keep), extras=extras)
    else:
        save_hf(out, cfg, init_params(cfg, seed=a.seed, dtype=_dtype(a.dtype)), extras=extras)
    print(f"q38 init-hf: wrote {out} ({a.model}, seed {a.seed})")
    return 0


def _prepare_data(argv: list[str]) -> int:
    from q38.files import MAX_LINE_BYTES
    from q38.train.data.formats import FORMATS
    from q38.train.data.options import CHUNK_BYTES, TRAIN_ON

    p = OneLineParser(prog="q38 prepare-data", description="Tokenize JSONL (or Parquet, with pyarrow) text / chat "
                      "records into memory-mapped token shards for `data.path`. A re-run on unchanged inputs does "
                      "nothing.")
    p.add_argument("inputs", nargs="+", help="JSONL / JSON / Parquet / Arrow / CSV files, directories of them, "
                   "Hugging Face save_to_disk directories, or builtin:NAME")
    p.add_argument("--out", required=True, help="output directory (set data.path to it)")
    p.add_argument("--tokenizer", default="byte", help="\"byte\" or a directory with tokenizer.json (default: byte)")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: CPU count)")
    p.add_argument("--chunk-mb", type=float, default=CHUNK_BYTES / (1 << 20),
                   help="input megabytes per shard (default: 64)")
    p.add_argument("--train-on", default="assistant", choices=TRAIN_ON,
                   help="targets of chat records: assistant turns (default), the last one, or all tokens; the run's "
                   "data.train_on must match")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an existing non-empty --out that is not an earlier output of prepare-data "
                   "(never a run or checkpoint directory, nor one holding or inside an input)")
    p.add_argument("--max-line-mb", type=positive_float, default=MAX_LINE_BYTES / (1 << 20),
                   help="refuse a JSONL line longer than this many MiB before parsing it (default: 16)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--format", default="auto", choices=FORMATS, dest="record_format",
                   help="the records' shape: recognised per record by its keys (auto, default), or text, messages "
                   "(OpenAI-style, tool calls too), sharegpt or alpaca; converted to messages for the chat template")
    p.add_argument("--split", default=None,
                   help="the split of a Hugging Face DatasetDict directory (default: its only split, or train)")
    a = p.parse_args(argv)
    if a.workers is not None and a.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {a.workers}")
    if not a.chunk_mb > 0:
        raise ValueError(f"--chunk-mb must be > 0, got {a.chunk_mb}")
    from q38.train.data.prepare import prepare_data

    prepare_data(a.inputs, a.out, tokenizer=a.tokenizer, workers=a.workers, chunk_bytes=int(a.chunk_mb * (1 << 20)),
                 progress=not a.no_progress, train_on=a.train_on, overwrite=a.overwrite,
                 record_format=a.record_format, split=a.split, max_line_bytes=int(a.max_line_mb * (1 << 20)))
    return 0


def _kernels(argv: list[str]) -> int:
    p = OneLineParser(prog="q38 kernels", description="Every kernel implementation against this machine's packages and "
                "device: the one kernels.auto picks per op, and why each other one cannot serve the run.")
    p.add_argument("--device", default=None, help="cpu, cuda or npu (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, help="compute dtype (train.param_dtype), e.g. bfloat16")
    p.add_argument("--cp", action="store_true", help="a run with context parallelism")
    p.add_argument("--unpacked", action="store_true", help="rows hold one document each (the data is not packed)")
    a = p.parse_args(argv)
    import importlib.metadata
    import platform

    import torch

    from q38.kernels import kernel_report

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = None if a.dtype is None else str(_dtype(a.dtype)).removeprefix("torch.")
    found = []
    for pkg in ("torch", "triton", "flash-linear-attention", "fla-core", "tilelang", "causal-conv1d", "torch_npu",
                "transformers"):
        try:
            found.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{pkg} -")
    print(f"python {platform.python_version()}; " + "; ".join(found))
    if device.startswith("cuda") and torch.cuda.is_available():
        print(f"device: {torch.cuda.get_device_name()} (compute capability "
              f"{'.'.join(map(str, torch.cuda.get_device_capability()))})")
    print(f"run: device {device}, dtype {dtype or 'any'}, cp {a.cp}, packed rows {not a.unpacked}")
    rows = kernel_report(device=device, cp=a.cp, packed=not a.unpacked, dtype=dtype)
    width = max(len(f"{op}.{name}") for op, name, _ in rows)
    for op, name, status in rows:
        print(f"  {op + '.' + name:<{width}}  {status}")
    return 0


LAUNCHED = ("train", "eval", "convert")  # the q38 commands that run under torchrun (q38 launch)


def _launch(argv: list[str]) -> int:
    if argv in ([], ["-h"], ["--help"]):
        print(f"usage: q38 launch [TORCHRUN OPTIONS] {{{','.join(LAUNCHED)}}} ...\n\n"
              "torchrun for q38 commands, e.g. q38 launch --standalone --nproc-per-node 2 train CONFIG. The first "
              "SIGTERM or Ctrl-C is passed to the workers, which save a checkpoint and exit 0; a second one is "
              "torchrun's own stop. The torchrun options are torchrun's (torchrun --help).")
        return 0
    at = next((i for i, a in enumerate(argv) if a in LAUNCHED), None)
    if at is None:
        raise ValueError(f"q38 launch expects torchrun options, then a q38 command ({', '.join(LAUNCHED)}) and its "
                         f"arguments, e.g. q38 launch --standalone --nproc-per-node 2 train CONFIG; got {argv}")
    from q38.train.run.launch import launch

    return launch(argv, at)


COMMANDS = {"train": _train, "eval": _eval, "generate": _generate, "rl": _rl, "plan": plan_cli, "convert": _convert, "init-hf": _init_hf, "prepare-data": _prepare_data,
            "kernels": _kernels, "launch": _launch}


def _one_line(e: BaseException) -> str:
    msg = str(e) or type(e).__name__
    if type(e).__name__ == "CheckpointException":  # torch DCP: name the underlying error of the first rank
        from q38.train.run.safety import _cause

        msg = f"checkpoint read/write failed: {_cause(e)}"
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        msg = f"{e.filename}: {e.strerror}"
    return " ".join(line.strip() for line in msg.splitlines() if line.strip())


def _collective_timeout(e: BaseException) -> bool:
    """A gloo / NCCL collective that ran past the process group's timeout (torch raises a plain RuntimeError, or a
    DistBackendError, whose text names the backend; gloo's async works, which the overlapped step waits on, say
    "Application timeout caused pair closure")."""
    msg = str(e).lower()
    if not isinstance(e, RuntimeError):
        return False
    return ("timed out" in msg and any(w in msg for w in ("gloo", "nccl", "hccl", "collective"))) or \
        "application timeout caused pair closure" in msg


def first_sentence(text: str) -> str:
    """``text`` up to its first full stop that ends a sentence (not the one of ``e.g.``, ``i.e.``, ``etc.``, nor one
    followed by a lower-case word)."""
    head = re.split(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)\.\s+(?=[A-Z`(\[])", text.strip(), maxsplit=1)[0]
    return head.rstrip(".") + "."


def usage() -> str:
    """The top-level help, read from each command's own parser (its usage and the first sentence of its
    description), so it names every option the command accepts."""
    import contextlib
    import io

    lines = ["usage: q38 {" + ",".join(COMMANDS) + "} ...   (q38 COMMAND --help: what each option means)"]
    for fn in COMMANDS.values():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            fn(["--help"])
        blocks = buf.getvalue().split("\n\n")
        lines.append("  " + blocks[0].removeprefix("usage: ").replace("\n", "\n  "))
        desc = blocks[1] if len(blocks) > 1 and not blocks[1].startswith(("options:", "positional")) else ""
        if desc:
            desc = " ".join(re.sub(r"(\w)-\n\s*(\w)", r"\1-\2", desc).split())
            lines.append("      " + first_sentence(desc))
    return "\n".join([*lines, DEBUG_HELP])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("Q38_DEBUG", "") not in ("", "0")
    if "--debug" in argv:
        argv.remove("--debug")
        debug = True
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"q38: unknown command {cmd!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    from q38.errors import ConfigError, RunError

    world = os.environ.get("WORLD_SIZE", "1")
    who = f"q38 {cmd}" + (f" [rank {os.environ.get('RANK', '?')}]" if world not in ("", "1") else "")
    try:
        return COMMANDS[cmd](rest)
    except SystemExit as e:  # --help
        return int(e.code or 0) if isinstance(e.code, (int, type(None))) else 2
    except BrokenPipeError:  # stdout closed early (`q38 plan ... | head`): the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 141  # 128 + SIGPIPE, what a shell tool reports
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        why = " (an unfinished checkpoint save is discarded; the previous one is intact)" if cmd == "train" else ""
        print(f"{who}: interrupted{why}", file=sys.stderr)
        return 130
    except BaseException as e:  # every other failure: one line (the traceback only with --debug / Q38_DEBUG=1)
        if debug:
            traceback.print_exc()
        if _collective_timeout(e):
            print(f"{who}: error: a collective waited longer than run.timeout_s (in a step: the step's bound + 60 s) "
                  f"({_one_line(e)}): another rank is stopped, dead or much slower; run.step_timeout_s names it and "
                  "dumps every rank's stacks",
                  file=sys.stderr)
            return 2
        if isinstance(e, (ConfigError, ValueError, OSError, FloatingPointError, NotImplementedError, RunError)) or \
                type(e).__name__ in ("CheckpointException", "SafetensorError", "DistError", "DistBackendError",
                                     "DistNetworkError", "DistStoreError"):  # torch.distributed: e.g. a timeout
            print(f"{who}: error: {_one_line(e)}", file=sys.stderr)
            return 2
        print(f"{who}: internal error: {type(e).__name__}: {_one_line(e)} (a q38 bug; rerun with --debug or "
              "Q38_DEBUG=1 for the traceback and report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
