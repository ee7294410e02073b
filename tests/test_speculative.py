"""MTP heads as drafts: the teacher-forced acceptance ``eval_losses`` reports (against a naive loop over full logits),
prefill through the chunked forward (its cache against the token-by-token cache), and speculative decoding (greedy
output equal to plain greedy decoding; the acceptance it counts equal to the eval's on the same sequence)."""

import attrs
import pytest
import torch

import q38
from q38.model_config import ModelConfig
from q38.pytree import tree_map_with_path

# Every dimension differs from the tiny preset (vocab 384, hidden 64, 4/2 heads of 16, GDN 2/4 heads of 16, conv 4,
# 8 experts top-2 of width 32, 1 MTP depth): a small vocabulary so that random heads agree often enough for the
# acceptance to be neither 0 nor 1.
CFG = ModelConfig(
    model_type="qwen3_5_moe", vocab_size=13, hidden_size=40, num_hidden_layers=4,
    layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
    num_attention_heads=6, num_key_value_heads=3, head_dim=8, rope_theta=10_000.0, partial_rotary_factor=0.5,
    linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_conv_kernel_dim=3, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
    shared_expert_intermediate_size=20, mtp_num_layers=2, initializer_range=0.08, max_position_embeddings=8192,
)


@pytest.fixture(autouse=True)
def _one_thread():
    """Decoding is hundreds of tiny ops: one intra-op thread (two contend on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _params(cfg: ModelConfig, seed: int = 3):
    """``init_params`` with every 1-D leaf perturbed (norm weights, dt_bias, A_log are not constants)."""
    params = q38.init_params(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return tree_map_with_path(lambda p, t: t + 0.3 * torch.randn(t.shape, generator=g) if t.ndim == 1 else t, params)


# ---- acceptance in eval ----------------------------------------------------------------------------------------


def _naive_acceptance(params, cfg, ids, labels, doc_ids):
    """Per (depth, position) accepted / counted flags and document positions, from full logits and Python loops."""
    out = q38.forward(params, ids, cfg, doc_ids=doc_ids)
    w = q38.model.head_weight(params)
    main = (out.hidden @ w.T).argmax(-1)
    drafts = [(h @ w.T).argmax(-1) for h in out.mtp_hidden]
    b, s = ids.shape
    main, drafts, labels, doc_ids = main.tolist(), [x.tolist() for x in drafts], labels.tolist(), doc_ids.tolist()
    rows = []
    for r in range(b):
        start = 0
        for t in range(s):
            if t > 0 and doc_ids[r][t] != doc_ids[r][t - 1]:
                start = t
            for d in range(1, cfg.mtp_num_layers + 1):
                j = t + 1 + d  # depth d's target token
                if j < s and doc_ids[r][j] == doc_ids[r][t] and labels[r][j] != -100:
                    rows.append((d, r, t, t - start, drafts[d - 1][r][t] == main[r][t + d]))
    return rows


@pytest.mark.parametrize("s", [300, pytest.param(4200, marks=pytest.mark.slow)], ids=["short", "past_4k"])
def test_eval_reports_the_teacher_forced_acceptance_of_every_depth(s):
    """``eval_accept_<d>`` (overall and per position bucket) and ``eval_accept_len_<k>`` equal the rates of a naive
    loop over full ``[b, s, v]`` logits, on a packed row (long: its first document reaches past 4k positions, every
    bucket counted) and a row with masked labels and padding."""
    from q38.train.core.state import state_from_params
    from q38.train.core.step_config import TrainConfig
    from q38.train.run.evaluate import eval_losses

    params = _params(CFG)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, CFG.vocab_size, (2, s), generator=g)
    doc_ids = torch.zeros(2, s, dtype=torch.long)
    doc_ids[0, s - 50:] = 1
    doc_ids[1, s // 4:] = 1
    doc_ids[1, 3 * s // 4:] = -1  # padding
    labels = ids.clone()
    labels[1, torch.rand(s, generator=g) < 0.3] = -100
    labels[doc_ids == -1] = -100
    state = state_from_params(params, CFG, TrainConfig(loss_chunk_size=512))
    got = eval_losses(state, [{"input_ids": ids, "labels": labels, "doc_ids": doc_ids}], progress=False)
    with torch.no_grad():
        rows = _naive_acceptance(params, CFG, ids, labels, doc_ids)
    for d in (1, 2):
        mine = [x for x in rows if x[0] == d]
        rate = sum(x[4] for x in mine) / len(mine)
        assert 0.05 < rate < 0.95, f"depth {d}: acceptance {rate} would not tell accepted from rejected"
        assert got[f"eval_accept_{d}"] == pytest.approx(rate, abs=1e-12)
        for lo, hi, name in ((0, 1024, "0_1k"), (1024, 4096, "1k_4k"), (4096, 10**9, "4k_up")):
            part = [x for x in mine if lo <= x[3] < hi]
            assert bool(part) == (f"eval_accept_{d}_{name}" in got) == (lo < s), name
            if not part:
                continue
            assert got[f"eval_accept_{d}_{name}"] == pytest.approx(sum(x[4] for x in part) / len(part), abs=1e-12)
    # expected accepted length: 1 + mean leading accepted over positions where both depths are counted
    by_pos: dict = {}
    for d, r, t, _, ok in rows:
        by_pos.setdefault((r, t), {})[d] = ok
    both = [v for v in by_pos.values() if len(v) == 2]
    assert got["eval_accept_len_1"] == pytest.approx(1 + sum(x[4] for x in rows if x[0] == 1) /
                                                     sum(1 for x in rows if x[0] == 1), abs=1e-12)
    lead = [int(v[1]) + int(v[1] and v[2]) for v in both]
    assert got["eval_accept_len_2"] == pytest.approx(1 + sum(lead) / len(lead), abs=1e-12)
    assert 1 < got["eval_accept_len_2"] < got["eval_accept_len_1"] + 1


# ---- prefill and the multi-token pass --------------------------------------------------------------------------

LENGTHS = (70, 23, 2, 41)  # the first crosses the GDN's 64-token chunk boundary; 2 < conv kernel - 1 + 1


def _prompts(cfg: ModelConfig, lengths=LENGTHS, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _real_kv(c, r):
    """Row ``r``'s real cached keys and values, in order."""
    return c.k[r, c.valid[r]], c.v[r, c.valid[r]]


