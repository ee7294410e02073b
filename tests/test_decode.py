"""Decoding (``q38.decode``): the one-token steps reproduce the chunked forward's logits on every prefix (packed
prompts as a batch of different lengths, fp32, 1e-5), and greedy sampling from a q38 checkpoint equals transformers'
greedy ``generate`` from its Hugging Face export, token for token."""

import attrs
import pytest
import torch

import q38
from q38.decode import DecodeCache, Sampling, decode_step, empty_cache, feed, generate, left_aligned, sample
from q38.model_config import ModelConfig
from q38.pytree import tree_map_with_path

# Every dimension differs from the tiny preset (hidden 64, 4/2 heads of 16, GDN 2/4 heads of 16, conv 4, 8 experts
# top-2 of width 32): two layer kinds in a 5-layer pattern that is not 3:1, value heads = 2 × key heads.
CFG = ModelConfig(
    model_type="qwen3_5_moe", vocab_size=200, hidden_size=40, num_hidden_layers=5,
    layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"),
    num_attention_heads=6, num_key_value_heads=3, head_dim=8, rope_theta=10_000.0, partial_rotary_factor=0.5,
    linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_conv_kernel_dim=3, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
    shared_expert_intermediate_size=20, mtp_num_layers=1, initializer_range=0.08, max_position_embeddings=4096,
)
LENGTHS = (70, 23, 41)  # the first crosses the GDN's 64-token chunk boundary


pytestmark = pytest.mark.usefixtures("one_thread")


def _params(cfg: ModelConfig, dtype=torch.float32):
    """``init_params`` with every 1-D leaf perturbed (norm weights, dt_bias, A_log are not constants)."""
    params = q38.init_params(cfg, seed=3)
    g = torch.Generator().manual_seed(4)
    return tree_map_with_path(
        lambda p, t: (t + 0.3 * torch.randn(t.shape, generator=g) if t.ndim == 1 else t).to(dtype), params)


def _prompts(cfg: ModelConfig) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def test_decode_steps_equal_the_packed_chunked_forward():
    params, prompts = _params(CFG), _prompts(CFG)
    # the reference: one packed row, documents marked by doc_ids, through the chunked forward
    ids = torch.tensor([sum(prompts, [])])
    doc_ids = torch.tensor([[i for i, p in enumerate(prompts) for _ in p]])
    with torch.no_grad():
        ref = q38.logits(params, ids, CFG, doc_ids=doc_ids)[0]
        tokens, active = left_aligned(prompts)
        got, cache = feed(params, empty_cache(CFG, len(prompts)), tokens, CFG, active=active)
    assert ref.std() > 0.5, "logits nearly constant: the comparison would not exercise the model"
    start, worst = 0, 0.0
    for r, p in enumerate(prompts):
        mine = got[r, active[r]]  # the steps row r took, in order
        assert torch.isfinite(mine).all()
        diff = (mine - ref[start:start + len(p)]).abs().max().item()
        worst = max(worst, diff)
        start += len(p)
    assert worst <= 1e-5, f"max |Δ logits| = {worst:.3e}"
    assert cache.pos.tolist() == list(LENGTHS)
    # a wrong conv window or a missed GDN state would move them far more: decoding the 2nd prompt from the 1st's cache
    with torch.no_grad():
        t2, a2 = left_aligned([prompts[1]])
        cont, _ = feed(params, attrs.evolve(cache, layers=[
            attrs.evolve(c, **{f: getattr(c, f)[:1] for f in attrs.fields_dict(type(c))}) for c in cache.layers],
            pos=cache.pos[:1]), t2, CFG)
    assert (cont[0] - ref[LENGTHS[0]:LENGTHS[0] + LENGTHS[1]]).abs().max() > 1e-2


def test_decode_step_is_pure_and_rows_are_independent():
    params, prompts = _params(CFG), _prompts(CFG)
    with torch.no_grad():
        tokens, active = left_aligned(prompts[:2])
        _, cache = feed(params, empty_cache(CFG, 2), tokens, CFG, active=active)
        before = [t.clone() for t in torch.utils._pytree.tree_leaves(cache)]
        nxt = torch.tensor([5, 7])
        a, c1 = decode_step(params, cache, nxt, CFG)
        b, _ = decode_step(params, cache, nxt, CFG)
        # the same row alone in a batch of one
        t1, a1 = left_aligned([prompts[1]])
        _, alone = feed(params, empty_cache(CFG, 1), t1, CFG, active=a1)
        solo, _ = decode_step(params, alone, nxt[1:], CFG)
    assert all(torch.equal(x, y) for x, y in zip(before, torch.utils._pytree.tree_leaves(cache)))
    assert torch.equal(a, b) and isinstance(c1, DecodeCache)
    assert (a[1] - solo[0]).abs().max() <= 1e-5


