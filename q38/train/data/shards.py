"""Pre-tokenized, memory-mapped token shards (written by ``q38 prepare-data``), weighted mixtures of them, and the
held-out evaluation split.

A prepared directory is a ``manifest.json`` (written last) and per shard ``NAME.tokens``, ``NAME.docs`` and an
optional ``NAME.mask``, all readable with ``numpy.memmap``. Rows of ``seq_len`` are cut on the fly, so opening a
directory reads only its manifest and a row read touches only its own pages; the sample order is a pure function
of ``(seed, consumed samples)`` (exact resume, any data-parallel size). The file format and the order:
docs/data.md#prepared-shards-on-disk.
"""

from __future__ import annotations

import abc
import hashlib
import math
import os
import re
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from q38.train.data.loader import IGNORE_INDEX, PAD_DOC_ID, DataError, PackedDataset
from q38.train.data.tokenizer import Tokenizer

FORMAT = "q38-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
MIX_BLOCK = 16384  # samples per mixture block: weights are realised exactly in every block, to 1 / MIX_BLOCK
EVAL_KEY = 0x5EED_E7A1  # fixed key of the eval-row order (independent of run.seed: the same split every run)
ID_CHUNK = 1 << 22  # tokens per bounded read when a shard's token ids are checked at open


# ---- identities and helpers -----------------------------------------------------------------------------------------


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_identity(tok: Tokenizer) -> dict[str, Any]:
    """What must match between a prepared directory and the run: the kind, the vocabulary file's hash, the size."""
    from q38.train.data.tokenizer import ByteTokenizer, HFTokenizer

    if isinstance(tok, ByteTokenizer):
        return {"kind": "byte", "sha256": None, "vocab_size": tok.vocab_size, "name": "byte"}
    if isinstance(tok, HFTokenizer):
        file = tok.path / "tokenizer.json" if tok.path.is_dir() else tok.path
        return {"kind": "hf", "sha256": sha256_file(file), "vocab_size": tok.vocab_size, "name": str(tok.path)}
    return {"kind": type(tok).__name__, "sha256": None, "vocab_size": tok.vocab_size, "name": repr(tok)}


def same_tokenizer(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("kind", "sha256", "vocab_size"))


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def shard_files(name: str) -> dict[str, str]:
    return {"tokens": f"{name}.tokens", "docs": f"{name}.docs", "mask": f"{name}.mask"}


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hash_keys(*parts: int | np.ndarray) -> np.ndarray:
    """64-bit keys from integers or integer arrays (seed, source, epoch, ...), elementwise."""
    h = np.array([0x9E3779B97F4A7C15], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for p in parts:
            if isinstance(p, (int, np.integer)):
                u = np.uint64(int(p) & 0xFFFFFFFFFFFFFFFF)
            else:
                p = np.asarray(p)
                u = p if p.dtype == np.uint64 else p.astype(np.int64).view(np.uint64)
            h = _mix64(h ^ u)
    return h


def hash_key(*parts: int) -> int:
    return int(hash_keys(*parts).reshape(-1)[0])


def feistel_permute(idx: np.ndarray, n: int, key: int | np.ndarray, rounds: int = 4) -> np.ndarray:
    """A seeded bijection of ``range(n)`` applied to ``idx`` (int64 array), in O(len(idx)) time and memory.
    ``key``: one key, or one per element of ``idx`` (a different bijection for each key)."""
    idx = np.asarray(idx, dtype=np.int64)
    if n <= 1:
        return idx.copy()
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    sh = np.uint64(half)
    key = np.broadcast_to(hash_keys(key), idx.shape)
    keys = np.stack([hash_keys(key, r) for r in range(rounds)]) if idx.size else np.zeros((rounds, 0), np.uint64)

    def enc(x: np.ndarray, ks: np.ndarray) -> np.ndarray:
        left, right = x >> sh, x & mask
        with np.errstate(over="ignore"):
            for k in ks:
                left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << sh) | right

    x = enc(idx.astype(np.uint64), keys)
    out = x >= np.uint64(n)
    while out.any():  # cycle walking: the domain 2**(2*half) < 4n, so a few rounds at most on average
        x[out] = enc(x[out], keys[:, out])
        out = x >= np.uint64(n)
    return x.astype(np.int64)


