"""What an export holds beside its weights (q38.train.data.export_files, docs/hf_checkpoints.md#what-an-export-holds):
the run's tokenizer as files ``AutoTokenizer`` loads, ``generation_config.json`` and the token ids of ``config.json``,
so transformers' ``generate`` on a ``q38 convert --to-hf`` export, with no stop ids passed by hand, stops where
``q38 generate`` stops and gives its tokens (text and chat prompts, a full and a LoRA run).

Independent references: transformers (``AutoTokenizer``, ``AutoModelForCausalLM.generate``), the UTF-8 bytes of each
text (Python's ``str.encode``), ChatML ids written out here by hand, and the bytes of the copied tokenizer files. The
model differs from the ``tiny`` preset in every dimension (``tests.test_decode.CFG``, vocabulary 300).
"""

import json

import pytest
import torch

from q38.cli import main
from tests.test_decode import CFG, _params

MODEL = CFG.replace(vocab_size=300)  # covers the byte tokenizer's 261 ids
EOS, IM_START, IM_END, PAD, BOS = 258, 259, 260, 256, 257  # the byte tokenizer's special ids
TEXTS = ["the cat sat on the mat", "dogs"]
CHATS = ["hello there", "what is two plus two?"]
N = 12


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _refused(capsys, argv, *needles):
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.count("\n") == 0 and ": error: " in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def _chat_ids(text: str) -> list[int]:
    """ChatML with the assistant turn opened, written out by hand."""
    return [IM_START, *b"user\n", *text.encode(), IM_END, *b"\n", IM_START, *b"assistant\n"]


def _stopping_base(path):
    """A Hugging Face base of ``MODEL`` whose greedy continuations reach a stop token after a few tokens: the
    ``lm_head`` rows of ``<|eos|>`` and ``<|im_end|>`` are 1.1 x the rows of a token the unchanged model emits
    fourth after the first text prompt and the first chat prompt (so the stop id wins where that token would)."""
    from q38.decode import generate
    from q38.hf import save_hf

    params = _params(MODEL)
    prompts = [list(TEXTS[0].encode()), _chat_ids(CHATS[0])]
    with torch.no_grad():
        plain, chat = generate(params, MODEL, prompts, max_new_tokens=N)
    head = params.lm_head.clone()
    head[EOS], head[IM_END] = 1.1 * params.lm_head[plain[3]], 1.1 * params.lm_head[chat[3]]
    import attrs

    save_hf(path, MODEL, attrs.evolve(params, lm_head=head))


@pytest.mark.slow  # ~13 s each on the 2-core test machine
@pytest.mark.parametrize("peft", [None, {"rank": 3, "alpha": 6, "targets": ["w_q", "we_down"]}], ids=["full", "lora"])
def test_transformers_generate_on_the_export_stops_where_q38_generate_stops(tmp_path, capsys, peft):
    """One step from a base whose continuations reach ``<|eos|>`` / ``<|im_end|>``; ``q38 convert --to-hf`` (and
    ``--to-peft``) of the run; then ``AutoTokenizer`` + ``AutoModelForCausalLM`` on the export, ``generate(
    do_sample=False, max_new_tokens=N)`` and nothing else, gives ``q38 generate``'s prompt ids and tokens for every
    text and chat prompt, each row ending at a stop token before ``N``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from q38.train.run.generate import generate_from
    from q38.train.run.trainer import train
    from tests.run_utils import run_config

    base = tmp_path / "base"
    _stopping_base(base)
    train(run_config(tmp_path / "run", steps=1, model=str(base), init_from=str(base),
                     train={"lr": 1e-4, "warmup_steps": 0}, **({"peft": peft} if peft else {})))
    out = tmp_path / "hf"
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(out)]) == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (BOS, EOS, PAD)
    gen = GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == [EOS, IM_END] and gen.pad_token_id == PAD and not gen.do_sample

    recs = generate_from(str(tmp_path / "run"), text=TEXTS, chat=CHATS, max_new_tokens=N)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    inputs = [tok(t, return_tensors="pt") for t in TEXTS]
    inputs += [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True) for c in CHATS]
    wants = [list(t.encode()) for t in TEXTS] + [_chat_ids(c) for c in CHATS]
    stopped = 0
    for rec, enc, want_prompt in zip(recs, inputs, wants):
        ids = enc["input_ids"]
        assert ids[0].tolist() == want_prompt == rec["prompt_ids"]
        with torch.no_grad():
            got = model.generate(**enc, do_sample=False, max_new_tokens=N)[0, ids.shape[1]:].tolist()
        assert got == rec["ids"], (tok.decode(ids[0]), got, rec["ids"])
        if len(got) < N:
            assert got[-1] in (EOS, IM_END) and not {EOS, IM_END} & set(got[:-1])
            stopped += 1
    # a text row stops at <|eos|>, a chat row at <|im_end|> (the base makes sure), each after a few tokens
    assert 2 <= recs[0]["ids"].index(EOS) < N - 1 and 2 <= recs[2]["ids"].index(IM_END) < N - 1, recs
    assert stopped >= 2
    if peft:  # the adapter export holds the same tokenizer and generation config
        assert main(["convert", "--to-peft", str(tmp_path / "run"), str(tmp_path / "adapter")]) == 0
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (tmp_path / "adapter" / f).read_bytes() == (out / f).read_bytes(), f
        assert AutoTokenizer.from_pretrained(tmp_path / "adapter")("dogs")["input_ids"] == list(b"dogs")


# ---- the tokenizer files --------------------------------------------------------------------------------------------

SAMPLES = ["plain ascii", "  two  spaces\tand a tab\n\nnew lines", "héllo wörld — ünïcödé", "日本語のテキスト",
           "emoji 🙂👍🏽", "digits 12345 and punctuation!?;:", "'s 're 've contractions", ""]


def _model_yaml(tmp_path):
    import yaml

    f = tmp_path / "model.yaml"
    f.write_text(yaml.safe_dump(MODEL.to_dict()))
    return f


def test_init_hf_writes_a_byte_tokenizer_transformers_loads(tmp_path, capsys):
    """``q38 init-hf`` of a model unlike tiny: ``AutoTokenizer`` on the directory encodes text as its UTF-8 bytes (the
    byte tokenizer's ids), decodes them back, knows the special tokens and renders chats as ChatML; the ``tokenizers``
    library reading ``tokenizer.json`` alone gives the same ids; q38 reads the directory as the same tokenizer."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from q38.train.data.chat import render_chat_prompt
    from q38.train.data.tokenizer import load_tokenizer

    out = tmp_path / "hf"
    assert main(["init-hf", "--model", str(_model_yaml(tmp_path)), str(out)]) == 0
    tok = AutoTokenizer.from_pretrained(out)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    mine = load_tokenizer(out)
    for text in SAMPLES:
        want = list(text.encode())
        assert tok(text)["input_ids"] == want == raw.encode(text).ids == mine.encode(text), text
        assert tok.decode(want) == text
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (EOS, PAD, BOS)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START, IM_END]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    want = [IM_START, *b"system\nbe brief", IM_END, 10, *_chat_ids("hi")]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"] == want
    assert render_chat_prompt(msgs, mine) == want  # q38 renders the exported template the same
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (BOS, EOS, PAD)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [EOS, IM_END]
    assert main(["init-hf", "--model", str(_model_yaml(tmp_path)), "--tokenizer", "none", str(tmp_path / "bare")]) == 0
    assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == ["config.json", "model.safetensors"]
    import yaml

    small = tmp_path / "small.yaml"  # 200 ids: the byte tokenizer's 261 do not fit
    small.write_text(yaml.safe_dump(dict(MODEL.to_dict(), vocab_size=200)))
    _refused(capsys, ["init-hf", "--model", small, tmp_path / "x"], "261 ids", "vocab_size 200")
    assert not (tmp_path / "x").exists()


