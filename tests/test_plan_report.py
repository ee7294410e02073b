"""What ``q38 plan`` prints: one dtype block (one line per role, from the run config's precision settings, the same
for the plan and the budget sections) and one tokens-per-rank figure, equal to what the runtime's batch sharding
(``q38.parallel.mesh.shard_batch``) leaves on each rank."""

import re

import pytest
import torch
import yaml

from q38.cli import plan_cli
from q38.parallel.precision import Precision

ROLES = [role for role, _, _ in Precision().roles()]
TINY = ["--model", "tiny", "--layout", "fsdp_cp", "--world", "4", "--seq-len", "128", "--global-batch", "4"]


def _run(capsys, *args) -> str:
    assert plan_cli([*TINY, *args]) == 0
    return capsys.readouterr().out


def _dtypes(out: str) -> dict[str, str]:
    """role -> dtype, from the report's dtype lines; each role must have exactly one."""
    found = {}
    for role in ROLES:
        lines = re.findall(rf"^  {role} +(fp32|bf16|fp16) ", out, flags=re.M)
        assert len(lines) == 1, (role, lines)
        found[role] = lines[0]
    return found


def _gib(out: str, label: str) -> float:
    m = re.search(rf"^  {label} +([\d,.]+) (B|KiB|MiB|GiB)", out, flags=re.M)
    return float(m.group(1).replace(",", "")) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]


def test_one_dtype_line_per_role_from_the_run_config(tmp_path, capsys):
    """The run config's ``train.param_dtype`` / ``reduce_dtype`` set the dtype block, and both sections follow it:
    the plan's all-gathers halve with bf16 compute, the budget casts shards only when compute differs from the
    masters; ``--dtype`` overrides the run config; with neither, fp32 as ``q38 train``."""
    bf16 = tmp_path / "bf16.yaml"
    bf16.write_text(yaml.safe_dump({"train": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}))
    run_dtype = tmp_path / "run_dtype.yaml"
    run_dtype.write_text(yaml.safe_dump({"run": {"dtype": "bfloat16"}}))
    outs = {name: _run(capsys, "--hardware", "h200", *args) for name, args in (
        ("bf16", ["--train", str(bf16)]), ("run.dtype", ["--train", str(run_dtype)]),
        ("--dtype", ["--train", str(bf16), "--dtype", "fp32"]), ("default", []))}
    want_bf16 = {"master weights": "fp32", "AdamW moments": "fp32", "gradients": "fp32", "params": "bf16",
                 "activations": "bf16"}
    assert _dtypes(outs["bf16"]) == _dtypes(outs["run.dtype"]) == want_bf16
    assert _dtypes(outs["--dtype"]) == _dtypes(outs["default"]) == dict.fromkeys(ROLES, "fp32")
    for out in outs.values():
        assert out.count("dtypes (") == 1 and "budget · tiny" in out  # one block, before both sections
    # printed with 2 decimals; the one set of figures is the budget's (its communication table)
    gather = r"all-gather backward \(reshard\) +\S+ +\S+"
    assert _gib(outs["--dtype"], gather) == pytest.approx(2 * _gib(outs["bf16"], gather), rel=1e-2)
    assert "compute-dtype copy of shards" in outs["bf16"] and "compute-dtype copy of shards" not in outs["--dtype"]
    reduced = _run(capsys, "--train", str(bf16), "--reduce-dtype", "bf16")
    assert _dtypes(reduced)["gradients"] == "bf16"
    # gradients are stored in reduce_dtype
    assert _gib(reduced, "gradients") == pytest.approx(_gib(reduced, "master weights") / 2, rel=1e-2)


class _Coords:
    """The DeviceMesh calls ``shard_batch`` makes, for one rank's coordinates (no process group needed)."""

    def __init__(self, coords: dict[str, int]):
        self.coords = coords

    def get_local_rank(self, name: str) -> int:
        return self.coords[name]


def test_one_tokens_per_rank_figure_equals_the_runtime_batch_sharding(capsys):
    """fsdp 2 × cp 2, 4 rows of 128 tokens: each rank keeps 2 rows of a 64-token slice (128 tokens); the report
    prints that figure once, and the budget's ``tokens_per_rank`` is it."""
    from q38.model_config import ModelConfig
    from q38.parallel.budget import estimate
    from q38.parallel.layout import Layout
    from q38.parallel.links import Topology
    from q38.parallel.mesh import Mesh, shard_batch

    out = _run(capsys)
    figures = re.findall(r"tokens per rank ([\d,]+)", out)
    assert len(figures) == 1 and "tokens per micro-batch" not in out and "per data-parallel rank" not in out
    printed = int(figures[0].replace(",", ""))

    cfg = ModelConfig.preset("tiny")
    layout = Layout.preset("fsdp_cp")
    sizes = layout.resolve_mesh(4)
    ids = torch.arange(4 * 128).reshape(4, 128) % cfg.vocab_size
    local = set()
    for f in range(sizes["fsdp"]):
        for c in range(sizes["cp"]):
            mesh = Mesh(_Coords({"fsdp": f, "cp": c}), layout, dict(sizes), Topology(4))
            sb = shard_batch({"input_ids": ids, "labels": ids.clone()}, mesh, cfg.mtp_num_layers)
            local.add(sb.input_ids.numel())
    assert local == {printed} == {128}
    b = estimate(cfg, layout, 4, seq_len=128, rows_per_rank=2)
    assert b.tokens_per_rank == printed