# ---- row sources ----------------------------------------------------------------------------------------------------


class RowSource(abc.ABC):
    """Rows ``[start, stop)`` of something that yields packed rows: ``rows(indices)`` -> int64 ``{input_ids,
    labels, doc_ids}: [len(indices), seq_len]`` (indices relative to ``start``). Abstract: ``PackedRows``
    (tokenized JSONL), ``ShardRows`` (prepared shards) and slices of them implement it."""

    name: str
    seq_len: int

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def rows(self, idx: np.ndarray) -> dict[str, torch.Tensor]: ...

    def split(self, eval_fraction: float) -> tuple["RowSource", "RowSource"]:
        """(train, eval): the eval part is the last ``ceil(fraction * rows)`` rows."""
        n = len(self)
        n_eval = math.ceil(eval_fraction * n)
        if n_eval >= n:
            raise DataError(f"data: {self.name} has {n} rows of seq_len {self.seq_len}; eval_split {eval_fraction} "
                            f"leaves none for training; lower data.eval_split or add data")
        return _Slice(self, 0, n - n_eval), _Slice(self, n - n_eval, n)


class _Slice(RowSource):
    def __init__(self, base: RowSource, start: int, stop: int) -> None:
        self.base, self.start, self.stop = base, start, stop
        self.name, self.seq_len = base.name, base.seq_len

    def __len__(self) -> int:
        return self.stop - self.start

    def rows(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        return self.base.rows(np.asarray(idx, dtype=np.int64) + self.start)


class PackedRows(RowSource):
    """The rows of an in-memory ``PackedDataset`` (JSONL tokenized on the fly)."""

    def __init__(self, dataset: PackedDataset, name: str) -> None:
        self.dataset, self.name, self.seq_len = dataset, name, dataset.seq_len

    def __len__(self) -> int:
        return len(self.dataset)

    def rows(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        return self.dataset[torch.as_tensor(np.asarray(idx, dtype=np.int64))]


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    d = Path(path)
    m = d / MANIFEST
    if not m.is_file():
        raise DataError(f"data: {d} has no {MANIFEST} (not prepared, or its preparation was interrupted); run "
                        f"`q38 prepare-data INPUT... --out {d}`")
    from q38.files import CheckpointMismatch, load_json

    try:
        manifest = load_json(m, f"data: {m}")  # bounded, never through a symlink or from a FIFO
    except CheckpointMismatch as e:
        raise DataError(f"{e}; re-run `q38 prepare-data INPUT... --out {d}`".replace(" (a crafted or damaged "
                        "checkpoint; nothing in it was run or followed); load only checkpoints written by q38 or "
                        "torch.distributed.checkpoint", "")) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise DataError(f"data: {m} is not a {FORMAT} v{VERSION} manifest; re-run `q38 prepare-data INPUT... "
                        f"--out {d}`")
    _check_manifest_fields(m, manifest, f"re-run `q38 prepare-data INPUT... --out {d}`")
    return manifest


_SHARD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")  # a file-name stem: no '/', no '..' prefix


def _check_manifest_fields(m: Path, man: Mapping[str, Any], fix: str) -> None:
    """The fields the loader uses have the types and ranges ``prepare-data`` writes: a token dtype of the format,
    each shard a plain file-name stem with non-negative counts, and the totals the sum of the shards'."""
    def bad(what: str) -> DataError:
        return DataError(f"data: {m}: {what}; the manifest is corrupt or was edited; {fix}")

    if man.get("token_dtype") not in ("uint8", "uint16", "uint32", "int32", "int64"):
        raise bad(f"token_dtype {str(man.get('token_dtype'))[:20]!r} is not one prepare-data writes")
    shards = man.get("shards")
    if not isinstance(shards, list):
        raise bad("no list of shards")
    total = 0
    for i, s in enumerate(shards):
        if not isinstance(s, dict) or not isinstance(s.get("name"), str) or not _SHARD_NAME.match(s["name"]):
            got = str(s.get("name") if isinstance(s, dict) else s)[:60]
            raise bad(f"shard {i} has no plain file name (got {got!r})")
        for k in ("tokens", "docs", "max_token_id"):
            if type(s.get(k)) is not int or s[k] < (-1 if k == "max_token_id" else 0):
                raise bad(f"shard {s['name']}: {k} {str(s.get(k))[:20]!r} is not a count")
        if type(s.get("mask")) is not bool:
            raise bad(f"shard {s['name']}: mask is not true/false")
        total += s["tokens"]
    if "num_tokens" in man and man["num_tokens"] != total:
        raise bad(f"num_tokens {str(man['num_tokens'])[:20]} is not the sum of its shards' tokens ({total})")
    if type(man.get("num_targets")) is not int or not 0 <= man["num_targets"] <= total:
        raise bad(f"num_targets {str(man.get('num_targets'))[:20]} is not between 0 and its {total} tokens")


def verify_shard_files(path: Path, man: Mapping[str, Any]) -> None:
    """Every shard file the manifest lists exists with the size its counts imply (no token is read)."""
    fix = f"re-run `q38 prepare-data INPUT... --out {path}`"
    itemsize = np.dtype(man["token_dtype"]).itemsize
    for s in man["shards"]:
        files = shard_files(s["name"])
        want = {"tokens": s["tokens"] * itemsize, "docs": (s["docs"] + 1) * 8}
        if s["mask"]:
            want["mask"] = s["tokens"]
        for kind, size in want.items():
            f = path / files[kind]
            if not f.exists() and not f.is_symlink():
                raise DataError(f"data: shard file {f} listed in {path / MANIFEST} is missing; {fix}")
            from q38.errors import ConfigError
            from q38.files import inside

            try:  # a regular file of the directory: not a link out, a FIFO or a device
                inside(path, files[kind], f"data: shard file listed in {path / MANIFEST}")
            except ConfigError as e:
                raise DataError(str(e).split(" (a crafted")[0] + f"; {fix}") from None
            got = f.stat().st_size
            if got != size:
                raise DataError(f"data: shard file {f} has {got} bytes but {path / MANIFEST} says {size} "
                                f"({s['tokens']} tokens, {s['docs']} documents); the shard is truncated or "
                                f"corrupt; {fix}")


class MappedRows(RowSource):
    """Rows cut from memory-mapped token files: the one packer of every on-disk source. Row ``k`` of a file is its
    tokens ``[k*seq_len, (k+1)*seq_len)``; each row's pieces of documents are numbered ``0, 1, ...`` in ``doc_ids``.

    A subclass (``ShardRows``: prepared shards; ``q38.train.data.megatron.MegatronRows``: Megatron indexed corpora) sets
    ``name``, ``seq_len``, ``shards`` (one dict per file, with at least ``"rows"``) and ``cum_rows`` (``cumsum([0] +
    rows)``) and implements ``_maps(s)`` -> ``(tokens, docs, mask)``: the file's token memory map, its document
    index (whatever ``_doc_of`` / ``_doc_starts`` read; by default the sorted ``int64`` document start offsets ending
    with the token count) and its ``uint8`` target mask (None: every token is a target)."""

    shards: list[dict[str, Any]]
    cum_rows: np.ndarray

    def __len__(self) -> int:
        return int(self.cum_rows[-1])

    @abc.abstractmethod
    def _maps(self, s: dict[str, Any]) -> tuple[np.ndarray, Any, np.ndarray | None]: ...

    def _doc_of(self, s: dict[str, Any], docs: Any, pos: np.ndarray) -> np.ndarray:
        """The document number of each token position ``pos`` of file ``s`` (any monotone numbering)."""
        return np.searchsorted(docs, pos, side="right") - 1

    def _doc_starts(self, s: dict[str, Any], docs: Any) -> np.ndarray:
        """Every document's start offset and the token count (tests and tools: reads the whole index)."""
        return np.asarray(docs)

    def rows(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        idx = np.asarray(idx, dtype=np.int64)
        L = self.seq_len
        ids = np.empty((len(idx), L), dtype=np.int64)
        labels = np.empty((len(idx), L), dtype=np.int64)
        doc_ids = np.empty((len(idx), L), dtype=np.int64)
        shard_of = np.searchsorted(self.cum_rows, idx, side="right") - 1
        for r, (g, si) in enumerate(zip(idx, shard_of)):
            if not 0 <= g < len(self):
                raise IndexError(f"row {g} out of range for {self.name} ({len(self)} rows)")
            s = self.shards[si]
            tok, docs, mask = self._maps(s)
            a = int(g - self.cum_rows[si]) * L
            ids[r] = tok[a:a + L]
            labels[r] = ids[r] if mask is None else np.where(mask[a:a + L] != 0, ids[r], IGNORE_INDEX)
            d = self._doc_of(s, docs, np.arange(a, a + L))
            doc_ids[r] = d - d[0]
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "doc_ids": torch.from_numpy(doc_ids)}

    def documents(self) -> list[tuple[list[int], list[int]]]:
        """Every document's ``(input_ids, labels)`` (tests and tools; reads the whole directory)."""
        out = []
        for s in self.shards:
            tok, docs, mask = self._maps(s)
            docs = self._doc_starts(s, docs)
            for i in range(len(docs) - 1):
                a, b = int(docs[i]), int(docs[i + 1])
                ids = tok[a:b].astype(np.int64)
                lab = ids if mask is None else np.where(mask[a:b] != 0, ids, IGNORE_INDEX)
                out.append((ids.tolist(), lab.tolist()))
        return out


class ShardRows(MappedRows):
    """The rows of a prepared directory, read from memory-mapped shards. Opening checks every shard file's size
    against the manifest (no token is read) and ``train_on`` against the one the directory was prepared with; the
    first read of a shard checks all of its token ids against ``vocab_size`` (one pass over its memory map), so a
    shard whose data disagrees with its manifest is refused before any of its rows reaches the model."""

    def __init__(self, path: str | os.PathLike, seq_len: int, *, tokenizer: Tokenizer | None = None,
                 vocab_size: int | None = None, train_on: str | None = None) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        self.seq_len = int(seq_len)
        self.vocab_size = vocab_size
        man = self.manifest = read_manifest(self.path)
        fix = f"re-run `q38 prepare-data INPUT... --out {self.path}`"
        if tokenizer is not None:
            mine = tokenizer_identity(tokenizer)
            theirs = man.get("tokenizer") or {}
            if not same_tokenizer(mine, theirs):
                raise DataError(
                    f"data: {self.path / MANIFEST} was prepared with tokenizer {theirs.get('name')!r} (vocab "
                    f"{theirs.get('vocab_size')}) but the run uses {mine['name']!r} (vocab {mine['vocab_size']}); set "
                    f"data.tokenizer to the one it was prepared with, or {fix} --tokenizer {mine['name']}"
                )
        prepared_on = man.get("train_on", "assistant")  # manifests before --train-on: always assistant
        if train_on is not None and train_on != prepared_on:
            raise DataError(f"data: {self.path} was prepared with --train-on {prepared_on} but data.train_on is "
                            f"{train_on}; set data.train_on: {prepared_on}, or {fix} --train-on {train_on}")
        self.dtype = np.dtype(man["token_dtype"])
        max_id = max((s["max_token_id"] for s in man["shards"]), default=-1)
        if vocab_size is not None and max_id >= vocab_size:
            bad = next(s for s in man["shards"] if s["max_token_id"] >= vocab_size)
            raise DataError(
                f"data: {self.path / (bad['name'] + '.tokens')} holds token id {bad['max_token_id']} >= the model's "
                f"vocab_size {vocab_size}; use a model whose vocabulary covers the tokenizer, or {fix} with the "
                f"model's tokenizer"
            )
        verify_shard_files(self.path, man)
        self.shards: list[dict[str, Any]] = [
            {"name": s["name"], "tokens": s["tokens"], "mask": s["mask"], "files": shard_files(s["name"]),
             "rows": s["tokens"] // self.seq_len, "mm": None} for s in man["shards"]]
        self.num_targets = int(man["num_targets"])
        if self.num_targets == 0:
            raise DataError(f"data: {self.path} has no trainable tokens (every token is masked under --train-on "
                            f"{prepared_on}: chat records without assistant turns?); add text records or assistant "
                            f"replies, or {fix} --train-on all")
        self.cum_rows = np.cumsum([0] + [s["rows"] for s in self.shards])
        if self.cum_rows[-1] == 0:
            raise DataError(f"data: {self.path} has {man['num_tokens']} tokens, fewer than one row of seq_len "
                            f"{self.seq_len} per shard; lower data.seq_len or add data")

    def _maps(self, s: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if s["mm"] is None:
            tok = np.memmap(self.path / s["files"]["tokens"], dtype=self.dtype, mode="r")
            docs = np.memmap(self.path / s["files"]["docs"], dtype=np.int64, mode="r")
            mask = np.memmap(self.path / s["files"]["mask"], dtype=np.uint8, mode="r") if s["mask"] else None
            self._check_docs(s, docs)
            if self.vocab_size is not None:
                self._check_ids(s, tok)
            s["mm"] = (tok, docs, mask)
        return s["mm"]

    def _check_docs(self, s: dict[str, Any], docs: np.ndarray) -> None:
        """The document offsets of shard ``s`` start at 0, never decrease and end at its token count (an offset past
        the tokens would split rows into documents that do not exist); else one line naming the file and entry."""
        n = s["tokens"]
        if len(docs) and docs[0] == 0 and docs[-1] == n and (len(docs) < 2 or bool(np.all(np.diff(docs) >= 0))):
            return
        f = self.path / s["files"]["docs"]
        out = (docs > n) | (docs < 0)
        if not len(docs) or docs[0] != 0:
            what = f"its first offset is {int(docs[0]) if len(docs) else 'missing'}, not 0"
        elif bool(out.any()) or docs[-1] != n:
            at = int(np.argmax(out)) if bool(out.any()) else len(docs) - 1
            what = f"offset {at} is {int(docs[at])}, the shard has {n} tokens"
        else:
            at = int(np.argmax(np.diff(docs) < 0)) + 1
            what = f"offset {at} ({int(docs[at])}) is below the one before it ({int(docs[at - 1])})"
        raise DataError(f"data: {f}: {what}; the shard does not match {self.path / MANIFEST}; re-run "
                        f"`q38 prepare-data INPUT... --out {self.path}`")

    def _check_ids(self, s: dict[str, Any], tok: np.ndarray) -> None:
        """Every token id of shard ``s`` is below ``vocab_size``; else one line naming the file, row and token. One
        pass over the file in reads of ``ID_CHUNK`` tokens into one buffer: a max over the memory map would page the
        whole shard into this process's resident set (its peak RSS would grow with the corpus)."""
        n = len(tok)
        if not n or int(np.iinfo(self.dtype).max) < self.vocab_size:
            return  # empty, or the dtype cannot hold an id that large
        f = self.path / s["files"]["tokens"]
        buf = np.empty(min(n, ID_CHUNK), dtype=self.dtype)
        with open(f, "rb") as fh:
            for a in range(0, n, ID_CHUNK):
                part = buf[:min(n, a + ID_CHUNK) - a]
                fh.readinto(memoryview(part).cast("B"))  # the map's length is the file's: the read is whole
                if int(part.max()) < self.vocab_size:
                    continue
                at = a + int(np.argmax(part >= self.vocab_size))
                raise DataError(
                    f"data: {f} holds token id {int(part[at - a])} >= the model's vocab_size {self.vocab_size} at "
                    f"token {at} (row {at // self.seq_len} of the shard at seq_len {self.seq_len}); the shard does "
                    f"not match {self.path / MANIFEST}; re-run `q38 prepare-data INPUT... --out {self.path}`"
                )


# ---- mixtures and the batch iterator ------------------------------------------------------------------------------


def block_counts(weights: Sequence[float | int], block: int = MIX_BLOCK) -> np.ndarray:
    """Integer shares of ``block`` samples per source (largest remainder). Raises for a positive weight too small to
    get a sample."""
    w = np.asarray(weights, dtype=np.float64)
    q = w / w.sum() * block
    c = np.floor(q).astype(np.int64)
    rest = block - int(c.sum())
    order = np.argsort(-(q - c), kind="stable")
    c[order[:rest]] += 1
    return c


class MixtureIterator:
    """Deterministic batches from weighted row sources: this rank's rows of each global batch.

    Same interface as ``data.BatchIterator`` (``batch(step)``, ``global_batch(step)``, ``step``, ``next``,
    ``state_dict`` / ``load_state_dict``); the state is ``{"consumed_samples"}``: ``next`` reads global samples
    ``[consumed, consumed + global_batch_size)``, so a resumed run with another global batch size continues the
    same sample stream.
    """

    def __init__(self, sources: Sequence[RowSource], weights: Sequence[float | int], batch_size: int, *,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, shuffle: bool = True) -> None:
        if not sources or len(sources) != len(weights):
            raise DataError("data: a mixture needs one weight per source")
        self.sources = list(sources)
        self.weights = [float(w) for w in weights]
        self.counts = block_counts(self.weights)
        for s, w, c in zip(self.sources, self.weights, self.counts):
            if w > 0 and c == 0:
                raise DataError(f"data: weight {w} of {s.name} is below 1/{MIX_BLOCK} of the total, too small to be "
                                f"sampled; raise it or drop the source")
        self.batch_size, self.dp_rank, self.dp_size = batch_size, dp_rank, dp_size
        self.global_batch_size = batch_size * dp_size
        self.seed, self.shuffle = int(seed), shuffle
        self.consumed_samples = 0
        self._block: tuple[int, np.ndarray, np.ndarray] | None = None

    def _block_plan(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, occurrence-within-block) of each sample slot of block ``b``."""
        if self._block is None or self._block[0] != b:
            slots = np.repeat(np.arange(len(self.sources)), self.counts)
            if len(self.sources) > 1:
                slots = slots[feistel_permute(np.arange(MIX_BLOCK), MIX_BLOCK, hash_key(self.seed, 0xB10C, b))]
            occ = np.empty(MIX_BLOCK, dtype=np.int64)
            for i in range(len(self.sources)):
                where = np.flatnonzero(slots == i)
                occ[where] = np.arange(len(where))
            self._block = (b, slots, occ)
        return self._block[1], self._block[2]

    def sample_sources(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, row within that source) of global samples ``g``."""
        g = np.asarray(g, dtype=np.int64)
        blocks, pos = np.divmod(g, MIX_BLOCK)
        src = np.empty_like(g)
        m = np.empty_like(g)  # how many samples each one's source gave before it
        for b in np.unique(blocks):
            sel = blocks == b
            slots, occ = self._block_plan(int(b))
            src[sel] = slots[pos[sel]]
            m[sel] = int(b) * self.counts[src[sel]] + occ[pos[sel]]
        row = np.empty_like(g)
        for i in np.unique(src):
            n = len(self.sources[int(i)])
            sel_i = src == i
            epochs, j = np.divmod(m[sel_i], n)
            if not self.shuffle:
                row[sel_i] = j
                continue
            row[sel_i] = feistel_permute(j, n, hash_keys(self.seed, int(i), epochs))
        return src, row

    def _read(self, g: np.ndarray) -> dict[str, torch.Tensor]:
        src, row = self.sample_sources(g)
        out = {k: torch.empty((len(g), self.sources[0].seq_len), dtype=torch.int64)
               for k in ("input_ids", "labels", "doc_ids")}
        for i in np.unique(src):
            sel = np.flatnonzero(src == i)
            part = self.sources[int(i)].rows(row[sel])
            for k in out:
                out[k][torch.from_numpy(sel)] = part[k]
        return out

    def global_batch(self, step: int) -> dict[str, torch.Tensor]:
        g0 = int(step) * self.global_batch_size
        return self._read(np.arange(g0, g0 + self.global_batch_size))

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        g0 = int(step) * self.global_batch_size + self.dp_rank * self.batch_size
        return self._read(np.arange(g0, g0 + self.batch_size))

    @property
    def step(self) -> int:
        return self.consumed_samples // self.global_batch_size

    def __iter__(self) -> "MixtureIterator":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        g0 = self.consumed_samples + self.dp_rank * self.batch_size  # (a resumed run may have another global batch)
        out = self._read(np.arange(g0, g0 + self.batch_size))
        self.consumed_samples += self.global_batch_size
        return out

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "consumed_samples" not in state:
            raise DataError(f"data iterator state {dict(state)} is not from prepared shards (no consumed_samples); "
                            f"the checkpoint was trained on another kind of data.path; use a new run.out_dir")
        n = int(state["consumed_samples"])
        if n < 0:
            raise DataError(f"data iterator state consumed_samples={n} is negative; the checkpoint is corrupt")
        self.consumed_samples = n


class EvalRows:
    """The held-out rows in a fixed order (all sources' eval rows, shuffled once with a fixed key), cut into
    ``num_batches`` global batches; ``batch(k)`` is this rank's share of eval batch ``k``. Every row is evaluated:
    the last batch is filled up with padding rows (doc id -1, no targets: they add nothing to any term), so an eval
    set smaller than one global batch is one padded batch. ``max_batches`` (> 0) keeps the first batches only."""

    def __init__(self, sources: Sequence[RowSource], batch_size: int, *, dp_rank: int = 0, dp_size: int = 1,
                 max_batches: int = 0) -> None:
        self.sources = list(sources)
        self.batch_size, self.dp_rank, self.dp_size = batch_size, dp_rank, dp_size
        self.global_batch_size = batch_size * dp_size
        self.cum = np.cumsum([0] + [len(s) for s in self.sources])
        total = int(self.cum[-1])
        if total == 0:
            names = ", ".join(s.name for s in self.sources)
            raise DataError(f"data: the eval set ({names}) has no rows; raise data.eval_split, or give "
                            f"data.eval_path a file with records")
        full = -(-total // self.global_batch_size)  # the last batch padded
        self.num_batches = full if max_batches <= 0 else min(full, max_batches)
        self.total = total

    def _read(self, pos: np.ndarray) -> dict[str, torch.Tensor]:
        out = {k: torch.empty((len(pos), self.sources[0].seq_len), dtype=torch.int64)
               for k in ("input_ids", "labels", "doc_ids")}
        real = pos < self.total
        pad = torch.from_numpy(np.flatnonzero(~real))
        out["input_ids"][pad], out["labels"][pad], out["doc_ids"][pad] = 0, IGNORE_INDEX, PAD_DOC_ID
        pos = pos[real]
        flat = feistel_permute(pos, self.total, EVAL_KEY)
        src = np.searchsorted(self.cum, flat, side="right") - 1
        at = np.flatnonzero(real)
        for i in np.unique(src):
            sel = np.flatnonzero(src == i)
            part = self.sources[int(i)].rows(flat[sel] - self.cum[i])
            for k in out:
                out[k][torch.from_numpy(at[sel])] = part[k]
        return out

    def global_batch(self, k: int) -> dict[str, torch.Tensor]:
        g0 = k * self.global_batch_size
        return self._read(np.arange(g0, g0 + self.global_batch_size))

    def batch(self, k: int) -> dict[str, torch.Tensor]:
        g0 = k * self.global_batch_size + self.dp_rank * self.batch_size
        return self._read(np.arange(g0, g0 + self.batch_size))

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's share of every eval batch, in order (what ``evaluate.eval_losses`` walks)."""
        return (self.batch(k) for k in range(self.num_batches))


# ---- data.path -> loaders -------------------------------------------------------------------------------------------


def parse_mixture(path: Any) -> list[tuple[str, float]]:
    """``data.path``: a string (one source, weight 1) or a list of ``{path, weight}`` mappings."""
    if isinstance(path, (str, os.PathLike)):
        return [(os.fspath(path), 1.0)]
    form = "data.path must be a path or a list of {path: DIR, weight: NUMBER} entries"
    if not isinstance(path, (list, tuple)) or not path:
        raise DataError(f"{form}, got {path!r}")
    out = []
    for i, e in enumerate(path):
        if not isinstance(e, Mapping) or set(e) != {"path", "weight"}:
            raise DataError(f"data.path[{i}] is {e!r}; {form}")
        w = e["weight"]
        if isinstance(w, str):
            try:
                w = float(w)
            except ValueError:
                raise DataError(f"data.path[{i}].weight {e['weight']!r} is not a number; {form}") from None
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise DataError(f"data.path[{i}].weight {e['weight']!r} must be a finite number >= 0; {form}")
        out.append((os.fspath(e["path"]), float(w)))
    if sum(w for _, w in out) <= 0:
        raise DataError(f"data.path weights sum to 0; give at least one source a positive weight ({form})")
    return out


def is_prepared(path: str) -> bool:
    return Path(path).is_dir()


__all__ = [
    "FORMAT", "VERSION", "MANIFEST", "MIX_BLOCK", "tokenizer_identity", "token_dtype", "feistel_permute",
    "RowSource", "PackedRows", "MappedRows", "ShardRows", "read_manifest", "block_counts", "MixtureIterator", "EvalRows",
    "parse_mixture", "PAD_DOC_ID",
]