def _assert_same_cache(a, b, cfg, tol):
    assert a.pos.tolist() == b.pos.tolist()
    worst = 0.0
    for la, lb, kind in zip(a.layers, b.layers, cfg.layer_types):
        for r in range(len(a.pos)):
            if kind == "linear_attention":
                pairs = [(la.conv[r], lb.conv[r]), (la.ssm[r], lb.ssm[r])]
            else:
                pairs = list(zip(_real_kv(la, r), _real_kv(lb, r)))
            for x, y in pairs:
                assert x.shape == y.shape
                worst = max(worst, (x - y).abs().max().item())
    assert worst <= tol, f"max |Δ cache| = {worst:.3e}"


def test_prefill_cache_and_logits_equal_the_token_by_token_feed():
    """One pass of the chunked forward over prompts of four lengths (one batch) gives the cache ``feed`` builds a
    token at a time (GDN conv windows and recurrent states, attention keys/values, positions) and its logits at
    every prompt position, within 1e-5 in fp32."""
    from q38.decode import empty_cache, feed, left_aligned, prefill

    params, prompts = _params(CFG), _prompts(CFG)
    with torch.no_grad():
        last, cache, hidden = prefill(params, CFG, prompts)
        tokens, active = left_aligned(prompts)
        ref, ref_cache = feed(params, empty_cache(CFG, len(prompts)), tokens, CFG, active=active)
        logits = hidden @ q38.model.head_weight(params).T
    assert ref.std() > 0.3
    _assert_same_cache(cache, ref_cache, CFG, 1e-5)
    for r, p in enumerate(prompts):
        assert (logits[r, :len(p)] - ref[r, active[r]]).abs().max() <= 1e-5
        assert (last[r] - ref[r, -1]).abs().max() <= 1e-5
    # the states are not trivially equal: another prompt's cache differs by far more
    assert (cache.layers[0].ssm[1] - ref_cache.layers[0].ssm[3]).abs().max() > 1e-2


