"""docs/extending.md, followed: its four recipes (a layout YAML, a layer kind, a loss term, a kernel) applied as
written to a temporary copy of the repository, then checked there (``CHECKS``, plus tests/test_kinds.py, which reads
the kind table) and, slow, the suite's layout, kind, kernel and objective tests run against the copy. A recipe
edit whose anchor no longer exists fails with a line saying which recipe and file to update.

The examples: layout ``ep_dp`` (a mesh dim name the code has never seen), a ``sliding_attention`` kind (attention's
weights, keys limited to a window, the attention region, a ``sliding_window`` config field), a router z-loss term
(``router_z_loss_coef``) and a looped ``experts`` kernel (``auto=False``). Besides, in this process: a new weight,
a toy kernel and a toy kind with its own region, by monkeypatching the tables."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from q38.layers.common import ParamInfo
from q38.model_config import ConfigError
from q38.parallel import Layout

ROOT = Path(__file__).resolve().parent.parent

# ---- the recipes, as the edits a contributor makes ---------------------------------------------------------------

LAYOUT_YAML = """\
# Expert parallelism over a mesh dim named dp: experts split over ep, every weight FSDP over dp and ep.
include: single.yaml
name: ep_dp
mesh: {dp: -1, ep: 2}
fsdp: [dp, ep]
rules:
  expert: ep
compute:
  expert: ep
activations:
  batch: [dp, ep]
