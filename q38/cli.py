"""``q38`` command line: ``train``, ``plan``, ``convert``, ``init-hf``.

Bad input ends with a one-line error naming the problem and the fix (exit code 2), never a traceback.
"""

import argparse
import os
import sys

USAGE = """usage: q38 {train,plan,convert,init-hf} ...
  train [CONFIG] [--set SECTION.KEY=VALUE ...]
                   train or resume (no CONFIG: the embedded tiny run); torchrun --nproc_per_node N for N ranks
  plan --model M --layout L --world N     per-rank memory and communication plan
  convert --to-hf RUN_DIR_OR_CHECKPOINT OUT_DIR     export a trained run's parameters as a Hugging Face checkpoint
  convert --from-hf HF_DIR OUT_CHECKPOINT           import a Hugging Face checkpoint as a q38 checkpoint
  init-hf --model PRESET OUT_DIR                    write a freshly initialised model as a Hugging Face checkpoint"""


class _Parser(argparse.ArgumentParser):
    """argparse that raises (one-line error through ``main``) instead of printing usage and exiting."""

    def error(self, message):
        raise ValueError(f"{message} (see `{self.prog} --help`)")


def _train(argv: list[str]) -> int:
    p = _Parser(prog="q38 train", description="Train from a YAML run config (default: specs/train/tiny.yaml). "
                "Resumes from the latest checkpoint in run.out_dir; SIGTERM / Ctrl-C saves a checkpoint and exits.")
    p.add_argument("config", nargs="?", help="run config YAML (default: the embedded tiny run)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set run.steps=50 (repeatable)")
    a = p.parse_args(argv)
    import yaml

    from q38.train.trainer import RunConfig, train

    overrides = {}
    for kv in a.set:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise ValueError(f"--set expects SECTION.KEY=VALUE, got {kv!r}")
        try:
            overrides[k] = yaml.safe_load(v)
        except yaml.YAMLError:
            overrides[k] = v
    cfg = RunConfig.from_yaml(a.config, overrides)
    train(cfg)
    return 0


def _plan(argv: list[str]) -> int:
    from q38.parallel.plan import plan_cli

    return plan_cli(argv)


def _dtype(name: str | None):
    import torch

    if name is None:
        return None
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    name = aliases.get(name, name)
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {name!r}")
    return getattr(torch, name)


def _convert(argv: list[str]) -> int:
    p = _Parser(prog="q38 convert", description="Convert between q38 checkpoints and Hugging Face safetensors.")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--to-hf", action="store_true", help="SRC is a q38 run / checkpoints / checkpoint directory")
    g.add_argument("--from-hf", action="store_true", help="SRC is a Hugging Face checkpoint directory")
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--dtype", default=None, help="cast parameters (float32, bfloat16, float16); default: --to-hf "
                   "writes the run's compute dtype (train_config.param_dtype: bfloat16 under the bf16 policy, as "
                   "Qwen checkpoints ship), --from-hf keeps the stored dtype")
    p.add_argument("--mtp-num-layers", type=int, default=None,
                   help="--from-hf: override the MTP depth (0 for a checkpoint saved without mtp.* weights)")
    a = p.parse_args(argv)
    from pathlib import Path

    from q38.train.checkpoint import load_params, resolve_checkpoint, write_checkpoint

    dtype = _dtype(a.dtype)
    out = Path(a.out)
    if a.to_hf:
        from q38.hf import save_hf

        ck = resolve_checkpoint(a.src)
        if dtype is None:  # checkpoints hold fp32 masters; export in the dtype the run computes in
            from q38.train.checkpoint import read_meta

            dtype = _dtype((read_meta(ck).get("train_config") or {}).get("param_dtype", "float32"))
        cfg, params, meta = load_params(ck, dtype=dtype)
        save_hf(out, cfg, params)
        print(f"q38 convert: wrote {out} (Hugging Face safetensors, {cfg.model_type}, step {meta.get('step')} "
              f"of {ck})")
        return 0
    import torch

    from q38.hf import load_hf
    from q38.train.config import TrainConfig
    from q38.train.state import state_from_params

    src = Path(a.src)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not a Hugging Face checkpoint directory (no config.json)")
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new output directory (nothing is overwritten)")
    cfg, params = load_hf(src, dtype=dtype, mtp_num_layers=a.mtp_num_layers)
    state = state_from_params(params, cfg, TrainConfig())
    import q38
    from q38.pytree import tree_leaves

    leaf = tree_leaves(params)[0]

    meta = {"step": 0, "model_config": cfg.to_dict(), "train_config": state.train_config.to_dict(),
            "param_dtype": str(leaf.dtype).removeprefix("torch."), "source": str(src), "data": None,
            "q38_version": q38.__version__, "torch_version": torch.__version__}
    write_checkpoint(out, state, meta)
    print(f"q38 convert: wrote {out} (q38 checkpoint, {cfg.model_type}, from {src}); "
          f"start a run from it with `init_from: {out}`")
    return 0


def _init_hf(argv: list[str]) -> int:
    p = _Parser(prog="q38 init-hf", description="Initialise a model and save it as a Hugging Face checkpoint "
                "(a small starting point for trying the fine-tuning workflow).")
    p.add_argument("--model", default="tiny", help="model preset name or YAML (default: tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("out")
    a = p.parse_args(argv)
    from pathlib import Path

    from q38.config import ModelConfig
    from q38.hf import save_hf
    from q38.model import init_params

    out = Path(a.out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new output directory (nothing is overwritten)")
    cfg = ModelConfig.load(a.model)
    save_hf(out, cfg, init_params(cfg, seed=a.seed, dtype=_dtype(a.dtype)))
    print(f"q38 init-hf: wrote {out} ({a.model}, seed {a.seed})")
    return 0


COMMANDS = {"train": _train, "plan": _plan, "convert": _convert, "init-hf": _init_hf}


def _one_line(e: BaseException) -> str:
    msg = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        msg = f"{e.filename}: {e.strerror}"
    return " ".join(line.strip() for line in msg.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"q38: unknown command {cmd!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    from q38.config import ConfigError

    world = os.environ.get("WORLD_SIZE", "1")
    who = f"q38 {cmd}" + (f" [rank {os.environ.get('RANK', '?')}]" if world not in ("", "1") else "")
    try:
        return COMMANDS[cmd](rest)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (ConfigError, ValueError, OSError, FloatingPointError, NotImplementedError) as e:
        print(f"{who}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{who}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
