"""Predicted step FLOPs (q38/flops.py, the formula MFU and ``q38 plan`` share) against torch's FlopCounterMode on a
real ``train_step`` (tolerance 5 %).

FlopCounterMode needs additions to count what this model runs on CPU, each independent of q38's formula: its
grouped-convolution backward ignores ``groups`` (a depthwise conv's weight gradient is counted ``channels`` times
too large), and it has no entries for the in-place ``baddbmm_`` / ``addmm_`` (the GDN backward and the chunked
loss accumulate gradients with them), the triangular solve, the CPU flash SDPA op, or ``_grouped_mm``. Its SDPA
formula counts every score (no causal skip), so the prediction is asked for ``causal_skip=False``.
"""

import pytest
import torch
from torch.utils.flop_counter import (FlopCounterMode, bmm_flop, conv_flop_count, mm_flop, sdpa_backward_flop_count,
                                      sdpa_flop_count)

from q38.model_config import ModelConfig
from q38.kernels import DEFAULT_KERNELS
from q38.flops import step_flops
from q38.train.core.step_config import TrainConfig
from q38.train.core.state import init_state
from q38.train.core.step import train_step

aten = torch.ops.aten


def _conv_bwd(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed, _op, _groups,
              output_mask, out_shape=None, **kw):
    one = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed=transposed)  # groups-aware via w_shape[1]
    return one * (int(output_mask[0]) + int(output_mask[1]))


def _solve(a_shape, b_shape, *args, out_shape=None, **kw):
    n, nrhs = a_shape[-1], b_shape[-1]
    batch = 1
    for x in b_shape[:-2]:
        batch *= x
    return batch * n * n * nrhs


def _grouped_mm(a_shape, b_shape, *args, out_shape=None, **kw):
    # [m, k] x [e, k, n] (forward) or [k, m] x [m, n] -> [e, k, n] (weight grad): 2 · total products
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    raise NotImplementedError((a_shape, b_shape))


def _sdpa_cpu(q, k, v, *args, out_shape=None, **kw):
    return sdpa_flop_count(q, k, v)


def _sdpa_cpu_bwd(grad_out, q, k, v, *args, out_shape=None, **kw):
    return sdpa_backward_flop_count(grad_out, q, k, v)


def _baddbmm_(self_shape, a_shape, b_shape, *args, out_shape=None, **kw):
    return bmm_flop(a_shape, b_shape)


def _addmm_(self_shape, a_shape, b_shape, *args, out_shape=None, **kw):
    return mm_flop(a_shape, b_shape)


MAPPING = {
    aten.baddbmm_: _baddbmm_,
    aten.addmm_: _addmm_,
    aten.convolution_backward: _conv_bwd,
    aten.linalg_solve_triangular: _solve,
    aten._grouped_mm: _grouped_mm,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_bwd,
}


GROUPED = DEFAULT_KERNELS.replace(experts="grouped_mm")  # the experts as the CPU run picks them (kernels: auto)


def _measure(cfg, tc, b, s):
    state = init_state(cfg, tc, seed=0, kernels=GROUPED)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False, custom_mapping=MAPPING) as fc:
        train_step(state, {"input_ids": ids, "labels": ids})
    return fc.get_total_flops(), fc.get_flop_counts()["Global"]


SMALL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
             num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=96)


@pytest.mark.parametrize("preset,recompute,mb", [
    pytest.param("tiny", "none", 1, marks=pytest.mark.slow),  # 10-25 s each on the shared machine
    pytest.param("tiny", "full", 1, marks=pytest.mark.slow),
    pytest.param("tiny", "selective_gdn", 2, marks=pytest.mark.slow),
    pytest.param("small", "none", 1, marks=pytest.mark.slow),
])
def test_step_flops_match_flop_counter(preset, recompute, mb):
    cfg = ModelConfig.preset("tiny")
    if preset == "small":
        cfg = cfg.replace(**SMALL)
    tc = TrainConfig(loss_chunk_size=256, micro_batches=mb, recompute=recompute != "none",
                     skip_gdn_recompute=recompute == "selective_gdn", aux_loss_scope="global_batch")
    b, s = 2, 128
    measured, by_op = _measure(cfg, tc, b, s)
    pred = step_flops(cfg, b, s, recompute=recompute, micro_batches=mb, aux_global=True, causal_skip=False)
    ratio = pred.executed / measured
    print(f"{preset} recompute={recompute} mb={mb}: predicted {pred.executed:.4g} measured {measured:.4g} ratio {ratio:.4f}")
    assert abs(ratio - 1) < 0.05, (ratio, pred, by_op)
