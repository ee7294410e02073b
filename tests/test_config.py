"""Model and train config: presets, HF config.json reading, and every validation rule's message."""

import json

import sys

import pytest
import torch

import q38
from q38.hf_config import config_from_hf
from q38.model_config import ConfigError, ModelConfig
from q38.kernels import DEFAULT_KERNELS, KernelConfig
from q38.layers.context import seq_info
from q38.train.core.step_config import TrainConfig, validate_run


def test_presets_load_and_name_their_family():
    names = ModelConfig.presets()
    assert {"tiny", "qwen3_5_35b_a3b", "qwen3_5_397b_a17b", "qwen3_8_2_4t"} <= set(names)
    big = ModelConfig.preset("qwen3_8_2_4t")
    assert big.model_type == "qwen3_8_moe" and big.hidden_size == 8192 and big.num_hidden_layers == 92
    assert big.layer_types.count("full_attention") == 23 and big.mtp_num_layers == 1
    assert ModelConfig.preset("qwen3_5_397b_a17b").num_experts == 512


def test_unknown_preset_and_model_type_list_the_known_ones():
    with pytest.raises(ConfigError, match="known presets: .*tiny"):
        ModelConfig.preset("tinyy")
    with pytest.raises(ConfigError, match="known model types: .*qwen3_5_moe.*qwen3_8_moe.*qwen3_next"):
        config_from_hf({"model_type": "llama", "num_hidden_layers": 2})


def _hf_text(**kw):
    d = dict(vocab_size=100, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=16, shared_expert_intermediate_size=16,
             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    d.update(kw)
    return d


@pytest.mark.parametrize("field", ["mtp_num_hidden_layers", "num_nextn_predict_layers", "mtp_num_layers"])
def test_from_hf_reads_nested_text_config_rope_and_each_mtp_field(tmp_path, field):
    raw = {"model_type": "qwen3_5_moe", "text_config": _hf_text(**{field: 2}), "vision_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = config_from_hf(tmp_path)
    assert cfg.mtp_num_layers == 2 and cfg.rope_theta == 1e7 and cfg.rotary_dim == 2
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention", "linear_attention")
    nxt = config_from_hf(dict(_hf_text(num_nextn_predict_layers=1), model_type="qwen3_next"))
    assert nxt.family.checkpoint_layout == "qwen3_next" and nxt.mtp_num_layers == 1


def test_from_hf_refuses_dense_layers():
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        config_from_hf(dict(_hf_text(mlp_only_layers=[1]), model_type="qwen3_next"))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "num_attention_heads .6. must be divisible by"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads .3. must be divisible"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
        ({"layer_types": ["linear_attention", "mamba", "full_attention", "full_attention"]}, "layer_types entries"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok .9. must be <= num_experts"),
        ({"head_dim": 10, "partial_rotary_factor": 0.5}, "rotary dim .* must be even"),
        ({"mtp_num_layers": -1}, "mtp_num_layers must be >= 0"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"model_type": "qwen4"}, "unknown model_type 'qwen4'"),
    ],
)
def test_model_config_rules(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.preset("tiny").replace(**changes)


def test_unknown_model_key_names_the_closest(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("num_hiden_layers: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'num_hidden_layers'"):
        ModelConfig.from_yaml(p)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"skip_flash_attn_recompute": True}, "skip_flash_attn_recompute: true needs recompute: true"),
        ({"skip_gdn_recompute": True}, "skip_gdn_recompute: true needs recompute: true"),
        ({"dynamic_chunk_loss": True}, "dynamic_chunk_loss: true needs loss_chunk_budget_bytes"),
        ({"warmup_steps": 20, "total_steps": 10}, "warmup_steps .20. must be between 0 and total_steps"),
        ({"schedule": "exp"}, "schedule must be one of"),
        ({"aux_loss_scope": "sequence"}, "aux_loss_scope must be one of"),
        ({"aux_loss_type": "switch"}, "aux_loss_type must be one of pooled, per_layer, sequence, got 'switch'"),
        ({"aux_loss_tokens": "all"}, "aux_loss_tokens must be one of real, labelled, got 'all'"),
        ({"aux_loss_free": "yes"}, "aux_loss_free must be true or false"),
        ({"router_bias_rate": 0.0}, "router_bias_rate must be > 0"),
        ({"micro_batches": 0}, "micro_batches must be >= 1"),
        ({"nan_policy": "ignore"}, "nan_policy must be one of"),
        ({"loss_chunk_size": 0}, "loss_chunk_size must be > 0"),
        ({"lr": 0.0}, "lr must be > 0"),
    ],
)
def test_train_config_rules(kw, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kw)


