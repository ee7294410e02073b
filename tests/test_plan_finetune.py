"""``q38 plan`` for fine-tuning: an unmerged LoRA run (no weight gradient for the frozen base, the adapters' own GEMMs
and saved ``x·Aᵀ``), the optimizer phase as the donated step runs it against the pure step's, lean optimizer state
(bytes per parameter by dtype, host offload), the run ``--search --out`` writes planning back to the same figures,
and ``--fewest-ranks`` pricing the global batch ``--search`` prices. Expected values are hand counts from the model
config's dimensions, on a model whose every dimension differs from the ``tiny`` preset's."""

import math
import re

import pytest
import yaml

from q38.cli import plan_cli
from q38.lora import PeftConfig
from q38.model_config import ModelConfig
from q38.parallel.budget import Hardware, estimate
from q38.parallel.budget_result import _fmt_bytes, _fmt_s
from q38.parallel.layout import Layout

# every dimension differs from tiny's (hidden 64, 4 layers, 4/2 heads of 16, GDN 2/4 heads of 16, 8 experts top-2,
# widths 32, vocab 384)
DIMS = dict(vocab_size=500, hidden_size=96, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=3,
            head_dim=24, linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=24,
            linear_value_head_dim=32, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"])
SEQ, ROWS = 256, 4


def _cfg() -> ModelConfig:
    return ModelConfig.preset("tiny").replace(**{**DIMS, "layer_types": tuple(DIMS["layer_types"])})


def _model_yaml(tmp_path) -> str:
    from q38.model_config import SPECS_DIR

    raw = yaml.safe_load((SPECS_DIR / "models" / "tiny.yaml").read_text())
    raw.update(DIMS)
    p = tmp_path / "model.yaml"
    p.write_text(yaml.safe_dump(raw))
    return str(p)


def _single(**kw):
    return estimate(_cfg(), Layout.preset("single"), 1, seq_len=SEQ, rows_per_rank=ROWS, param_dtype="bf16",
                    aux_global=False, packed_rows=False, **kw)


def _leaves():
    from q38.model import abstract_params, is_param_info
    from q38.pytree import named_leaves

    return [math.prod(i.shape) for _, i in named_leaves(abstract_params(_cfg()), is_leaf=is_param_info)
            if i is not None]


# ---- the optimizer phase: donated vs pure, bytes per parameter by state dtype ----------------------------------


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_optimizer_phase_donated_and_pure_against_a_hand_count(impl):
    """One process holds every parameter: N values, the largest leaf L. Donated, fp32 state and gradients: masters 4
    + moments 8 + gradients 4 bytes a value, plus (foreach) one leaf's sqrt(v) of 4 bytes. Pure: the same plus the
    fp32 copies of weights and moments it returns (12), the clipped fp32 gradients (4) and (foreach) sqrt(v) of every
    parameter (4)."""
    n, big = sum(_leaves()), max(_leaves())
    donated = _single(adamw_impl=impl, reduce_dtype="fp32")
    pure = _single(adamw_impl=impl, reduce_dtype="fp32", donated=False)
    foreach = impl == "foreach"
    assert donated.peak_optimizer == n * (4 + 8 + 4) + foreach * big * 4
    assert pure.peak_optimizer == n * (4 + 8 + 4 + 12 + 4) + foreach * n * 4
    assert "donated step" in donated.optimizer_state and "pure step" in pure.optimizer_state


@pytest.mark.parametrize("moments,master,reduce,per_value,leaf", [
    ("bfloat16", "float32", "fp32", 4 + 4 + 4, 8),  # bf16 m and v; one leaf's fp32 moments
    ("int8", "float32", "fp32", 4 + 2 * (1 + 4 / 256) + 4, 8),  # 1 byte + a 4-byte scale per 256 values, twice
    ("float32", "bfloat16_remainder", "bf16", 4 + 8 + 2, 4 + 4),  # fp32 copies of one leaf's master and gradient
    ("int8", "bfloat16_remainder", "bf16", 4 + 2 * (1 + 4 / 256) + 2, 4 + 8 + 4),
])
def test_lean_state_bytes_per_parameter(moments, master, reduce, per_value, leaf):
    """The donated optimizer phase of each lean state: the state once in its dtypes, the gradients in the reduce
    dtype, and one leaf's fp32 working copies of whatever is not fp32 (fused AdamW: no other temporary)."""
    n, big = sum(_leaves()), max(_leaves())
    b = _single(moment_dtype=moments, master_dtype=master, reduce_dtype=reduce, adamw_impl="fused")
    assert b.peak_optimizer == pytest.approx(n * per_value + big * leaf, rel=1e-12)
    # the forward/backward phase stores the same moments, and no cast copy beside a bf16+remainder master
    mom = next(it for it in b.memory if it.name == "optimizer moments")
    assert mom.bytes == pytest.approx(n * {"bfloat16": 4, "int8": 2 * (1 + 4 / 256), "float32": 8}[moments])
    cast = [it for it in b.memory if it.name == "compute-dtype copy of shards"]
    assert bool(cast) == (master == "float32")


def test_offloaded_optimizer_host_bytes_and_time():
    """Offloaded: the device keeps its bf16 shards (2 bytes a value) and the gradients, which are bf16 whatever
    reduce_dtype (the leaf is the bf16 compute copy: q38/train/core/step.py rounds its reduced gradient to bf16);
    the host holds each local rank's masters and moments (4 + 8) per value (the gradients land leaf by leaf), and
    AdamW streams masters and moments read and written, the gradients read and the bf16 weights written
    (2·4 + 2·8 + 2 + 2 bytes a value) at the profile's host memory bandwidth."""
    hw = Hardware.load("h200")
    n = sum(_leaves())
    b = _single(offload_optimizer=True, reduce_dtype="fp32", hardware=hw)
    assert b.peak_optimizer == n * (2 + 2)
    held, host_s, link_s = b.host_optimizer
    assert held == hw.devices_per_node * n * (4 + 8)
    assert host_s == pytest.approx(hw.devices_per_node * n * (8 + 16 + 2 + 2) / hw.host_memory_bandwidth)
    assert link_s == pytest.approx(n * (2 + 2) / hw.host_link_bandwidth)
    assert not [it for it in b.memory if it.name in ("master weights", "optimizer moments")]


@pytest.mark.slow
def test_the_search_keeps_an_offloaded_candidate_only_when_the_host_holds_its_state():
    """Host bytes per node = devices per node × (4 + 8) × the rank's parameters (hand count from the layout's
    shards): a profile whose host memory is just above that (over the 90 % headroom) keeps the candidate, one just
    below refuses it; the same search without offload never looks at the host. Offloading without bf16 compute is
    refused as ``q38 train`` refuses it."""
    import attrs

    from q38.model_config import ConfigError
    from q38.parallel.search import MEMORY_HEADROOM, search

    cfg, world = _cfg(), 8
    hw = Hardware.load("h200")
    kw = dict(seq_len=SEQ, global_batch=world, param_dtype="bf16", offload_optimizer=True)
    cands, _ = search(cfg, world, hw, **kw)
    best = cands[0]
    numel = next(it for it in best.budget.memory if it.name == "compute-dtype shards").bytes / 2
    held = hw.devices_per_node * numel * (4 + 8)
    assert best.budget.host_optimizer[0] == held
    need = max(c.budget.host_optimizer[0] for c in cands)  # the candidate holding the most on the host
    roomy = attrs.evolve(hw, host_memory_bytes=need / MEMORY_HEADROOM * 1.001)
    assert len(search(cfg, world, roomy, **kw)[0]) == len(cands)
    least = min(c.budget.host_optimizer[0] for c in cands)
    tight = attrs.evolve(hw, host_memory_bytes=least / MEMORY_HEADROOM * 0.999)
    with pytest.raises(ConfigError, match="no layout fits"):
        search(cfg, world, tight, **kw)
    assert search(cfg, world, tight, seq_len=SEQ, global_batch=world, param_dtype="bf16")[0]  # not offloaded
    with pytest.raises(ConfigError, match="offload_optimizer keeps a bf16 compute copy on the device: it needs "
                                          "param_dtype bf16"):
        estimate(cfg, Layout.preset("single"), 1, seq_len=SEQ, rows_per_rank=ROWS, param_dtype="fp32",
                 offload_optimizer=True, hardware=hw)


def test_the_2_4t_optimizer_phase_donated_halves_the_pure_one():
    """The command of issue #42 (layout qwen3_8_2_4t on 512 H200s, full recompute): the pure step's optimizer
    phase (142.6 GiB, over the H200) against the donated one, which holds the state and the fp32 gradients once
    (16 bytes a value on the fullest rank)."""
    from q38.parallel.budget import GIB

    cfg = ModelConfig.preset("qwen3_8_2_4t")
    lay = Layout.preset("qwen3_8_2_4t")
    kw = dict(seq_len=16384, rows_per_rank=1, recompute="full", param_dtype="bf16", reduce_dtype="fp32",
              hardware=Hardware.load("h200"))
    pure, donated = estimate(cfg, lay, 512, donated=False, **kw), estimate(cfg, lay, 512, **kw)
    numel = next(it for it in donated.memory if it.name == "master weights").bytes / 4
    assert donated.peak_optimizer == numel * 16
    assert pure.peak_optimizer / GIB == pytest.approx(142.6, abs=0.05)
    assert donated.peak_optimizer / GIB < 72 and donated.peak_phase == "forward/backward"


# ---- an unmerged LoRA run ----------------------------------------------------------------------------------------


def test_unmerged_lora_flops_against_a_hand_count():
    """Adapters on the routed experts alone (``we_gate_up [e, 2f, d]``, ``we_down [e, d, f]``), rank r: every token
    runs k experts. Full fine-tune: 3 × the experts' forward F = 2·k·(2f·d + d·f) a token and MoE layer. LoRA: the
    frozen experts' weight gradient goes (2 × F), each adapter adds its two GEMMs forward, 2·k·r·(i + o), and
    four backward (3 × in all)."""
    cfg = _cfg()
    d, f, k, r = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, 8
    tokens = SEQ * ROWS
    moe_layers = cfg.num_hidden_layers + cfg.mtp_num_layers  # the MTP block has its own MoE
    fwd = 2 * k * (2 * f * d + d * f)
    full = _single()
    assert full.flops.experts == 3 * fwd * moe_layers * tokens  # the reference count itself
    peft = PeftConfig(rank=r, targets=("we_gate_up", "we_down"))
    lora = _single(peft=peft)
    adapters = 2 * k * r * ((d + 2 * f) + (f + d)) * cfg.num_hidden_layers  # not the MTP layer (peft.mtp false)
    assert lora.flops.experts == pytest.approx(2 * fwd * moe_layers * tokens + 3 * adapters * tokens, rel=1e-12)
    # no frozen matmul (nor the GDN conv) gets a weight gradient: the dense term, without adapters, is two thirds
    assert lora.flops.dense == pytest.approx(full.flops.dense * 2 / 3, rel=1e-12)
    # recompute runs the adapters' forward again (projections are recomputed in every mode)
    rec = _single(peft=peft, recompute="full")
    rec_full = _single(recompute="full")
    assert rec.flops.recompute - rec_full.flops.recompute == pytest.approx(adapters * tokens, rel=1e-12)


def test_unmerged_lora_memory_has_no_merged_copy_and_saves_x_a():
    """No merged weight in any phase; without recompute each adapted matmul saves ``x·Aᵀ``: tokens × r × k values
    per expert matrix (two per layer) in bf16; with recompute only the layer in backward holds it (and its
    gradient)."""
    cfg = _cfg()
    r, k, tokens = 8, cfg.num_experts_per_tok, SEQ * ROWS
    peft = PeftConfig(rank=r, targets=("we_gate_up", "we_down"))
    for rc in ("none", "full"):
        b = _single(peft=peft, recompute=rc)
        names = [it.name for it in (*b.memory, *b.optimizer_phase)]
        assert not [n for n in names if "merged" in n], names
        items = {it.name: it.bytes for it in b.memory}
        if rc == "none":
            assert items["adapter activations (saved)"] == tokens * r * k * 2 * cfg.num_hidden_layers * 2
        else:
            assert items["adapter activations (layer)"] == 2 * tokens * r * k * 2 * 2


def test_an_fp8_base_is_dequantized_per_gathered_layer_forward_and_backward():
    """FP8 base: each dequantization reads the layer's quantized values (1 byte) and writes bf16 (2 bytes) at the
    HBM bandwidth; forward and again for the input gradient (plus the recomputed forward under recompute)."""
    from q38.fp8 import default_quantized
    from q38.model import abstract_params, is_param_info
    from q38.pytree import named_leaves

    hw = Hardware.load("h200")
    q = sum(math.prod(i.shape) for p, i in named_leaves(abstract_params(_cfg()), is_leaf=is_param_info)
            if i is not None and default_quantized(p))
    peft = PeftConfig(rank=8, base_dtype="fp8")
    for rc, times in (("none", 2), ("full", 3)):
        b = _single(peft=peft, recompute=rc, hardware=hw)
        assert b.dequant_s == pytest.approx(times * q * 3 / hw.hbm_bandwidth, rel=1e-12)
    assert _single(peft=PeftConfig(rank=8), hardware=hw).dequant_s == 0


# ---- the plan and the run agree ----------------------------------------------------------------------------------


def _header(path) -> tuple[float, float, int]:
    with open(path) as f:
        head = f.readline()
    m = re.search(r"\(([0-9.e+-]+) s\).* \(([0-9]+) B\) a rank, global batch ([0-9]+)", head)
    assert m, head
    return float(m.group(1)), float(m.group(2)), int(m.group(3))


@pytest.mark.slow  # ~35 s on the shared 2 cores (a search over 8 ranks, then the plan of its output)
def test_search_out_plans_back_to_the_same_peak_and_step_time(tmp_path, capsys, monkeypatch):
    """``--search --lora-rank --lora-base-dtype fp8 --moment-dtype bfloat16 --out DIR`` writes the run it priced (its
    ``peft`` section and state dtypes included); ``q38 plan --train DIR/train.yaml`` prices the same peak and step."""
    monkeypatch.chdir(tmp_path)
    model = _model_yaml(tmp_path)
    common = ["--model", model, "--world", "8", "--hardware", "h200"]
    rc = plan_cli([*common, "--search", "--seq-len", str(SEQ), "--global-batch", "16", "--lora-rank", "8",
                   "--lora-base-dtype", "fp8", "--reduce-dtype", "bf16", "--moment-dtype", "int8", "--out", "best"])
    assert rc == 0, capsys.readouterr()
    written = yaml.safe_load((tmp_path / "best" / "train.yaml").read_text())
    assert written["peft"]["rank"] == 8 and written["peft"]["base_dtype"] == "fp8"
    assert written["train"]["reduce_dtype"] == "bfloat16" and written["train"]["moment_dtype"] == "int8"
    step, peak, gb = _header(tmp_path / "best" / "train.yaml")
    assert gb == 16
    capsys.readouterr()
    assert plan_cli([*common, "--train", "best/train.yaml"]) == 0
    out = capsys.readouterr().out
    assert f"peak {_fmt_bytes(peak)} in the" in out, out[-3000:]
    assert f"step time on h200: {_fmt_s(step)} =" in out
    assert "frozen base" in out and "adapter activations" in out  # planned back as the LoRA run, not a full one


@pytest.mark.slow  # ~60 s on the shared 2 cores (a fewest-ranks search up to 16 ranks, then the search on its world)
def test_fewest_ranks_and_search_price_one_global_batch(tmp_path, capsys, monkeypatch):
    """``--fewest-ranks`` prices the run config's global batch (its batch_size × the data-parallel size of its
    layout at --world) at every world and says so once; ``--search`` on the world it found, given that global batch,
    finds the same layout, peak and step time."""
    import q38.parallel.search as search_mod

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(search_mod, "LEAN_OPTIONS", ())  # the planned state's row is the one compared
    model = _model_yaml(tmp_path)
    run = {"model": model, "layout": "fsdp", "data": {"path": "data.jsonl", "seq_len": SEQ, "batch_size": 2},
           "train": {"param_dtype": "bfloat16"}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    common = ["--model", model, "--hardware", "h200", "--train", "run.yaml", "--search", "--memory-cap", "0.1",
              "--recompute", "full"]
    assert plan_cli([*common, "--world", "16", "--fewest-ranks"]) == 0
    out = capsys.readouterr().out
    assert out.count("global batch") == 1 and "global batch 32 sequences" in out, out
    m = re.search(r"planned state \([^)]*\): (\d+) \((.*?), recompute (\S+), (\d+) micro-batch\(es\); peak (.*?) "
                  r"per device, step (.*?), MFU", out)
    assert m, out
    world = m.group(1)
    assert plan_cli([*common, "--world", world, "--global-batch", "32", "--out", "best"]) == 0
    step, peak, gb = _header(tmp_path / "best" / "train.yaml")
    assert gb == 32 and _fmt_bytes(peak) == m.group(5) and _fmt_s(step) == m.group(6)
