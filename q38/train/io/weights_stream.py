"""The serving hand-over from a sharded train state (docs/rl.md#handing-the-weights-to-a-serving-engine): the
``(Hugging Face name, tensor)`` pairs ``q38.hf.hf_weights`` yields for one process's plain parameters, from
parameters that are DTensors (FSDP, EP, CP shards), LoRA adapters merged, one tensor group gathered at a time."""

import torch
from torch import Tensor

from q38.hf import _abstract_shapes, hf_pairs
from q38.lora import _node, merged_params
from q38.model_config import ConfigError, ModelConfig
from q38.pytree import named_leaves


def _full(x):
    """``x`` with every DTensor gathered to its full tensor (a collective over the DTensor's mesh)."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def _dtype(node) -> torch.dtype:
    """The dtype of a leaf in plain form: a tensor's own; an adapted or block-FP8 node is merged in fp32."""
    return torch.float32 if _node(node) else node.dtype


def sharded_hf_weights(config: ModelConfig, params, *, dtype: torch.dtype | None = None):
    """``hf_weights(config, merged plain params)`` from ``params`` whose leaves may be DTensors and whose weights
    may carry LoRA adapters (or a block-FP8 base): the same names, in the same order, with the same values.

    Group by group (one export rule: e.g. one layer's fused experts, one projection), each leaf of the group is
    gathered to its full tensor (``DTensor.full_tensor``: an all-gather over its mesh) and, when adapted, merged in
    fp32 (``q38.lora.merged_params``); the group's leaves and outputs are freed before the next group is gathered,
    so a rank holds its shards plus one group, never the model. Every rank of the mesh must iterate the generator to
    the end in step (the gathers are collectives), and every rank receives every pair (a colocated engine on each
    rank loads its own copy). ``dtype``: every tensor cast to it (default: each leaf's own; merged leaves fp32)."""
    nodes = {p: x for p, x in named_leaves(params, is_leaf=_node) if x is not None}
    expected = _abstract_shapes(config)
    problems = [f"missing {p}" for p in expected if p not in nodes] + [f"unexpected {p}" for p in nodes
                                                                        if p not in expected]
    if problems:
        raise ConfigError(f"sharded_hf_weights: params do not match the config: {'; '.join(problems[:4])}"
                          + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""))

    def leaf(q: str) -> Tensor:
        x = torch.utils._pytree.tree_map(_full, nodes[q])
        return merged_params(x) if _node(x) else x

    yield from hf_pairs(config, leaf, lambda q: dtype or _dtype(nodes[q]))
