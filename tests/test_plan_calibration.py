"""``q38 plan`` against what it can be checked with: sourced hardware profiles refused in one line when a figure is
missing or impossible, step time / tokens/s / MFU as ranges over the profiles' efficiency ranges (against a naive
count written here), and the published runs of this architecture (docs/plan.md#checked-against-published-runs)."""

import math

import pytest
import torch
import yaml

from q38.cli import plan_cli
from q38.kernels import KernelConfig, resolve_kernels
from q38.model_config import SPECS_DIR, ModelConfig
from q38.parallel.budget import Hardware, estimate
from q38.parallel.layout import Layout


def unlike_tiny() -> ModelConfig:
    """Every dimension differs from the tiny preset's."""
    return ModelConfig.preset("tiny").replace(
        vocab_size=400, hidden_size=40, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
        num_attention_heads=3, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=3,
        linear_key_head_dim=12, linear_value_head_dim=12, num_experts=12, num_experts_per_tok=3,
        moe_intermediate_size=28, shared_expert_intermediate_size=20, mtp_num_layers=1)


def test_the_model_is_unlike_tiny():
    tiny, cfg = ModelConfig.preset("tiny"), unlike_tiny()
    dims = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size")
    assert [k for k in dims if getattr(tiny, k) == getattr(cfg, k)] == []


# ---- a bad profile: one line naming the file, the key and the fix, before any pricing -------------------------------


def _set(raw: dict, path: str, value) -> None:
    *head, last = path.split(".")
    for k in head:
        raw = raw[k]
    if value is _DEL:
        del raw[last]
    else:
        raw[last] = value


_DEL = object()
BAD = [
    ("hbm_bandwidth", _DEL, "missing hardware key(s) ['hbm_bandwidth']"),
    ("hbm_bandwidth", -3.35e12, "hbm_bandwidth must be a positive finite number"),
    ("peak_bf16_flops", float("nan"), "peak_bf16_flops must be a positive finite number"),
    ("inter_node_bandwidth", 400.0, "inter_node_bandwidth = 400 is outside the plausible"),  # Gb/s, not bytes/s
    ("sources.hbm_bytes", _DEL, "no source for ['hbm_bytes']"),
    ("achievable_fraction", [0.6, 0.3], "achievable_fraction: the range's low end 0.6 is above its high end 0.3"),
    ("efficiency.matmul.torch.efficiency", [0.5, 1.2],
     "efficiency.matmul.torch.efficiency (high): efficiency must be in (0, 1]"),
    ("efficiency.gdn.fla.efficiency", [0.06, 0.03],
     "efficiency.gdn.fla.efficiency: the range's low end 0.06 is above its high end 0.03"),
    ("efficiency.loss.torch.efficiency", 0.4, "efficiency.loss.torch: an assumed efficiency must be a range"),
    ("efficiency.gdn.fla.efficiency", _DEL, "efficiency.gdn.fla.efficiency: missing efficiency"),
    ("efficiency.attention.flash9", {"efficiency": [0.1, 0.2], "status": "assumed", "source": "x"},
     "unknown attention implementation 'flash9'"),
    ("efficiency.conv", {"torch": {"efficiency": [0.1, 0.2], "status": "assumed", "source": "x"}},
     "unknown op 'conv'"),
    ("collectives.broadcast", {"intra": {"efficiency": [0.1, 0.2], "status": "assumed", "source": "x"}},
     "collectives.broadcast: unknown collective"),
    ("collectives.all_to_all.intra.efficiency", [0.0, 0.5], "collectives.all_to_all.intra.efficiency (low)"),
    ("efficiency.experts.grouped_mm.narrow.max_width", "wide", "efficiency.experts.grouped_mm.narrow: needs max_width"),
    ("hbm_efficiency", _DEL, "missing hbm_efficiency"),
    ("hbm_efficiency", [0.5, 1.5], "hbm_efficiency (high): efficiency must be in (0, 1]"),
]


@pytest.mark.parametrize("key,value,msg", BAD, ids=[b[0] + ":" + b[2][:24] for b in BAD])
def test_a_bad_profile_is_refused_in_one_line_before_pricing(tmp_path, capsys, key, value, msg):
    raw = yaml.safe_load((SPECS_DIR / "hardware" / "h100.yaml").read_text())
    _set(raw, key, value)
    p = tmp_path / "hw.yaml"
    p.write_text(yaml.safe_dump(raw))
    assert plan_cli(["--model", "tiny", "--layout", "fsdp", "--world", "2", "--hardware", str(p)]) == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("settings from")]
    assert len(lines) == 1 and str(p) in lines[0] and msg in lines[0], lines
    assert "budget" not in out  # refused before anything was priced


