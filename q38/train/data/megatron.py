"""Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``, as Megatron-LM's ``preprocess_data.py`` and
Megatron-Core's ``IndexedDatasetBuilder`` write them) read in place as a ``data.path`` source: no re-tokenization,
the tokens memory-mapped, rows cut and documents numbered by the same code as q38's prepared shards
(``q38.train.data.shards.MappedRows``).

Everything is checked before a token is read, in bounded memory: the index header and sizes, the sequences' layout
in the ``.bin``, the document indices, then the token ids against the tokenizer and model vocabulary (that scan is
split over the ranks). The index format and the checks: docs/data.md#megatron-indexed-corpora-read-as-they-are.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from q38.errors import DataError
from q38.train.data.shards import MappedRows
from q38.train.data.tokenizer import Tokenizer

HEADER = b"MMIDIDX\x00\x00"
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
CHUNK = 1 << 22  # index entries / tokens per bounded read


def megatron_prefix(path: Any) -> str | None:
    """``PREFIX`` if ``path`` names a Megatron corpus: ``PREFIX.bin`` / ``PREFIX.idx`` itself, or a prefix next to
    which ``PREFIX.idx`` or ``PREFIX.bin`` exists; else None."""
    p = os.fspath(path)
    if p.startswith("builtin:"):
        return None
    if p.endswith((".bin", ".idx")):
        return p[:-4]
    if Path(p).exists():
        return None
    return p if Path(p + ".idx").exists() or Path(p + ".bin").exists() else None  # a FIFO too: named


def _fail(msg: str) -> None:
    raise DataError(f"data: {msg}")


def _check_regular(f: Path, prefix: str, fix: str) -> None:
    """``f`` (a corpus file; a symlink is followed) exists and is a regular file: a FIFO, device, socket or
    directory is named as what it is, never opened."""
    import stat

    from q38.files import file_kind

    try:
        st = os.stat(f)
    except FileNotFoundError:
        _fail(f"Megatron corpus {prefix}: {f} not found (a Megatron corpus is PREFIX.bin, the tokens, and "
              f"PREFIX.idx, the index; both must exist); {fix}")
    except OSError as e:
        _fail(f"Megatron corpus {prefix}: {f} cannot be read ({e.strerror or e}); {fix}")
    if not stat.S_ISREG(st.st_mode):
        _fail(f"Megatron corpus {prefix}: {f} is {file_kind(st.st_mode)}, not a regular file (a Megatron corpus is "
              f"two files, PREFIX.bin and PREFIX.idx); {fix}")


def _chunks(n: int, size: int | None = None):
    size = size or CHUNK
    for a in range(0, n, size):
        yield a, min(n, a + size)


class MegatronIndex:
    """A validated ``PREFIX.idx`` / ``PREFIX.bin`` pair: ``dtype``, ``num_sequences``, ``num_documents``,
    ``num_tokens`` and the memory-mapped ``lengths``, ``pointers`` and ``doc_index`` arrays."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.idx, self.bin = Path(prefix + ".idx"), Path(prefix + ".bin")
        fix = "rebuild it with Megatron's preprocess_data.py, or point data.path at another PREFIX"
        for f in (self.idx, self.bin):
            _check_regular(f, prefix, fix)
        size = self.idx.stat().st_size
        from q38.files import open_regular

        with open_regular(self.idx, f"data: {self.idx}", follow=True) as fh:  # never blocks on a FIFO
            head = fh.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:9] != HEADER:
            _fail(f"{self.idx} is not a Megatron index (it does not start with the MMIDIDX header); {fix}")
        version, code, seqs, docs = struct.unpack("<QBQQ", head[9:])
        if version != 1:
            _fail(f"{self.idx} is Megatron index version {version}; q38 reads version 1; {fix}")
        if code not in DTYPES:
            _fail(f"{self.idx} has token dtype code {code}, not one of Megatron's "
                  f"({', '.join(f'{k} {np.dtype(v).name}' for k, v in DTYPES.items())}); the index is corrupt; {fix}")
        self.dtype = np.dtype(DTYPES[code])
        if self.dtype.kind == "f":
            _fail(f"{self.idx} stores {self.dtype.name} values, not token ids (q38 trains on token corpora: uint8, "
                  f"int8, int16, uint16, int32 or int64); {fix}")
        body = seqs * (4 + 8) + docs * 8
        if size not in (HEADER_BYTES + body, HEADER_BYTES + body + seqs):
            _fail(f"{self.idx} has {size} bytes but its header ({seqs} sequences, {docs} document indices) needs "
                  f"{HEADER_BYTES + body} (or {HEADER_BYTES + body + seqs} with sequence modes); the index is "
                  f"truncated or corrupt; {fix}")
        if docs < 1:
            _fail(f"{self.idx} has no document index (it needs at least the leading 0); the index is corrupt; {fix}")
        self.num_sequences, self.num_doc_index = int(seqs), int(docs)
        self._offsets = {"lengths": HEADER_BYTES, "pointers": HEADER_BYTES + 4 * seqs,
                         "doc_index": HEADER_BYTES + 12 * seqs}
        mm = np.memmap(self.idx, dtype=np.uint8, mode="r")
        # memory maps for the binary searches of row reads (they touch a few pages each)
        self.lengths = np.frombuffer(mm, np.int32, seqs, self._offsets["lengths"]) if seqs else np.zeros(0, np.int32)
        self.pointers = np.frombuffer(mm, np.int64, seqs, self._offsets["pointers"]) if seqs else np.zeros(0, np.int64)
        self.doc_index = np.frombuffer(mm, np.int64, docs, self._offsets["doc_index"])
        self._check(fix)

    def _read(self, name: str, dtype: Any, a: int, b: int) -> np.ndarray:
        """Entries ``[a, b)`` of an index array, read from the file (not the memory map: checking a large index
        leaves no pages of it resident)."""
        dt = np.dtype(dtype)
        return np.fromfile(self.idx, dtype=dt, count=b - a, offset=self._offsets[name] + a * dt.itemsize)

    def _check(self, fix: str) -> None:
        """The sequences lie back to back in the .bin, which ends with the last; the document indices ascend from 0
        to at most the sequence count. Walked in chunks of the memory-mapped index (bounded memory)."""
        isz = self.dtype.itemsize
        bin_bytes = self.bin.stat().st_size
        expect = 0  # where the next sequence must start
        for a, b in _chunks(self.num_sequences):
            lengths = self._read("lengths", np.int32, a, b).astype(np.int64)
            ptr = self._read("pointers", np.int64, a, b)
            if (lengths < 0).any():
                k = a + int(np.argmax(lengths < 0))
                _fail(f"{self.idx}: sequence {k} has negative length {int(lengths[k - a])}; the index is corrupt; "
                      f"{fix}")
            ends = ptr + lengths * isz
            starts = np.concatenate([[expect], ends[:-1]])
            if (ptr != starts).any() or (ends > bin_bytes).any():
                bad_start = ptr != starts
                past = ends > bin_bytes
                k = int(np.argmax(bad_start | past))
                if past[k]:
                    _fail(f"{self.idx}: sequence {a + k} ends at byte {int(ends[k])}, past the end of {self.bin} "
                          f"({bin_bytes} bytes): the .bin is truncated, or the index is corrupt or belongs to another "
                          f".bin; {fix}")
                _fail(f"{self.idx}: sequence {a + k} starts at byte {int(ptr[k])} but the sequences before it end at "
                      f"byte {int(starts[k])}; q38 reads corpora whose sequences lie back to back from byte 0 of the "
                      f".bin, as Megatron writes them; the index is corrupt or was edited; {fix}")
            expect = int(ends[-1])
        if expect != bin_bytes:
            _fail(f"{self.bin} has {bin_bytes} bytes but {self.idx} describes {expect} ({expect // isz} "
                  f"{self.dtype.name} tokens); the .bin does not belong to this index; {fix}")
        self.num_tokens = expect // isz
        prev = 0
        for a, b in _chunks(self.num_doc_index):
            d = self._read("doc_index", np.int64, a, b)
            if a == 0 and d[0] != 0:
                _fail(f"{self.idx}: the document indices start at {int(d[0])}, not 0; the index is corrupt; {fix}")
            steps = np.diff(np.concatenate([[prev], d]))
            if (steps < 0).any() or (d > self.num_sequences).any():
                k = int(np.argmax((steps < 0) | (d > self.num_sequences)))
                _fail(f"{self.idx}: document index {a + k} is {int(d[k])} (the indices must ascend and stay within "
                      f"the {self.num_sequences} sequences); the index is corrupt; {fix}")
            prev = int(d[-1])
        self.num_documents = self.num_doc_index - 1 + (prev < self.num_sequences)

    def max_token(self, part: int = 0, parts: int = 1) -> tuple[int, int, int]:
        """(smallest id, largest id, position of the largest) over part ``part`` of ``parts`` equal runs of the .bin's
        chunks (the whole .bin by default), read in fixed-size chunks."""
        lo, hi, at = 0, -1, -1
        spans = list(_chunks(self.num_tokens))[part::parts]
        with open(self.bin, "rb") as fh:
            buf = np.empty(min(CHUNK, self.num_tokens), dtype=self.dtype)
            for a, b in spans:
                part_ = buf[:b - a]
                fh.seek(a * self.dtype.itemsize)
                fh.readinto(memoryview(part_).cast("B"))
                m = int(part_.max())
                lo = min(lo, int(part_.min()))
                if m > hi or (m == hi and a + int(np.argmax(part_)) < at):
                    hi, at = m, a + int(np.argmax(part_))
        return lo, hi, at

    def max_token_all_ranks(self) -> tuple[int, int, int]:
        """``max_token`` with the scan split over the ranks of the default process group (each rank reads one
        ``1/world`` of the .bin, then one ``all_gather_object``), so opening a terabyte corpus on many ranks costs
        each rank its share; every rank gets the same answer (the first position of the largest id)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.max_token()
        world = dist.get_world_size()
        mine = self.max_token(dist.get_rank(), world)
        got: list = [None] * world
        dist.all_gather_object(got, mine)
        hi = max(h for _, h, _ in got)
        at = min(a for _, h, a in got if h == hi)
        return min(lo for lo, _, _ in got), hi, at


class MegatronRows(MappedRows):
    """The rows of one Megatron corpus: its tokens memory-mapped as one flat array, rows of ``seq_len`` cut from it
    and its documents numbered by ``MappedRows`` as a prepared shard's are (every token is a target). Opening
    validates the index against the ``.bin`` (``MegatronIndex``) and, with a ``vocab_size``, every token id."""

    def __init__(self, prefix: str, seq_len: int, *, tokenizer: Tokenizer | None = None,
                 vocab_size: int | None = None) -> None:
        self.index = ix = MegatronIndex(prefix)
        self.name = prefix
        self.seq_len = int(seq_len)
        limit = min(v for v in (vocab_size, tokenizer.vocab_size if tokenizer is not None else None, 1 << 62)
                    if v is not None)
        if ix.num_tokens and (ix.dtype.kind == "i" or np.iinfo(ix.dtype).max >= limit) and limit < 1 << 62:
            lo, hi, at = ix.max_token_all_ranks()
            if lo < 0:
                _fail(f"{ix.bin} holds a negative token id ({lo}); the corpus is corrupt; rebuild it with Megatron's "
                      f"preprocess_data.py")
            if hi >= limit:
                whose = ("the tokenizer's" if tokenizer is not None and limit == tokenizer.vocab_size
                         else "the model's")
                _fail(f"{ix.bin} holds token id {hi} >= {whose} vocab_size {limit} (at token {at}); the corpus was "
                      f"made with another tokenizer: set data.tokenizer to the one it was made with (and a model "
                      f"whose vocab_size covers it)")
        rows = ix.num_tokens // self.seq_len
        self.shards = [{"name": prefix, "tokens": ix.num_tokens, "rows": rows, "mm": None}]
        self.cum_rows = np.array([0, rows], dtype=np.int64)
        self.num_targets = ix.num_tokens
        if rows == 0:
            _fail(f"Megatron corpus {prefix} has {ix.num_tokens} tokens, fewer than one row of seq_len "
                  f"{self.seq_len}; lower data.seq_len or add data")

    def _maps(self, s: dict[str, Any]) -> tuple[np.ndarray, Any, None]:
        if s["mm"] is None:
            s["mm"] = np.memmap(self.index.bin, dtype=self.index.dtype, mode="r", shape=(self.index.num_tokens,))
        return s["mm"], None, None

    def _doc_of(self, s: dict[str, Any], docs: Any, pos: np.ndarray) -> np.ndarray:
        """Token position -> sequence (by byte offset) -> document: two binary searches in the memory-mapped index,
        so no per-document array is ever built."""
        ix = self.index
        seq = np.searchsorted(ix.pointers, pos * ix.dtype.itemsize, side="right") - 1
        return np.searchsorted(ix.doc_index, seq, side="right") - 1

    def _doc_starts(self, s: dict[str, Any], docs: Any) -> np.ndarray:
        ix = self.index
        d = np.asarray(ix.doc_index, dtype=np.int64)
        if d[-1] < ix.num_sequences:  # sequences after the last document index: one more document
            d = np.append(d, ix.num_sequences)
        ptr = np.append(np.asarray(ix.pointers), ix.num_tokens * ix.dtype.itemsize)
        return ptr[d] // ix.dtype.itemsize


__all__ = ["HEADER", "DTYPES", "megatron_prefix", "MegatronIndex", "MegatronRows"]
