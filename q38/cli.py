"""``q38`` command line: ``train``, ``plan``, ``convert``.

Bad input ends with a one-line error naming the problem and the fix (exit code 2), never a traceback.
"""

import argparse
import sys


def _train(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="q38 train", description="Train from a YAML run config (default: the tiny run).")
    p.add_argument("config", nargs="?", help="run config YAML (default: specs/train/tiny.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set run.steps=50")
    a = p.parse_args(argv)
    import yaml

    from q38.train.trainer import RunConfig, train

    overrides = {}
    for kv in a.set:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ValueError(f"--set expects SECTION.KEY=VALUE, got {kv!r}")
        overrides[k] = yaml.safe_load(v)
    cfg = RunConfig.from_yaml(a.config, overrides)
    train(cfg)
    return 0


def _plan(argv: list[str]) -> int:
    from q38.parallel.plan import plan_cli

    return plan_cli(argv)


COMMANDS = {"train": _train, "plan": _plan}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: q38 {train,plan,convert} ...\n  train [CONFIG]   train (no CONFIG: the embedded tiny run)\n"
              "  plan --model M --layout L --world N   per-rank memory and communication plan\n"
              "  convert ...      Hugging Face <-> q38 checkpoints")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"q38: unknown command {cmd!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    from q38.config import ConfigError

    try:
        return COMMANDS[cmd](rest)
    except (ConfigError, ValueError, FileNotFoundError, FloatingPointError) as e:
        print(f"q38 {cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"q38 {cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
