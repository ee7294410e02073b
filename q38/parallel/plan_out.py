"""What ``q38 plan --search --out DIR`` writes: the run it priced, as a layout YAML and a ``train.yaml`` that ``q38
train`` starts (docs/plan.md#what---out-writes).

The run config is the planned one (``--train``, or the shipped ``specs/train/<model>.yaml``) with every setting the
plan took from its own flags written in (dtypes, optimizer state, the ``peft`` section, the kernels it priced) and the
candidate's layout, data shape, micro-batches and recompute flags. Settings the run would refuse are not written (EP
balance with LoRA: priced off, written off). A fine-tune plan (LoRA, or ``--finetune`` / ``--init-from``) writes
``init_from``, ``data.path`` and ``data.tokenizer`` from ``--init-from`` / ``--data`` / ``--tokenizer``, else as
required placeholders the config loader names until they are filled (``q38.errors.placeholder``), and fine-tune
defaults for the steps and the schedule instead of a pre-training config's. Every file is written whole or not at all
(a temporary file renamed over it).
"""

import os
from pathlib import Path
from typing import Any, Mapping

import attrs
import yaml

from q38.errors import placeholder
from q38.layers.kinds import MIXER_KINDS, kept_regions
from q38.parallel.budget_result import _fmt_bytes, _fmt_s
from q38.parallel.precision import short_dtype

WRITTEN_BY = "# Written by `q38 plan --search`"  # first line of each file write_best writes

# the required keys a fine-tune plan cannot know, and what each wants (the loader prints it while unfilled)
INIT_FROM = "the base model to fine-tune, a Hugging Face checkpoint directory or a q38 checkpoint"
DATA = "your training data, a JSONL file of text or chat records, a prepared directory or a Megatron PREFIX"
TOKENIZER = "the base model's tokenizer, a directory with tokenizer.json (usually init_from's)"

# fine-tune defaults, written instead of a pre-training config's steps and schedule (docs/plan.md)
FINETUNE_STEPS = 1000  # --steps sets it: the data's sequences × epochs / the global batch
FINETUNE_LR = {"lora": 2e-4, "full": 1e-5}  # peak learning rate: adapters from zero, a full model from a trained one
WARMUP_FRACTION = 0.03  # linear warmup over 3 % of the steps
PRICED_OPS = ("gdn", "attention", "experts", "block", "loss", "gdn_chunk_size")  # the kernels the budget prices


@attrs.frozen(kw_only=True)
class RunChoices:
    """What ``q38 plan`` was told about the run it writes beyond the budget: a fine-tune (``finetune``; LoRA is one
    by itself), its base (``init_from``), the data, the tokenizer, the step count; None: not given."""

    finetune: bool = False
    init_from: str | None = None
    data: str | None = None
    tokenizer: str | None = None
    steps: int | None = None


def candidate_run_config(c: Any, model: str, layout_path: str, seq_len: int, base: dict | None = None) -> dict:
    """The run config (``q38 train`` YAML) matching a candidate (``q38.parallel.search.Candidate``): ``base`` (the
    planned run config, if any) with the layout, data shape, micro-batches and recompute flags of the candidate, and
    the kernels it was priced with."""
    b = c.budget
    rc = b.recompute
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (base or {}).items()}
    out.setdefault("model", model)
    out["layout"] = layout_path
    out["data"] = dict(out.get("data") or {}, seq_len=seq_len, batch_size=b.rows_per_rank)
    train = dict(out.get("train") or {}, micro_batches=b.micro_batches, recompute=rc != "none")
    train.update({k.keep_flag: k.region in kept_regions(rc) for k in MIXER_KINDS.values()})
    if train.get("enable_ep_balance") and dict(b.mesh).get("ep", 1) <= 1:
        train["enable_ep_balance"] = False
    if dict(b.mesh).get("ep", 1) > 1:
        train["ep_dispatch"] = c.ep_dispatch
    out["train"] = train
    out["run"] = dict(out.get("run") or {}, dtype={"bf16": "bfloat16", "fp16": "float16"}.get(b.param_dtype,
                                                                                                "float32"))
    if b.kernels is not None:  # the kernels the budget priced, resolved for this candidate's device and CP
        priced = b.kernels.to_dict()
        ops = [op for op in PRICED_OPS if op != "gdn_chunk_size" or priced["gdn"] == "torch"]  # the torch core's
        out["kernels"] = dict(out.get("kernels") or {}, **{op: priced[op] for op in ops})
    order = ("model", "init_from", "layout", "data", "train", "run", "kernels", "peft")  # the loader's sections
    return {**{k: out[k] for k in order if k in out}, **{k: v for k, v in out.items() if k not in order}}


