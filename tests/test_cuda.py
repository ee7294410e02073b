"""The accelerator path against the CPU fp32 reference: each layer family and a whole bf16 ``train_step`` on the
device, compared with the same computation in fp32 on the CPU (the path every other test checks against
transformers, naive loops and the unsharded run).

Runs where there is a device: ``benchmarks/gpu.sh`` runs this file on the lent GPU. Elsewhere it is skipped, by
name; the script's CPU dry run runs it with ``Q38_TEST_DEVICE=cpu`` (bf16 on the CPU against fp32 on the CPU), so
the test code itself is exercised on every CI run (tests/test_gpu_script.py).

Tolerances (relative error ‖Δ‖ / ‖ref‖ of the output and of every gradient): the device side computes in bf16 (8
significant bits: one rounding is up to 2⁻⁹ ≈ 2e-3) with fp32 accumulation. bf16 on the CPU against fp32 measured
up to 2.9e-2 (GDN's A_log / dt_bias gradients, sums over every token; the MoE router gradient through its sharpened
softmax) and 1e-2 or less for outputs and most gradients, so ``BF16_TOL`` is 6e-2: a wrong kernel (offsets, layout,
mask) is off by O(1). fp32 on the device against fp32 on the CPU differs only by summation order: ``FP32_TOL`` 1e-4
(TF32 is off for matmuls by default in torch).
"""

import os

import attrs
import pytest
import torch

import q38
from q38.pytree import tree_leaves, tree_map
from q38.kernels import KernelConfig, resolve_kernels
from q38.layers.context import seq_info

DEVICE = os.environ.get("Q38_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device: benchmarks/gpu.sh runs this file on the lent GPU "
                                              "(and its CPU dry run with Q38_TEST_DEVICE=cpu)"),
]
BF16_TOL = 6e-2
FP32_TOL = 1e-4
B, S = 2, 96


def _cfg(**kw) -> q38.ModelConfig:
    """Small, with every dimension a multiple of 16 (the CUDA grouped GEMM's alignment)."""
    base = dict(model_type="qwen3_5_moe", vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=32, mtp_num_layers=1,
                initializer_range=0.1)
    base.update(kw)
    return q38.ModelConfig(**base)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().float().cpu(), ref.detach().float().cpu()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def _doc_ids() -> torch.Tensor:
    """Packed rows: three documents in row 0, one in row 1."""
    doc = torch.zeros(B, S, dtype=torch.long)
    doc[0, 30:] = 1
    doc[0, 71:] = 2
    return doc


