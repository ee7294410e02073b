"""``q38 generate``: prompts (text, or chat messages rendered by the tokenizer's chat template, from the command line
and from JSONL files, in any mix) → tokens sampled by ``q38.decode.generate`` from a q38 checkpoint (a LoRA one with
its adapters merged) or a Hugging Face directory, and the text of each answer: special tokens left out (by default)
and cut before the first stop string (docs/evaluate.md#q38-generate)."""

from typing import Any, Sequence

import torch

from q38.errors import ConfigError, DataError
from q38.files import MAX_LINE_BYTES

PROMPT_HINT = "each line is one {\"text\": PROMPT} or {\"messages\": [...]} object"


def read_prompts(path: str, limit: int | None = None) -> list[dict]:
    """The prompt records of a JSONL file: ``{"text": ...}`` prompts and ``{"messages": [...]}`` chats (blank lines
    skipped), each with ``"from": "FILE:LINE"``. Read as every JSONL input is: a regular file only (a FIFO or device
    is refused, never waited on), each line at most ``limit`` bytes (default ``q38.files.MAX_LINE_BYTES``, refused
    after reading that much of it) and nested at most ``q38.files.MAX_JSON_DEPTH`` deep (checked before parsing);
    a chat is checked as the trainer's chat loader checks one (roles, non-empty messages)."""
    from q38.files import CheckpointMismatch, open_regular
    from q38.train.data.chat import validate_chat_record
    from q38.train.data.loader import parse_record

    limit = MAX_LINE_BYTES if limit is None else limit
    out = []
    try:
        with open_regular(path, "--prompts", follow=True) as f:
            n = 0
            while raw := f.readline(limit + 1):
                n += 1
                where = f"{path}:{n}"
                if len(raw) > limit and not raw.endswith(b"\n"):
                    raise DataError(f"{where}: line longer than {limit:,} bytes ({limit / (1 << 20):g} MiB), the "
                                    "limit on one prompt; shorten the prompt (q38 reads at most that much of a line)")
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
                if not line.strip():
                    continue
                rec = parse_record(line, where)
                if not isinstance(rec, dict) or not (("text" in rec) ^ ("messages" in rec)):
                    raise DataError(f"{where}: expected {{\"text\": PROMPT}} or {{\"messages\": [...]}}, got "
                                    f"{line.strip()[:80]!r}")
                if "messages" in rec:
                    validate_chat_record(rec, where)
                out.append({**rec, "from": where})
    except CheckpointMismatch as e:  # missing, unreadable, a FIFO or a device
        raise DataError(f"{e}; {PROMPT_HINT}") from None
    if not out:
        raise DataError(f"{path}: no prompts; {PROMPT_HINT}")
    return out


def prompt_records(inputs: Sequence[tuple[str, str]], system: str | None = None) -> list[dict]:
    """The prompt records of ``inputs``, in their order: ``("text", PROMPT)``, ``("chat", USER MESSAGE)`` (after a
    ``system`` message when given) and ``("file", JSONL PATH)`` (``read_prompts``)."""
    if system is not None and not any(kind == "chat" for kind, _ in inputs):
        raise ValueError("--system goes with --chat (a JSONL chat carries its own system message)")
    recs: list[dict] = []
    for kind, value in inputs:
        if kind == "text":
            recs.append({"text": value, "from": "--prompt"})
        elif kind == "chat":
            recs.append({"messages": ([{"role": "system", "content": system}] if system is not None else [])
                         + [{"role": "user", "content": value}], "from": "--chat"})
        elif kind == "file":
            recs += read_prompts(value)
        else:
            raise ValueError(f"unknown prompt kind {kind!r}: text, chat or file")
    if not recs:
        raise ValueError("no prompts: give --prompt, --chat or --prompts")
    return recs


def prompt_ids(rec: dict, tok) -> list[int]:
    """A prompt record's token ids: text encoded as it is (no bos: q38's data adds none), chat messages through
    the chat template (ChatML without one) with an assistant turn opened (checked as the trainer's chat loader
    checks a record)."""
    from q38.train.data.chat import render_chat_prompt, validate_chat_record

    where = rec.get("from", "prompt")
    if "messages" in rec:
        validate_chat_record(rec, where)
        return render_chat_prompt(rec["messages"], tok, add_generation_prompt=True, tools=rec.get("tools"),
                                  **(rec.get("chat_template_kwargs") or {}))
    if not isinstance(rec["text"], str) or not rec["text"]:
        raise DataError(f"{where}: a text prompt must be a non-empty string, got {rec['text']!r}")
    return tok.encode(rec["text"])