def planned_run_config(raw: Mapping[str, Any], kw: Mapping[str, Any], kernels, *, model: str,
                       choices: RunChoices = RunChoices(), own: bool = False) -> dict:
    """The run config the search prices: ``raw`` (the planned run config; ``own``: the user's ``--train`` file, not a
    shipped one) with every setting ``q38 plan`` took from its own flags written in (dtypes, optimizer state, LoRA's
    ``peft`` section, the kernels), so that ``q38 train`` runs and ``q38 plan --train`` prices the run the search
    priced; then the fine-tune keys (:func:`finetune_keys`). The layout, data shape, micro-batches and recompute are
    the candidate's (``candidate_run_config``)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    train = dict(out.get("train") or {})
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    train["param_dtype"] = names[short_dtype(kw.get("param_dtype", "fp32"))]
    train["reduce_dtype"] = names[short_dtype(kw.get("reduce_dtype", "fp32"))]
    for key, default in (("moment_dtype", "float32"), ("master_dtype", "float32"), ("offload_optimizer", False)):
        v = kw.get(key, default)
        if v != default or key in train:
            train[key] = {"fp32": "float32"}.get(v, v) if isinstance(v, str) else v
    if "ep_balance" in kw and (kw["ep_balance"] or train.get("enable_ep_balance")):
        train["enable_ep_balance"] = bool(kw["ep_balance"])  # off for LoRA: priced off, written off
    out["train"] = train
    run = dict(out.get("run") or {})
    run.pop("dtype", None)  # train.param_dtype says it (candidate_run_config writes the alias back, equal)
    out["run"] = run
    peft = kw.get("peft")
    if peft is not None:
        out["peft"] = peft.to_dict()
    else:
        out.pop("peft", None)
    if kernels is not None and (kernels.to_dict() != type(kernels)().to_dict() or out.get("kernels")):
        out["kernels"] = kernels.to_dict()
    return finetune_keys(out, raw, model=model, lora=peft is not None, choices=choices, own=own)


def is_finetune(raw: Mapping[str, Any], lora: bool, choices: RunChoices) -> bool:
    """A fine-tune plan: LoRA, ``--finetune`` or ``--init-from``, or a planned run config that starts from a
    checkpoint."""
    return lora or choices.finetune or choices.init_from is not None or bool(raw.get("init_from"))


def finetune_keys(out: dict, raw: Mapping[str, Any], *, model: str, lora: bool, choices: RunChoices,
                  own: bool) -> dict:
    """``out`` with the keys a fine-tune needs: ``init_from``, ``data.path`` and ``data.tokenizer`` from the plan's
    flags, else kept from the user's own run config (``own``), else a required placeholder (a tokenizer found in
    the ``--init-from`` directory is taken); the steps and schedule: a pre-training config's (one without
    ``init_from`` or ``peft``) are replaced by the fine-tune defaults, ``--steps`` sets the step count of any plan.
    Not a fine-tune: only ``--data`` / ``--tokenizer`` / ``--steps`` are written."""
    data, train, run = dict(out.get("data") or {}), dict(out.get("train") or {}), dict(out.get("run") or {})
    if choices.data is not None:
        data["path"] = _path_arg(choices.data)
    if choices.tokenizer is not None:
        data["tokenizer"] = _path_arg(choices.tokenizer)
    if is_finetune(raw, lora, choices):
        init = _path_arg(choices.init_from) if choices.init_from is not None else raw.get("init_from")
        out["init_from"] = init or placeholder(INIT_FROM)
        if choices.data is None and not (own and "path" in data):
            data["path"] = placeholder(DATA)
        if choices.tokenizer is None and not (own and "tokenizer" in data):
            found = init and (Path(init) / "tokenizer.json").is_file()
            data["tokenizer"] = init if found else placeholder(TOKENIZER)
        if not (raw.get("init_from") or raw.get("peft") is not None):  # a pre-training config: not its schedule
            steps = choices.steps or FINETUNE_STEPS
            train.update(lr=FINETUNE_LR["lora" if lora else "full"], total_steps=steps, schedule="cosine",
                         warmup_steps=round(WARMUP_FRACTION * steps), min_lr_ratio=0.1)
            if lora:
                train["weight_decay"] = 0.0  # the adapters start at B = 0: decay pulls them back to the base
            run.update(steps=steps, out_dir=f"runs/{Path(model).stem}_{'lora' if lora else 'finetune'}")
            run.pop("resume_from", None)
    if choices.steps is not None:
        run["steps"] = train["total_steps"] = choices.steps
        if train.get("warmup_steps", 0) > choices.steps:
            train["warmup_steps"] = round(WARMUP_FRACTION * choices.steps)
    out.update(data=data, train=train, run=run)
    return out


def _path_arg(p: str) -> str:
    """A path given on the plan's command line, absolute when it exists here (the written file may be read from
    another directory); else as given (a path on the cluster, ``builtin:NAME``, ``byte``)."""
    return str(Path(p).resolve()) if Path(p).exists() else p


def layout_beside(layout: str, base_dir) -> str:
    """A relative layout path names the YAML file in ``base_dir`` (the run config's directory) when there is one, else
    a preset name or a path relative to the CWD, as given: how ``q38 train`` reads a run config's ``layout`` (its own
    copy of this rule: ``q38.parallel`` imports nothing of ``q38.train``)."""
    if base_dir is not None and not os.path.isabs(layout) and (Path(base_dir) / layout).is_file():
        return str(Path(base_dir) / layout)
    return layout


def written_by_plan(d: Path) -> bool:
    """``d`` holds only what ``write_best`` wrote (an earlier search's output): YAML files whose first line is
    ``WRITTEN_BY``, and directories (``--fewest-ranks``: one a row) that hold only such files."""
    def ours(f: Path) -> bool:
        if f.is_dir() and not f.is_symlink():
            return any(f.iterdir()) and written_by_plan(f)
        if not (f.is_file() and not f.is_symlink() and f.suffix == ".yaml"):
            return False
        with open(f, errors="replace") as fh:
            return fh.readline().startswith(WRITTEN_BY)
    return all(ours(f) for f in d.iterdir())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_best(c: Any, out_dir: str | Path, model: str, seq_len: int,
               base: dict | None = None) -> tuple[Path, Path]:
    """The candidate's layout YAML and its run config ``train.yaml`` in ``out_dir``, each headed by the predicted
    step time, peak and global batch (``q38 plan --train`` on the run config prices them again)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lp = out / f"{c.layout_dict['name']}.yaml"
    b = c.budget
    head = (f"{WRITTEN_BY}: predicted {_fmt_s(b.step_s)} a step ({b.step_s!r} s), MFU {100 * (b.mfu or 0):.1f}% on "
            f"{b.hardware}, peak {_fmt_bytes(b.peak_bytes)} ({b.peak_bytes:.0f} B) a rank, global batch "
            f"{b.global_tokens // b.seq_len} sequences.\n")
    run = candidate_run_config(c, model, lp.name, seq_len, base)  # the layout beside it (loaders look there first)
    from q38.errors import unfilled

    left = unfilled(run)
    if left:
        head += (f"# Fill in before q38 train: {', '.join(k for k, _ in left)} (or pass --set KEY=VALUE "
                 "to q38 train; docs/plan.md).\n")
    _write_atomic(lp, head + yaml.safe_dump(c.layout_dict, sort_keys=False))
    tp = out / "train.yaml"
    _write_atomic(tp, head + yaml.safe_dump(run, sort_keys=False))
    return lp, tp
