"""``q38 generate`` beyond greedy decoding (tests/test_decode.py): top-k sampling against transformers' warpers and a
naive sampling loop written here, stop strings, special tokens left out of the text, prompts of every kind mixed in
one call with labelled output, and hostile inputs refused in one line (prompt files, lengths, chats). The model
differs from the tiny preset in every dimension."""

import json
import os
import subprocess
import sys

import pytest
import torch

import q38
from q38.cli import main
from q38.decode import Sampling, generate, sampling_probs
from q38.model_config import ModelConfig
from q38.pytree import tree_map_with_path

# Unlike tiny (hidden 64, 4/2 heads of 16, GDN 2/4 heads of 16, conv 4, 8 experts top-2 of width 32, vocab 384):
# 4 layers in a 1:1 pattern, 6/2 attention heads of 12, GDN 2/4 heads of 10/14, conv 3, 5 experts top-2 of 18.
CFG = ModelConfig(
    model_type="qwen3_5_moe", vocab_size=300, hidden_size=36, num_hidden_layers=4,
    layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
    num_attention_heads=6, num_key_value_heads=2, head_dim=12, rope_theta=10_000.0, partial_rotary_factor=0.5,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=10, linear_value_head_dim=14,
    linear_conv_kernel_dim=3, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=18,
    shared_expert_intermediate_size=22, mtp_num_layers=0, initializer_range=0.08, max_position_embeddings=512,
)
BYTE_SPECIALS = range(256, 261)  # the byte tokenizer's <|pad|>, <|bos|>, <|eos|>, <|im_start|>, <|im_end|>


@pytest.fixture(autouse=True)
def _one_thread():
    """Decoding is hundreds of tiny ops: one intra-op thread (two contend on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _params():
    """``init_params`` with every 1-D leaf perturbed (norm weights, dt_bias, A_log are not constants)."""
    params = q38.init_params(CFG, seed=13)
    g = torch.Generator().manual_seed(14)
    return tree_map_with_path(lambda p, t: t + 0.3 * torch.randn(t.shape, generator=g) if t.ndim == 1 else t, params)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Hugging Face directory of ``CFG`` (no tokenizer.json: the byte tokenizer)."""
    d = tmp_path_factory.mktemp("gen") / "hf"
    q38.save_hf(d, CFG, _params())
    return d


def _byte_text(ids, skip_special: bool) -> str:
    """The byte tokenizer's decode, written out: UTF-8 runs, special tokens by name (or left out), other ids U+FFFD."""
    names = {256: "<|pad|>", 257: "<|bos|>", 258: "<|eos|>", 259: "<|im_start|>", 260: "<|im_end|>"}
    out, run = [], bytearray()
    for i in ids:
        if i < 256:
            run.append(i)
            continue
        out.append(run.decode("utf-8", errors="replace"))
        run = bytearray()
        if i in names and not skip_special:
            out.append(names[i])
        elif i not in names:
            out.append("\ufffd")
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)


# ---- top-k ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 1.0), (1.3, 12, 0.8), (1.0, 1, 1.0), (0.9, 400, 0.5),
                                                     (1.0, 0, 0.9)])