def _layer_grads(apply, layer_params, cfg, device, dtype, kernels: KernelConfig, packed: bool):
    """Output, input gradient and parameter gradients of ``apply(p, x, cfg, info)`` on ``device`` in ``dtype``
    (the same seeded input and output gradient everywhere)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, cfg.hidden_size, generator=g)
    dy = torch.randn(B, S, cfg.hidden_size, generator=g)
    p = tree_map(lambda t: t.detach().to(device=device, dtype=dtype).requires_grad_(), layer_params)
    xd = x.to(device=device, dtype=dtype).requires_grad_()
    doc = _doc_ids().to(device) if packed else None
    leaves = [xd, *tree_leaves(p)]
    resolved = resolve_kernels(kernels, device=device, dtype=str(dtype).removeprefix("torch."), model=cfg)
    y = apply(p, xd, cfg, seq_info(doc, B, S, device, kernels=resolved))
    grads = torch.autograd.grad(y, leaves, dy.to(device=device, dtype=dtype))
    return [y, *grads]


def _compare(got, ref, tol, what):
    errs = [_rel(a, r) for a, r in zip(got, ref)]
    print(f"{what}: relative errors {[f'{e:.1e}' for e in errs]}")
    assert max(errs) <= tol, f"{what}: relative errors (output, dx, parameter grads) {[f'{e:.1e}' for e in errs]}"


@pytest.mark.parametrize("experts", ["grouped_mm", "batched"])
def test_moe_layer_on_the_device_matches_cpu_fp32(experts):
    from q38.layers.moe import moe_apply

    cfg = _cfg()
    params = q38.init_params(cfg, seed=0).layers[0].moe
    # router weights with wide margins between experts: bf16 and fp32 pick the same top-k for every token (a tie
    # broken differently would be a different, equally right, computation)
    params = attrs.evolve(params, w_router=params.w_router * 20.0)

    def apply(p, x, cfg, info):
        return moe_apply(p, x, cfg, kernels=info.kernels)[0]

    ref = _layer_grads(apply, params, cfg, "cpu", torch.float32, KernelConfig(experts="batched"), packed=False)
    got = _layer_grads(apply, params, cfg, DEVICE, torch.bfloat16, KernelConfig(experts=experts), packed=False)
    _compare(got, ref, BF16_TOL, f"MoE, experts={experts}, bf16 on {DEVICE}")


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("family", ["gdn", "attention"])
def test_token_mixer_on_the_device_matches_cpu_fp32(family, packed):
    """The GDN layer (torch core, fp32 and bf16 on the device) and the attention layer (SDPA in bf16 on the device,
    against the explicit-softmax reference on the CPU), on plain and packed rows."""
    from q38.layers.attention import attention_apply
    from q38.layers.gdn import gdn_apply

    kind, apply, ref_kernels, dev_kernels, dtypes = {
        "gdn": ("linear_attention", gdn_apply, KernelConfig(gdn="torch"), KernelConfig(gdn="torch"),
                (torch.float32, torch.bfloat16)),
        "attention": ("full_attention", attention_apply, KernelConfig(attention="eager"),
                      KernelConfig(attention="sdpa"), (torch.bfloat16,)),
    }[family]
    cfg = _cfg()
    params = q38.init_params(cfg, seed=0).layers[cfg.layer_types.index(kind)].mixer
    ref = _layer_grads(apply, params, cfg, "cpu", torch.float32, ref_kernels, packed)
    for dtype in dtypes:
        got = _layer_grads(apply, params, cfg, DEVICE, dtype, dev_kernels, packed)
        tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
        _compare(got, ref, tol, f"{family} ({getattr(dev_kernels, family)}), {dtype} on {DEVICE}, packed={packed}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex's backward and varlen run on CUDA only (torch has no "
                                                          "FlexAttention backward on CPU, varlen_attn no CPU kernel)")
@pytest.mark.parametrize("impl", ["flex", "varlen"])
def test_fused_attention_forward_and_backward_on_cuda_match_sdpa(impl):
    """The attention layer on packed rows with ``kernels.attention: flex`` / ``varlen`` on the GPU: output, input
    and parameter gradients against the same layer on SDPA with the dense mask, on the GPU in fp32 (flex: FP32_TOL)
    and against the CPU fp32 explicit-softmax reference in bf16 (BF16_TOL). varlen takes 16-bit only."""
    from q38.layers.attention import attention_apply

    cfg = _cfg()
    params = q38.init_params(cfg, seed=0).layers[cfg.layer_types.index("full_attention")].mixer
    kernels = KernelConfig(attention=impl)
    if impl == "flex":
        ref = _layer_grads(attention_apply, params, cfg, "cuda", torch.float32, KernelConfig(attention="sdpa"), True)
        got = _layer_grads(attention_apply, params, cfg, "cuda", torch.float32, kernels, True)
        _compare(got, ref, FP32_TOL, "attention (flex vs sdpa), fp32 on cuda, packed")
    ref = _layer_grads(attention_apply, params, cfg, "cpu", torch.float32, KernelConfig(attention="eager"), True)
    got = _layer_grads(attention_apply, params, cfg, "cuda", torch.bfloat16, kernels, True)
    _compare(got, ref, BF16_TOL, f"attention ({impl}), bf16 on cuda, packed")


def test_a_bf16_train_step_on_the_device_tracks_cpu_fp32():
    """One whole step (chunked loss, MTP, aux loss, AdamW on fp32 masters) under the bf16 policy on the device
    against fp32 on the CPU: the loss terms within 1 %, the gradient norm within 5 % (bf16 on the CPU measured 5e-4
    and 3e-3), every parameter fp32 on the device after the update."""
    from q38.pytree import tree_leaves
    from q38.train.core.step_config import TrainConfig
    from q38.train.core.state import init_state
    from q38.train.core.step import train_step

    cfg = _cfg(initializer_range=0.05)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone(), "doc_ids": _doc_ids()}
    out = {}
    for key, where, dtype in (("ref", "cpu", "float32"), ("device", DEVICE, "bfloat16")):
        tc = TrainConfig(param_dtype=dtype, loss_chunk_size=64, aux_loss_coef=0.01)
        kernels = resolve_kernels(KernelConfig(), device=where, dtype=dtype, model=cfg)
        state = init_state(cfg, tc, seed=0, device=where, kernels=kernels)
        new, m = train_step(state, {k: v.to(where) for k, v in batch.items()})
        out[key] = m.as_dict()
        if key == "device":
            for t in tree_leaves(new.params):
                assert t.dtype == torch.float32 and t.device.type == torch.device(where).type
    ref, got = out["ref"], out["device"]
    print({k: (ref[k], got[k]) for k in ("loss", "mtp_1", "aux", "grad_norm")})
    for k in ("loss", "mtp_1", "aux"):
        assert abs(got[k] - ref[k]) <= 1e-2 * abs(ref[k]), (k, got[k], ref[k])
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= 5e-2 * ref["grad_norm"], (got["grad_norm"], ref["grad_norm"])
