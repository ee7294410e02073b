"""``q38 plan --search`` and ``--fewest-ranks`` explore the pipeline axis (docs/parallel.md#the-pipeline-axis): ``pp``
dividing the world and at most the model's layers, 1F1B with at least ``pp`` micro-batches, the automatic stage split
written explicit; a pp candidate wins where it keeps every collective but its point-to-point activations off a slow
link, and ``--out`` writes the layout it priced, whose plan is the search's row and whose run starts. On a model whose
every dimension differs from the ``tiny`` preset's."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from q38.cli import plan_cli
from q38.kernels import KernelConfig
from q38.model_config import SPECS_DIR
from q38.parallel.budget import Hardware, estimate
from q38.parallel.budget_result import _fmt_bytes, _fmt_s
from q38.parallel.layout import Layout
from q38.parallel.pipeline import stage_split
from q38.parallel.search import fewest_ranks, pipeline_sizes, search
from tests.model_utils import PLAN_CFG, dims_like_tiny

CFG = PLAN_CFG  # unlike tiny in every dimension
CPU_KERNELS = {"attention": "sdpa", "gdn": "torch", "experts": "batched"}
KW = {"param_dtype": "fp32", "reduce_dtype": "fp32", "kernels": KernelConfig.from_dict(CPU_KERNELS)}


def test_the_model_is_unlike_tiny():
    assert dims_like_tiny(CFG) == []


def _slow_link(tmp_path) -> str:
    """The H200 profile with one device a node and a 100 MB/s link between nodes: every collective but a pipeline's
    point-to-point activations crosses it."""
    raw = yaml.safe_load((SPECS_DIR / "hardware" / "h200.yaml").read_text())
    raw.update(name="slow_link", devices_per_node=1, inter_node_bandwidth=1.0e8)
    p = tmp_path / "slow_link.yaml"
    p.write_text(yaml.safe_dump(raw))
    return str(p)


def test_pipeline_sizes_divide_the_world_and_stay_within_the_layers():
    assert pipeline_sizes(CFG, 8) == [2]  # 2 layers: pp 2 at most
    six = CFG.replace(num_hidden_layers=6, layer_types=("linear_attention", "full_attention") * 3)
    assert pipeline_sizes(six, 12) == [2, 3, 4, 6] and pipeline_sizes(six, 7) == []
    assert pipeline_sizes(six.replace(tie_word_embeddings=True), 12) == []  # a pipeline refuses tied embeddings


def test_search_picks_pp_on_a_slow_link_and_its_row_is_the_layouts_plan(tmp_path):
    hw = Hardware.load(_slow_link(tmp_path))
    cands, _ = search(CFG, 2, hw, seq_len=32, global_batch=4, **KW)
    pp = [c for c in cands if dict(c.budget.mesh).get("pp", 1) > 1]
    assert pp and len(pp) < len(cands)  # both kinds priced
    assert all(c.budget.micro_batches >= dict(c.budget.mesh)["pp"] for c in pp)  # 1F1B: m >= pp
    best = cands[0]
    assert dict(best.budget.mesh) == {"pp": 2, "fsdp": 1}, best.mesh
    fastest_plain = min(c.budget.step_s for c in cands if c not in pp)
    assert best.budget.step_s < fastest_plain
    # the layout states the split it was priced with: the automatic one, explicit
    layout = Layout.from_dict(best.layout_dict)
    auto = Layout.from_dict({**best.layout_dict, "pipeline": {"schedule": "1f1b", "stages": "auto"}})
    assert [list(r) for r in best.layout_dict["pipeline"]["stages"]] == [[c.first, c.last]
                                                                         for c in stage_split(auto, CFG)]
    again = estimate(CFG, layout, 2, seq_len=32, rows_per_rank=best.budget.rows_per_rank,
                     micro_batches=best.budget.micro_batches, recompute=best.budget.recompute, hardware=hw,
                     ep_dispatch=best.ep_dispatch, **{**KW, "kernels": best.budget.kernels})
    assert again.peak_bytes == best.budget.peak_bytes and again.step_s == best.budget.step_s
    assert [r.layers for r in again.pipeline] == [((0, 0),), ((1, 1),)]


def test_fewest_ranks_finds_a_pp_layout_when_one_rank_is_over_the_cap(tmp_path, capsys):
    hw = Hardware.load(_slow_link(tmp_path))
    least = min(c.budget.peak_bytes for c in search(CFG, 1, hw, seq_len=32, global_batch=4, **KW)[0])
    cap = 0.99 * least  # one device does not fit; two do, and the fastest of two is pipelined
    world, c = fewest_ranks(CFG, hw, 4, seq_len=32, global_batch=4, memory_cap=cap, **KW)
    assert world == 2 and dict(c.budget.mesh).get("pp") == 2, c.mesh
    # the command line shows the pp row
    model = tmp_path / "model.yaml"
    model.write_text(yaml.safe_dump(CFG.to_dict()))
    train = tmp_path / "mine.yaml"
    train.write_text(yaml.safe_dump({"model": str(model), "kernels": CPU_KERNELS, "train": {"param_dtype": "float32"}}))
    assert plan_cli(["--model", str(model), "--world", "4", "--hardware", _slow_link(tmp_path), "--train", str(train),
                     "--seq-len", "32", "--global-batch", "4", "--search", "--fewest-ranks",
                     "--memory-cap", repr(cap / 2**30)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"planned state .*: 2 \(pp=2 × fsdp=1,", out), out


def _header(path) -> tuple[float, float]:
    head = Path(path).read_text().splitlines()[0]
    m = re.search(r"\(([0-9.e+-]+) s\).* \(([0-9]+) B\) a rank", head)
    assert m, head
    return float(m.group(1)), float(m.group(2))


@pytest.mark.slow  # a 2-rank search, q38 plan --train, and q38 train on 2 processes (torchrun): ~1-2 min on 2 cores
def test_search_out_writes_the_pp_layout_it_priced_and_the_run_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model.yaml"
    model.write_text(yaml.safe_dump(CFG.to_dict()))
    hw = _slow_link(tmp_path)
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({
        "model": str(model), "kernels": CPU_KERNELS,
        "data": {"path": "builtin:tiny", "tokenizer": "byte"},
        "train": {"param_dtype": "float32", "loss_chunk_size": 64, "aux_loss_scope": "global_batch"},
        "run": {"steps": 1, "log_every": 1, "progress": False, "out_dir": str(tmp_path / "run")}}))
    common = ["--model", str(model), "--world", "2", "--hardware", hw]
    assert plan_cli([*common, "--search", "--train", "mine.yaml", "--seq-len", "32", "--global-batch", "4",
                     "--out", "plan"]) == 0
    capsys.readouterr()
    written = yaml.safe_load((tmp_path / "plan" / "train.yaml").read_text())
    lay = Layout.load(str(tmp_path / "plan" / written["layout"]))
    assert lay.pp == 2 and [list(r) for r in lay.pipeline.stages] == [[0, 0], [1, 1]]
    assert written["train"]["micro_batches"] >= 2
    # q38 plan on the written run prints the figures the search wrote in its first line
    step, peak = _header(tmp_path / "plan" / "train.yaml")
    assert plan_cli([*common, "--train", str(tmp_path / "plan" / "train.yaml")]) == 0
    out = capsys.readouterr().out
    assert f"peak {_fmt_bytes(peak)} in the" in out and f"step time on slow_link: {_fmt_s(step)} =" in out
    # and the run starts: q38 train on 2 processes, one step
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                        "q38.cli", "train", str(tmp_path / "plan" / "train.yaml")], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [yaml.safe_load(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records if "loss" in x] == [1]


def test_fewest_ranks_prints_the_fastest_pp_layout_beside_a_row_without_one():
    """On the H200 profile (eight devices a node, NVLink inside) a pipeline only adds its bubble and more
    micro-batches: the row's layout has no pp, and the line under it names the fastest pipelined one and its cost."""
    from q38.parallel.search import FewestRow, format_fewest

    hw = Hardware.load("h200")
    world, c = fewest_ranks(CFG, hw, 8, seq_len=32, global_batch=8, **KW)
    assert world == 8 and "pp" not in dict(c.budget.mesh)
    alt = c.pp_alternative
    assert alt is not None and dict(alt.budget.mesh)["pp"] == 2 and alt.budget.step_s >= c.budget.step_s
    text = format_fewest([FewestRow("full fine-tune", "planned", {}, (world, c))], hw, 8, seq_len=32, global_batch=8)
    assert f"    with pp: {alt.mesh}, recompute {alt.budget.recompute}" in text
    assert f"({alt.budget.step_s / c.budget.step_s:.2f} × the row's)" in text