def test_a_stepwise_pass_keeps_any_prefix_as_feeding_only_that_prefix():
    """``extend(..., stepwise=True)`` over 5 tokens from a prefilled cache, then ``keep_prefix`` of 0..5 tokens per
    row, equals the cache of feeding each row only its kept tokens one at a time (1e-5, fp32), and the pass's hidden
    states give the one-token steps' logits."""
    from q38.decode import decode_step, extend, keep_prefix, prefill

    params, prompts = _params(CFG), _prompts(CFG)
    with torch.no_grad():
        _, cache, _ = prefill(params, CFG, prompts)
        new = torch.randint(0, CFG.vocab_size, (len(prompts), 5), generator=torch.Generator().manual_seed(9))
        hidden, ext = extend(params, cache, new, CFG, stepwise=True)
        keep = torch.tensor([0, 5, 2, 3])
        got = keep_prefix(ext, keep, CFG)
        ref, steps = cache, []
        for t in range(5):
            logits, ref = decode_step(params, ref, new[:, t], CFG, active=t < keep)
            steps.append(logits)
    _assert_same_cache(got, ref, CFG, 1e-5)
    full = hidden @ q38.model.head_weight(params).T
    for r in range(len(prompts)):
        for t in range(int(keep[r])):
            assert (full[r, t] - steps[t][r]).abs().max() <= 1e-5


# ---- speculative decoding ----------------------------------------------------------------------------------------

SPEC = attrs.evolve(CFG, vocab_size=11)  # 2 MTP depths, a small vocabulary: drafts are accepted now and then


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_speculative_greedy_equals_plain_greedy(k):
    """Greedy speculative decoding with k drafts (k = 1, = the trained depths, and beyond them: the heads reused)
    gives plain greedy decoding's tokens, token for token, for prompts of four lengths in one batch (one stopping
    early on a stop token), and both accepts and rejects drafts along the way."""
    from q38.decode import generate
    from q38.speculative import speculative_generate

    params, prompts = _params(SPEC), _prompts(SPEC, (19, 3, 1, 8))
    want = generate(params, SPEC, prompts, max_new_tokens=24)
    got, stats = speculative_generate(params, SPEC, prompts, k=k, max_new_tokens=24)
    assert got == want and all(len(w) == 24 for w in want)
    # with a stop token (the rows stop at different steps)
    stop = want[2][4]
    want_stop = generate(params, SPEC, prompts, max_new_tokens=24, stop_ids=(stop,))
    assert len({len(w) for w in want_stop}) > 1
    assert speculative_generate(params, SPEC, prompts, k=k, max_new_tokens=24, stop_ids=(stop,))[0] == want_stop
    acc = [a for _, _, a in stats.rounds]
    assert 0 in acc and max(acc) >= 1, acc
    assert stats.passes < 24 and 1 < stats.mean_accepted_length <= k + 1


def _joint(params, cfg, prompt, sampling, n_tokens):
    """The exact distribution of the next ``n_tokens`` sampled tokens after ``prompt`` under ``sampling``, from the
    main model's distributions after each prefix (a full prefill per prefix): ``{tokens: probability}``."""
    from q38.decode import prefill, sampling_probs

    out = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for seq, pr in out.items():
            logits = prefill(params, cfg, [prompt + list(seq)])[0]
            probs = sampling_probs(logits, sampling)[0]
            for t in probs.nonzero().flatten().tolist():
                nxt[seq + (t,)] = pr * float(probs[t])
        out = nxt
    return out


def _tv(counts: dict, exact: dict) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(key, 0) / n - exact.get(key, 0.0)) for key in set(counts) | set(exact))


@pytest.mark.slow
def test_sampled_speculative_decoding_follows_plain_sampling(monkeypatch):
    """Sampled speculative decoding (temperature 1, top-k 3, k = 2 drafts) commits tokens distributed as plain
    sampling's: the empirical joint distribution of the first three tokens over 3,000 rows is within total-variation
    0.07 of the exact one computed here from the main model's distributions (measured 0.045; plain sampling's own
    3,000 rows: 0.042, the sampling noise of 27 outcomes). Drafts are both accepted and rejected along the way; a rule that accepts every draft lands far
    from the exact distribution (the test can fail)."""
    from collections import Counter

    import q38.speculative as sp
    from q38.decode import Sampling, generate

    params, prompt = _params(SPEC), _prompts(SPEC, (9,))[0]
    s = Sampling(temperature=1.0, top_k=3, seed=11)
    exact = _joint(params, SPEC, prompt, s, 3)
    assert abs(sum(exact.values()) - 1) < 1e-6 and len(exact) == 27
    rows = [prompt] * 3000
    got, stats = sp.speculative_generate(params, SPEC, rows, k=2, max_new_tokens=3, sampling=s)
    plain = generate(params, SPEC, rows, max_new_tokens=3, sampling=s)
    tv_spec, tv_plain = _tv(Counter(map(tuple, got)), exact), _tv(Counter(map(tuple, plain)), exact)
    acc = [a for _, _, a in stats.rounds]
    assert 0 in acc and 2 in acc, Counter(acc)
    assert tv_spec < 0.07 and tv_plain < 0.07, (tv_spec, tv_plain)

    def accept_all(draws, fed, q, logits, running):  # the wrong rule: every draft kept, the bonus from the main model
        k = fed.shape[1] - 1
        bonus = draws.pick(sp.sampling_probs(logits[:, k], draws.s))
        return torch.full((fed.shape[0],), k, dtype=torch.long), bonus

    monkeypatch.setattr(sp, "_accept_sampled", accept_all)
    wrong = sp.speculative_generate(params, SPEC, rows, k=2, max_new_tokens=3, sampling=s)[0]
    assert _tv(Counter(map(tuple, wrong)), exact) > 3 * max(tv_spec, 0.02)


