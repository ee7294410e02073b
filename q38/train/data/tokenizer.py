"""Tokenizers: the built-in byte tokenizer and a Hugging Face ``tokenizer.json`` directory, behind one protocol.

``load_tokenizer("byte")`` gives ``ByteTokenizer`` (UTF-8 bytes and five special tokens, ChatML's among them);
``load_tokenizer(DIR)`` gives ``HFTokenizer`` over ``DIR/tokenizer.json`` (its special tokens from
``tokenizer_config.json``). Chat formatting (``q38.train.data.chat``) and the data pipeline (``q38.train.data.loader``) build on
this module; it imports neither.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from q38.errors import DataError

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"



@runtime_checkable  # the test-time beartype hook checks `tokenizer: Tokenizer` arguments with isinstance
class Tokenizer(Protocol):
    """What the pipeline needs from a tokenizer (``ByteTokenizer`` and ``HFTokenizer`` both provide it)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...


class ByteTokenizer:
    """UTF-8 bytes (ids 0..255) plus five special tokens. ``encode`` never produces specials from text."""

    SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", IM_START, IM_END)

    def __init__(self) -> None:
        self._special_to_id = {tok: 256 + i for i, tok in enumerate(self.SPECIAL_TOKENS)}
        self._id_to_special = {i: tok for tok, i in self._special_to_id.items()}

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIAL_TOKENS)

    @property
    def pad_id(self) -> int:
        return 256

    @property
    def bos_id(self) -> int:
        return 257

    @property
    def eos_id(self) -> int:
        return 258

    def token_to_id(self, token: str) -> int | None:
        return self._special_to_id.get(token)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        parts: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
                continue
            if buf:
                parts.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            # Ids past the specials (the model vocab may be padded beyond 261) render as U+FFFD.
            parts.append(self._id_to_special.get(i, "\ufffd"))
        if buf:
            parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>")


def _token_content(value: Any) -> str | None:
    """``tokenizer_config.json`` stores special tokens either as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_json_object(file: Path) -> dict[str, Any]:
    """A tokenizer directory's JSON file as a dict ({} when absent); a bad file is one ``DataError`` naming it."""
    if not file.is_file():
        return {}
    from q38.files import CheckpointMismatch, load_json

    try:  # bounded, a regular file (a hub cache links to blobs), nested at most MAX_JSON_DEPTH deep
        data = load_json(file, f"tokenizer: cannot parse {file}", MAX_TOKENIZER_BYTES, follow=True)
    except CheckpointMismatch as e:
        raise DataError(str(e)) from None
    if not isinstance(data, dict):
        raise DataError(f"tokenizer: {file} must contain a JSON object")
    return data


MAX_TOKENIZER_BYTES = 256 << 20  # tokenizer.json files of the family are ~11 MB
MAX_PATTERN_CHARS = 4096
_UNBOUNDED = ("*", "+")


def risky_repetition(pattern: str) -> str | None:
    """The first group of a regex that is repeated without bound while its own body repeats or alternates (``(a+)+``,
    ``(a|ab)*``, ``(?:x*y)+``): the forms for which a backtracking engine (the tokenizers library's Oniguruma) can
    take exponential time on one line. None when there is none. Character classes and escapes are skipped; a
    group repeated by ``?`` or ``{m,n}`` is bounded and allowed."""
    stack: list[tuple[int, bool]] = []  # (start, body repeats or alternates)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a character class: up to its closing bracket
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            continue
        if c == "(":
            stack.append((i, False))
        elif c == "|" and stack:
            stack[-1] = (stack[-1][0], True)
        elif c in _UNBOUNDED or (c == "{" and re.match(r"\{\d*,\}", pattern[i:])):
            if stack:
                stack[-1] = (stack[-1][0], True)
        elif c == ")" and stack:
            start, busy = stack.pop()
            after = pattern[i + 1:i + 2]
            unbounded = after in _UNBOUNDED or bool(re.match(r"\{\d*,\}", pattern[i + 1:]))
            if busy and unbounded:
                return pattern[start:i + 2]
            if stack and busy:
                stack[-1] = (stack[-1][0], True)  # a repeating body inside: the outer group's body repeats too
        i += 1
    return None


