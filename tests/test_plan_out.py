"""What ``q38 plan --search --out`` writes is a run that starts: a fine-tune plan's required keys are placeholders the
loader names in one line until filled, then ``q38 train`` runs the file; settings the run refuses (EP balance with
LoRA) are priced off and written off, and the loader refuses them before any weight is read; ``--search`` writes only
where ``--out`` says, ``--fewest-ranks --out`` one subdirectory a row; ``q38 plan --train FILE`` prints one budget,
the one ``--search`` priced. On a model whose every dimension differs from the ``tiny`` preset's."""

import json
import re
from pathlib import Path

import pytest
import yaml

from q38.cli import main, plan_cli
from q38.parallel.budget_result import _fmt_bytes, _fmt_s
from tests.model_utils import PLAN_CFG, dims_like_tiny

CFG = PLAN_CFG  # unlike tiny in every dimension
# the kernels a CPU runs (what the user's run config names; the plan prices and writes them as named)
CPU_KERNELS = {"attention": "sdpa", "gdn": "torch", "experts": "batched"}


def test_the_model_is_unlike_tiny():
    assert dims_like_tiny(CFG) == []


def _model_yaml(d: Path) -> str:
    p = d / "model.yaml"
    p.write_text(yaml.safe_dump(CFG.to_dict()))
    return str(p)


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith(("settings from", "train.enable_ep_balance from"))]
    assert len(err) == 1, err
    return err[0]


def _header(path) -> tuple[float, float, int]:
    """(step s, peak bytes, global batch) from the first line of a file the plan wrote."""
    head = Path(path).read_text().splitlines()[0]
    m = re.search(r"\(([0-9.e+-]+) s\).* \(([0-9]+) B\) a rank, global batch ([0-9]+)", head)
    assert m, head
    return float(m.group(1)), float(m.group(2)), int(m.group(3))


# ---- a fine-tune plan's file runs as written, after filling what the loader names ----------------------------


@pytest.mark.slow  # ~15-40 s a case on the shared 2 cores: a one-rank search, then two q38 train calls
@pytest.mark.parametrize("kind", ["lora_fp8", "full"])
def test_a_finetune_plan_runs_after_filling_only_the_placeholders_the_loader_names(tmp_path, monkeypatch, capsys,
                                                                                  kind):
    """``q38 plan --search --out`` for a LoRA run on an FP8 base and for a full fine-tune, from a run config that
    names no base, data or tokenizer: ``q38 train`` on the written file refuses in one line naming ``init_from``,
    ``data.path`` and ``data.tokenizer``; with exactly those filled (``--set``, as the line says) it runs its steps
    from the base checkpoint. The plan's ``--steps 2`` replaces the fine-tune default of 1000."""
    from q38.hf import save_hf
    from q38.model import init_params

    monkeypatch.chdir(tmp_path)
    model = _model_yaml(tmp_path)
    save_hf(tmp_path / "base", CFG, init_params(CFG, seed=5))  # the released model this fine-tune starts from
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"record {i}: the quick brown fox jumps"}) + "\n"
                                                 for i in range(16)))
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({"model": model, "kernels": CPU_KERNELS,
                                                        "train": {"loss_chunk_size": 64}}))
    how = ["--lora-rank", "4", "--lora-base-dtype", "fp8"] if kind == "lora_fp8" else ["--finetune"]
    assert plan_cli(["--model", model, "--world", "1", "--hardware", "h200", "--search", "--train", "mine.yaml",
                     "--seq-len", "32", "--global-batch", "2", "--steps", "2", "--out", "plan", *how]) == 0
    capsys.readouterr()
    written = yaml.safe_load((tmp_path / "plan" / "train.yaml").read_text())
    assert written["run"]["steps"] == written["train"]["total_steps"] == 2
    assert ("peft" in written) == (kind == "lora_fp8")
    assert written["kernels"]["attention"] == "sdpa" and written["kernels"]["gdn"] == "torch"

    assert main(["train", "plan/train.yaml"]) == 2
    line = _one_error_line(capsys)
    named = re.findall(r"--set (\S+)=\.\.\.", line)
    assert sorted(named) == ["data.path", "data.tokenizer", "init_from"], line
    assert not Path(written["run"]["out_dir"]).exists()  # refused before anything was created
    fill = {"init_from": str(tmp_path / "base"), "data.path": "data.jsonl", "data.tokenizer": "byte"}
    assert main(["train", "plan/train.yaml", *[a for k in named for a in ("--set", f"{k}={fill[k]}")]]) == 0
    out = Path(written["run"]["out_dir"])
    records = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["loss"] == r["loss"] for r in steps)
    meta = json.loads(next(out.glob("checkpoints/step_*/meta.json")).read_text())
    assert str(tmp_path / "base") in json.dumps(meta)  # the run started from the base it was given


