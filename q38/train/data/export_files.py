"""What a Hugging Face export holds beside its weights (docs/hf_checkpoints.md#what-an-export-holds): the run's
tokenizer as files ``AutoTokenizer.from_pretrained`` loads, ``generation_config.json`` (where generation stops: the
ids ``q38 generate`` stops at), and the ``bos`` / ``eos`` / ``pad`` ids of ``config.json``.

The byte tokenizer is written as a real ``tokenizer.json`` (a byte-level BPE without merges: byte ``b`` is token
``b``, its five special tokens ids 256-260) with a ChatML chat template that renders as q38's ChatML does; a Hugging
Face tokenizer directory is copied file by file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from q38.errors import DataError
from q38.train.data.tokenizer import (
    IM_END, IM_START, MAX_TOKENIZER_BYTES, ByteTokenizer, HFTokenizer, load_tokenizer, stop_token_ids,
)

# The files of a Hugging Face tokenizer directory an export copies (those present), and its extra chat templates.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model")
CHAT_TEMPLATES_DIR = "additional_chat_templates"
GENERATION_CONFIG = "generation_config.json"

# ChatML as q38 renders it without a template (q38.train.data.chat.encode_chat / render_chat_prompt)
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '" + IM_START + "' + message['role'] + '\\n' + message['content'] + '" + IM_END + "\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '" + IM_START + "assistant\\n' }}{%- endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet of the ``tokenizers`` library (GPT-2's): byte ``b`` → one printable character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def byte_tokenizer_files(max_positions: int) -> dict[str, bytes]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of q38's byte tokenizer: the same ids for every text without
    special-token names in it (``ByteTokenizer.encode`` never makes a special token from text; a Hugging Face
    tokenizer turns the text ``<|im_end|>`` into that token), the same special tokens, and ChatML as its chat
    template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ByteTokenizer.SPECIAL_TOKENS])
    byte = ByteTokenizer()
    got = [tok.token_to_id(t) for t in ByteTokenizer.SPECIAL_TOKENS]
    if got != [byte.token_to_id(t) for t in ByteTokenizer.SPECIAL_TOKENS]:
        raise AssertionError(f"byte tokenizer export: special token ids {got}")
    config = {
        "tokenizer_class": "TokenizersBackend", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>", "add_bos_token": False, "add_eos_token": False, "chat_template": CHATML_TEMPLATE,
        "model_max_length": int(max_positions), "clean_up_tokenization_spaces": False,
    }
    return {"tokenizer.json": tok.to_str(pretty=True).encode(),
            "tokenizer_config.json": json.dumps(config, indent=2).encode()}


def _copied_files(tok: HFTokenizer) -> dict[str, bytes]:
    """The files of a Hugging Face tokenizer directory, each a regular file read with a bound."""
    from q38.files import inside, read_bounded

    root = tok.path if tok.path.is_dir() else tok.path.parent
    names = [n for n in TOKENIZER_FILES if (root / n).exists() or (root / n).is_symlink()]
    extra = root / CHAT_TEMPLATES_DIR
    if extra.is_dir():
        names += [f"{CHAT_TEMPLATES_DIR}/{f.name}" for f in sorted(extra.glob("*.jinja"))]
    out = {}
    for n in names:
        try:
            f = inside(root, n, "tokenizer", follow=True)  # a regular file (a hub cache links to blobs)
            out[n] = read_bounded(f, MAX_TOKENIZER_BYTES, f"tokenizer: {root / n}", follow=True)
        except OSError as e:
            raise DataError(f"tokenizer: cannot read {root / n} ({e.strerror or e})") from None
    return out


def export_extras(spec: str | os.PathLike, vocab_size: int, max_positions: int):
    """The ``q38.hf.ExportExtras`` of an export whose run used the tokenizer ``spec`` (``"byte"`` or a Hugging Face
    tokenizer directory) on a model of ``vocab_size`` ids: the tokenizer's files, ``generation_config.json``
    (``eos_token_id``: every id ``q38 generate`` stops at, greedy decoding), and ``bos`` / ``eos`` / ``pad`` ids for
    ``config.json``. A tokenizer whose ids do not fit the model is refused (one ``DataError``)."""
    from q38.hf import ExportExtras

    tok = load_tokenizer(spec)
    if tok.vocab_size > vocab_size:
        raise DataError(f"tokenizer {spec}: {tok.vocab_size} ids, more than the model's vocab_size {vocab_size}; "
                        "export with the tokenizer the model was trained with")
    files = byte_tokenizer_files(max_positions) if isinstance(tok, ByteTokenizer) else _copied_files(tok)
    ids: dict[str, Any] = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    stops = list(stop_token_ids(tok))
    generation = {**ids, "eos_token_id": stops if len(stops) > 1 else stops[0], "do_sample": False}
    files[GENERATION_CONFIG] = json.dumps(generation, indent=2, sort_keys=True).encode()
    return ExportExtras(files=files, config=ids)


def recorded_tokenizer(meta: dict) -> str | None:
    """The tokenizer a checkpoint's run used (``run_config.data.tokenizer``), or for a checkpoint imported from a
    Hugging Face directory that directory when it holds ``tokenizer.json``; None when the checkpoint names none."""
    rc = meta.get("run_config")
    data = rc.get("data") if isinstance(rc, dict) else None
    spec = data.get("tokenizer") if isinstance(data, dict) else None
    if isinstance(spec, str) and spec:
        return spec
    src = meta.get("source")
    if isinstance(src, str) and src and "\x00" not in src and Path(src, "tokenizer.json").is_file():
        return src
    return None


__all__ = ["export_extras", "byte_tokenizer_files", "recorded_tokenizer", "CHATML_TEMPLATE", "GENERATION_CONFIG"]