def check_tokenizer_file(file: Path) -> None:
    """Before the tokenizers library reads ``file``: its size, and every regex it holds (pre-tokenizer splits,
    normalizer replacements) bounded in length and free of nested or alternating unbounded repetition."""
    from q38.files import CheckpointMismatch, load_json

    try:
        data = load_json(file, "tokenizer", MAX_TOKENIZER_BYTES, follow=True)  # a hub cache links to its blob
    except CheckpointMismatch as e:
        raise DataError(str(e)) from None
    todo = [data]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            pat = x.get("Regex")
            if isinstance(pat, str):
                if len(pat) > MAX_PATTERN_CHARS:
                    raise DataError(f"tokenizer: {file}: a regex of {len(pat):,} characters (the limit is "
                                    f"{MAX_PATTERN_CHARS:,}); not a tokenizer q38 reads")
                bad = risky_repetition(pat)
                if bad is not None:
                    raise DataError(f"tokenizer: {file}: the regex {pat[:80]!r} repeats the group {bad!r}, whose "
                                    "own body repeats or alternates; such a pattern can backtrack for minutes on "
                                    "one line, so q38 refuses it (use the tokenizer the checkpoint was released with)")
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (via the ``tokenizers`` library) read from a local directory.

    eos/pad/bos come from ``tokenizer_config.json`` when present; otherwise eos falls back to a common end token
    (``<|endoftext|>``, ``</s>``, ...) and pad falls back to eos (pad positions are never targets).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        from tokenizers import Tokenizer as _HFTok

        self.path = Path(path)
        file = self.path / "tokenizer.json" if self.path.is_dir() else self.path
        if not file.is_file():
            raise DataError(f"tokenizer: {file} not found; expected a directory containing tokenizer.json")
        check_tokenizer_file(file)
        try:
            self._tok = _HFTok.from_file(str(file))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise DataError(f"tokenizer: cannot load {file}: {e}") from e
        config = read_json_object(file.parent / "tokenizer_config.json")
        self.eos_token = self._resolve(config, "eos_token", _EOS_CANDIDATES)
        self.pad_token = self._resolve(config, "pad_token", ()) or self.eos_token
        self.bos_token = self._resolve(config, "bos_token", ())

    def _resolve(self, config: Mapping[str, Any], key: str, fallbacks: Sequence[str]) -> str | None:
        name = _token_content(config.get(key))
        if name is not None:
            if self._tok.token_to_id(name) is None:
                raise DataError(
                    f"tokenizer: {key} {name!r} from {self.path / 'tokenizer_config.json'} is not in the vocabulary "
                    f"of {self.path / 'tokenizer.json'}"
                )
            return name
        for cand in fallbacks:
            if self._tok.token_to_id(cand) is not None:
                return cand
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        if self.eos_token is None:
            raise DataError(
                f"tokenizer {self.path}: no end-of-sequence token; set eos_token in tokenizer_config.json "
                f"(plain-text records end with eos)"
            )
        return self._tok.token_to_id(self.eos_token)

    @property
    def pad_id(self) -> int:
        return self._tok.token_to_id(self.pad_token) if self.pad_token is not None else 0

    @property
    def bos_id(self) -> int | None:
        return self._tok.token_to_id(self.bos_token) if self.bos_token is not None else None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return list(self.encoding(text).ids)

    def encoding(self, text: str) -> Any:
        """The ``tokenizers.Encoding`` of ``encode`` (ids plus character offsets, for chat-template masks). A failure
        inside the library (a Rust panic, e.g. its regex engine's retry limit) is one ``DataError``."""
        try:
            return self._tok.encode(text, add_special_tokens=False)
        except BaseException as e:  # pyo3's PanicException derives from BaseException
            if type(e).__name__ != "PanicException":
                raise
            raise DataError(f"tokenizer {self.path}: the tokenizers library failed on a text of {len(text):,} "
                            f"characters ({str(e).splitlines()[0][:200]})") from None

    def added_tokens(self) -> list[Any]:
        """The ``tokenizers.AddedToken`` s of ``tokenizer.json`` (special or not)."""
        return list(self._tok.get_added_tokens_decoder().values())

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def stop_token_ids(tok: Tokenizer) -> tuple[int, ...]:
    """Where generation stops, for every prompt: the end-of-sequence token and the end of a chat turn
    (``<|im_end|>``) when the vocabulary has it. ``q38 generate`` stops there, and an export's
    ``generation_config.json`` names the same ids, so transformers' ``generate`` stops at the same token."""
    ids = [tok.eos_id]
    end = tok.token_to_id(IM_END)
    if end is not None and end not in ids:
        ids.append(end)
    return tuple(ids)


def load_tokenizer(spec: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` -> ``ByteTokenizer``; a directory holding ``tokenizer.json`` -> ``HFTokenizer``."""
    if isinstance(spec, str) and spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer(path)
    if path.is_file() and path.name == "tokenizer.json":
        return HFTokenizer(path.parent)
    what = "is a directory without tokenizer.json" if path.is_dir() else "does not exist"
    raise DataError(
        f"tokenizer: {str(spec)!r} {what}; expected \"byte\" (the built-in byte tokenizer) or a directory "
        f"containing tokenizer.json (e.g. a Hugging Face model directory)"
    )
