"""``q38 generate``: prompts (text, or chat messages rendered by the tokenizer's chat template) → tokens sampled by
``q38.decode.generate`` from a q38 checkpoint (a LoRA one with its adapters merged) or a Hugging Face directory
(docs/evaluate.md#q38-generate)."""

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from q38.errors import DataError


def read_prompts(path: str) -> list[dict]:
    """A JSONL file of ``{"text": ...}`` prompts and ``{"messages": [...]}`` chats (blank lines skipped)."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: malformed JSON ({e.msg}); each line is {{\"text\": ...}} or "
                            "{\"messages\": [...]}") from None
        if not isinstance(rec, dict) or not (("text" in rec) ^ ("messages" in rec)):
            raise DataError(f"{path}:{n}: expected {{\"text\": PROMPT}} or {{\"messages\": [...]}}, got {line[:80]!r}")
        out.append(rec)
    if not out:
        raise DataError(f"{path}: no prompts; one JSON object per line")
    return out


def prompt_ids(rec: dict, tok) -> list[int]:
    """A prompt record's token ids: text encoded as it is (no bos: q38's data adds none), chat messages through
    the chat template (ChatML without one) with an assistant turn opened."""
    from q38.train.data.chat import render_chat_prompt

    if "messages" in rec:
        return render_chat_prompt(rec["messages"], tok, add_generation_prompt=True, tools=rec.get("tools"),
                                  **(rec.get("chat_template_kwargs") or {}))
    if not isinstance(rec["text"], str) or not rec["text"]:
        raise DataError(f"a text prompt must be a non-empty string, got {rec['text']!r}")
    return tok.encode(rec["text"])


def stop_tokens(tok, chat: bool) -> tuple[int, ...]:
    """Where a row stops: the tokenizer's end-of-sequence token, and for chats the end of a turn (``<|im_end|>``)
    when the vocabulary has it."""
    from q38.train.data.tokenizer import IM_END

    ids = [tok.eos_id]
    if chat and tok.token_to_id(IM_END) is not None:
        ids.append(tok.token_to_id(IM_END))
    return tuple(ids)


def inference_params(state):
    """The state's parameters as ``decode_step`` takes them: LoRA adapters merged (fp32), FP8 weights dequantized."""
    from q38.lora import merged_params

    return merged_params(state.params) if state.peft is not None else state.params


def generate_from(source: str, *, text: Sequence[str] | None = None, chat: Sequence[str] | None = None,
                  prompts_file: str | None = None, system: str | None = None, max_new_tokens: int = 64,
                  temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, stop_at_eos: bool = True,
                  overrides: dict | None = None, speculative: int | None = None) -> list[dict[str, Any]]:
    """One record per prompt: ``prompt_ids``, ``ids`` (sampled) and ``text`` (decoded). One process.
    ``speculative`` K (not None): greedy decoding with K MTP drafts per pass (``q38.speculative``); each record
    then holds ``speculative``: its verification ``passes`` and the ``tokens`` they committed."""
    from q38.decode import Sampling, generate
    from q38.train.data.tokenizer import load_tokenizer
    from q38.train.run.inference import load_state, open_source
    from q38.train.run.launch import WorldInfo, check_run, pick_device
    from q38.train.run.trainer import _source_precision

    world = WorldInfo.from_env()
    if world.world_size > 1:
        raise NotImplementedError("q38 generate runs on one process; run it without torchrun")
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
    if system is not None and not chat:
        raise ValueError("--system goes with --chat (a JSONL chat carries its own system message)")
    recs = [{"text": t} for t in text or []]
    recs += [{"messages": ([{"role": "system", "content": system}] if system else [])
              + [{"role": "user", "content": m}]} for m in chat or []]
    if prompts_file is not None:
        recs += read_prompts(prompts_file)
    src = open_source(source, dict(overrides or {}, layout="single"))
    cfg = src.cfg if src.checkpoint is not None else _source_precision(src.cfg)
    if speculative is not None:
        from q38.speculative import check_speculative

        check_speculative(cfg.model, speculative, temperature)
    tok = load_tokenizer(cfg.data.tokenizer)
    prompts = [prompt_ids(r, tok) for r in recs]
    device = pick_device(cfg.run.device, 0)
    plan = check_run(cfg, 1, device)
    import attrs

    state = load_state(attrs.evolve(src, cfg=cfg), world, device, plan, None)
    params = inference_params(state)
    stop_ids = stop_tokens(tok, any("messages" in r for r in recs)) if stop_at_eos else ()
    if speculative is not None:
        from q38.speculative import speculative_generate

        outs, stats = speculative_generate(params, cfg.model, prompts, k=speculative, max_new_tokens=max_new_tokens,
                                           stop_ids=stop_ids, router_bias=state.router_bias)
        return [{"prompt_ids": p, "ids": o, "text": tok.decode(o), "speculative": stats.row(r)}
                for r, (p, o) in enumerate(zip(prompts, outs))]
    with torch.no_grad():
        outs = generate(params, cfg.model, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                        stop_ids=stop_ids, router_bias=state.router_bias)
    return [{"prompt_ids": p, "ids": o, "text": tok.decode(o)} for p, o in zip(prompts, outs)]