"""

SLIDING_PY = '''\
"""Sliding-window attention: gated attention (attention.py's weights and projections) whose queries see the
``sliding_window`` most recent keys of their own document, themselves included. One device (no CP)."""

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from q38.layers.attention import AttnParams
from q38.layers.context import SeqInfo
from q38.layers.cost import CPExchange, MixerFlops, MixerSaved, Workload
from q38.layers.hf_keys import renames
from q38.layers.norm import rms_norm
from q38.layers.rope import apply_rope, rope_cos_sin
from q38.model_config import ModelConfig

SLIDING_RENAMES = {"w_q": "self_attn.q_proj.weight", "w_k": "self_attn.k_proj.weight",
                   "w_v": "self_attn.v_proj.weight", "w_o": "self_attn.o_proj.weight",
                   "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}


def sliding_apply(p: AttnParams, x: Float[Tensor, "b s d"], cfg: ModelConfig, info: SeqInfo) -> Float[Tensor, "b s d"]:
    if not info.comm.is_local:
        raise NotImplementedError("sliding_attention does not support context parallelism (a cp mesh dim > 1)")
    h, g, c, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    cos, sin = rope_cos_sin(info.positions, cfg.rotary_dim, cfg.rope_theta)
    q, gate = rearrange(F.linear(x, p.w_q), "b s (h c2) -> b s h c2", h=h).chunk(2, dim=-1)
    q = apply_rope(rms_norm(q, p.q_norm, eps), cos, sin)
    k = apply_rope(rms_norm(rearrange(F.linear(x, p.w_k), "b s (g c) -> b s g c", g=g), p.k_norm, eps), cos, sin)
    v = rearrange(F.linear(x, p.w_v), "b s (g c) -> b s g c", g=g)
    back = info.seq_idx[:, :, None] - info.seq_idx[:, None, :]  # query index minus key index
    same_doc = info.doc_ids[:, :, None] == info.doc_ids[:, None, :]
    visible = (back >= 0) & (back < cfg.sliding_window) & same_doc
    q, k, v = (rearrange(t, "b s h c -> b h s c") for t in (q, k, v))
    k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    with info.region("attention"):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=c**-0.5)
    o = rearrange(o, "b h s c -> b s (h c)") * rearrange(torch.sigmoid(gate), "b s h c -> b s (h c)")
    return F.linear(o, p.w_o)


def sliding_flops(cfg: ModelConfig, w: Workload) -> MixerFlops:
    d, h, g, c = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dense = 2 * w.tokens * d * (2 * h * c + 2 * g * c + h * c)
    win = min(cfg.sliding_window, w.seq)
    keys = (win * (win + 1) / 2 + (w.seq - win) * win) / w.seq if w.causal_skip else w.seq  # visible keys per query
    return MixerFlops(terms={"dense": dense, "attention": 4 * w.tokens * h * c * keys}, kernel=("attention",))


def sliding_saved(cfg: ModelConfig, w: Workload) -> MixerSaved:
    h, g, c, n, act = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, w.tokens, w.act_bytes
    mask = w.rows * w.seq * w.seq  # the boolean [b, s, s] mask
    core = n * c * 4 * h * act + n * h * 4 + mask  # q, repeated k and v, out; logsumexp fp32
    rest = n * (2 * h * c + 2 * g * c + 2 * h * c) * act
    return MixerSaved(core=core, rest=rest, widest=max(mask, n * h * c * act), kept=n * h * (c * act + 4))


def sliding_cp_exchange(cfg: ModelConfig, w: Workload) -> CPExchange:
    return CPExchange(collective="none (no context parallelism)", bytes=0.0, calls=0, recompute_calls=0)


def sliding_hf(cfg, layout, qp: str, hp: str, shapes: dict) -> list:
    return renames(SLIDING_RENAMES, qp, hp, shapes)
'''

SLIDING_RECORD = """\
    MixerKind(name="sliding_attention", params=AttnParams, abstract=abstract_attention, apply=sliding_apply,
              region="attention", keep_flag="skip_flash_attn_recompute", flops=sliding_flops,
              saved=sliding_saved, cp_exchange=sliding_cp_exchange, hf_rules=sliding_hf),
"""

Z_TERM = '''\
def router_z_term(ti: TermInput) -> Tensor:
    """Router z-loss (ST-MoE): the mean over counted tokens and MoE layers of logsumexp(router logits)²; this
    micro-batch's partial: its sum over local counted tokens / (layers · the step's counted tokens)."""
    m = aux_mask(ti.mb, ti.train_config).reshape(-1)
    z = sum(torch.logsumexp(rl.float(), dim=-1).pow(2)[m].sum() for rl in ti.out.router_logits)
    return z / (len(ti.out.router_logits) * ti.step.n_aux.clamp(min=1))


'''

LOOPED_KERNEL = '''

def swiglu_looped(
    x_md: Float[Tensor, "m d"],
    counts_e: Int[Tensor, " e"],
    we_gate_up: Float[Tensor, "e f2 d"],
    we_down: Float[Tensor, "e d f"],
    w_m: Float[Tensor, " m"],
) -> Float[Tensor, "m d"]:
    """``kernels.experts: looped``: one expert at a time over its run of the sorted slots (a plain reference)."""
    if x_md.shape[0] == 0:
        return x_md * w_m[:, None]
    ys, start = [], 0
    for e, n in enumerate(counts_e.tolist()):
        gate, up = F.linear(x_md[start:start + n], we_gate_up[e]).chunk(2, dim=-1)
        ys.append(F.linear(F.silu(gate) * up * w_m[start:start + n, None], we_down[e]))
        start += n
    return torch.cat(ys)
'''

LOOPED_ENTRY = """\
        "looped": KernelImpl(devices=("cpu", "cuda", "npu", "meta"), cp=True, packed=True, backward=True, auto=False,
                             note="one expert at a time over its slots (a reference; auto never picks it)",
                             fn="q38.layers.moe:swiglu_looped"),
