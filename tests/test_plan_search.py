"""``q38 plan --search`` and the budget options: the written layout and run config are accepted by ``q38 train``'s
checks unchanged; bad input gives one line each."""

import pytest
import yaml

from q38.cli import plan_cli
from q38.parallel.search import search
from q38.parallel.budget import Hardware
from q38.model_config import ModelConfig

TINY = ["--model", "tiny", "--seq-len", "128", "--global-batch", "8"]


def _err(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    return [line for line in err if not line.startswith("settings from")]


def test_search_writes_a_layout_q38_train_accepts(tmp_path, capsys, monkeypatch):
    from q38.train.run.trainer import RunConfig, check_run

    monkeypatch.chdir(tmp_path)
    rc = plan_cli(["--search", "--world", "4", "--hardware", "h200", *TINY, "--out", "best"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "layouts fit" in out and "best:" in out
    written = sorted(p.name for p in (tmp_path / "best").iterdir())
    assert "train.yaml" in written and len(written) == 2
    written = yaml.safe_load((tmp_path / "best" / "train.yaml").read_text())
    assert written["kernels"]["gdn"] == "fla" and written["kernels"]["attention"] == "flex"  # what the h200 plan priced
    # on this CPU, the kernels this machine has (the written ones are refused up front here, in one line)
    cfg = RunConfig.from_yaml(tmp_path / "best" / "train.yaml", {"kernels.gdn": "auto", "kernels.attention": "auto"})
    plan = check_run(cfg, world_size=4)  # the layout loads, fills 4 ranks and places every parameter
    assert plan.dp_size * cfg.data.batch_size == 8


def test_search_ranks_by_step_time_and_respects_the_cap():
    cfg = ModelConfig.preset("tiny")
    hw = Hardware.load("h200")
    cands, cap = search(cfg, 8, hw, seq_len=128, global_batch=16, memory_cap=40 * 2**20)
    times = [c.budget.step_s for c in cands]
    assert times == sorted(times)
    assert all(c.budget.peak_bytes <= cap for c in cands)
    meshes = {c.mesh for c in cands}
    assert len(meshes) > 1  # several factorisations survive


def test_budget_of_a_given_layout(capsys):
    rc = plan_cli(["--layout", "fsdp_ep", "--world", "4", "--hardware", "h200", *TINY])
    out = capsys.readouterr().out
    assert rc == 0
    assert "step time on h200" in out and "MFU" in out and "peak memory per rank" in out


def test_unknown_hardware_is_one_line(capsys):
    rc = plan_cli(["--search", "--world", "4", "--hardware", "tpu9", *TINY])
    err = _err(capsys)
    assert rc == 2 and len(err) == 1 and "unknown hardware profile 'tpu9'" in err[0] and "h200" in err[0]


def test_memory_cap_nothing_fits_says_the_smallest_need(capsys):
    rc = plan_cli(["--search", "--world", "4", "--hardware", "h200", *TINY, "--memory-cap", "0.001"])
    err = _err(capsys)
    assert rc == 2 and len(err) == 1 and "no layout fits" in err[0] and "the smallest needs" in err[0]


def test_world_without_factorisation_is_one_line(capsys):
    # world 5: ep 5 does not divide 8 experts, fsdp 5 not the batch of 8, and pp 5 is more than tiny's 4 layers (world
    # 3 has one since the search tries pp: 3 stages of one rank, 8 rows in 8 micro-batches)
    rc = plan_cli(["--search", "--world", "5", "--hardware", "h200", *TINY])
    err = _err(capsys)
    assert rc == 2 and len(err) == 1 and "world 5 has no valid factorisation" in err[0]


def test_written_layout_yaml_is_plain_data(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert plan_cli(["--search", "--world", "2", "--hardware", "ascend_910b", *TINY, "--out", "o"]) == 0
    lay = next(p for p in (tmp_path / "o").iterdir() if p.name != "train.yaml")
    d = yaml.safe_load(lay.read_text())
    assert set(d) <= {"include", "name", "mesh", "uneven"} and d["include"].endswith(".yaml")


def test_prefetch_overlap_follows_the_runtime_rule():
    """MeshRuntime gathers a parameter sharded evenly on one tensor dim over several mesh dims by one collective over
    their flattened group, and prefetches the first even gather of every parameter of the layers after the first
    (and of the MTP block); the embedding, final norm, head and layer 0 are gathered when used. Gradient
    reductions are async with ``train.overlap_comm`` (the default) and synchronous without."""
    from q38.parallel.budget import estimate
    from q38.parallel.layout import Layout

    cfg = ModelConfig.preset("tiny")
    hw = Hardware.load("h200")
    one = estimate(cfg, Layout.preset("fsdp"), 4, seq_len=128, rows_per_rank=1, hardware=hw)
    two = estimate(cfg, Layout.preset("fsdp_ep").with_mesh(fsdp=2, ep=2), 4, seq_len=128, rows_per_rank=1,
                   hardware=hw)
    off = estimate(cfg, Layout.preset("fsdp"), 4, seq_len=128, rows_per_rank=1, hardware=hw, prefetch=False,
                   async_reduce=False)
    fwd = lambda b: {(t.mesh_dim, t.overlapped) for t in b.comm if t.collective.startswith("all-gather fwd")}  # noqa
    assert fwd(one) == {("fsdp", True), ("fsdp", False)}
    # dense weights: one gather over fsdp·ep; experts (EP-local): over fsdp
    assert fwd(two) == {("fsdp", True), ("fsdp", False), ("fsdp·ep", True), ("fsdp·ep", False)}
    pre = sum(t.bytes for t in one.comm if t.collective == "all-gather fwd (prefetched)")
    sync = sum(t.bytes for t in one.comm if t.collective == "all-gather fwd")
    assert pre > 2 * sync  # layers 1..3 and the MTP block ahead; layer 0 and the edges when used
    assert fwd(off) == {("fsdp", False)}
    rs = lambda b: {t.overlapped for t in b.comm if t.collective.startswith("reduce-scatter")}  # noqa
    assert rs(one) == {True} and rs(off) == {False}


def test_plan_takes_the_gdn_kernel_and_chunk_from_the_run_config(tmp_path, capsys, monkeypatch):
    """``kernels.gdn`` / ``kernels.gdn_chunk_size`` of ``--train`` reach the budget; ``auto`` resolves as the run
    would (a hardware profile: the accelerator chunk and the kernels ``resolve_kernels`` picks on its device, here
    FLA without CP; none: the CPU's chunk); ``--gdn-kernel`` overrides ``kernels.gdn``."""
    import q38.parallel.search as S

    seen = []
    real = S.estimate
    monkeypatch.setattr(S, "estimate", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    outs = {}
    for name, kernels in (("auto", None), ("c16", {"gdn": "torch", "gdn_chunk_size": 16}), ("fla", {"gdn": "fla"})):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"kernels": kernels} if kernels else {}))
        for hw in ([], ["--hardware", "h200"]):
            assert plan_cli(["--layout", "fsdp", "--world", "2", *TINY, "--train", str(path), *hw]) == 0
            outs[name, bool(hw)] = capsys.readouterr().out
    got = [(kw["gdn_chunk"], kw["gdn_kernel"]) for kw in seen]
    # tiny's GDN head dims are 16: auto is 32 on the CPU, 64 on an accelerator
    # per config: no hardware, then h200 (auto resolves to FLA on CUDA, no CP here) and its torch fallbacks' budget
    assert got == [(32, False), (64, True), (64, False), (16, False), (16, False), (16, False), (32, True), (64, True),
                   (64, False)], got
    assert outs["auto", False] != outs["c16", False]  # the chunk changes the GDN core's predicted working set
    assert plan_cli(["--layout", "fsdp", "--world", "2", *TINY, "--train", str(tmp_path / "fla.yaml"),
                     "--gdn-kernel", "torch"]) == 0
    assert seen[-1]["gdn_kernel"] is False


def test_the_plan_says_whether_the_peak_fits_the_hardware(capsys):
    import attrs

    from q38.parallel.budget import format_budget

    rc = plan_cli(["--layout", "fsdp_ep", "--world", "4", "--hardware", "h200", *TINY])
    out = capsys.readouterr().out
    assert rc == 0 and "\nfits: peak " in out and "% of the h200's 131.32 GiB, cap 90 %" in out
    assert plan_cli(["--layout", "fsdp_ep", "--world", "4", *TINY]) == 0  # no hardware: no verdict
    assert "fits" not in capsys.readouterr().out
    b = search(ModelConfig.preset("tiny"), 4, Hardware.load("h200"), seq_len=128, global_batch=8)[0][0].budget
    largest = max(b.memory, key=lambda it: it.bytes).name.strip()
    assert attrs.evolve(b, hbm_bytes=b.peak_bytes * 2).fit_line().startswith("fits: ")
    assert " = 50 % of the h200" in attrs.evolve(b, hbm_bytes=b.peak_bytes * 2).fit_line()
    over = attrs.evolve(b, hbm_bytes=b.peak_bytes / 0.95).fit_line()  # fits the device, not the 90 % cap
    assert over.startswith("OVER THE CAP: ") and f"the largest item is {largest}" in over
    short = attrs.evolve(b, hbm_bytes=b.peak_bytes / 2)
    assert short.fit_line().startswith("DOES NOT FIT: ") and "--recompute full" in short.fit_line()
    assert short.fit_line() in format_budget(short)
    assert attrs.evolve(b, hbm_bytes=None).fit_line() is None


@pytest.mark.slow
def test_the_search_covers_hsdp_and_charges_each_collective_on_its_link(tmp_path):
    """On 16 H200s (2 nodes of 8) the search prices HSDP (fsdp 8 inside a node, replicated over the 2 nodes): its
    gathers and reduce-scatters on NVLink, its gradient all-reduce on the NIC. The layout it would write is accepted
    by ``q38 train``'s checks."""
    from q38.parallel.layout import Layout
    from q38.parallel.search import candidate_layout

    cfg = ModelConfig.preset("tiny")
    cands, _ = search(cfg, 16, Hardware.load("h200"), seq_len=128, global_batch=16)
    hsdp = [c for c in cands if c.layout_dict["name"] == "hsdp_r2_f8"]
    assert len(hsdp) >= 1
    links = {(t.collective, t.mesh_dim): t.link for t in hsdp[0].budget.comm}
    assert links[("all-reduce grads", "dp_replicate")] == "inter"
    assert links[("reduce-scatter grads", "fsdp")] == "intra"
    assert not any(d == "dp_replicate" and c.startswith("all-gather") for c, d in links)  # replicated: not gathered
    layout = Layout.from_dict(candidate_layout(cfg, 8, 1, 1, 2), source="hsdp")
    assert layout.resolve_mesh(16) == {"dp_replicate": 2, "fsdp": 8}


@pytest.mark.slow
def test_the_search_tries_mesh_orders_and_both_dispatches_and_the_run_config_names_its_choice():
    """On 16 ranks of 8 per node, fsdp 2 × ep 8 in the template order (ep innermost) keeps every EP group inside a
    node; the order with fsdp innermost spreads each EP group over both nodes, where the hierarchical dispatch
    crosses fewer inter-node bytes than the flat one. The written run config carries the chosen dispatch."""
    from q38.parallel.budget import estimate
    from q38.parallel.layout import Layout
    from q38.parallel.plan_out import candidate_run_config
    from q38.parallel.search import candidate_layout, mesh_orders

    cfg = ModelConfig.preset("tiny")
    hw = Hardware.load("h200")
    assert mesh_orders(2, 1, 8) == [None, ("ep", "fsdp")]
    assert len(mesh_orders(2, 2, 4)) == 6  # the template and the 5 other orders of three dims
    inner = Layout.from_dict(candidate_layout(cfg, 2, 1, 8, 1, ("ep", "fsdp")), source="t")
    assert list(inner.resolve_mesh(16)) == ["ep", "fsdp"]
    kw = dict(seq_len=128, rows_per_rank=1, hardware=hw)
    ep_inter = lambda b: sum(t.inter_bytes for t in b.comm if t.mesh_dim == "ep")  # noqa: E731
    template = estimate(cfg, Layout.from_dict(candidate_layout(cfg, 2, 1, 8), source="t"), 16, **kw)
    assert ep_inter(template) == 0
    flat = estimate(cfg, inner, 16, ep_dispatch="flat", **kw)
    hier = estimate(cfg, inner, 16, ep_dispatch="hierarchical", **kw)
    assert 0 < ep_inter(hier) < ep_inter(flat)
    cands, _ = search(cfg, 16, hw, seq_len=128, global_batch=16)
    seen = {(tuple(n for n, _ in c.budget.mesh), c.ep_dispatch) for c in cands if dict(c.budget.mesh).get("ep", 1) > 1}
    assert {d for _, d in seen} == {"flat", "hierarchical"}
    assert len({o for o, _ in seen}) > 1  # several mesh orders
    hier_cand = next(c for c in cands if c.ep_dispatch == "hierarchical")
    assert candidate_run_config(hier_cand, "tiny", "l.yaml", 128)["train"]["ep_dispatch"] == "hierarchical"