def _hf_tokenizer_dir(d):
    """A Hugging Face tokenizer unlike the byte one: a BPE with merges, ``<|endoftext|>`` as eos and ChatML tokens,
    a chat template file and an extra named template."""
    from tokenizers import AddedToken, Tokenizer, models

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz \n"))
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({"th": len(vocab), "the": len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("t", "h"), ("th", "e")], unk_token=None))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "tokenizer_class":
                                                         "TokenizersBackend"}))
    (d / "chat_template.jinja").write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                                           "<|im_end|>\n{% endfor %}")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "short.jinja").write_text("{{ messages[0]['content'] }}")
    return tok


def test_convert_copies_a_hugging_face_tokenizer(tmp_path, capsys):
    """A run whose tokenizer is a Hugging Face directory: ``convert --to-hf`` copies its files byte for byte (the
    extra chat templates too) and names its eos (and ``<|im_end|>`` as a stop) in ``config.json`` and
    ``generation_config.json``; ``--tokenizer`` picks another one (or none)."""
    from tests.run_utils import run_config
    from q38.train.run.trainer import train

    src = tmp_path / "tok"
    tok = _hf_tokenizer_dir(src)
    eos, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    model = dict(MODEL.to_dict(), num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                 mtp_num_layers=0)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "the then there"}) + "\n" for _ in range(8)))
    train(run_config(tmp_path / "run", steps=1, model=model, data={"path": str(data), "tokenizer": str(src)}))
    out = tmp_path / "hf"
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(out)]) == 0, capsys.readouterr().err
    copied = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "additional_chat_templates/short.jinja")
    for f in copied:
        assert (out / f).read_bytes() == (src / f).read_bytes(), f
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == eos and config["pad_token_id"] == eos and config["bos_token_id"] is None
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [eos, im_end]
    # (AutoTokenizer on a qwen3_5_moe_text directory builds transformers' Qwen3_5Tokenizer from the vocabulary with
    # Qwen's own pre-tokenizer; a tokenizer of another design loads as itself through TokenizersBackend)
    from transformers import TokenizersBackend

    assert TokenizersBackend.from_pretrained(out)("the then")["input_ids"] == tok.encode("the then").ids
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "b"), "--tokenizer", "byte"]) == 0
    assert json.loads((tmp_path / "b" / "config.json").read_text())["eos_token_id"] == EOS
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "n"), "--tokenizer", "none"]) == 0
    assert not (tmp_path / "n" / "tokenizer.json").exists()
    # bad tokenizers: one line, exit 2, nothing written
    src.rename(tmp_path / "moved")
    _refused(capsys, ["convert", "--to-hf", tmp_path / "run", tmp_path / "x"], "is not there", "--tokenizer")
    _refused(capsys, ["convert", "--to-hf", tmp_path / "run", tmp_path / "x", "--tokenizer", tmp_path / "nowhere"],
             "nowhere", "--tokenizer")
    _refused(capsys, ["convert", "--from-hf", out, tmp_path / "x", "--tokenizer", "byte"], "--tokenizer")
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "moved").iterdir() if p.is_file())
    _refused(capsys, ["convert", "--to-hf", tmp_path / "run", tmp_path / "moved", "--tokenizer", tmp_path / "moved",
                      "--overwrite"], "tokenizer (--tokenizer)", "--overwrite does not change this")
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "moved").iterdir() if p.is_file()) == before
    assert not (tmp_path / "x").exists()