"""

# (recipe, file, anchor, text, where): each edit puts ``text`` before or after the one occurrence of ``anchor``
EDITS = (
    ("kind", "q38/model_config.py", "    partial_rotary_factor: float = 0.25  # fraction of head_dim that is rotated\n",
     "    sliding_window: int = 4096  # sliding_attention layers: the keys a query sees, itself included\n", "after"),
    ("kind", "q38/model_config.py", '        need(self.rms_norm_eps > 0, "rms_norm_eps must be > 0")\n',
     '        need(self.sliding_window > 0, f"sliding_window must be > 0, got {self.sliding_window}")\n', "after"),
    ("kind", "q38/hf_config.py", "        rope_theta=rope_theta,\n",
     '        sliding_window=int(text.get("sliding_window") or 4096),\n', "after"),
    ("kind", "q38/hf_config.py", "        layer_types=list(cfg.layer_types),\n",
     '        **({"sliding_window": cfg.sliding_window} if "sliding_attention" in cfg.layer_types else {}),\n',
     "after"),
    ("kind", "q38/layers/kinds.py", "from q38.model_config import ",
     "from q38.layers.sliding import sliding_apply, sliding_cp_exchange, sliding_flops, sliding_hf, sliding_saved\n",
     "before"),
    ("kind", "q38/layers/kinds.py", "              saved=gdn_saved, cp_exchange=gdn_cp_exchange, hf_rules=_gdn_hf),\n",
     SLIDING_RECORD, "after"),
    ("loss term", "q38/train/core/objective.py", "def default_terms(mc, tc) -> tuple[Term, ...]:\n", Z_TERM, "before"),
    ("loss term", "q38/train/core/objective.py",
     '    return (Term("loss", 1.0, main_term), *mtp, Term("aux", aux_coef(mc, tc), aux_term))\n',
     '    z = (Term("z_loss", tc.router_z_loss_coef, router_z_term),) if tc.router_z_loss_coef else ()\n', "before"),
    ("loss term", "q38/train/core/objective.py",
     '    return (Term("loss", 1.0, main_term), *mtp, Term("aux", aux_coef(mc, tc), aux_term))\n',
     '    return (Term("loss", 1.0, main_term), *mtp, Term("aux", aux_coef(mc, tc), aux_term), *z)\n', "replace"),
    ("loss term", "q38/train/core/step_config.py",
     "    aux_loss_coef: float | None = attrs.field(default=None, validator=[ge(0), finite])\n",
     "    router_z_loss_coef: float = attrs.field(default=0.0, validator=[ge(0), finite])  # router z-loss weight\n",
     "after"),
    ("kernel", "q38/kernels.py", '        "batched": KernelImpl(', LOOPED_ENTRY, "before"),
)


def _edit(root: Path, recipe: str, rel: str, anchor: str, text: str, where: str) -> None:
    path = root / rel
    src = path.read_text()
    n = src.count(anchor)
    assert n == 1, (f"docs/extending.md's {recipe} recipe no longer fits {rel} ({n} places match {anchor!r}): "
                    "update the recipe and tests/test_extending.py's EDITS together")
    new = {"before": text + anchor, "after": anchor + text, "replace": text}[where]
    path.write_text(src.replace(anchor, new))


def extend_copy(dest: Path) -> Path:
    """A copy of the repository (q38, specs, tests, pyproject.toml) with the four recipes applied."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("q38", "specs", "tests"):
        shutil.copytree(ROOT / d, dest / d, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    (dest / "specs" / "parallel" / "ep_dp.yaml").write_text(LAYOUT_YAML)
    (dest / "q38" / "layers" / "sliding.py").write_text(SLIDING_PY)
    with open(dest / "q38" / "layers" / "moe.py", "a") as f:
        f.write(LOOPED_KERNEL)
    for e in EDITS:
        _edit(dest, *e)
    (dest / "tests" / "test_recipes_followed.py").write_text(CHECKS)
    return dest


def run_in(root: Path, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m pytest args`` with the copy's q38 first on the path (ahead of the installed one)."""
    env = {**os.environ, "PYTHONPATH": str(root), "Q38_SPECS": str(root / "specs"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _passed(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, (f"pytest in the extended copy failed (rc {r.returncode}):\n{r.stdout[-6000:]}\n"
                               f"{r.stderr[-3000:]}")


@pytest.fixture(scope="module")
def extended(tmp_path_factory) -> Path:
    return extend_copy(tmp_path_factory.mktemp("extended"))


# ---- what the copy checks: each recipe's result, beside the suite's own tests ------------------------------------

CHECKS = textwrap.dedent('''\
    """Written by tests/test_extending.py into a copy of the repository with docs/extending.md's recipes applied."""

    from pathlib import Path

    import pytest
    import torch

    import q38
    from q38.kernels import REGISTRY, KernelConfig, fallback, kernel_report, resolve_kernels
    from q38.layers.attention import attention_apply
    from q38.layers.context import seq_info
    from q38.layers.kinds import MIXER_KINDS, count_by_kind, kept_regions, layer_kinds, recompute_modes
    from q38.model import count_params, forward, init_params
    from q38.model_config import ModelConfig
    from q38.parallel import Layout
    from q38.pytree import named_leaves

    TOL = 1e-5


    def test_the_copy_is_what_runs():
        assert Path(q38.__file__).resolve().parent.parent == Path(__file__).resolve().parent.parent


    def test_layout_is_a_preset_and_places_experts_on_its_new_dim(tiny_cfg):
        assert "ep_dp" in Layout.presets()
        pl = Layout.preset("ep_dp").validate(tiny_cfg, 4)
        assert pl["layers.0.moe.we_gate_up"].mesh_axes_per_dim == (("ep",), ("dp",), ())
        assert pl["layers.0.mixer.w_qkv"].mesh_axes_per_dim == (("dp", "ep"), ())


    def _sliding(tiny_cfg, window):
        return tiny_cfg.replace(layer_types=("sliding_attention",) + tiny_cfg.layer_types[1:], sliding_window=window)


    def test_sliding_kind_runs_counts_prices_and_round_trips(tiny_cfg, tmp_path):
        from q38.flops import step_flops
        from q38.hf import load_hf, save_hf
        from q38.parallel.budget import estimate

        cfg = _sliding(tiny_cfg, 4)
        assert [k.name for k in layer_kinds(cfg)][0] == "sliding_attention"
        assert count_by_kind(cfg)["sliding_attention"] == 1
        params = init_params(cfg, seed=0)
        ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(forward(params, ids, cfg).hidden).all()
        leaves = [(p, t) for p, t in named_leaves(params) if t is not None]
        assert count_params(cfg).total == sum(t.numel() for p, t in leaves if not p.startswith("mtp."))
        full = tiny_cfg.replace(layer_types=("full_attention",) + tiny_cfg.layer_types[1:])
        assert step_flops(cfg, 1, 16).attention < step_flops(full, 1, 16).attention  # fewer keys per query
        assert step_flops(cfg.replace(sliding_window=16), 1, 16) == step_flops(full, 1, 16)  # a window of the row
        assert estimate(cfg, Layout.preset("fsdp"), 2, seq_len=16, rows_per_rank=1).peak_bytes > 0
        assert recompute_modes() == ("none", "full", "selective_attention", "selective_gdn",
                                     "selective_attention+gdn")  # it shares attention's region
        assert kept_regions("selective_attention") == {MIXER_KINDS["sliding_attention"].region}
        save_hf(tmp_path / "hf", cfg, params)
        cfg2, back = load_hf(tmp_path / "hf")
        assert cfg2.layer_types[0] == "sliding_attention" and cfg2.sliding_window == 4
        assert torch.equal(back.layers[0].mixer.w_q, params.layers[0].mixer.w_q)


    def test_sliding_attention_is_attention_over_its_window(tiny_cfg):
        """Reference: full attention (the shipped layer) over the window's tokens alone, whose last output is the
        sliding layer's output at that position (RoPE scores depend on offsets only). A window as long as the row
        is full attention."""
        cfg = _sliding(tiny_cfg, 3)
        p = init_params(cfg, seed=1).layers[0].mixer
        s = 10
        x = torch.randn(2, s, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        y = MIXER_KINDS["sliding_attention"].apply(p, x, cfg, seq_info(None, 2, s, "cpu"))
        for t in range(s):
            lo = max(0, t - 2)
            ref = attention_apply(p, x[:, lo:t + 1], cfg, seq_info(None, 2, t + 1 - lo, "cpu"))[:, -1]
            assert torch.allclose(y[:, t], ref, atol=TOL), t
        wide = cfg.replace(sliding_window=s)
        full = attention_apply(p, x, wide, seq_info(None, 2, s, "cpu"))
        assert torch.allclose(MIXER_KINDS["sliding_attention"].apply(p, x, wide, seq_info(None, 2, s, "cpu")), full,
                              atol=TOL)


    def test_z_loss_term_is_its_formula_with_its_weight(tiny_cfg):
        from q38.train.core.objective import default_terms
        from q38.train.core.state import init_state
        from q38.train.core.step import loss_and_grads
        from q38.train.core.step_config import TrainConfig

        cfg = tiny_cfg.replace(initializer_range=0.1)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
        doc = torch.zeros(2, 12, dtype=torch.long)
        doc[1, -3:] = -1  # padding: not counted
        labels = ids.clone()
        labels[1, -3:] = -100
        batch = {"input_ids": ids, "labels": labels, "doc_ids": doc}
        assert "z_loss" not in [t.name for t in default_terms(cfg, TrainConfig())]  # off by default
        tc = TrainConfig(router_z_loss_coef=0.25)
        terms = default_terms(cfg, tc)
        assert [t.weight for t in terms if t.name == "z_loss"] == [0.25]
        state = init_state(cfg, tc, seed=0)
        r = loss_and_grads(state, batch)  # the step's terms by name: the keys of the logs
        out = forward(state.params, ids, cfg, doc_ids=doc)
        real = (doc != -1).reshape(-1)
        z = torch.stack([torch.logsumexp(rl, -1).pow(2)[real].mean() for rl in out.router_logits]).mean()
        assert abs(float(r.terms["z_loss"]) - float(z)) <= TOL
        assert abs(float(r.objective) - sum(t.weight * float(r.terms[t.name]) for t in terms)) <= TOL


    def test_looped_kernel_matches_the_fallback_and_is_named_only():
        assert list(REGISTRY["experts"])[-2:] == ["looped", "batched"] and fallback("experts") == "batched"
        assert resolve_kernels(KernelConfig(), device="cpu").experts != "looped"
        assert resolve_kernels(KernelConfig(experts="looped"), device="cpu").experts == "looped"
        assert ("experts", "looped", "usable when named (auto does not pick it)") in kernel_report(device="cpu")
        g = torch.Generator().manual_seed(0)
        counts = torch.tensor([3, 0, 5, 2])
        m, d, f = int(counts.sum()), 8, 6
        args = [torch.randn(m, d, generator=g), counts, torch.randn(4, 2 * f, d, generator=g),
                torch.randn(4, d, f, generator=g), torch.rand(m, generator=g)]
        grads = {}
        for name in ("looped", "batched"):
            leaves = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
            y = KernelConfig(experts=name).fn("experts")(*leaves)
            y.pow(2).sum().backward()
            grads[name] = [y.detach()] + [a.grad for a in leaves if a.is_floating_point()]
        for a, b in zip(grads["looped"], grads["batched"]):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-5)
''')


@pytest.mark.slow
def test_the_recipes_hold_in_a_copy(extended):
    """The four recipes applied to a copy (each edit finds its place), the copy's recipe checks and its kind tests
    (which read the table, so they cover the sliding-window kind) pass."""
    _passed(run_in(extended, "tests/test_recipes_followed.py", "tests/test_kinds.py", timeout=300))


@pytest.mark.slow
def test_the_suite_passes_against_the_extended_tables(extended):
    """The suite's layout, kind, kernel and objective tests pass in the copy, after the layout recipe's golden file
    is written as the recipe says."""
    _passed(run_in(extended, "tests/test_layout.py", "-k", "golden and ep_dp", env={"Q38_UPDATE_GOLDEN": "1"}))
    _passed(run_in(extended, "-m", "not slow", "tests/test_layout.py", "tests/test_kinds.py", "tests/test_kernels.py",
                   "tests/test_objective.py", timeout=1800))


# ---- in this process: the tables monkeypatched -----------------------------------------------------------------


def test_a_new_weight_reaches_every_layout(tiny_cfg):
    """A new layer weight declared with role-named axes (no layout edited) is FSDP-sharded on its fsdp_dim in every
    FSDP layout and replicated in `single`."""
    tree = {"layers": [{"mixer": {"w_new": ParamInfo((1024, 32), axes=("new_out", "embed"), fsdp_dim=0)}}]}
    for name in Layout.presets():
        lay = Layout.preset(name)
        world = 1
        for _, s in lay.mesh:
            world *= s if s > 0 else 2
        pp = lay.placements(tree, world)["layers.0.mixer.w_new"]
        assert pp.mesh_axes_per_dim == (tuple(lay.fsdp), ()), name


def test_a_new_kernel_is_one_registry_entry(monkeypatch):
    """Registering a toy GDN implementation makes it choosable, preferred by auto where it runs, and refused with a
    message where it does not (before anything is allocated)."""
    import q38.kernels as k

    toy = k.KernelImpl(devices=("cpu",), cp=False, packed=True, backward=True, note="toy")
    monkeypatch.setitem(k.REGISTRY, "gdn", {"toy": toy, **k.REGISTRY["gdn"]})
    k.check_registry(k.REGISTRY)
    assert k.resolve_kernels(k.KernelConfig(), device="cpu").gdn == "toy"  # auto: first that supports the run
    assert k.resolve_kernels(k.KernelConfig(), device="cpu", cp=True).gdn == "torch"  # toy has no CP
    with pytest.raises(ConfigError, match=r"kernels.gdn: toy does not support context parallelism"):
        k.resolve_kernels(k.KernelConfig(gdn="toy"), device="cpu", cp=True)


def test_the_registry_states_its_fallbacks():
    """Each op has exactly one ``fallback=True`` entry and it is portable; a second one, none, or one that cannot
    run everywhere the op runs is refused when the registry is checked."""
    import attrs

    import q38.kernels as k

    assert {op: k.fallback(op) for op in k.OPS} == {op: getattr(k.DEFAULT_KERNELS, op) for op in k.OPS}
    gdn = k.REGISTRY["gdn"]
    with pytest.raises(ValueError, match="kernels.gdn: 2 implementations marked fallback=True"):
        k.check_registry({**k.REGISTRY, "gdn": {**gdn, "fla": attrs.evolve(gdn["fla"], fallback=True)}})
    with pytest.raises(ValueError, match="kernels.gdn: 0 implementations marked fallback=True"):
        k.check_registry({**k.REGISTRY, "gdn": {n: attrs.evolve(i, fallback=False) for n, i in gdn.items()}})
    narrow = attrs.evolve(gdn["torch"], devices=("cpu", "cuda", "meta"), cp=False)
    with pytest.raises(ValueError, match=r"kernels.gdn: fallback torch is not portable: it lacks devices \['npu'\], "
                                         r"cp$"):
        k.check_registry({**k.REGISTRY, "gdn": {**gdn, "torch": narrow}})


def test_a_kind_with_its_own_region_is_one_record(monkeypatch, tiny_cfg, tmp_path):
    """A toy mixer with its own params class and its own region (``y = x Wᵀ``), one ``MixerKind`` record added to
    the table and nothing else: accepted in ``layer_types``, initialised and run, counted, priced by ``step_flops``
    and the budget, placed by a layout (its new axis takes the FSDP role), written to and read back from a Hugging
    Face checkpoint, and its region makes the recompute modes."""
    import attrs
    import torch
    import torch.nn.functional as F
    from torch import Tensor

    import q38.layers.kinds as kinds
    from q38.flops import step_flops
    from q38.hf import load_hf, save_hf
    from q38.layers.hf_keys import renames
    from q38.model import abstract_params, count_params, forward, init_params
    from q38.parallel.budget import estimate
    from q38.pytree import named_leaves, pytree_node

    @pytree_node
    @attrs.frozen
    class ToyParams:
        w_mix: Tensor  # [d, d]

    def abstract_toy(cfg):
        return ToyParams(w_mix=ParamInfo((cfg.hidden_size, cfg.hidden_size), std=cfg.initializer_range,
                                         axes=("toy_out", "embed")))

    def toy_apply(p, x, cfg, info):
        with info.region("toy"):
            return F.linear(x, p.w_mix)

    def toy_flops(cfg, w):
        return kinds.MixerFlops(terms={"dense": 2 * w.tokens * cfg.hidden_size**2}, kernel=("dense",))

    def toy_saved(cfg, w):
        x = w.tokens * cfg.hidden_size * w.act_bytes
        return kinds.MixerSaved(core=x, rest=0.0, widest=x, kept=x)

    toy = kinds.MixerKind(
        name="toy_mixer", params=ToyParams, abstract=abstract_toy, apply=toy_apply, region="toy",
        keep_flag="skip_toy_recompute", flops=toy_flops, saved=toy_saved,
        cp_exchange=lambda cfg, w: kinds.CPExchange(collective="toy exchange", bytes=0.0, calls=2, recompute_calls=3),
        hf_rules=lambda cfg, layout, qp, hp, shapes: renames({"w_mix": "toy_mixer.weight"}, qp, hp, shapes),
    )
    monkeypatch.setitem(kinds.MIXER_KINDS, "toy_mixer", toy)

    cfg = tiny_cfg.replace(layer_types=("toy_mixer",) + tiny_cfg.layer_types[1:])
    params = init_params(cfg, seed=0)
    assert isinstance(params.layers[0].mixer, ToyParams) and kinds.kind_of(params.layers[0].mixer) is toy
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(forward(params, ids, cfg).hidden).all()
    leaves = [(p, t) for p, t in named_leaves(params) if t is not None]
    assert count_params(cfg).total == sum(t.numel() for p, t in leaves if not p.startswith("mtp."))
    assert kinds.count_by_kind(cfg)["toy_mixer"] == 1
    assert step_flops(tiny_cfg, 1, 8).dense != step_flops(cfg, 1, 8).dense  # the toy's formula replaced layer 0's
    assert estimate(cfg, Layout.preset("fsdp"), 2, seq_len=8, rows_per_rank=1).peak_bytes > 0
    pp = Layout.preset("fsdp").placements(abstract_params(cfg), 2)["layers.0.mixer.w_mix"]
    assert pp.mesh_axes_per_dim == (("fsdp",), ())  # its axes take the FSDP role
    assert "selective_toy" in kinds.recompute_modes() and "selective_attention+gdn+toy" in kinds.recompute_modes()
    assert kinds.keep_flags("selective_gdn+toy") == {"skip_flash_attn_recompute": False, "skip_gdn_recompute": True,
                                                     "skip_toy_recompute": True}

    save_hf(tmp_path / "hf", cfg, params)
    cfg2, back = load_hf(tmp_path / "hf")
    assert cfg2.layer_types[0] == "toy_mixer"
    assert torch.equal(back.layers[0].mixer.w_mix, params.layers[0].mixer.w_mix)
