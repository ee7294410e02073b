"""Kernels as a run setting: the registry refuses every unsupported combination with one message, ``auto`` picks
per device / CP, FLA is gated on known-good versions, old model-config keys are mapped with a note, and a checkpoint
made under one kernel setting resumes under another."""

import json
import sys
import warnings

import attrs
import pytest

import q38.kernels as K
from q38.model_config import ConfigError, ModelConfig
from q38.kernels import KernelConfig, resolve_kernels
from q38.train.io import checkpoint as ck
from q38.train.run.trainer import RunConfig, check_run, train
from tests.run_utils import run_config, run_dict


@pytest.fixture
def fla_ok(monkeypatch):
    """Pretend a known-good FLA is installed (the CPU test machine has none)."""
    monkeypatch.setitem(K.REGISTRY["gdn"], "fla", attrs.evolve(K.REGISTRY["gdn"]["fla"], problem=lambda: None))


@pytest.mark.parametrize(
    "kernels,where,message",
    [
        ({"gdn": "fla"}, {"device": "cpu"}, "kernels.gdn: fla runs on cuda only, not on 'cpu'"),
        ({"block": "compiled"}, {"device": "cuda", "cp": True},
         "kernels.block: compiled does not support context parallelism"),
        ({"gdn": "npu"}, {"device": "cuda"}, "kernels.gdn: npu runs on npu only"),
        ({"gdn": "npu"}, {"device": "npu"}, "kernels.gdn: npu does not support packed rows"),
        ({"gdn": "npu"}, {"device": "npu", "packed": False}, "kernels.gdn: npu has no backward"),
        ({"causal_conv1d": "cuda"}, {"device": "cpu"}, "kernels.causal_conv1d: cuda runs on cuda only"),
        ({"causal_conv1d": "cuda"}, {"device": "cuda", "cp": True, "packed": False},
         "kernels.causal_conv1d: cuda does not support context parallelism"),
        ({"causal_conv1d": "cuda"}, {"device": "cuda"}, "kernels.causal_conv1d: cuda does not support packed rows"),
        ({"causal_conv1d": "npu"}, {"device": "npu", "packed": False}, "kernels.causal_conv1d: npu has no backward"),
        ({"experts": "grouped_mm"}, {"device": "npu"}, "kernels.experts: grouped_mm runs on cpu/cuda/meta only"),
        ({"experts": "grouped_mm"}, {"device": "cuda", "dtype": "float32"},
         r"kernels.experts: grouped_mm takes bfloat16 on cuda, not float32 \(train.param_dtype\)"),
    ],
)
def test_registry_refuses_unsupported_combinations(fla_ok, kernels, where, message):
    with pytest.raises(ConfigError, match=message + r".*use kernels\.\w+: auto \(picks \w+ here\)"):
        resolve_kernels(KernelConfig(**kernels), **where)


@pytest.fixture
def no_fla(monkeypatch):
    """FLA reads as not installed (the slow suite's environment has it, for the Triton-interpreter tests)."""
    real = K._version
    monkeypatch.setattr(K, "_version", lambda pkg: None if pkg in ("flash-linear-attention", "fla-core") else real(pkg))


def test_registry_refuses_fla_without_a_known_good_install(no_fla):
    # No FLA: the environment check names the package (on a CUDA run, nothing else missing).
    with pytest.raises(ConfigError, match="kernels.gdn: fla flash-linear-attention is not installed"):
        resolve_kernels(KernelConfig(gdn="fla"), device="cuda")


@pytest.mark.parametrize(
    "versions,problem",
    [
        ({"flash-linear-attention": (0, 6, 0), "triton": (3, 6, 0)}, "Triton 3.6.0 < 3.7.1"),
        ({"flash-linear-attention": (0, 6, 0), "triton": (3, 7, 1)}, None),
        ({"flash-linear-attention": (0, 6, 0), "triton": (3, 6, 0), "tilelang": (0, 1, 0)}, None),
        ({"flash-linear-attention": (0, 5, 1), "triton": (3, 7, 1)}, "older than 0.5.2"),
        ({"triton": (3, 7, 1)}, "not installed"),
    ],
)
def test_fla_gate(monkeypatch, versions, problem):
    monkeypatch.setattr(K, "_version", lambda pkg: versions.get(pkg))
    got = K._fla_problem()
    assert (got is None) if problem is None else (problem in got)