def test_sampling_probs_equal_transformers_warpers(temperature, top_k, top_p):
    """The distribution drawn from equals transformers' temperature → top-k → top-p warpers followed by softmax
    (1e-6), ties at the k-th logit kept as there."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 300, generator=g) * 3
    logits[1, 10:14] = logits[1].max() - 0.5  # four tokens tied just below the best: a k-th value with ties
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    want = torch.softmax(scores, dim=-1)
    got = sampling_probs(logits, s)
    assert torch.equal(got > 0, want > 0)
    assert (got - want).abs().max() <= 1e-6
    if 0 < top_k < 300 and top_p == 1:
        assert ((got > 0).sum(-1) >= min(top_k, 300)).all()
    if top_k == 5:  # rows without ties keep exactly k tokens
        assert (got > 0).sum(-1)[[0, 2, 3]].tolist() == [5, 5, 5]


def test_top_k_generation_equals_a_naive_sampling_loop():
    """``generate`` with a temperature and top-k (cached decode, one batch of prompts of different lengths) draws the
    tokens of a loop written here: the whole sequence through ``q38.logits`` at every step, the k best logits picked
    by sorting in Python, softmax over them, one ``torch.multinomial`` over the rows from the same seeded generator."""
    params = _params()
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 4, 13)]
    temperature, k, n_new, seed = 0.9, 4, 7, 5
    got = generate(params, CFG, prompts, max_new_tokens=n_new,
                   sampling=Sampling(temperature=temperature, top_k=k, seed=seed))

    gen = torch.Generator().manual_seed(seed)
    seqs = [list(p) for p in prompts]
    want: list[list[int]] = [[] for _ in prompts]
    for _ in range(n_new):
        rows = []
        for seq in seqs:
            with torch.no_grad():
                last = (q38.logits(params, torch.tensor([seq]), CFG)[0, -1] / temperature).tolist()
            best = sorted(range(len(last)), key=lambda j: -last[j])[:k]
            top = max(last[j] for j in best)
            weights = {j: torch.tensor(last[j] - top, dtype=torch.float64).exp().item() for j in best}
            total = sum(weights.values())
            rows.append([weights.get(j, 0.0) / total for j in range(len(last))])
        draws = torch.multinomial(torch.tensor(rows, dtype=torch.float32), 1, generator=gen).view(-1).tolist()
        for r, t in enumerate(draws):
            seqs[r].append(t)
            want[r].append(t)
    assert got == want
    free = generate(params, CFG, prompts, max_new_tokens=n_new, sampling=Sampling(temperature=temperature, seed=seed))
    assert free != got, "top-k changed no draw: the comparison would not show it is applied"


def test_sampling_options_are_checked():
    for bad in (dict(top_k=-1), dict(top_k=1.5), dict(top_k=True), dict(top_p=0), dict(temperature=float("nan")),
                dict(seed=-1), dict(seed=1 << 63)):
        with pytest.raises(ValueError):
            Sampling(**bad)


# ---- stop strings and special tokens ----------------------------------------------------------------------------


def test_stop_strings_cut_the_answer_where_the_text_first_holds_one(hf_dir):
    """With ``stop``, each row ends at the first token after which its text (special tokens left out) contains a
    stop string, and the answer is that text cut before it; found here from the unstopped greedy tokens."""
    from q38.train.run.generate import generate_from

    prompts = ["the cat sat", "on a mat, 12"]
    free = generate_from(str(hf_dir), text=prompts, max_new_tokens=40, stop_at_eos=False)
    stops, expected = [], []
    for r in free:
        text = _byte_text(r["ids"], skip_special=True)
        assert r["text"] == text and r["stopped"] == "length"
        at = next(i for i in range(3, len(text) - 2) if text.find(text[i:i + 2]) == i)
        stops.append(text[at:at + 2])
    for r in free:
        hits = [(i, s) for s in stops for i in [_byte_text(r["ids"], True).find(s)] if i >= 0]
        at, s = min(hits)
        n = next(n for n in range(1, len(r["ids"]) + 1) if s in _byte_text(r["ids"][:n], True))
        expected.append((r["ids"][:n], _byte_text(r["ids"], True)[:at]))
    cut = generate_from(str(hf_dir), text=prompts, max_new_tokens=40, stop_at_eos=False, stop=stops)
    assert [(r["ids"], r["text"]) for r in cut] == expected
    assert all(r["stopped"] == "stop_string" for r in cut)
    assert any(len(ids) < 40 for ids, _ in expected)


def test_special_tokens_are_left_out_of_the_text_unless_kept(hf_dir):
    """The answer's text leaves the tokenizer's special tokens out by default (transformers' skip_special_tokens)
    and shows them with ``skip_special_tokens=False``; the ids are the same."""
    from q38.train.run.generate import generate_from

    kw = dict(text=["x", "yz", "the"], max_new_tokens=60, stop_at_eos=False, temperature=20.0, seed=4)
    skipped = generate_from(str(hf_dir), **kw)
    kept = generate_from(str(hf_dir), skip_special_tokens=False, **kw)
    assert [r["ids"] for r in skipped] == [r["ids"] for r in kept]
    assert any(i in BYTE_SPECIALS for r in kept for i in r["ids"]), "no special token sampled: pick another seed"
    for a, b in zip(skipped, kept):
        assert a["text"] == _byte_text(a["ids"], skip_special=True)
        assert b["text"] == _byte_text(b["ids"], skip_special=False)
    assert [r["text"] for r in skipped] != [r["text"] for r in kept]


def test_special_ids_of_a_hugging_face_tokenizer_match_its_skip_special_tokens(tmp_path):
    """``answer_text`` on a Hugging Face tokenizer equals the tokenizers library's own
    ``decode(skip_special_tokens=True)`` (and ``False`` with nothing skipped)."""
    from tokenizers import Tokenizer

    from q38.train.data.tokenizer import load_tokenizer
    from q38.train.run.generate import answer_text, special_ids
    from tests.test_data import _train_hf_tokenizer

    d = _train_hf_tokenizer(tmp_path / "tok", config={"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"})
    tok, ref = load_tokenizer(str(d)), Tokenizer.from_file(str(d / "tokenizer.json"))
    words = ref.encode("the cat sat on two plus").ids
    specials = [ref.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")]
    ids = [specials[0], *words[:3], specials[1], *words[3:], specials[2]]
    assert special_ids(tok) >= set(specials)
    assert answer_text(tok, ids, skip=special_ids(tok))[0] == ref.decode(ids, skip_special_tokens=True)
    assert answer_text(tok, ids)[0] == ref.decode(ids, skip_special_tokens=False)
    assert answer_text(tok, ids, skip=special_ids(tok), stop=["sat", "cat"]) == ("the ", "cat")


# ---- mixed prompts, labelled output ------------------------------------------------------------------------------


def test_prompt_kinds_mix_in_command_line_order_with_labelled_answers(hf_dir, tmp_path, capsys):
    """``--prompt``, ``--chat`` and ``--prompts`` in one call run as one batch in the order given; each answer is the
    one that prompt gets alone (greedy rows are independent), labelled with its prompt in the text output and carried
    with its index and origin in the JSON output."""
    from q38.train.run.generate import generate_from

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hello"}]}) + "\n\n"
                 + json.dumps({"text": "two plus"}) + "\n")
    args = ["generate", str(hf_dir), "--prompt", "the cat", "--chat", "hi", "--prompts", str(f), "--prompt", "a b",
            "--max-new-tokens", "5"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["index"], r["from"]) for r in recs] == [(1, "--prompt"), (2, "--chat"), (3, f"{f}:1"), (4, f"{f}:3"),
                                                       (5, "--prompt")]
    assert recs[0]["prompt"] == "the cat" and recs[1]["messages"] == [{"role": "user", "content": "hi"}]
    heads = ["[1] --prompt: the cat", "[2] --chat: user: hi", f"[3] {f}:1: user: hello", f"[4] {f}:3: two plus",
             "[5] --prompt: a b"]
    assert text == "".join(f"{h}\n[{r['index']}] answer: {r['text']}\n\n" for h, r in zip(heads, recs))
    others = generate_from(str(hf_dir), inputs=[("text", "a b"), ("chat", "hi"), ("text", "the cat")],
                           max_new_tokens=5)  # another batch, another order
    for r, o in zip([recs[4], recs[1], recs[0]], others):
        assert (r["prompt_ids"], r["ids"], r["text"]) == (o["prompt_ids"], o["ids"], o["text"])
    assert main(["generate", str(hf_dir), "--max-new-tokens", "5"]) == 2
    assert "give at least one prompt" in capsys.readouterr().err


# ---- hostile inputs: one line, exit 2 ------------------------------------------------------------------------------


def _one_line_error(capsys, *args) -> str:
    assert main(["generate", *map(str, args)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "internal error" not in err and "Traceback" not in err, err
    return err


def test_hostile_prompt_files_are_one_line(hf_dir, tmp_path, capsys, monkeypatch):
    """A prompts line past the line bound is refused after reading no more than the bound, a line nested 10^6 deep
    before it is parsed, and chats the trainer's chat loader refuses (no messages, an unknown role) name the line."""
    import q38.train.run.generate as g

    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 10**6 + "]" * 10**6 + "\n")
    err = _one_line_error(capsys, hf_dir, "--prompts", deep)
    assert "deep.jsonl:1" in err and "nested too deeply" in err
    for rec, words in (({"messages": []}, "non-empty list"), ({"messages": [{"role": "wizard", "content": "x"}]},
                                                              "'wizard'")):
        f = tmp_path / "chat.jsonl"
        f.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps(rec) + "\n")
        err = _one_line_error(capsys, hf_dir, "--prompts", f, "--prompt", "ok")
        assert "chat.jsonl:2" in err and words in err
    err = _one_line_error(capsys, hf_dir, "--chat", "hi", "--prompts", tmp_path / "none.jsonl")
    assert "none.jsonl" in err and "not found" in err
    long = tmp_path / "long.jsonl"
    long.write_bytes(b'{"text": "' + b"a" * (3 << 20) + b'"}\n')
    monkeypatch.setattr(g, "MAX_LINE_BYTES", 1 << 20)
    err = _one_line_error(capsys, hf_dir, "--prompts", long)
    assert "long.jsonl:1" in err and "line longer than 1,048,576 bytes" in err, err


