"""``kernels.block: compiled``: a decoder layer through ``torch.compile(fullgraph=True)`` equals the same layer run
eagerly, in fp32 on CPU: output, router logits and the gradients of the input and of every parameter, within 1e-5
(relative to max(1, max |eager|)). ``fullgraph=True`` makes any graph break an error, so passing also says each layer
traced as one graph. Slow: compiling takes minutes on a loaded 2-core machine.

The suite's shape checks (jaxtyping + beartype, installed by an import hook from pyproject's ``addopts``) wrap every
q38 function in a checker the compiler cannot trace (even switched off at run time, the wrapper breaks the trace), so
the comparison runs in a subprocess without the hook: this file run as a script (production has no hook either)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import q38
from q38.model_config import ModelConfig
from q38.errors import ConfigError
from q38.kernels import DEFAULT_KERNELS, KernelConfig, resolve_kernels
from q38.layers.block import compiled_block, layer_apply
from q38.layers.context import seq_info
from q38.pytree import tree_leaves, tree_map

TOL = 1e-5


def _run(apply, lp, x, cfg, info):
    params = tree_map(lambda t: t.detach().clone().requires_grad_(), lp)
    x = x.detach().clone().requires_grad_()
    y, logits = apply(params, x, cfg, info)
    w = torch.sin(torch.arange(y.numel(), dtype=y.dtype)).view_as(y)
    loss = (y * w).sum() + (logits * torch.cos(torch.arange(logits.numel(), dtype=y.dtype)).view_as(logits)).sum()
    leaves = [x, *tree_leaves(params)]
    return (y, logits, *torch.autograd.grad(loss, leaves))


def compare(kind: str) -> dict:
    """Eager vs ``kernels.block: compiled`` on one layer of ``kind`` (packed rows: the masked GDN, conv and attention
    paths): per tensor (output, logits, d input, d every parameter), max |compiled − eager| / max(1, max |eager|)."""
    cfg = ModelConfig.preset("tiny")
    lp = q38.init_params(cfg, seed=0).layers[cfg.layer_types.index(kind)]
    b, s = 2, 32
    x = torch.randn(b, s, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    doc = torch.tensor([[0] * 12 + [1] * 20, [0] * 32])
    eager = _run(layer_apply, lp, x, cfg, seq_info(doc, b, s, "cpu", kernels=DEFAULT_KERNELS))
    kc = DEFAULT_KERNELS.replace(block="compiled")
    compiled = _run(kc.fn("block")(layer_apply), lp, x, cfg, seq_info(doc, b, s, "cpu", kernels=kc))
    assert kc.fn("block")(layer_apply) is compiled_block(layer_apply)  # one compiled function for every layer
    assert len(compiled) == len(eager)
    return {"errors": [(c - e).abs().max().item() / max(1.0, e.abs().max().item()) for c, e in zip(compiled, eager)]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_a_compiled_layer_equals_eager(kind):
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), kind], capture_output=True, text=True,
                          timeout=1800, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-4000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])["errors"]
    assert len(errors) > 10 and max(errors) <= TOL, errors


def test_compiled_blocks_refuse_what_they_do_not_support():
    with pytest.raises(ConfigError, match="kernels.block: compiled does not support context parallelism"):
        resolve_kernels(KernelConfig(block="compiled"), device="cpu", cp=True)
    # grouped_mm cannot be traced in fp32: auto takes the padded path, an explicit choice is refused
    assert resolve_kernels(KernelConfig(block="compiled"), device="cpu", dtype="float32").experts == "batched"
    with pytest.raises(ConfigError, match="grouped_mm cannot be compiled in float32"):
        resolve_kernels(KernelConfig(block="compiled", experts="grouped_mm"), device="cpu", dtype="float32")
    # routing replay (q38 rl) through a compiled layer: one line at the first layer, before any trace
    cfg = ModelConfig.preset("tiny")
    b, s = 1, 8
    kc = DEFAULT_KERNELS.replace(block="compiled", experts="batched")
    routes = torch.zeros(b, s, cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="compiled with routing replay"):
        q38.forward(q38.init_params(cfg, seed=0), torch.zeros(b, s, dtype=torch.long), cfg, routes=routes,
                    info=seq_info(None, b, s, "cpu", kernels=kc))


if __name__ == "__main__":
    print(json.dumps(compare(sys.argv[1])))