@pytest.mark.parametrize("k", [1, 2])
def test_eval_acceptance_equals_the_acceptance_counted_while_decoding(k):
    """On the sequences speculative decoding produced (prompt + output), ``eval_losses`` counts the same acceptance
    as the decoding did: one eval row per decoding round, labelled only at that round's ``k`` draft targets, so that
    the eval counts exactly that round's position; ``eval_accept_len_<k>`` (and for k = 1 ``eval_accept_1``) equals
    the decoding's mean accepted length (accepted drafts) over the same rounds, exactly."""
    from q38.speculative import speculative_generate
    from q38.train.core.state import state_from_params
    from q38.train.core.step_config import TrainConfig
    from q38.train.run.evaluate import eval_losses

    params, prompts = _params(SPEC), _prompts(SPEC, (12, 5, 9))
    outs, stats = speculative_generate(params, SPEC, prompts, k=k, max_new_tokens=30)
    seqs = [p + o for p, o in zip(prompts, outs)]
    rounds = [(r, t, a) for r, t, a in stats.rounds if t + 1 + k < len(seqs[r])]  # every target in the sequence
    assert len(rounds) >= 10 and {a for *_, a in rounds} >= {0, 1}
    s = max(len(x) for x in seqs)
    ids = torch.zeros(len(rounds), s, dtype=torch.long)
    doc_ids = torch.full((len(rounds), s), -1)
    labels = torch.full((len(rounds), s), -100)
    for i, (r, t, _) in enumerate(rounds):
        ids[i, :len(seqs[r])] = torch.tensor(seqs[r])
        doc_ids[i, :len(seqs[r])] = 0
        labels[i, t + 2:t + 2 + k] = ids[i, t + 2:t + 2 + k]  # the targets of depths 1..k at position t
    state = state_from_params(params, SPEC, TrainConfig(loss_chunk_size=64))
    got = eval_losses(state, [{"input_ids": ids, "labels": labels, "doc_ids": doc_ids}], progress=False)
    mean_accepted = sum(a for *_, a in rounds) / len(rounds)
    assert got[f"eval_accept_len_{k}"] == pytest.approx(1 + mean_accepted, abs=1e-12)
    if k == 1:
        assert got["eval_accept_1"] == pytest.approx(mean_accepted, abs=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("peft", [None, {"rank": 4, "alpha": 16, "targets": ["w_q", "w_qkv", "we_down"], "mtp": True}],
                         ids=["full", "lora"])
def test_speculative_generate_from_a_checkpoint_equals_plain_greedy(tmp_path, peft):
    """``q38 generate --speculative K`` on a q38 checkpoint (one training step of a model shaped as ``CFG`` with 2
    MTP depths; a LoRA run's adapters, MTP included, merged) gives the plain greedy tokens for two prompts in one
    batch, with K = 1 and K = 3 (more drafts than heads), and reports its passes."""
    from q38.train.run.generate import generate_from
    from q38.train.run.trainer import train
    from tests.run_utils import run_config

    model = dict(CFG.to_dict(), vocab_size=300)  # covers the byte tokenizer (261 ids)
    cfg = run_config(tmp_path / "run", steps=1, model=model, **({"peft": peft} if peft else {}),
                     train={"lr": 3e-2, "warmup_steps": 0})
    train(cfg)
    prompts = ["the cat sat on the mat", "dogs"]
    plain = generate_from(str(tmp_path / "run"), text=prompts, max_new_tokens=16, stop_at_eos=False)
    assert len({t for r in plain for t in r["ids"]}) >= 3
    for k in (1, 3):
        spec = generate_from(str(tmp_path / "run"), text=prompts, max_new_tokens=16, stop_at_eos=False,
                             speculative=k)
        assert [r["ids"] for r in spec] == [r["ids"] for r in plain]
        for r in spec:
            assert r["speculative"]["k"] == k and 1 <= r["speculative"]["passes"] <= 15
            assert r["speculative"]["tokens"] >= r["speculative"]["passes"]
    # a stop string (q38 generate --stop) ends the rows where plain decoding ends them
    stop = plain[0]["text"][4:6]
    want = generate_from(str(tmp_path / "run"), text=prompts, max_new_tokens=16, stop_at_eos=False, stop=[stop])
    got = generate_from(str(tmp_path / "run"), text=prompts, max_new_tokens=16, stop_at_eos=False, stop=[stop],
                        speculative=2)
    assert want[0]["stopped"] == "stop_string" and len(want[0]["ids"]) < 16
    assert [(r["ids"], r["text"], r["stopped"]) for r in got] == [(r["ids"], r["text"], r["stopped"]) for r in want]


def test_speculative_refusals_are_one_line_before_decoding(tmp_path, capsys):
    """``q38 generate --speculative``: a checkpoint without MTP heads, K < 1 and K past what the verification pass
    keeps are one-line errors, exit 2 (a temperature is decoded by the speculative-sampling rule)."""
    from q38.cli import main
    from q38.speculative import MAX_DRAFTS, check_speculative
    from q38.train.run.trainer import train
    from tests.run_utils import run_config

    train(run_config(tmp_path / "run", steps=1))  # tiny cut to 2 layers, 1 MTP depth
    cases = ((["--speculative", "0"], "--speculative K must be an integer in [1, 16]"),
             (["--speculative", str(MAX_DRAFTS + 1)], "the pass keeps one GDN state per draft"))
    for bad, msg in cases:
        assert main(["generate", str(tmp_path / "run"), "--prompt", "x", *bad]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(ValueError, match="this checkpoint has none"):
        check_speculative(attrs.evolve(CFG, mtp_num_layers=0), 1)
    assert main(["generate", str(tmp_path / "run"), "--prompt", "x", "--speculative", "1",
                 "--set", "model.mtp_num_layers=0"]) == 2
    err = capsys.readouterr().err
    assert "this checkpoint has none" in err and len(err.strip().splitlines()) == 1, err


def _cp_eval(rank, world, ckpt, data):
    import os

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        from q38.train.run.inference import evaluate

        return evaluate(ckpt, data, batch_size=2, overrides={"layout": "fsdp_cp"}, progress=False)
    finally:
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(k, None)


@pytest.mark.dist
def test_acceptance_under_context_parallelism_equals_one_process(tmp_path):
    """On ``fsdp_cp`` (2 ranks splitting each row's sequence, so ``t + d`` of a draft can sit on the other rank) the
    eval's acceptance equals the one-process eval of the same checkpoint."""
    from q38.train.run.inference import evaluate
    from q38.train.run.trainer import train
    from tests.dist_utils import run_distributed
    from tests.run_utils import run_config
    from tests.test_eval import SEQ, _rows_file

    data = _rows_file(tmp_path / "rows.jsonl", 4)
    model = dict(attrs.evolve(CFG, vocab_size=300).to_dict())
    train(run_config(tmp_path / "run", steps=1, model=model, data={"path": str(data), "seq_len": SEQ,
                                                                   "shuffle": False},
                     train={"lr": 3e-2, "warmup_steps": 0}))
    ckpt = str(tmp_path / "run" / "checkpoints" / "step_000001")
    one = evaluate(ckpt, str(data), batch_size=2, progress=False)
    r0, r1 = run_distributed(_cp_eval, 2, ckpt, str(data))
    assert r0 == r1
    keys = [k for k in one if k.startswith("eval_accept")]
    assert {"eval_accept_1", "eval_accept_2", "eval_accept_len_2"} <= set(keys)
    assert 0 < one["eval_accept_1"] < 1, one
    for k in keys:
        assert r0[k] == pytest.approx(one[k], abs=1e-12), k