def test_auto_picks_per_device_and_cp(fla_ok):
    assert resolve_kernels(KernelConfig(), device="cpu") == KernelConfig(gdn="torch", causal_conv1d="torch",
                                                                         attention="sdpa", experts="grouped_mm",
                                                                         loss="torch", block="eager",
                                                                         gdn_chunk_size=64)
    assert resolve_kernels(KernelConfig(), device="cuda", dtype="bfloat16").loss == "torch"  # compiled: auto=False
    assert resolve_kernels(KernelConfig(), device="cuda").gdn == "fla"
    assert resolve_kernels(KernelConfig(), device="cuda", cp=True).gdn == "fla"  # CP: q38's state carry over FLA
    assert resolve_kernels(KernelConfig(), device="cuda").causal_conv1d == "torch"  # cuda conv: no packed rows
    # grouped-GEMM experts where F.grouped_mm takes the run's dtype (CUDA: bf16 only), padded bmm elsewhere
    assert resolve_kernels(KernelConfig(), device="cuda", dtype="bfloat16").experts == "grouped_mm"
    assert resolve_kernels(KernelConfig(), device="cuda", dtype="float32").experts == "batched"
    assert resolve_kernels(KernelConfig(), device="npu", packed=False).experts == "batched"


def test_gdn_chunk_is_a_kernel_setting_picked_per_device_and_head_dims():
    small = ModelConfig.preset("tiny")  # GDN head dims <= 64
    assert max(small.linear_key_head_dim, small.linear_value_head_dim) <= 64
    big = attrs.evolve(small, linear_key_head_dim=128, linear_value_head_dim=128)
    chunk = lambda **kw: resolve_kernels(KernelConfig(**kw.pop("kc", {})), **kw).gdn_chunk_size  # noqa: E731
    assert chunk(device="cpu", model=small) == 32  # CPU, small heads: the [C, C] factors are what costs
    assert chunk(device="cpu", model=big) == 64
    assert chunk(device="cpu") == 64  # head dims not known: the accelerator chunk
    assert chunk(device="cuda", model=small) == 64 == K.GDN_CHUNK
    assert chunk(device="cpu", model=small, kc={"gdn_chunk_size": 48}) == 48  # an explicit value is kept
    assert KernelConfig.from_dict({"gdn_chunk_size": 16}).gdn_chunk_size == 16
    for bad in (0, -64, 32.0, "32", True):
        with pytest.raises(ConfigError, match=r"kernels.gdn_chunk_size must be a positive integer or auto"):
            KernelConfig(gdn_chunk_size=bad)
    assert not KernelConfig(gdn="torch", causal_conv1d="torch", attention="sdpa", experts="batched",
                            loss="torch").resolved  # the chunk is still auto


def test_gdn_chunk_is_refused_where_the_torch_core_does_not_run(fla_ok):
    # FLA's chunk kernels have their own chunk (64): another explicit value would be silently ignored
    with pytest.raises(ConfigError, match=r"kernels.gdn_chunk_size: 32 sets the torch GDN core's chunk, but "
                                          r"kernels.gdn is fla here .*set kernels.gdn: torch"):
        resolve_kernels(KernelConfig(gdn_chunk_size=32), device="cuda")  # auto picks fla here
    assert resolve_kernels(KernelConfig(gdn_chunk_size=64), device="cuda").gdn == "fla"
    assert resolve_kernels(KernelConfig(gdn="torch", gdn_chunk_size=32), device="cuda", cp=True).gdn == "torch"


def test_auto_without_fla_is_torch_on_cuda(no_fla):
    assert resolve_kernels(KernelConfig(), device="cuda").gdn == "torch"


def test_grouped_experts_need_the_capability_and_a_torch_that_has_them(monkeypatch):
    bf16 = {"device": "cuda", "dtype": "bfloat16"}
    monkeypatch.setattr(K, "_cuda_capability", lambda: (7, 5))  # pre-Ampere GPU
    assert resolve_kernels(KernelConfig(), **bf16).experts == "batched"
    with pytest.raises(ConfigError, match=r"kernels.experts: grouped_mm needs CUDA compute capability >= \(8, 0\)"):
        resolve_kernels(KernelConfig(experts="grouped_mm"), **bf16)
    monkeypatch.setattr(K, "_cuda_capability", lambda: (9, 0))
    assert resolve_kernels(KernelConfig(), **bf16).experts == "grouped_mm"
    import torch.nn.functional as F

    monkeypatch.delattr(F, "grouped_mm")  # an older torch
    assert resolve_kernels(KernelConfig(), device="cpu").experts == "batched"
    with pytest.raises(ConfigError, match="has no torch.nn.functional.grouped_mm"):
        resolve_kernels(KernelConfig(experts="grouped_mm"), device="cpu")


