"""``benchmarks/rl_arith.py`` (the GRPO-after-SFT arithmetic benchmark of docs/rl.md) runs end to end at its smoke
setting: data written, ``q38 train`` SFT, a GRPO run of each mode, the table printed. Its numbers are not asserted
(a few steps of each: meaningless); the model it trains is unlike the tiny preset in every dimension."""

import json

import pytest

from benchmarks import rl_arith
from q38 import ModelConfig
from q38.hf_config import load_model_config

DIMS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def test_the_benchmark_model_is_unlike_tiny():
    tiny, cfg = ModelConfig.preset("tiny"), load_model_config(str(rl_arith.MODEL))
    assert [k for k in DIMS if getattr(tiny, k) == getattr(cfg, k)] == []
    assert {"linear_attention", "full_attention"} <= set(cfg.layer_types) and cfg.num_experts > 1


def test_the_three_sets_are_disjoint_and_answered_right():
    items = rl_arith.problems(99, 9, 0)
    assert len(items) == 100 * 10 * 2 and items == rl_arith.problems(99, 9, 0) != rl_arith.problems(99, 9, 1)
    sft, rl, held = rl_arith.split(items, 512, 256)
    assert len(rl) == 512 and len(held) == 256 and len(sft) == len(items) - 768
    assert not ({q for q, _ in sft} & {q for q, _ in rl} or {q for q, _ in sft} & {q for q, _ in held}
                or {q for q, _ in rl} & {q for q, _ in held})
    for q, a in items[:50]:  # an answer computed here, not by the benchmark's own formula
        x, op, y, eq = q.split()
        assert eq == "=" and int(a) == (int(x) + int(y) if op == "+" else int(x) - int(y))


@pytest.mark.slow
def test_the_smoke_run_prints_the_table(tmp_path, capsys, one_thread):
    assert rl_arith.main(["--quick", "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "SFT:" in out and "held-out" in out
    rows = [ln.split("|")[1:3] for ln in out.splitlines() if ln.startswith(("| full |", "| lora |"))]
    assert [(m.strip(), s.strip()) for m, s in rows] == [("full", "0"), ("lora", "0")]
    rec = json.loads((tmp_path / "sft.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]
    assert all("answer" in json.loads(ln) for ln in (tmp_path / "held_out.jsonl").read_text().splitlines())