def check_lengths(prompts: Sequence[Sequence[int]], recs: Sequence[dict], max_new_tokens: int,
                  max_positions: int) -> None:
    """Each prompt and its ``max_new_tokens`` fit the model's ``max_positions`` (refused before any weight is read,
    naming the prompt and the largest ``--max-new-tokens`` it allows)."""
    for i, (p, rec) in enumerate(zip(prompts, recs), start=1):
        where = f"prompt [{i}] ({rec.get('from', 'prompt')})"
        if len(p) >= max_positions:
            raise DataError(f"{where} has {len(p):,} tokens, as many as or more than the model's "
                            f"max_position_embeddings ({max_positions:,}) leave room for; shorten it")
        if len(p) + max_new_tokens > max_positions:
            raise ConfigError(f"--max-new-tokens {max_new_tokens:,}: {where} has {len(p):,} tokens, and the model "
                              f"has max_position_embeddings {max_positions:,}; give --max-new-tokens "
                              f"{max_positions - len(p):,} or less")


def check_decode_memory(prompts: Sequence[Sequence[int]], max_new_tokens: int, model, device: str) -> None:
    """Refuse, before any weight is read, prompts whose one batch cannot fit: every row holds a decode cache for the
    longest prompt plus ``max_new_tokens`` steps (``q38.decode.cache_bytes``, keys and values at 2 bytes an element
    at the least) and fp32 logits and probabilities over the vocabulary; that lower bound must fit in what
    ``device`` can still allocate."""
    from q38.decode import cache_bytes
    from q38.train.run.inference import device_room

    longest = max(len(p) for p in prompts)
    per_row = cache_bytes(model, 1, longest + max_new_tokens, torch.bfloat16) + 2 * 4 * model.vocab_size
    where, room = device_room(device)
    if room is not None and len(prompts) * per_row > room:
        raise ConfigError(f"{len(prompts):,} prompts of up to {longest:,} tokens with --max-new-tokens "
                          f"{max_new_tokens:,} need at least {len(prompts) * per_row / 2**30:,.2f} GiB of {where} "
                          f"for their decode caches (all prompts run as one batch), more than the {room / 2**30:,.2f} "
                          f"GiB this process can still allocate; give at most {room // per_row:,} prompts in one "
                          "call, or lower --max-new-tokens")


def stop_tokens(tok) -> tuple[int, ...]:
    """Where a row stops, text and chat prompts alike: the tokenizer's end-of-sequence token and the end of a turn
    (``<|im_end|>``) when the vocabulary has it (``stop_token_ids``: the ids an export's ``generation_config.json``
    names, so transformers stops where ``q38 generate`` does)."""
    from q38.train.data.tokenizer import stop_token_ids

    return stop_token_ids(tok)