def test_bad_kernel_names_are_refused():
    with pytest.raises(ConfigError, match=r"kernels.gdn must be one of \('fla', 'npu', 'torch', 'auto'\)"):
        KernelConfig(gdn="triton")
    with pytest.raises(ConfigError, match="unknown kernel key.*did you mean 'attention'"):
        KernelConfig.from_dict({"attn": "sdpa"})


def test_old_grouped_expert_flag_is_mapped_onto_kernels_experts():
    d = ModelConfig.preset("tiny").to_dict()
    out = {}
    with pytest.warns(UserWarning, match=r"use_grouped_expert_matmul: grouped_mm is a run setting now"):
        cfg = ModelConfig.from_dict(dict(d, use_grouped_expert_matmul=True), kernels_out=out)
    assert cfg == ModelConfig.preset("tiny") and out == {"experts": "grouped_mm"}
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # false was the old default: dropped without a note
        assert ModelConfig.from_dict(dict(d, use_grouped_expert_matmul=False), kernels_out=out) == cfg
    assert out == {}


def test_old_model_keys_are_mapped_onto_kernels_with_a_note(tmp_path):
    d = ModelConfig.preset("tiny").to_dict()
    out = {}
    with pytest.warns(UserWarning, match=r"gdn_implementation: fla is a run setting now.*kernels: \{gdn: fla\}"):
        cfg = ModelConfig.from_dict(dict(d, gdn_implementation="fla", attention_implementation="sdpa"),
                                    kernels_out=out)
    assert cfg == ModelConfig.preset("tiny") and out == {"gdn": "fla", "attention": "sdpa"}
    # the GDN chunk length was a model field (default 64): mapped onto kernels, with a note only when not 64
    with pytest.warns(UserWarning, match=r"gdn_chunk_size: 16 is a run setting now.*kernels: \{gdn_chunk_size: 16\}"):
        assert ModelConfig.from_dict(dict(d, gdn_chunk_size=16), kernels_out=(out := {})) == cfg
    assert out == {"gdn_chunk_size": 16}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ModelConfig.from_dict(dict(d, gdn_chunk_size=64)) == cfg
    # in a run config: the old key lands in kernels, and the up-front check refuses it on this CPU run
    raw = run_dict(tmp_path, steps=1)
    raw["model"] = dict(raw["model"], gdn_implementation="fla")
    with pytest.warns(UserWarning):
        rc = RunConfig.from_dict(raw)
    assert rc.kernels.gdn == "fla" and "gdn_implementation" not in rc.model.to_dict()
    with pytest.raises(ConfigError, match="kernels.gdn: fla runs on cuda only"):
        check_run(rc, 1, "cpu")


def test_checkpoint_made_with_one_kernel_setting_resumes_with_another(tmp_path, capsys):
    out = tmp_path / "run"
    first = train(run_config(out, steps=1, kernels={"attention": "eager"}))
    said = capsys.readouterr().out
    assert "kernels: gdn=torch (auto), causal_conv1d=torch (auto), attention=eager" in said
    assert "malloc" not in said  # the CPU allocator setting is internal: made, not printed
    if sys.platform.startswith("linux"):  # ... and it can be made here (glibc)
        from q38.train.run.launch import tune_cpu_allocator

        assert tune_cpu_allocator() == "glibc malloc: mmap threshold 32 MiB, trim threshold 1 GiB (CPU: fewer page faults)"
    path = out / "checkpoints" / "step_000001"
    meta = ck.read_meta(path)
    assert meta["kernels"] == {"gdn": "torch", "causal_conv1d": "torch", "attention": "eager", "experts": "grouped_mm",
                              "block": "eager", "loss": "torch", "gdn_chunk_size": 32}  # auto on CPU at the tiny model's head dims
    assert "attention_implementation" not in meta["model_config"]
    # An older checkpoint's meta.json carried the kernel keys (and the GDN chunk) inside the model config: still the
    # same model.
    meta["model_config"] = dict(meta["model_config"], gdn_implementation="torch", attention_implementation="eager",
                                gdn_chunk_size=64)
    (path / "meta.json").write_text(json.dumps(meta))
    ck.write_manifest(path)  # as that older run's save would have sealed it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = train(run_config(out, steps=2, kernels={"attention": "sdpa", "gdn_chunk_size": 16}))
    notes = [str(w.message) for w in caught if "is a run setting now" in str(w.message)]
    assert notes and all("attention_implementation: eager" in n and "gdn_implementation" not in n for n in notes)
    assert [r["step"] for r in first + second] == [1, 2]
    err = capsys.readouterr().err
    assert "kernels.attention: 'eager' -> 'sdpa'" in err and "kernels.gdn_chunk_size: 32 -> 16" in err


