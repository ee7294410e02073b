"""Models the tests share: the dimensions a test model must not share with the tiny preset, and a small planning
model unlike tiny in every one of them."""

from q38.model_config import ModelConfig

# every dimension a feature's test model must take a value of its own in (STYLE: a path tested only on tiny is untested)
UNLIKE_TINY_DIMS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "shared_expert_intermediate_size")

# tiny is hidden 64, 4 layers, 4/2 heads of 16, GDN 2/4 heads of 16, 8 experts top-2, widths 32, vocab 384; this one
# differs in each (vocab above the byte tokenizer's 261 tokens)
PLAN_CFG = ModelConfig.preset("tiny").replace(
    vocab_size=400, hidden_size=40, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
    num_attention_heads=3, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=3,
    linear_key_head_dim=12, linear_value_head_dim=12, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=28,
    shared_expert_intermediate_size=20, initializer_range=0.1)


def dims_like_tiny(cfg: ModelConfig) -> list[str]:
    """The dimensions of ``cfg`` equal to the tiny preset's (a test model's should be none)."""
    tiny = ModelConfig.preset("tiny")
    return [k for k in UNLIKE_TINY_DIMS if getattr(cfg, k) == getattr(tiny, k)]
