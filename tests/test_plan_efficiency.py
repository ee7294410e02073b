"""``q38 plan`` prices each op at the efficiency of the kernel the run resolves: the work each attention kernel
executes (against a brute-force count over the dense mask), the profiles' tables, the resolver followed (also for
kernels that are being wired in, through a patched registry), and the measured-efficiency file."""

import json

import attrs
import pytest
import torch

from q38.cli import plan_cli
from q38.model_config import ConfigError, ModelConfig
from q38.parallel.budget import Hardware, estimate
from q38.parallel.efficiency import KNOWN_IMPLS, PRICED_OPS, keys_per_query, read_measured
from q38.parallel.layout import Layout

PROD = ["--model", "qwen3_8_2_4t", "--layout", "qwen3_8_2_4t", "--world", "1024", "--hardware", "h200"]


def _brute(S: int, cp: int, L: int, block: int = 128) -> dict[str, float]:
    """Keys per query from the dense [S, S] mask of documents of ``L`` tokens: causal, per document, and the
    128-blocks FlexAttention computes (over whole rows: the CP ranks' shards together)."""
    q = torch.arange(S)
    causal = q[:, None] >= q[None, :]
    doc = causal & ((q[:, None] // L) == (q[None, :] // L))
    nb = S // block
    blocks = doc.reshape(nb, block, nb, block).any(3).any(1).sum().item()
    return {"dense": float(S), "causal": causal.sum().item() / S, "documents": doc.sum().item() / S,
            "blocks": blocks * block * block / S}


@pytest.mark.parametrize("S,cp,L", [(1024, 1, 200), (1024, 2, 256), (2048, 4, 300), (1024, 1, 4096)])
def test_attention_work_equals_a_count_over_the_dense_mask(S, cp, L):
    want = _brute(S, cp, L)
    for work, n in want.items():
        assert keys_per_query(work, S // cp, cp, L) == pytest.approx(n, rel=1e-12), work


SHIPPED = ["h100", "h200", "b200", "gb200", "ascend_910b"]


def _entries(hw):
    for e in (*hw.efficiency, *hw.collectives):
        yield e
        if e.narrow is not None:
            yield e.narrow[1]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_profile_entry_is_sourced_and_the_production_ops_are_in_the_table(name):
    """No shipped efficiency is assumed without a range that says so; every figure of every profile names its
    source; the collectives are priced for every kind and link."""
    import yaml

    from q38.model_config import SPECS_DIR
    from q38.parallel.efficiency import COLLECTIVE_KINDS
    from q38.parallel.hardware import _BOUNDS

    hw = Hardware.load(name)
    assert hw.efficiency and {e.op for e in hw.efficiency} == set(PRICED_OPS)
    assert {(e.op, e.impl) for e in hw.collectives} == {(k, link) for k in COLLECTIVE_KINDS for link in ("intra",
                                                                                                        "inter")}
    for e in _entries(hw):
        assert e.impl in KNOWN_IMPLS.get(e.op, ("intra", "inter"))
        assert 0 < e.low <= e.value <= e.high <= 1 and e.value == pytest.approx((e.low + e.high) / 2)
        assert e.status in ("published", "assumed") and len(e.source) > 20  # nothing is measured yet
        if e.status == "assumed":
            assert e.low < e.high, (e.op, e.impl)  # an assumption carries its spread
    raw = yaml.safe_load((SPECS_DIR / "hardware" / f"{name}.yaml").read_text())
    numbers = [k for k in raw if k in _BOUNDS or k == "achievable_fraction"]  # YAML reads 989.4e12 as a string
    assert len(numbers) >= 8 and all(len(hw.sources[k]) > 15 for k in numbers), set(numbers) - set(hw.sources)
    if hw.device == "cuda":  # every kernel the plan can resolve on CUDA is priced from the table, not the fallback
        for op, impls in (("attention", ("eager", "sdpa", "flex", "varlen")), ("gdn", ("torch", "fla")),
                          ("experts", ("grouped_mm", "batched")), ("loss", ("torch", "compiled"))):
            for impl in impls:
                assert "no entry" not in hw.price(op, impl).describe(), (op, impl)


def test_a_malformed_profile_entry_is_one_line(tmp_path):
    import yaml

    from q38.model_config import SPECS_DIR

    raw = yaml.safe_load((SPECS_DIR / "hardware" / "h200.yaml").read_text())
    raw["efficiency"]["attention"]["flex"] = {"efficiency": [0.2, 0.3], "status": "assumed"}
    base = tmp_path / "hw.yaml"
    base.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"efficiency.attention.flex: a assumed efficiency needs source"):
        Hardware.load(str(base))
    raw["efficiency"]["attention"]["flash9"] = {"efficiency": [0.2, 0.3], "status": "assumed", "source": "x"}
    del raw["efficiency"]["attention"]["flex"]
    base.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"unknown attention implementation 'flash9'"):
        Hardware.load(str(base))


def _ops(out: str) -> dict[str, list[str]]:
    lines = out.split("compute per op on")[1].splitlines()[2:7]
    return {ln.split()[0]: ln.split() for ln in lines}


def test_the_plan_prices_what_the_resolver_picks_and_names_the_fallbacks(capsys):
    from q38.kernels import KernelConfig, resolve_kernels

    assert plan_cli(PROD) == 0
    out = capsys.readouterr().out
    ops = _ops(out)
    want = resolve_kernels(KernelConfig(), device="cuda", cp=True, dtype="bfloat16", environment=False)
    for op, reg in (("attention", "attention"), ("gdn", "gdn"), ("experts", "experts"), ("loss", "loss")):
        assert ops[op][1] == getattr(want, reg), (op, ops[op])
    assert "kernels: with what the run resolves" in out and "with the torch fallbacks (attention sdpa, gdn torch)" in out


def test_the_plan_follows_a_resolver_that_picks_fused_kernels_under_cp(capsys, monkeypatch):
    """Once flex and FLA serve CP (helpers' branches), the plan prices them with no change of its own: here the
    registry is patched to say so."""
    import q38.kernels as K

    monkeypatch.setitem(K.REGISTRY, "attention", {
        "flex": K.KernelImpl(devices=("cuda",), cp=True, packed=True, backward=True,
                             fn="q38.layers.attention:sdpa_attention"), **K.REGISTRY["attention"]})
    monkeypatch.setitem(K.REGISTRY["gdn"], "fla", attrs.evolve(K.REGISTRY["gdn"]["fla"], cp=True))
    assert plan_cli(PROD) == 0
    out = capsys.readouterr().out
    ops = _ops(out)
    assert ops["attention"][1] == "flex" and ops["gdn"][1] == "fla"
    line = next(ln for ln in out.splitlines() if ln.startswith("kernels: with what the run resolves"))
    auto, fallback = [float(part.split("MFU ")[1].split("%")[0]) for part in line.split("; with the torch")]
    assert auto > fallback + 3  # fused attention and GDN are worth several points of MFU on this layout


def test_priced_ops_cover_every_executed_flop():
    cfg = ModelConfig.preset("tiny")
    hw = Hardware.load("h200")
    from q38.kernels import KernelConfig, resolve_kernels

    kc = resolve_kernels(KernelConfig(attention="sdpa"), device="cuda", dtype="bfloat16", environment=False,
                         packed=False)
    b = estimate(cfg, Layout.preset("fsdp"), 2, seq_len=128, rows_per_rank=2, recompute="full", hardware=hw,
                 kernels=kc, packed_rows=False, micro_batches=2)
    f = b.flops
    assert sum(o.flops for o in b.ops) == pytest.approx(f.executed, rel=1e-12)  # sdpa causal: the model's count
    mem = {o.op: o for o in b.ops}["elementwise"]  # the memory-bound ops: bytes at the HBM share, no FLOPs
    assert mem.flops == 0 and mem.seconds == pytest.approx(mem.bytes / (hw.hbm_bandwidth * mem.efficiency.value))
    assert b.compute_s == pytest.approx(sum(o.flops / (hw.peak_bf16_flops * o.efficiency.value) for o in b.ops
                                            if o is not mem) + mem.seconds)
    packed = estimate(cfg, Layout.preset("fsdp"), 2, seq_len=128, rows_per_rank=2, hardware=hw, kernels=kc,
                      doc_len=32)
    att = {o.op: o for o in packed.ops}["attention"]
    assert att.flops == pytest.approx(packed.flops.attention * 128 / (129 / 2))  # the dense mask: every pair


def test_measured_efficiencies_replace_the_assumed_ones(tmp_path, capsys):
    p = tmp_path / "eff.jsonl"
    p.write_text(json.dumps({"op": "attention", "impl": "flex", "tflops": 98.94, "dtype": "bf16", "device": "H200",
                             "command": "python benchmarks/efficiency.py", "date": "2026-12-02"}) + "\n\n"
                 + json.dumps({"op": "matmul", "impl": "torch", "efficiency": 0.66, "device": "H200",
                               "command": "x", "date": "2026-12-02"}) + "\n")
    hw = Hardware.load("h200")
    got = {(e.op, e.impl): e for e in read_measured(p, hw.peak)}
    assert got["attention", "flex"].value == pytest.approx(0.1, rel=1e-3) and got["matmul", "torch"].value == 0.66
    assert plan_cli([*PROD, "--efficiencies", str(p)]) == 0
    ops = _ops(capsys.readouterr().out)
    assert ops["attention"][3] == "0.10" and "measured 2026-12-02 on H200: python benchmarks/efficiency.py" in \
        " ".join(ops["attention"])
    assert ops["gdn"][1] == "fla" and ops["gdn"][3] == "0.03-0.06"  # not in the file: the profile's range


@pytest.mark.parametrize("line,msg", [
    ('{"op": "attention", "impl": "sdpa", "tflops": 1.0}', "missing ['device', 'command']"),
    ('{"op": "attn", "impl": "sdpa", "efficiency": 0.1, "device": "d", "command": "c", "date": "t"}',
     "unknown op 'attn'"),
    ('{"op": "attention", "impl": "sdpa", "efficiency": 1.5, "device": "d", "command": "c", "date": "t"}',
     "efficiency must be in (0, 1]"),
    ('{"op": "attention", "impl": "sdpa", "efficiency": 0.1, "tflops": 1.0, "device": "d", "command": "c"}',
     "exactly one of"),
    ("not json", "not a JSON object"),
])
def test_a_bad_measured_line_is_one_line_naming_file_and_line(tmp_path, capsys, line, msg):
    p = tmp_path / "eff.jsonl"
    p.write_text(line + "\n")
    assert plan_cli([*PROD, "--efficiencies", str(p)]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("settings from")]
    assert len(err) == 1 and f"{p}:1" in err[0] and msg in err[0], err
