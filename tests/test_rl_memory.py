"""A rollout batch larger than memory is priced and refused up front (``q38.train.run.rl_memory``): ``q38 rl``
compares the price of an iteration's rollout (``q38.parallel.budget_rollout``, as ``q38 plan`` prices it) with the
device's free memory (a byte budget injected by ``$Q38_RL_MEMORY_BYTES`` here) and refuses before any rollout, in one
line naming how many prompts fit; nothing is written. On a model unlike tiny (tests/test_rl_cli.py's)."""

import pytest
import torch

from q38.cli import main
from q38.errors import ConfigError
from q38.lora import merged_params
from q38.train.run.rl_memory import MEMORY_ENV, check_rollout_memory, free_memory, merged_copy_bytes, rollout_price
from tests.test_policy_loss import CFG
from tests.test_rl import _lora_state, _state
from tests.test_rl_cli import _args, _prompts, hf_dir  # noqa: F401  (hf_dir: the fixture)


def test_q38_rl_refuses_a_rollout_larger_than_memory_in_one_line(hf_dir, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv(MEMORY_ENV, "1000")
    out = tmp_path / "out"
    assert main(_args(hf_dir, _prompts(tmp_path), out, 1)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "a rollout of 2 prompts x group size 2" in err[0] and "at most 0 prompts per iteration fit" in err[0]
    assert "$Q38_RL_MEMORY_BYTES" in err[0]
    assert not (out / "checkpoints").exists()  # refused before any rollout or checkpoint


def test_the_refusal_names_how_many_prompts_fit(monkeypatch):
    state = _state()
    ids = [[5] * 9, [7] * 4]
    price = [rollout_price(CFG, p, 3, 9, 12, torch.float32) for p in (1, 2, 3, 4)]
    assert price == sorted(price) and len(set(price)) == 4
    monkeypatch.setenv(MEMORY_ENV, str(price[1]))  # two prompts fit exactly, four do not
    check_rollout_memory(state, ids, 2, 3, 12, "cpu")
    with pytest.raises(ConfigError, match="at most 2 prompts per iteration fit") as e:
        check_rollout_memory(state, ids, 4, 3, 12, "cpu")
    assert "\n" not in str(e.value)
    monkeypatch.setenv(MEMORY_ENV, "lots")
    with pytest.raises(ConfigError, match="not a byte count"):
        free_memory("cpu")


def test_free_memory_reads_the_available_ram_on_cpu(monkeypatch):
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    n, source = free_memory("cpu")
    with open("/proc/meminfo") as f:
        avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    assert "available RAM" in source and abs(n - avail) < 2**30  # read moments apart on a busy machine


def test_a_lora_rollouts_merged_copy_is_priced_as_merged_params_builds_it():
    state = _lora_state()
    held = {id(t) for t in torch.utils._pytree.tree_leaves(state.params)}
    real = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(merged_params(state.params))
               if id(t) not in held)  # the tensors the merge allocates (unadapted leaves are shared)
    assert merged_copy_bytes(state.params) == real > 0
    assert merged_copy_bytes(_state().params) == 0