def test_the_resolved_gdn_chunk_reaches_the_core_and_the_layer_is_chunk_agnostic(monkeypatch):
    """The layer runs the torch core in chunks of the given ``kernels.gdn_chunk_size`` (spied), packed rows included,
    and the output does not depend on the chunk beyond rounding (fp32, 1e-5 relative)."""
    import torch

    import q38.layers.gdn as gdn
    from q38.layers.context import seq_info
    from q38.model import init_params

    cfg = ModelConfig.preset("tiny")
    p = init_params(cfg, seed=0).layers[cfg.layer_types.index("linear_attention")].mixer
    x = torch.randn(2, 40, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    doc = torch.tensor([[0] * 15 + [1] * 25, [0] * 40])
    seen, real = [], gdn.gated_delta_rule_chunked
    monkeypatch.setattr(gdn, "gated_delta_rule_chunked", lambda *a, **kw: seen.append(kw["chunk_size"]) or real(*a, **kw))
    outs = {}
    for chunk in (8, 16, 64):
        kernels = K.DEFAULT_KERNELS.replace(gdn_chunk_size=chunk)
        outs[chunk] = gdn.gdn_apply(p, x, cfg, seq_info(doc, 2, 40, "cpu", kernels=kernels))
    assert seen == [8, 16, 64]
    for chunk in (8, 16):
        assert (outs[chunk] - outs[64]).abs().max() <= 1e-5 * outs[64].abs().max()


def test_kernel_report_names_the_pick_and_every_refusal(fla_ok, monkeypatch):
    rows = {(op, name): status for op, name, status in K.kernel_report(device="cuda", dtype="bfloat16", cp=True)}
    assert set(rows) == {(op, n) for op in K.OPS for n in K.REGISTRY[op]}  # every implementation, none left out
    picked = resolve_kernels(KernelConfig(), device="cuda", dtype="bfloat16", cp=True)
    assert {(op, n) for (op, n), s in rows.items() if s == "auto"} == {(op, getattr(picked, op)) for op in K.OPS}
    assert rows[("gdn", "fla")] == "auto"  # the production layout: CP and packed rows
    assert rows[("block", "compiled")] == "does not support context parallelism (a `cp` mesh dim > 1)"
    assert rows[("loss", "compiled")] in ("usable when named (auto does not pick it)",
                                          K._compile_problem())  # opt-in: never "auto"
    assert rows[("attention", "eager")] == "usable"
    # the environment's own reason, as resolve_kernels would raise it
    monkeypatch.setitem(K.REGISTRY["gdn"], "fla", attrs.evolve(K.REGISTRY["gdn"]["fla"],
                                                                 problem=lambda: "Triton 3.6.0 < 3.7.1 miscompiles"))
    rows = {(op, name): status for op, name, status in K.kernel_report(device="cuda", dtype="bfloat16")}
    assert rows[("gdn", "fla")] == "Triton 3.6.0 < 3.7.1 miscompiles" and rows[("gdn", "torch")] == "auto"


def test_a_device_no_implementation_serves_is_one_error_naming_every_reason():
    with pytest.raises(ConfigError, match=r"kernels.gdn: no implementation serves this run on device 'tpu' \(fla: "
                                          r"runs on cuda only.*torch: runs on cpu/cuda/npu/meta only"):
        resolve_kernels(KernelConfig(), device="tpu")


def test_q38_kernels_prints_versions_and_the_table(capsys):
    from q38.cli import main

    assert main(["kernels", "--device", "cuda", "--dtype", "bf16", "--unpacked"]) == 0
    out = capsys.readouterr().out
    assert "torch " in out.splitlines()[0] and "flash-linear-attention" in out.splitlines()[0]
    assert "run: device cuda, dtype bfloat16, cp False, packed rows False" in out
    assert "  gdn.torch " in out and "  experts.grouped_mm " in out
    # unpacked rows: the CUDA conv kernel is refused only for its missing package (packed rows would refuse it first)
    assert "causal_conv1d.cuda   causal_conv1d is not installed" in out
    assert main(["kernels", "--device", "tpu"]) == 2
    assert "no implementation serves this run on device 'tpu'" in capsys.readouterr().err


def test_the_run_log_line_says_what_auto_passed_over_and_why(monkeypatch):
    monkeypatch.setitem(K.REGISTRY["gdn"], "fla", attrs.evolve(K.REGISTRY["gdn"]["fla"],
                                                                 problem=lambda: "Triton 3.6.0 < 3.7.1 miscompiles"))
    req = KernelConfig(attention="eager")
    got = resolve_kernels(req, device="cuda", dtype="bfloat16")
    line = K.describe_kernels(req, got, device="cuda:0", dtype="bfloat16")
    assert line.startswith("kernels: gdn=torch (auto; passed over fla: Triton 3.6.0 < 3.7.1 miscompiles), ")
    # the CUDA conv is meant for this device: its reason is named; npu kernels are not (another device)
    assert "causal_conv1d=torch (auto; passed over cuda: does not support packed rows" in line and "npu" not in line
    assert "attention=eager," in line  # named, not auto: no note
    assert "experts=grouped_mm (auto)" in line and line.endswith("loss=torch (auto)")  # compiled is opt-in: not "passed"
    # on the CPU nothing is passed over: every preferred implementation is for another device
    cpu = K.describe_kernels(KernelConfig(), resolve_kernels(KernelConfig(), device="cpu"), device="cpu")
    assert "passed over" not in cpu and cpu.startswith("kernels: gdn=torch (auto), causal_conv1d=torch (auto)")


def _spied(monkeypatch, calls: list):
    """Every registered implementation that has a callable, wrapped to record ``(op, name)`` in ``calls`` when run."""
    for op, impls in K.REGISTRY.items():
        for name, impl in list(impls.items()):
            if impl.fn is None or impl.requires is not None:  # not wired, or needs a package the CPU lacks
                continue

            def spy(*a, _fn=impl.load(op, name), _key=(op, name), **kw):
                calls.append(_key)
                return _fn(*a, **kw)

            monkeypatch.setitem(impls, name, attrs.evolve(impl, fn=spy))


def test_kernels_are_arguments_two_forwards_in_one_process_each_run_their_own(monkeypatch):
    """Two kernel choices passed explicitly and interleaved in one process (A, B, A): each forward calls only its
    own implementations (spied registry entries), A gives the same bits before and after B (nothing B chose
    lingers), and the two choices agree within fp32 rounding. A layer reading process state would fail this."""
    import torch

    import q38
    from q38.kernels import DEFAULT_KERNELS
    from q38.layers.context import seq_info

    grouped = resolve_kernels(KernelConfig(), device="cpu").experts  # grouped_mm where this torch has it
    a_k = DEFAULT_KERNELS  # sdpa, batched experts, chunks of 64
    b_k = DEFAULT_KERNELS.replace(attention="eager", experts=grouped, gdn_chunk_size=16)
    calls: list = []
    _spied(monkeypatch, calls)
    chunks: list = []
    real_core = K.REGISTRY["gdn"]["torch"].fn  # the spy

    def core(*a, chunk_size, **kw):
        chunks.append(chunk_size)
        return real_core(*a, chunk_size=chunk_size, **kw)

    monkeypatch.setitem(K.REGISTRY["gdn"], "torch", attrs.evolve(K.REGISTRY["gdn"]["torch"], fn=core))

    cfg = ModelConfig.preset("tiny").replace(initializer_range=0.1)
    p = q38.init_params(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    doc = torch.tensor([[0] * 15 + [1] * 25, [0] * 40])

    def run(kc):
        calls.clear()
        chunks.clear()
        h = q38.forward(p, ids, cfg, info=seq_info(doc, 2, 40, "cpu", kernels=kc)).hidden
        return h, set(calls), set(chunks)

    (h_a, calls_a, chunks_a), (h_b, calls_b, chunks_b), (h_a2, calls_a2, _) = run(a_k), run(b_k), run(a_k)
    both = {("causal_conv1d", "torch"), ("gdn", "torch")}
    both = {*both, ("block", "eager")}
    assert calls_a == calls_a2 == {("attention", "sdpa"), ("experts", "batched"), *both}
    assert calls_b == {("attention", "eager"), ("experts", b_k.experts), *both}
    assert chunks_a == {64} and chunks_b == {16}
    assert torch.equal(h_a, h_a2)
    assert (h_a - h_b).abs().max() <= 1e-5 * max(1.0, h_a.abs().max().item())


def test_the_step_runs_the_kernels_of_its_state(monkeypatch):
    """``train_step``'s layers and loss run ``state.kernels``: two states in one process, two sets of calls."""
    import torch

    from q38.kernels import DEFAULT_KERNELS
    from q38.model import init_params
    from q38.train.core.step_config import TrainConfig
    from q38.train.core.state import state_from_params
    from q38.train.core.step import loss_and_grads

    calls: list = []
    _spied(monkeypatch, calls)
    cfg = ModelConfig.preset("tiny").replace(mtp_num_layers=0)
    params = init_params(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    seen = {}
    for kc in (DEFAULT_KERNELS, DEFAULT_KERNELS.replace(attention="eager")):
        calls.clear()
        loss_and_grads(state_from_params(params, cfg, TrainConfig(loss_chunk_size=16), kernels=kc),
                       {"input_ids": ids, "labels": ids})
        seen[kc.attention] = set(calls)
    assert seen["sdpa"] - seen["eager"] == {("attention", "sdpa")}
    assert seen["eager"] - seen["sdpa"] == {("attention", "eager")}
    assert ("loss", "torch") in seen["sdpa"] and ("gdn", "torch") in seen["sdpa"]
    with pytest.raises(ValueError, match="resolve_kernels first"):
        state_from_params(params, cfg, TrainConfig(), kernels=KernelConfig())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_mm_shape_rule_is_the_kernels_own(dtype):
    """The stride rule ``auto`` and an explicit choice follow is what F.grouped_mm itself accepts: over a grid of
    hidden sizes and expert widths, the rule says yes exactly where the kernel runs."""
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    for d in (16, 18, 20, 24, 36):
        for f in (8, 12, 18, 20, 32):
            cfg = attrs.evolve(ModelConfig.preset("tiny"), hidden_size=d, moe_intermediate_size=f)
            try:
                F.grouped_mm(torch.ones(5, d, dtype=dt), torch.ones(2, d, f, dtype=dt),
                             offs=torch.tensor([2, 5], dtype=torch.int32))
                runs = True
            except RuntimeError as e:
                assert "16 bytes" in str(e)
                runs = False
            assert (K._grouped_mm_shape_problem(cfg, dtype) is None) == runs, (d, f, dtype)


def test_grouped_mm_at_an_unaligned_width_falls_back_or_is_refused():
    """Expert width 18 in fp32 (72-byte rows): ``auto`` takes the batched experts and a step trains; naming
    grouped_mm is one line naming the width and the fix (it was torch's internal stride error at the first step)."""
    import torch

    from q38.model import init_params
    from q38.train.core.state import state_from_params
    from q38.train.core.step import train_step
    from q38.train.core.step_config import TrainConfig

    cfg = attrs.evolve(ModelConfig.preset("tiny"), hidden_size=40, moe_intermediate_size=18, num_experts=6,
                       num_experts_per_tok=3, shared_expert_intermediate_size=28)
    assert cfg.hidden_size != ModelConfig.preset("tiny").hidden_size
    assert resolve_kernels(KernelConfig(), device="cpu", dtype="float32", model=cfg).experts == "batched"
    with pytest.raises(ConfigError, match="kernels.experts: grouped_mm needs moe_intermediate_size to be a multiple "
                                          "of 4 in float32.*is 18; use kernels.experts: batched"):
        resolve_kernels(KernelConfig(experts="grouped_mm"), device="cpu", dtype="float32", model=cfg)
    state = state_from_params(init_params(cfg, seed=0), cfg, TrainConfig(param_dtype="float32"))
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    _, m = train_step(state, {"input_ids": ids, "labels": ids.clone()})
    assert torch.isfinite(m.loss)