def test_cross_config_rules():
    tiny = ModelConfig.preset("tiny")
    # refused when the run is checked, before any weight (the layer refused it at the first step)
    with pytest.raises(ConfigError, match="kernels.block: compiled runs without expert parallelism for now.*ep size is "
                                          "2"):
        validate_run(tiny, TrainConfig(), ep_size=2, kernels=KernelConfig(block="compiled", experts="batched"))
    with pytest.raises(ConfigError, match="enable_ep_balance: true needs expert parallelism"):
        validate_run(tiny, TrainConfig(enable_ep_balance=True), ep_size=1)
    with pytest.raises(ConfigError, match="kernels.gdn: fla runs on cuda only, not on 'cpu'"):
        validate_run(tiny, TrainConfig(), device="cpu", kernels=KernelConfig(gdn="fla"))
    with pytest.raises(ConfigError, match="kernels.causal_conv1d: cuda runs on cuda only"):
        validate_run(tiny, TrainConfig(), device="cpu", kernels=KernelConfig(causal_conv1d="cuda"))
    with pytest.raises(ConfigError, match="kernels.gdn: npu runs on npu only"):
        validate_run(tiny, TrainConfig(), device="cpu", kernels=KernelConfig(gdn="npu"))
    with pytest.raises(ConfigError, match="needs a fused attention kernel"):
        validate_run(tiny, TrainConfig(recompute=True, skip_flash_attn_recompute=True),
                     kernels=KernelConfig(attention="eager"))
    with pytest.raises(ConfigError, match="unknown train config key.*did you mean 'micro_batches'"):
        TrainConfig.from_dict({"micro_batch": 2})


def test_unavailable_kernel_raises_naming_the_option_and_install(tiny_cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # not importable (the slow suite's environment installs it)
    p = q38.init_params(tiny_cfg, seed=0)
    info = seq_info(None, 1, 8, "cpu", kernels=DEFAULT_KERNELS.replace(gdn="fla"))
    with pytest.raises(ImportError, match="kernels.gdn: fla needs flash-linear-attention"):
        q38.forward(p, torch.zeros(1, 8, dtype=torch.long), tiny_cfg, info=info)


def test_eager_attention_matches_sdpa(tiny_cfg):
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    doc = torch.tensor([[0] * 15 + [1] * 25, [0] * 40])
    p = q38.init_params(tiny_cfg.replace(initializer_range=0.1), seed=0)
    a = q38.logits(p, ids, tiny_cfg, doc_ids=doc)
    b = q38.logits(p, ids, tiny_cfg, doc_ids=doc, kernels=DEFAULT_KERNELS.replace(attention="eager"))
    assert (a - b).abs().max() <= 1e-5


def test_the_loader_refuses_what_a_lora_run_would_refuse_at_its_first_step():
    """EP balance and a compiled block with a ``peft`` section (either base dtype): one ``ConfigError`` when the run
    config is read, naming the setting and the fix."""
    from q38.train.run.run_config import RunConfig

    for peft in ({"rank": 4}, {"rank": 4, "base_dtype": "fp8"}):
        with pytest.raises(ConfigError, match=f"train.enable_ep_balance with a peft section \\(LoRA, base_dtype "
                                              f"{peft.get('base_dtype', 'compute')}\\) is not implemented.*set "
                                              "train.enable_ep_balance: false"):
            RunConfig.from_dict({"model": "tiny", "peft": peft, "train": {"enable_ep_balance": True}})
        with pytest.raises(ConfigError, match="kernels.block: compiled with a peft section .* set kernels.block: eager"):
            RunConfig.from_dict({"model": "tiny", "peft": peft, "kernels": {"block": "compiled"}})
    assert RunConfig.from_dict({"model": "tiny", "train": {"enable_ep_balance": True}}).peft is None  # full: allowed