# ---- ranges ----------------------------------------------------------------------------------------------------------


def _budget(hw: Hardware, world: int = 1, layout: str = "fsdp", **kw):
    cfg = unlike_tiny()
    kc = resolve_kernels(KernelConfig(), device="cuda", dtype="bfloat16", environment=False, packed=True)
    return cfg, estimate(cfg, Layout.preset(layout), world, seq_len=256, rows_per_rank=2, param_dtype="bf16",
                         hardware=hw, kernels=kc, gdn_kernel=True, **kw)


def test_the_range_is_each_op_at_the_ends_of_its_efficiency_range():
    """One rank (no collective): the step's ends are each op's executed FLOPs at the low / high end of its kernel's
    range plus the optimizer, counted here from the profile table; the midpoint is the point estimate."""
    hw = Hardware.load("h100")
    cfg, b = _budget(hw)
    assert not b.comm
    table = {(e.op, e.impl): e for e in hw.efficiency}
    mem = next(o for o in b.ops if o.op == "elementwise")
    h_lo, h_hi = hw.hbm_efficiency
    slow, fast, mid = (mem.bytes / (hw.hbm_bandwidth * x) for x in (h_lo, h_hi, (h_lo + h_hi) / 2))
    for o in b.ops:
        if o.op == "elementwise":
            continue
        e = table[o.op, o.impl]
        width = cfg.moe_intermediate_size if o.op == "experts" else cfg.hidden_size
        if e.narrow is not None and width <= e.narrow[0]:
            e = e.narrow[1]
        slow += o.flops / (hw.peak_bf16_flops * e.low)
        fast += o.flops / (hw.peak_bf16_flops * e.high)
        mid += o.flops / (hw.peak_bf16_flops * (e.low + e.high) / 2)
    assert b.step_range == pytest.approx((fast + b.optimizer_s, slow + b.optimizer_s), rel=1e-9)
    assert b.step_s == pytest.approx(mid + b.optimizer_s, rel=1e-9)
    lo, hi = b.tokens_per_s_range
    assert lo == pytest.approx(b.global_tokens / (slow + b.optimizer_s)) and lo < b.tokens_per_s < hi
    mlo, mhi = b.mfu_range
    assert mlo < b.mfu < mhi
    # the op whose range alone moves the step most (the others at their fast end), counted here
    moves = {o.op: o.flops / hw.peak_bf16_flops * (1 / o.efficiency.low - 1 / o.efficiency.high) for o in b.ops}
    moves["elementwise"] = mem.bytes / hw.hbm_bandwidth * (1 / h_lo - 1 / h_hi)
    name, move = b.spread_driver
    assert name == max(moves, key=moves.get) and move == pytest.approx(moves[name], rel=1e-9)


def test_point_ranges_collapse_to_the_point_estimate(tmp_path):
    """Every efficiency a measured point and every collective at one share: the range is the point estimate, on a
    layout with collectives (2 ranks, FSDP x EP on two 1-GPU "nodes")."""
    raw = yaml.safe_load((SPECS_DIR / "hardware" / "h100.yaml").read_text())
    for impls in raw["efficiency"].values():
        for e in impls.values():
            e.update(efficiency=0.4, status="measured", command="c", date="2026-12-07", device="d")
            e.pop("source", None), e.pop("narrow", None)
    for links in raw["collectives"].values():
        for e in links.values():
            e.update(efficiency=0.8, status="measured", command="c", date="2026-12-07", device="d")
            e.pop("source", None)
    raw["devices_per_node"], raw["hbm_efficiency"] = 1, 0.8
    p = tmp_path / "hw.yaml"
    p.write_text(yaml.safe_dump(raw))
    _, b = _budget(Hardware.load(str(p)), world=2, layout="fsdp_ep")
    assert b.comm and any(t.link == "inter" for t in b.comm)
    assert b.step_range == pytest.approx((b.step_s, b.step_s), rel=1e-12)
    # the collectives priced at 0.8 of each link: the full-bandwidth time over 0.8
    full = Hardware.load(str(p))
    from q38.parallel.links import LinkModel

    lm = LinkModel(full.intra_node_bandwidth, full.inter_node_bandwidth)
    t = next(t for t in b.comm if t.link == "inter")
    assert t.seconds == pytest.approx(lm.seconds("all_gather" if "gather" in t.collective else "all_to_all"
                                                 if "all-to-all" in t.collective else "reduce_scatter",
                                                 t.bytes - t.inter_bytes, t.inter_bytes) / 0.8, rel=1e-9)


