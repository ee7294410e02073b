"""Data pipeline: JSONL records, their encoding (text here; chat records through ``q38.train.data.chat``, tokenizers in
``q38.train.data.tokenizer``), sequence packing and a deterministic DP loader.

Label convention (Hugging Face style, not pre-shifted): ``labels[b, t]`` is ``input_ids[b, t]`` when the token at
position ``t`` is a training target and ``-100`` otherwise; the loss shifts later (position ``t`` predicts
``labels[t + 1]`` when both lie in the same document). ``doc_ids[b, t]`` numbers the documents packed into a row
``0, 1, 2, ...`` along the row; padding has doc id ``-1``, input id ``pad_id`` and label ``-100``.

Pipeline: ``read_jsonl`` -> ``encode_record`` -> ``pack_documents`` -> ``PackedDataset`` -> ``BatchIterator``;
``build_dataset`` does the first four steps for a file or a shipped corpus (``"builtin:tiny"``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import attrs
import torch

from q38.batch import IGNORE_INDEX, PAD_DOC_ID  # one ignore index and pad doc id for data, batch and losses
from q38.errors import DataError
from q38.files import MAX_LINE_BYTES
from q38.train.data.chat import encode_chat_record, validate_chat_record
from q38.train.data.formats import to_record
from q38.train.data.tokenizer import Tokenizer

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
BUILTIN_PREFIX = "builtin:"
OVERLONG_MODES = ("truncate", "error", "split")
CHAT_ROLES = ("system", "user", "assistant", "tool")


# ----------------------------------------------------------------------------------------------------------------
# Records -> (input_ids, labels)


def encode_text(text: str, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """Plain text: every token is a target, followed by eos (also a target)."""
    ids = tokenizer.encode(text) + [tokenizer.eos_id]
    return ids, list(ids)


def encode_record(record: Mapping[str, Any], tokenizer: Tokenizer, *, train_on: str = "assistant"
                  ) -> tuple[list[int], list[int]]:
    """A validated record (``{"text": ...}`` or ``{"messages": [...]}``) -> ``(input_ids, labels)``. Chat records
    are rendered by the tokenizer's chat template (ChatML without one); ``train_on`` (assistant | all |
    last_assistant) picks their targets, see ``q38.train.data.chat``."""
    if "messages" in record:
        return encode_chat_record(record, tokenizer, train_on=train_on)
    return encode_text(record["text"], tokenizer)


def validate_record(record: Any, where: str) -> None:
    """Raise ``DataError`` (prefixed with ``where``, e.g. ``file:line``) unless ``record`` is a text or chat record."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with a \"text\" or \"messages\" key, got "
                        f"{type(record).__name__}")
    has_text, has_msgs = "text" in record, "messages" in record
    if has_text and has_msgs:
        raise DataError(f"{where}: record has both \"text\" and \"messages\"; use one of them")
    if not has_text and not has_msgs:
        keys = ", ".join(repr(k) for k in record) or "none"
        raise DataError(
            f"{where}: record is neither plain text nor chat (keys: {keys}); expected {{\"text\": str}} or "
            f"{{\"messages\": [{{\"role\": \"system\"|\"user\"|\"assistant\", \"content\": str}}, ...]}}"
        )
    if has_text:
        if not isinstance(record["text"], str):
            raise DataError(f"{where}: \"text\" must be a string, got {type(record['text']).__name__}")
        return
    validate_chat_record(record, where)




def line_too_long(where: str, limit: int) -> DataError:
    return DataError(f"{where}: line longer than {limit:,} bytes ({limit / (1 << 20):g} MiB), the limit on one JSONL "
                     f"record; split the record, or raise the limit (q38 prepare-data --max-line-mb)")


def record_too_large(where: str, size: int, limit: int) -> DataError:
    return DataError(f"{where}: a record of {size:,} bytes, more than the limit of {limit:,} bytes "
                     f"({limit / (1 << 20):g} MiB) on one record; split the record, or raise the limit (q38 "
                     "prepare-data --max-line-mb)")


