"""``kernels.block: compiled``: a decoder layer through ``torch.compile(fullgraph=True)`` equals the same layer run
eagerly, in fp32 on CPU: output, router logits and the gradients of the input and of every parameter, within 1e-5
(relative to max(1, max |eager|)). ``fullgraph=True`` makes any graph break an error, so passing also says each layer
traced as one graph. Slow: compiling takes minutes on a loaded 2-core machine.

The suite's shape checks (jaxtyping + beartype, installed by an import hook from pyproject's ``addopts``) wrap every
q38 function in a checker the compiler cannot trace; jaxtyping's runtime switch turns them off for these tests
(production runs have no hook)."""

import pytest
import torch

import q38
from q38.config import ModelConfig
from q38.errors import ConfigError
from q38.kernels import DEFAULT_KERNELS, KernelConfig, resolve_kernels
from q38.layers.block import compiled_block, layer_apply
from q38.layers.context import seq_info
from q38.pytree import tree_leaves, tree_map

TOL = 1e-5


@pytest.fixture
def no_shape_checks(monkeypatch):
    import jaxtyping

    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _close(x, ref):
    return (x - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item())


def _run(apply, lp, x, cfg, info):
    params = tree_map(lambda t: t.detach().clone().requires_grad_(), lp)
    x = x.detach().clone().requires_grad_()
    y, logits = apply(params, x, cfg, info)
    w = torch.sin(torch.arange(y.numel(), dtype=y.dtype)).view_as(y)
    loss = (y * w).sum() + (logits * torch.cos(torch.arange(logits.numel(), dtype=y.dtype)).view_as(logits)).sum()
    leaves = [x, *tree_leaves(params)]
    return (y, logits, *torch.autograd.grad(loss, leaves))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_a_compiled_layer_equals_eager(no_shape_checks, kind):
    cfg = ModelConfig.preset("tiny")
    lp = q38.init_params(cfg, seed=0).layers[cfg.layer_types.index(kind)]
    b, s = 2, 32
    x = torch.randn(b, s, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    doc = torch.tensor([[0] * 12 + [1] * 20, [0] * 32])  # packed rows: the masked GDN, conv and attention paths
    eager = _run(layer_apply, lp, x, cfg, seq_info(doc, b, s, "cpu", kernels=DEFAULT_KERNELS))
    kc = DEFAULT_KERNELS.replace(block="compiled")
    compiled = _run(kc.fn("block")(layer_apply), lp, x, cfg, seq_info(doc, b, s, "cpu", kernels=kc))
    assert kc.fn("block")(layer_apply) is compiled_block(layer_apply)  # one compiled function for every layer
    assert len(compiled) == len(eager)
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert _close(c, e), (i, (c - e).abs().max().item())


def test_compiled_blocks_refuse_what_they_do_not_support():
    with pytest.raises(ConfigError, match="kernels.block: compiled does not support context parallelism"):
        resolve_kernels(KernelConfig(block="compiled"), device="cpu", cp=True)
    # grouped_mm cannot be traced in fp32: auto takes the padded path, an explicit choice is refused
    assert resolve_kernels(KernelConfig(block="compiled"), device="cpu", dtype="float32").experts == "batched"
    with pytest.raises(ConfigError, match="grouped_mm cannot be compiled in float32"):
        resolve_kernels(KernelConfig(block="compiled", experts="grouped_mm"), device="cpu", dtype="float32")