def test_the_plan_prints_the_ranges_and_what_dominates_them(capsys):
    assert plan_cli(["--model", "qwen3_5_35b_a3b", "--layout", "fsdp_ep", "--mesh", "ep=8", "--world", "16",
                     "--hardware", "h100", "--seq-len", "4096", "--global-batch", "512", "--dtype", "bf16",
                     "--micro-batches", "8", "--recompute", "selective_attention+gdn"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("range over the profile's efficiency"))
    assert "tokens/s (" in line and "a rank); MFU " in line and "the spread is dominated by elementwise" in line
    assert "memory-bound ops:" in out and "elementwise eager" in out


# ---- the published runs it can express -------------------------------------------------------------------------------

# Megatron-Bridge's measured runs (docs/plan.md#checked-against-published-runs): tokens/s per GPU and TFLOP/s per GPU
QWEN36_35B_16_H100 = (5885.0, 135.6)
QWEN3_NEXT_80B_128_H100 = 89.0


def _published(model: str, world: int, ep: int, global_batch: int, micro_batches: int, recompute: str):
    cfg = ModelConfig.preset(model)
    hw = Hardware.load("h100")
    kc = resolve_kernels(KernelConfig(), device="cuda", dtype="bfloat16", environment=False, packed=True)
    b = estimate(cfg, Layout.preset("fsdp_ep").with_mesh(ep=ep), world, seq_len=4096,
                 rows_per_rank=global_batch // world, micro_batches=micro_batches, recompute=recompute,
                 param_dtype="bf16", hardware=hw, kernels=kc, gdn_kernel=True)
    assert b.peak_bytes <= 0.9 * hw.hbm_bytes  # a layout q38 can run: it fits
    return b


def test_qwen3_next_80b_on_128_h100_is_at_most_a_quarter_above_the_published_run():
    """Megatron-Bridge: 89 TFLOP/s a GPU (EP32 PP4 VPP3, DeepEP). q38's nearest layout without a pipeline axis,
    fsdp 4 x ep 32, global batch 1024 of 4096 tokens: its fastest end at most 1.25 x the published figure (q38's
    FLOP count per GPU; the whole range lies below the published run: docs/plan.md#checked-against-published-runs)."""
    b = _published("qwen3_next_80b_a3b", 128, 32, 1024, 1, "selective_attention")
    fast, _ = b.step_range
    tflops = b.flops.model / fast / 1e12  # per GPU, q38's FLOP count
    assert tflops <= 1.25 * QWEN3_NEXT_80B_128_H100, tflops


def test_qwen3_5_35b_on_16_h100_is_at_most_a_quarter_above_the_published_run():
    """Megatron-Bridge: 5,885 tokens/s a GPU on real data (PP2 x EP8, HybridEP, CUDA graphs). q38's nearest layout,
    fsdp 2 x ep 8, global batch 512 of 4096 tokens, 8 micro-batches: the fastest end at most 1.25 x the published
    figure in tokens/s (independent of how either counts FLOPs), and the published figure inside the range."""
    b = _published("qwen3_5_35b_a3b", 16, 8, 512, 8, "selective_attention+gdn")
    lo, hi = (t / b.world for t in b.tokens_per_s_range)
    assert hi <= 1.25 * QWEN36_35B_16_H100[0], hi
    assert lo < QWEN36_35B_16_H100[0] < hi, (lo, hi)
    assert math.isfinite(hi)


# ---- the memory-bound traffic: the counter against a count by hand ---------------------------------------------------


def test_the_traffic_counter_counts_an_rms_norm_as_its_code_reads_and_writes():
    """q38's rms_norm forward on x [n, d] bf16 (norm.py: x.float(), pow, mean, + eps, rsqrt, w.float(), 1 + w,
    two products, the cast back): 6 + 8 + 4 + 8 + 8 + 6 = 40 n d + 24 n + 18 d bytes, counted by hand from the code."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from q38.layers.norm import rms_norm
    from q38.parallel.traffic import _Count

    n, d = 96, 40
    with FakeTensorMode():
        x = torch.empty(n, d, dtype=torch.bfloat16)
        w = torch.empty(d, dtype=torch.bfloat16)
        c = _Count()
        with c:
            rms_norm(x, w, 1e-6)
    assert c.bytes["forward"] == 40 * n * d + 24 * n + 18 * d


def test_the_layer_traffic_is_per_token_and_leaves_out_what_other_rows_price():
    """On the model unlike tiny: the count is almost all per token, does not change with the expert width (the routed
    experts are the experts row's), and grows with the expert count only by the router's few bytes."""
    from q38.parallel.traffic import layer_traffic

    cfg = unlike_tiny()
    t = layer_traffic(cfg)
    assert set(t.forward) == {"linear_attention", "full_attention"}
    assert all(v > 0 for v in (*t.forward.values(), *t.backward.values()))
    for ph in ("forward", "backward"):  # the per-call part (weight casts, weight-gradient sums): < 1 % of a 4096-row
        per, fixed = getattr(t, ph), getattr(t, f"{ph}_fixed")
        assert all(fixed[k] < 0.01 * per[k] * 4096 for k in per), (per, fixed)
    wider = layer_traffic(cfg.replace(moe_intermediate_size=52))
    assert wider.forward == pytest.approx(t.forward) and wider.backward == pytest.approx(t.backward)
    more = layer_traffic(cfg.replace(num_experts=24))  # only the router's logits, softmax and top-k grow
    assert all(0 < more.forward[k] - t.forward[k] < 0.05 * t.forward[k] for k in t.forward)


# ---- measured lines at several widths (benchmarks/gpu.sh measures the 2.4T and the 35B-A3B layer shapes) ------------


def test_measured_lines_at_two_widths_price_each_model_at_its_own(tmp_path):
    """Two lines of experts/grouped_mm, at expert widths 2048 and 512: a model whose experts are 512 wide (the
    35B-A3B) is priced at the narrow one, a 2048-wide one (the 2.4T preset) at the wide one; a line without a width
    is the widest."""
    import json

    from q38.parallel.efficiency import read_measured

    hw = Hardware.load("h100")
    line = {"op": "experts", "impl": "grouped_mm", "dtype": "bf16", "device": "H100", "command": "c", "date": "d"}
    p = tmp_path / "eff.jsonl"
    p.write_text("".join(json.dumps({**line, **extra}) + "\n" for extra in (
        {"width": 2048, "tflops": 494.7}, {"width": 512, "tflops": 197.9}, {"op": "matmul", "impl": "torch",
                                                                             "tflops": 600.0})))
    got = hw.with_measured(read_measured(p, hw.peak))
    assert got.price("experts", "grouped_mm", 2048).value == pytest.approx(0.5, rel=1e-3)
    assert got.price("experts", "grouped_mm", 512).value == pytest.approx(0.2, rel=1e-3)
    assert got.price("experts", "grouped_mm", 768).value == pytest.approx(0.5, rel=1e-3)  # above 512: the wide one
    assert got.price("matmul", "torch", 2048).status == "measured"  # no width: it serves every width
    cfg = ModelConfig.preset("qwen3_5_35b_a3b")
    kc = resolve_kernels(KernelConfig(), device="cuda", dtype="bfloat16", environment=False, packed=True)
    b = estimate(cfg, Layout.preset("fsdp_ep").with_mesh(ep=8), 16, seq_len=4096, rows_per_rank=1, param_dtype="bf16",
                 hardware=got, kernels=kc, gdn_kernel=True)
    assert {o.op: o for o in b.ops}["experts"].efficiency.value == pytest.approx(0.2, rel=1e-3)


def test_a_bad_width_is_one_line(tmp_path, capsys):
    p = tmp_path / "eff.jsonl"
    p.write_text('{"op": "matmul", "impl": "torch", "tflops": 600, "width": -1, "device": "d", "command": "c"}\n')
    assert plan_cli(["--model", "tiny", "--layout", "fsdp", "--world", "2", "--hardware", "h100",
                     "--efficiencies", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{p}:1: width must be a positive integer" in err[0]


def test_the_benchmark_measures_each_model_at_its_layer_shapes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("eff_bench", SPECS_DIR.parent / "benchmarks" / "efficiency.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    s = mod.shapes("qwen3_5_35b_a3b", 16384, 32, 4096)
    cfg = ModelConfig.preset("qwen3_5_35b_a3b")
    assert (s["d"], s["f"], s["vocab"], s["head_dim"]) == (cfg.hidden_size, cfg.moe_intermediate_size,
                                                           cfg.vocab_size, cfg.head_dim)
    assert s["slots"] // s["experts"] == 16384 * 8 // 32  # rows a local expert receives