def parse_record(line: bytes | str, where: str):
    """One JSON record (a JSONL line, a JSON-array element's text): nested at most ``MAX_JSON_DEPTH`` deep (checked
    before parsing), else one ``DataError`` naming ``where``."""
    from q38.files import MAX_JSON_DEPTH, json_depth_over

    if json_depth_over(line):
        raise DataError(f"{where}: JSON nested too deeply (more than {MAX_JSON_DEPTH} levels of arrays / objects); "
                        "each record must be one JSON object of text or messages")
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); each line must be one JSON "
                        f"object") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply to read; each line must be one JSON object of text or "
                        "messages") from None


def bounded_lines(f, path: str | os.PathLike, limit: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes]]:
    """``(line number, raw line)`` of a binary file, each read with ``readline(limit + 1)``: a line longer than
    ``limit`` bytes (its newline not counted) is refused, naming ``path:line``, after at most ``limit + 1`` of its
    bytes were read."""
    lineno = 0
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            raise line_too_long(f"{path}:{lineno}", limit)
        yield lineno, raw


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Validated records of a JSONL file (blank lines skipped; ShareGPT / Alpaca / OpenAI-style records converted to
    q38's, ``q38.train.data.formats``). Errors name ``file:line``; a file without records raises once iteration reaches
    its end. A missing file raises immediately."""
    path = Path(path)
    if not path.is_file():
        from q38.files import file_kind

        what = f"is {file_kind(path.stat().st_mode)}" if path.exists() else "not found"
        raise DataError(f"data: {path} {what}; expected a JSONL file of {{\"text\": ...}} or "
                        f"{{\"messages\": [...]}} records, or \"builtin:tiny\"")
    return (record for _, record in _iter_jsonl(path))


def _iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` pairs of an existing JSONL file."""
    n = 0
    with open(path, "rb") as f:
        for lineno, raw in bounded_lines(f, path):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not valid UTF-8 ({e})") from None
            if not line.strip():
                continue
            record = parse_record(line, where)
            record = to_record(record, "auto", where)  # ShareGPT / Alpaca / OpenAI-style -> q38 messages
            validate_record(record, where)
            n += 1
            yield lineno, record
    if n == 0:
        raise DataError(f"data: {path} contains no records; expected one JSON object per line")


# ----------------------------------------------------------------------------------------------------------------
# Packing


@attrs.frozen
class PackedRow:
    input_ids: list[int]
    labels: list[int]
    doc_ids: list[int]


def pack_documents(docs: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, *, pad_id: int,
                   overlong: str = "truncate", sources: Sequence[str] | None = None) -> list[PackedRow]:
    """Greedy in-order packing of ``(input_ids, labels)`` documents into rows of ``seq_len``.

    A document goes into the current row if it fits, else it starts a new row; a document never straddles rows
    except under ``overlong="split"``. Overlong documents (> seq_len): ``"truncate"`` keeps the first seq_len
    tokens, ``"error"`` raises, ``"split"`` cuts them into seq_len pieces, each its own document. Empty documents
    are dropped. ``sources[i]`` (e.g. ``file:line``) is quoted in errors about document ``i``.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"seq_len must be a positive integer, got {seq_len!r}")
    if overlong not in OVERLONG_MODES:
        raise DataError(f"overlong is {overlong!r}; expected one of {', '.join(OVERLONG_MODES)}")
    rows: list[PackedRow] = []
    cur_ids: list[int] = []
    cur_labels: list[int] = []
    cur_docs: list[int] = []

    def flush() -> None:
        if not cur_ids:
            return
        pad = seq_len - len(cur_ids)
        rows.append(PackedRow(cur_ids + [pad_id] * pad, cur_labels + [IGNORE_INDEX] * pad,
                              cur_docs + [PAD_DOC_ID] * pad))
        cur_ids.clear(), cur_labels.clear(), cur_docs.clear()

    for i, (ids, labels) in enumerate(docs):
        ids, labels = list(ids), list(labels)
        if len(ids) != len(labels):
            raise DataError(f"sample {i}: input_ids has {len(ids)} tokens but labels has {len(labels)}")
        if not ids:
            continue
        pieces = [(ids, labels)]
        if len(ids) > seq_len:
            if overlong == "error":
                src = f" ({sources[i]})" if sources is not None else ""
                raise DataError(
                    f"sample {i}{src} has {len(ids)} tokens, longer than seq_len {seq_len}; set `overlong: truncate` "
                    f"or `overlong: split`, raise seq_len, or shorten the sample"
                )
            if overlong == "truncate":
                pieces = [(ids[:seq_len], labels[:seq_len])]
            else:
                pieces = [(ids[k:k + seq_len], labels[k:k + seq_len]) for k in range(0, len(ids), seq_len)]
        for p_ids, p_labels in pieces:
            if len(cur_ids) + len(p_ids) > seq_len:
                flush()
            doc = cur_docs[-1] + 1 if cur_docs else 0
            cur_ids += p_ids
            cur_labels += p_labels
            cur_docs += [doc] * len(p_ids)
    flush()
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Dataset and loader


class PackedDataset:
    """Packed rows held as three int64 tensors ``[num_rows, seq_len]``."""

    def __init__(self, rows: Sequence[PackedRow | Mapping[str, Sequence[int]]]) -> None:
        if not rows:
            raise DataError("PackedDataset: no rows (the data produced no tokens)")
        def field(r: Any, k: str) -> Sequence[int]:
            return r[k] if isinstance(r, Mapping) else getattr(r, k)
        self.input_ids = torch.tensor([list(field(r, "input_ids")) for r in rows], dtype=torch.int64)
        self.labels = torch.tensor([list(field(r, "labels")) for r in rows], dtype=torch.int64)
        self.doc_ids = torch.tensor([list(field(r, "doc_ids")) for r in rows], dtype=torch.int64)
        if not (self.input_ids.shape == self.labels.shape == self.doc_ids.shape):
            raise DataError("PackedDataset: input_ids, labels and doc_ids rows must all have the same length")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens."""
        return int((self.doc_ids >= 0).sum())

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def __getitem__(self, idx: int | torch.Tensor | Sequence[int]) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[idx], "labels": self.labels[idx], "doc_ids": self.doc_ids[idx]}


