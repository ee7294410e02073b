"""The trainer's memory pre-flight (q38/train/run/launch.py: ``check_memory``): on an accelerator, a run whose predicted
per-rank peak (q38 plan's budget, from the same settings ``q38 plan --train`` reads) exceeds the device's memory is
refused before anything is allocated, naming the fix; ``run.memory_check: false`` starts it anyway. The device's
memory is faked here (the CPU test machine has no accelerator); the CPU is never checked."""

import re

import pytest

import q38.train.run.launch as L
from q38.model_config import ConfigError
from q38.cli import plan_cli
from q38.train.run.trainer import RunConfig, train
from tests.run_utils import REPO, run_config

GB = 10**9


def _fake_device(monkeypatch, nbytes, kinds=("cuda",)):
    monkeypatch.setattr(L, "device_memory", lambda d: ("Fake H200", nbytes) if d.split(":")[0] in kinds else None)


def test_a_run_over_the_device_memory_is_refused_with_the_fix(tmp_path, monkeypatch):
    cfg = run_config(tmp_path)
    _fake_device(monkeypatch, 1024)  # 1 KiB: no model fits
    with pytest.raises(ConfigError, match=r"memory: DOES NOT FIT: peak .* of the Fake H200's 1.00 KiB.*"
                                          r"train.recompute: true.*run.memory_check: false"):
        L.check_run(cfg, 1, "cuda")
    _fake_device(monkeypatch, 1000 * GB)
    assert L.check_run(cfg, 1, "cuda").memory.startswith("memory (q38 plan): fits: peak ")
    assert L.check_run(cfg, 1, "cpu").memory is None  # the CPU's memory is not modelled: no check


def test_memory_check_false_starts_anyway_and_says_why_it_may_not_fit(tmp_path, monkeypatch):
    cfg = run_config(tmp_path, run={"memory_check": False})
    _fake_device(monkeypatch, 1024)
    assert L.check_run(cfg, 1, "cuda").memory.startswith("memory (q38 plan): DOES NOT FIT: ")


def test_the_production_run_predicts_what_q38_plan_predicts(monkeypatch, capsys):
    """The shipped 1024-rank config: the trainer's prediction (from the typed RunConfig and the kernels resolved for
    CUDA) equals `q38 plan --hardware h200`'s (from the raw YAML), and keeping the torch GDN core's states
    (skip_gdn_recompute, where FLA is not installed) is refused on an H200's 141 GB."""
    import attrs

    from q38.kernels import REGISTRY

    _fake_device(monkeypatch, 141 * GB)
    # the torch GDN core: FLA made unavailable, whether or not this machine has it installed
    monkeypatch.setitem(REGISTRY["gdn"], "fla", attrs.evolve(REGISTRY["gdn"]["fla"],
                                                             problem=lambda: "FLA is not installed (this test)"))
    with pytest.raises(ConfigError, match="DOES NOT FIT: peak 27[0-9].[0-9]+ GiB"):
        L.check_run(RunConfig.from_yaml(REPO / "specs/train/qwen3_8_2_4t.yaml", {"train.skip_gdn_recompute": True}),
                    1024, "cuda")
    # the plan resolves kernels for the target machine (its packages installed: flex, FLA); so does this run
    for op, name in (("attention", "flex"), ("gdn", "fla")):
        monkeypatch.setitem(REGISTRY[op], name, attrs.evolve(REGISTRY[op][name], problem=lambda: None))
    ok = L.check_run(RunConfig.from_yaml(REPO / "specs/train/qwen3_8_2_4t.yaml"), 1024, "cuda").memory
    assert plan_cli(["--model", "qwen3_8_2_4t", "--layout", "qwen3_8_2_4t", "--world", "1024", "--hardware",
                     "h200"]) == 0
    planned = capsys.readouterr().out
    peak = re.search(r"fits: peak ([\d.]+ GiB)", ok).group(1)
    assert f"fits: peak {peak} " in planned, (ok, planned[-600:])


def test_the_run_log_carries_the_verdict(tmp_path, monkeypatch, capsys):
    _fake_device(monkeypatch, 1000 * GB, kinds=("cpu",))  # pretend the CPU is a device, to see the log line
    train(run_config(tmp_path, steps=1))
    assert re.search(r"memory \(q38 plan\): fits: peak [\d.]+ [KMG]iB = 0 % of the Fake H200's 931.32 GiB",
                     capsys.readouterr().out)


def test_device_memory_reads_the_device_and_skips_what_is_not_there(monkeypatch):
    import types

    import torch

    assert L.device_memory("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: seen.append(i) or types.SimpleNamespace(name="NVIDIA H200", total_memory=141 * GB))
    assert L.device_memory("cuda:1") == ("NVIDIA H200", 141 * GB) and seen == [1]
    assert L.device_memory("cuda:2") is None  # no such device: check_device names it, not this
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert L.device_memory("cuda") is None