def special_ids(tok) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (a Hugging Face tokenizer's added tokens marked special, the byte
    tokenizer's five): what ``skip_special_tokens`` leaves out of a decoded text."""
    if hasattr(tok, "added_tokens"):
        return frozenset(tok.token_to_id(t.content) for t in tok.added_tokens() if t.special)
    if hasattr(tok, "SPECIAL_TOKENS"):
        return frozenset(tok.token_to_id(t) for t in tok.SPECIAL_TOKENS)
    raise NotImplementedError(f"tokenizer {tok!r} does not say which of its tokens are special")


def answer_text(tok, ids: Sequence[int], *, skip: frozenset[int] = frozenset(),
                stop: Sequence[str] = ()) -> tuple[str, str | None]:
    """The text of sampled ``ids`` (the tokens of ``skip`` left out) cut before the first of the ``stop`` strings it
    contains; returns ``(text, the stop string found or None)``."""
    text = tok.decode([i for i in ids if i not in skip])
    hits = [(text.find(s), s) for s in stop if s in text]
    if not hits:
        return text, None
    at, s = min(hits)
    return text[:at], s


def inference_params(state):
    """The state's parameters as ``decode_step`` takes them: LoRA adapters merged (fp32), FP8 weights dequantized."""
    from q38.lora import merged_params

    return merged_params(state.params) if state.peft is not None else state.params


def generate_from(source: str, *, text: Sequence[str] | None = None, chat: Sequence[str] | None = None,
                  prompts_file: str | None = None, inputs: Sequence[tuple[str, str]] = (), system: str | None = None,
                  max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int = 0, stop_at_eos: bool = True, stop: Sequence[str] = (),
                  skip_special_tokens: bool = True, overrides: dict | None = None,
                  speculative: int | None = None) -> list[dict[str, Any]]:
    """One record per prompt, in order: ``inputs`` (``prompt_records``), then ``text``, ``chat`` and the records of
    ``prompts_file``. Each record: ``index`` (from 1), ``from`` (``--prompt``, ``--chat`` or ``FILE:LINE``), the
    prompt (``prompt``: a text prompt; ``messages`` and ``tools``: a chat), ``prompt_ids``, ``ids`` (every sampled
    token, the stop token or the tokens of a stop string included), ``text`` (the answer: the text of ``ids``, special
    tokens left out unless not ``skip_special_tokens``, cut before the first ``stop`` string) and ``stopped``
    (``eos``, ``stop_string`` or ``length``). One process. ``speculative`` K (not None): decoding with K MTP
    drafts per pass (``q38.speculative``); each record then holds ``speculative``: its verification ``passes`` and
    the ``tokens`` they committed."""
    from q38.decode import Sampling, generate
    from q38.train.data.tokenizer import load_tokenizer
    from q38.train.run.inference import load_state, open_source
    from q38.train.run.launch import WorldInfo, check_run, pick_device
    from q38.train.run.trainer import _source_precision

    world = WorldInfo.from_env()
    if world.world_size > 1:
        raise NotImplementedError("q38 generate runs on one process; run it without torchrun")
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"a stop string must be non-empty text, got {list(stop)!r}")
    ordered = [*inputs, *(("text", t) for t in text or []), *(("chat", m) for m in chat or []),
               *([("file", prompts_file)] if prompts_file is not None else [])]
    recs = prompt_records(ordered, system)
    src = open_source(source, dict(overrides or {}, layout="single"))
    cfg = src.cfg if src.checkpoint is not None else _source_precision(src.cfg)
    if speculative is not None:
        from q38.speculative import check_speculative

        check_speculative(cfg.model, speculative)
    tok = load_tokenizer(cfg.data.tokenizer)
    prompts = [prompt_ids(r, tok) for r in recs]
    check_lengths(prompts, recs, max_new_tokens, cfg.model.max_position_embeddings)
    device = pick_device(cfg.run.device, 0)
    check_decode_memory(prompts, max_new_tokens, cfg.model, device)
    skip = special_ids(tok) if skip_special_tokens else frozenset()
    stop_ids = stop_tokens(tok) if stop_at_eos else ()
    plan = check_run(cfg, 1, device)
    import attrs

    state = load_state(attrs.evolve(src, cfg=cfg), world, device, plan, None)
    params = inference_params(state)
    stop_when = (lambda r, ids: answer_text(tok, ids, skip=skip, stop=stop)[1] is not None) if stop else None
    stats = None
    if speculative is not None:
        from q38.speculative import speculative_generate

        outs, stats = speculative_generate(params, cfg.model, prompts, k=speculative, max_new_tokens=max_new_tokens,
                                           stop_ids=stop_ids, router_bias=state.router_bias, stop_when=stop_when,
                                           sampling=sampling)
    else:
        with torch.no_grad():
            outs = generate(params, cfg.model, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                            stop_ids=stop_ids, router_bias=state.router_bias, stop_when=stop_when)
    out = []
    for i, (rec, p, o) in enumerate(zip(recs, prompts, outs), start=1):
        answer, hit = answer_text(tok, o, skip=skip, stop=stop)
        why = "stop_string" if hit is not None else "eos" if o and o[-1] in stop_ids else "length"
        prompt = {"prompt": rec["text"]} if "text" in rec else {k: rec[k] for k in ("messages", "tools") if k in rec}
        out.append({"index": i, "from": rec["from"], **prompt, "prompt_ids": p, "ids": o, "text": answer,
                    "stopped": why, **({"speculative": stats.row(i - 1)} if stats is not None else {})})
    return out