# ---- one budget: q38 plan --train FILE prints the figures --search priced -------------------------------------


def test_plan_train_prints_one_budget_equal_to_the_search(tmp_path, monkeypatch, capsys):
    """A LoRA (FP8 base) search over 2 ranks writes its run; ``q38 plan --train`` on it prints one set of figures:
    one memory total, the LoRA dtypes (a frozen fp8 base, fp32 adapter masters; no full fp32 state priced above the
    budget), and the peak and step time the search wrote in the file's first line."""
    monkeypatch.chdir(tmp_path)
    model = _model_yaml(tmp_path)
    common = ["--model", model, "--world", "2", "--hardware", "h200"]
    assert plan_cli([*common, "--search", "--seq-len", "64", "--global-batch", "4", "--lora-rank", "4",
                     "--lora-base-dtype", "fp8", "--out", "best"]) == 0
    capsys.readouterr()
    step, peak, gb = _header(tmp_path / "best" / "train.yaml")
    assert gb == 4
    (tmp_path / "elsewhere").mkdir()  # the written layout is read beside the run config, from any directory
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert plan_cli([*common, "--train", str(tmp_path / "best" / "train.yaml")]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^  total ", out, flags=re.M)) == 1, out  # one memory total: the budget's
    assert f"peak {_fmt_bytes(peak)} in the" in out and f"step time on h200: {_fmt_s(step)} =" in out
    # no full fp32 state priced above the budget: every master-weight figure is the adapters' (both phases)
    assert "fullest rank      rank 0" not in out and "FSDP traffic per step" not in out
    masters = set(re.findall(r"^  (?:adapter )?master weights +([\d.,]+ \S+)", out, flags=re.M))
    assert len(masters) == 1, masters
    assert re.search(r"^  frozen base +fp8 ", out, flags=re.M) and re.search(r"^  adapter masters +fp32 ", out,
                                                                               flags=re.M)
    assert out.count("dtypes (") == 1


# ---- settings the run refuses are not written, and the loader refuses them up front --------------------------


def test_ep_balance_is_priced_and_written_off_for_lora(tmp_path, monkeypatch, capsys):
    """A run config with ``train.enable_ep_balance: true`` planned as a LoRA run: the budget has no duplicated
    experts (the full fine-tune's has), stderr says it is off, and the written run config has it false."""
    monkeypatch.chdir(tmp_path)
    model = _model_yaml(tmp_path)
    (tmp_path / "pre.yaml").write_text(yaml.safe_dump({"model": model, "layout": "fsdp_ep", "train": {
        "enable_ep_balance": True}, "data": {"seq_len": 64, "batch_size": 2}}))
    common = ["--model", model, "--world", "2", "--hardware", "h200", "--train", "pre.yaml"]
    assert plan_cli(common) == 0
    assert "EP-balance duplicate experts" in capsys.readouterr().out  # the full fine-tune prices them
    assert plan_cli([*common, "--lora-rank", "4"]) == 0
    cap = capsys.readouterr()
    assert "EP-balance duplicate experts" not in cap.out
    assert "train.enable_ep_balance from pre.yaml: off" in cap.err
    assert plan_cli([*common, "--lora-rank", "4", "--search", "--out", "o", "--memory-cap", "1"]) == 0
    assert yaml.safe_load((tmp_path / "o" / "train.yaml").read_text())["train"]["enable_ep_balance"] is False


def test_ep_balance_with_lora_is_refused_before_any_weight_is_read(tmp_path, capsys):
    """``peft`` with ``train.enable_ep_balance: true``: ``q38 train`` refuses in one line when it reads the config
    (the base's weights file is not a safetensors file: reading it would be another error), nothing is created, and
    ``q38 plan --train`` refuses the same file."""
    from q38.hf import save_hf
    from q38.model import init_params

    base = save_hf(tmp_path / "base", CFG, init_params(CFG, seed=1))
    for f in base.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    out = tmp_path / "run"
    run = {"model": str(base), "init_from": str(base), "layout": "fsdp_ep", "peft": {"rank": 4},
           "data": {"path": "builtin:tiny", "seq_len": 32, "batch_size": 2},
           "train": {"enable_ep_balance": True}, "run": {"out_dir": str(out), "steps": 1}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    want = "train.enable_ep_balance with a peft section (LoRA, base_dtype compute) is not implemented"
    assert main(["train", str(tmp_path / "run.yaml")]) == 2
    line = _one_error_line(capsys)
    assert want in line and "set train.enable_ep_balance: false" in line, line
    assert not out.exists()
    for base_dtype in ("fp8",):
        (tmp_path / "fp8.yaml").write_text(yaml.safe_dump({**run, "peft": {"rank": 4, "base_dtype": base_dtype}}))
        assert main(["plan", "--model", str(base), "--world", "2", "--hardware", "h200", "--train",
                     str(tmp_path / "fp8.yaml")]) == 2
        assert "(LoRA, base_dtype fp8) is not implemented" in _one_error_line(capsys)


# ---- where the plan writes ---------------------------------------------------------------------------------------


def test_search_without_out_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model = _model_yaml(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert plan_cli(["--model", model, "--world", "2", "--hardware", "h200", "--search", "--seq-len", "64",
                     "--global-batch", "4"]) == 0
    assert "not written: add --out DIR" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("args,opt", [(["--out", "o"], "--out"), (["--search", "--init-from", "b"], "--init-from"),
                                      (["--search", "--steps", "3"], "--steps")])
def test_out_options_without_their_command_are_one_line(tmp_path, monkeypatch, capsys, args, opt):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", _model_yaml(tmp_path), "--world", "2", "--hardware", "h200", *args]) == 2
    line = _one_error_line(capsys)
    assert opt in line and "q38 plan --search" in line
    assert not (tmp_path / "o").exists()


def test_fewest_ranks_out_writes_the_winner_of_each_row(tmp_path, monkeypatch, capsys):
    """``--search --fewest-ranks --out DIR`` for a LoRA (FP8 base) plan: one subdirectory a row, named for it, each
    holding the row's layout and run config; each file's first line has the row's printed peak and step time, the
    LoRA rows keep their base dtype and the full fine-tune row has no peft section; each loads and passes ``q38
    train``'s checks at the row's world size."""
    from q38.errors import unfilled
    from q38.train.run.launch import check_run
    from q38.train.run.run_config import RunConfig

    monkeypatch.chdir(tmp_path)
    model = _model_yaml(tmp_path)
    assert plan_cli(["--model", model, "--world", "8", "--hardware", "h200", "--search", "--fewest-ranks",
                     "--seq-len", "64", "--global-batch", "8", "--lora-rank", "4", "--lora-base-dtype", "fp8",
                     "--out", "rows"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^  (.*?): (\d+) \(.*?; peak (.*?) per device, step (.*?), MFU", out, flags=re.M)
    assert len(rows) == 4, out
    slugs = {"LoRA rank 4 (per_expert experts, FP8 base)": "lora_fp8",
             "LoRA rank 4 (per_expert experts, base in the compute dtype)": "lora_compute",
             "LoRA rank 4 (FP8 base) on the full fine-tune's 8": "lora_fp8_on_8"}
    assert sorted(p.name for p in (tmp_path / "rows").iterdir()) == sorted(
        ["lora_fp8", "lora_compute", "full_finetune", "lora_fp8_on_8"])
    for name, world, peak, step in rows:
        slug = slugs.get(name, "full_finetune" if name.startswith("full fine-tune") else None)
        path = tmp_path / "rows" / slug / "train.yaml"
        s, p, gb = _header(path)
        assert (_fmt_bytes(p), _fmt_s(s), gb) == (peak, step, 8), (name, path)
        written = yaml.safe_load(path.read_text())
        assert written.get("peft", {}).get("base_dtype") == {"lora_compute": "compute", "full_finetune": None}.get(
            slug, "fp8")
        # every row of a fine-tune plan is a fine-tune: its base, data and tokenizer are left to fill
        assert [k for k, _ in unfilled(written)] == ["init_from", "data.path", "data.tokenizer"], slug
        cfg = RunConfig.from_yaml(path, {"kernels.gdn": "auto", "kernels.attention": "auto"}, placeholders="ignore")
        check_run(cfg, world_size=int(world))
    # the directory is the plan's own output now: a second run may write into it
    assert plan_cli(["--model", model, "--world", "8", "--hardware", "h200", "--search", "--seq-len", "64",
                     "--global-batch", "8", "--out", "rows"]) == 0


def test_init_from_data_and_tokenizer_on_the_plan_command_line_leave_nothing_to_fill(tmp_path, monkeypatch, capsys):
    """``--init-from DIR --data PATH`` fill what would be placeholders (absolute paths: the file runs from any
    directory); the tokenizer is the base directory's when it holds ``tokenizer.json``; the run config loads as
    written. A pre-training plan (no LoRA, no ``--finetune``) writes no placeholder and keeps its schedule."""
    from q38.errors import unfilled
    from q38.train.run.run_config import RunConfig

    monkeypatch.chdir(tmp_path)
    model = _model_yaml(tmp_path)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")  # read by nothing here: the plan only names it
    (tmp_path / "base" / "tokenizer.json").write_text("{}")
    (tmp_path / "chat.jsonl").write_text('{"text": "hello"}\n')
    common = ["--model", model, "--world", "1", "--hardware", "h200", "--search", "--seq-len", "32", "--global-batch",
              "2"]
    assert plan_cli([*common, "--init-from", "base", "--data", "chat.jsonl", "--out", "ft"]) == 0
    written = yaml.safe_load((tmp_path / "ft" / "train.yaml").read_text())
    assert unfilled(written) == []
    assert written["init_from"] == written["data"]["tokenizer"] == str(tmp_path / "base")
    assert written["data"]["path"] == str(tmp_path / "chat.jsonl")
    assert written["run"]["steps"] == written["train"]["total_steps"] == 1000 and written["train"]["lr"] == 1e-5
    assert "peft" not in written and written["run"]["out_dir"] == "runs/model_finetune"
    (tmp_path / "pre.yaml").write_text(yaml.safe_dump({"model": model, "data": {"path": "corpus.jsonl"},
                                                       "train": {"lr": 3e-4, "total_steps": 5000},
                                                       "run": {"steps": 5000}}))
    assert plan_cli([*common, "--train", "pre.yaml", "--out", "pre"]) == 0
    pre = yaml.safe_load((tmp_path / "pre" / "train.yaml").read_text())
    assert unfilled(pre) == [] and "init_from" not in pre and pre["data"]["path"] == "corpus.jsonl"
    assert pre["train"]["lr"] == 3e-4 and pre["run"]["steps"] == pre["train"]["total_steps"] == 5000
    capsys.readouterr()
    RunConfig.from_yaml(tmp_path / "pre" / "train.yaml")  # no placeholder to refuse


def test_a_lean_state_file_prints_its_own_dtypes_and_one_total(tmp_path, capsys):
    """``q38 plan --train FILE`` of a full fine-tune with int8 moments and bf16 + remainder masters: the dtype block
    says so (not fp32 moments), and the one memory total is the budget's, whose moments item is the int8 size."""
    model = _model_yaml(tmp_path)
    (tmp_path / "lean.yaml").write_text(yaml.safe_dump({"model": model, "layout": "fsdp", "data": {
        "seq_len": 64, "batch_size": 2}, "train": {"param_dtype": "bfloat16", "moment_dtype": "int8",
                                                    "master_dtype": "bfloat16_remainder"}}))
    assert plan_cli(["--model", model, "--world", "2", "--train", str(tmp_path / "lean.yaml")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  AdamW moments +int8 ", out, flags=re.M) and re.search(r"^  master weights +bf16\+remainder ",
                                                                                 out, flags=re.M)
    assert len(re.findall(r"^  total ", out, flags=re.M)) == 1 and "optimizer moments" in out