class BatchIterator:
    """Infinite, deterministic iterator of this DP rank's batches ``{input_ids, labels, doc_ids}: [batch_size,
    seq_len]`` int64.

    Epoch ``e`` visits the rows in ``torch.randperm(n, generator=Generator().manual_seed(seed + e))`` order (or in
    order without ``shuffle``), cut into global batches of ``batch_size * dp_size`` rows (the remainder is dropped);
    rank ``r`` takes rows ``[r * batch_size, (r + 1) * batch_size)`` of each global batch. ``state_dict()`` is
    ``{"epoch", "index"}`` (``index`` = global batches already consumed in ``epoch``); ``load_state_dict`` resumes
    exactly where an uninterrupted iterator would be.
    """

    def __init__(self, dataset: PackedDataset, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(dp_size, int) or dp_size < 1:
            raise DataError(f"dp_size must be a positive integer, got {dp_size!r}")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank must be in [0, {dp_size}), got {dp_rank!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.global_batch_size = batch_size * dp_size
        n = len(dataset)
        if n < self.global_batch_size:
            raise DataError(
                f"the dataset has {n} packed rows of seq_len {dataset.seq_len} but one global batch needs "
                f"{self.global_batch_size} (batch_size {batch_size} x dp_size {dp_size}); reduce batch_size or "
                f"seq_len, or add data"
            )
        self.steps_per_epoch = n // self.global_batch_size
        self.epoch = 0
        self.index = 0
        self._perm_epoch: int | None = None
        self._perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            n = len(self.dataset)
            if self.shuffle:
                self._perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                self._perm = torch.arange(n)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def global_rows(self, step: int) -> torch.Tensor:
        """Dataset row indices of global batch number ``step`` (counted from the start of epoch 0)."""
        epoch, index = divmod(int(step), self.steps_per_epoch)
        start = index * self.global_batch_size
        return self._permutation(epoch)[start:start + self.global_batch_size]

    def global_batch(self, step: int) -> dict[str, torch.Tensor]:
        """The whole global batch (all ranks) of ``step``: ``[batch_size * dp_size, seq_len]``."""
        return self.dataset[self.global_rows(step)]

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's share of global batch ``step``."""
        rows = self.global_rows(step)[self.dp_rank * self.batch_size:(self.dp_rank + 1) * self.batch_size]
        return self.dataset[rows]

    @property
    def step(self) -> int:
        """Global batches consumed so far."""
        return self.epoch * self.steps_per_epoch + self.index

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        out = self.batch(self.step)
        self.index += 1
        if self.index == self.steps_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = [k for k in ("epoch", "index") if k not in state]
        if missing:
            raise DataError(f"data iterator state lacks {', '.join(missing)}; expected {{\"epoch\", \"index\"}}")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.steps_per_epoch:
            raise DataError(
                f"data iterator state epoch={epoch} index={index} does not fit this dataset ({self.steps_per_epoch} "
                f"global batches per epoch); was the data, seq_len or global batch size changed since the checkpoint?"
            )
        self.epoch, self.index = epoch, index


# ----------------------------------------------------------------------------------------------------------------
# Entry point


def builtin_corpora() -> list[str]:
    return sorted(f"{BUILTIN_PREFIX}{p.stem}" for p in CORPUS_DIR.glob("*.jsonl"))


def resolve_data_path(path_or_builtin: str | os.PathLike) -> Path:
    """``"builtin:NAME"`` -> the shipped ``corpus/NAME.jsonl``; anything else is a path."""
    spec = os.fspath(path_or_builtin)
    if spec.startswith(BUILTIN_PREFIX):
        path = CORPUS_DIR / f"{spec[len(BUILTIN_PREFIX):]}.jsonl"
        if not path.is_file():
            raise DataError(f"data: unknown built-in corpus {spec!r}; available: {', '.join(builtin_corpora())}")
        return path
    return Path(spec)


def load_documents(path_or_builtin: str | os.PathLike, tokenizer: Tokenizer, *, train_on: str = "assistant"
                   ) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
    """Tokenized ``(input_ids, labels)`` per record, and the ``file:line`` of each."""
    path = resolve_data_path(path_or_builtin)
    read_jsonl(path)  # raises DataError for a missing file
    docs: list[tuple[list[int], list[int]]] = []
    sources: list[str] = []
    for lineno, record in _iter_jsonl(path):
        try:
            docs.append(encode_record(record, tokenizer, train_on=train_on))
        except DataError as e:
            raise DataError(f"{path}:{lineno}: {e}") from None
        sources.append(f"{path}:{lineno}")
    return docs, sources


def build_dataset(path_or_builtin: str | os.PathLike, tokenizer: Tokenizer, seq_len: int, *,
                  overlong: str = "truncate", train_on: str = "assistant") -> PackedDataset:
    """A JSONL file (or ``"builtin:tiny"``) -> tokenized, packed ``PackedDataset`` of rows of ``seq_len``."""
    if overlong not in OVERLONG_MODES:
        raise DataError(f"overlong is {overlong!r}; expected one of {', '.join(OVERLONG_MODES)}")
    docs, sources = load_documents(path_or_builtin, tokenizer, train_on=train_on)
    rows = pack_documents(docs, seq_len, pad_id=tokenizer.pad_id, overlong=overlong, sources=sources)
    return PackedDataset(rows)


__all__ = [
    "IGNORE_INDEX", "PAD_DOC_ID", "DataError", "encode_text", "encode_record", "validate_record", "read_jsonl",
    "PackedRow", "pack_documents", "PackedDataset", "BatchIterator", "builtin_corpora", "resolve_data_path",
    "load_documents", "build_dataset",
]