def _q38_peak(*args) -> tuple[subprocess.CompletedProcess, int]:
    """``q38 ARGS`` in a subprocess (120 s at most: a hang fails): the result and the process's peak RSS in KiB."""
    code = ("import resource, sys; from q38.cli import main; rc = main(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r, int(r.stdout.split()[-1])


def test_a_fifo_without_a_writer_is_refused_not_waited_on(hf_dir, tmp_path):
    fifo = tmp_path / "p.fifo"
    os.mkfifo(fifo)
    r, _ = _q38_peak("generate", hf_dir, "--prompt", "x", "--prompts", fifo)
    assert r.returncode == 2 and "FIFO" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_line_past_the_real_bound_stays_far_under_2_gb(hf_dir, tmp_path):
    """A 20 MB line (past the 16 MiB bound) is refused with the process's peak memory under 1 GiB."""
    long = tmp_path / "long.jsonl"
    long.write_bytes(b'{"text": "' + b"a" * (20 << 20) + b'"}\n')
    r, peak_kib = _q38_peak("generate", hf_dir, "--prompts", long)
    assert r.returncode == 2 and "line longer than 16,777,216 bytes" in r.stderr, r.stderr
    assert peak_kib < 1 << 20, f"peak RSS {peak_kib} KiB"


def test_lengths_past_the_models_positions_are_refused_up_front(hf_dir, tmp_path, capsys):
    """``--max-new-tokens 10^9`` with the eos stop off, and a prompt longer than max_position_embeddings (512 here),
    are refused before any weight is read, naming the limit and the largest value allowed; a bad seed too."""
    err = _one_line_error(capsys, hf_dir, "--prompt", "hello", "--max-new-tokens", 10**9, "--no-eos-stop")
    assert "max_position_embeddings 512" in err and "--max-new-tokens 507 or less" in err
    err = _one_line_error(capsys, hf_dir, "--chat", "x", "--prompt", "a" * 600)
    assert "prompt [2] (--prompt) has 600 tokens" in err and "512" in err
    assert "seed" in _one_line_error(capsys, hf_dir, "--prompt", "a", "--seed", 10**30)
    assert "top-k" in _one_line_error(capsys, hf_dir, "--prompt", "a", "--top-k", -2)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(_params(), CFG, [[1, 2, 3]], max_new_tokens=510)


def test_more_prompts_than_memory_holds_are_refused_up_front(hf_dir, tmp_path, capsys, monkeypatch):
    """A prompts file of many short prompts (one batch) whose decode caches exceed the memory left is refused before
    any weight is read, naming how many prompts fit; the bound is the cache's size, counted here from the model's
    dimensions."""
    import q38.model

    n = 3000
    f = tmp_path / "many.jsonl"
    f.write_text((json.dumps({"text": "ab"}) + "\n") * n)
    length = 2 + 100
    gdn = CFG.linear_num_value_heads * CFG.linear_key_head_dim * CFG.linear_value_head_dim * 4 + (
        CFG.linear_conv_kernel_dim - 1) * CFG.linear_conv_dim * 2
    attn = length * (2 * CFG.num_key_value_heads * CFG.head_dim * 2 + 1)
    per_row = 2 * gdn + 2 * attn + 8 + 2 * 4 * CFG.vocab_size  # 2 layers of each kind, the position, logits + probs
    monkeypatch.setattr(q38.model, "host_memory_available", lambda: 1000 * per_row)
    err = _one_line_error(capsys, hf_dir, "--prompts", f, "--max-new-tokens", 100)
    assert f"{n:,} prompts of up to 2 tokens" in err and "give at most 1,000 prompts in one call" in err, err


def test_eval_batch_size_past_memory_is_one_line(hf_dir, tmp_path, capsys):
    """``q38 eval --batch-size 10^12`` is refused before any data or weight is read (it would pad terabytes)."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "the cat sat on the mat"}) + "\n")
    assert main(["eval", str(hf_dir), "--data", str(data), "--batch-size", str(10**12)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--batch-size 1,000,000,000,000" in err and "or less" in err, err