def test_sampling_rules():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample(logits, Sampling(), None).tolist() == [1]
    gen = torch.Generator().manual_seed(0)
    # top_p 0.5: only the most likely token (its probability alone passes 0.5) can be drawn
    draws = {sample(logits, Sampling(temperature=1.0, top_p=0.5), gen).item() for _ in range(50)}
    assert draws == {1}
    draws = {sample(logits, Sampling(temperature=5.0), gen).item() for _ in range(200)}
    assert draws == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)
    params = _params(CFG)
    a = generate(params, CFG, _prompts(CFG), max_new_tokens=6, sampling=Sampling(temperature=1.0, seed=11))
    b = generate(params, CFG, _prompts(CFG), max_new_tokens=6, sampling=Sampling(temperature=1.0, seed=11))
    c = generate(params, CFG, _prompts(CFG), max_new_tokens=6, sampling=Sampling(temperature=1.0, seed=12))
    assert a == b != c and all(len(x) == 6 for x in a)


# ---- against transformers: greedy generation from the Hugging Face export ------------------------------------------


@pytest.mark.parametrize("peft", [None, {"rank": 4, "alpha": 16, "targets": ["w_q", "w_qkv", "we_down"]}],
                         ids=["full", "lora"])
def test_greedy_generation_equals_transformers_on_the_hf_export(tmp_path, peft):
    """A q38 checkpoint (one training step of a model shaped as ``CFG``; a LoRA run's adapters merged) sampled
    greedily by ``q38 generate`` gives transformers' ``generate(do_sample=False)`` tokens from its ``convert --to-hf``
    export, for two prompts of different lengths decoded as one batch."""
    from transformers import Qwen3_5MoeForCausalLM

    from q38.train.io.hf_io import export_checkpoint
    from q38.train.io.peft_export import export_merged
    from q38.train.run.generate import generate_from
    from q38.train.run.trainer import train
    from tests.run_utils import run_config

    model = dict(CFG.to_dict(), vocab_size=300)  # covers the byte tokenizer (261 ids)
    cfg = run_config(tmp_path / "run", steps=1, model=model, **({"peft": peft} if peft else {}),
                     train={"lr": 3e-2, "warmup_steps": 0})
    train(cfg)
    ck = tmp_path / "run" / "checkpoints" / "step_000001"
    (export_merged if peft else export_checkpoint)(ck, tmp_path / "hf")
    prompts = ["the cat sat on the mat", "dogs"]
    n = 12
    recs = generate_from(str(tmp_path / "run"), text=prompts, max_new_tokens=n, stop_at_eos=False)
    hf = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="eager")
    hf.eval().generation_config.eos_token_id = None
    for p, r in zip(prompts, recs):
        ids = torch.tensor([list(p.encode())])
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                               pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert r["prompt_ids"] == ids[0].tolist()
        assert r["ids"] == want
        assert len(set(want)) >= 3, "a constant continuation would not exercise the decode"
    # the Hugging Face directory itself as the source (loaded as init_from): the same tokens
    from_hf = generate_from(str(tmp_path / "hf"), text=prompts, max_new_tokens=n, stop_at_eos=False)
    assert [r["ids"] for r in from_hf] == [r["ids"] for r in recs]


@pytest.mark.slow
def test_generate_cli_chat_prompts_and_errors(tmp_path, capsys):
    """``q38 generate``: a chat message is rendered as ChatML by a tokenizer without a template (ids written out
    here by hand) with the assistant turn opened; a JSONL of text and chat prompts runs as one batch; the same
    seed samples the same tokens; bad options are one-line errors."""
    import json

    from q38.train.run.trainer import train
    from tests.run_utils import q38, run_config

    train(run_config(tmp_path / "run", steps=1))
    r = q38("generate", tmp_path / "run", "--chat", "hi", "--max-new-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    im_start, im_end = 259, 260  # the byte tokenizer's <|im_start|>, <|im_end|>
    assert rec["prompt_ids"] == [im_start, *b"user\nhi", im_end, *b"\n", im_start, *b"assistant\n"]
    assert 1 <= len(rec["ids"]) <= 5
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"text": "the cat"}) + "\n" + json.dumps(
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]}) + "\n")
    args = ("generate", tmp_path / "run", "--prompts", prompts, "--temperature", "0.8", "--top-p", "0.9", "--seed",
            "3", "--max-new-tokens", "4", "--json")
    a, b = q38(*args), q38(*args)
    assert a.returncode == 0, a.stderr
    recs = [json.loads(line) for line in a.stdout.strip().splitlines()]
    assert len(recs) == 2 and recs[0]["prompt_ids"] == list(b"the cat") and a.stdout == b.stdout
    for bad, msg in ((["--top-p", "0"], "top_p must be in (0, 1]"), (["--temperature", "-1"], "temperature"),
                     (["--system", "x"], "--system goes with --chat")):
        from q38.cli import main

        assert main(["generate", str(tmp_path / "run"), "--prompt", "x", *bad]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err
