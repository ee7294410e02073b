"""``q38 prepare-data``: JSONL (and Parquet, with pyarrow) text / chat records -> token shards (format: shards.py).

Inputs are cut into chunks (byte ranges of a JSONL file ending at line ends, or Parquet row groups); each chunk is
tokenized by a worker process with ``q38.train.data.loader.encode_record`` — the function the on-the-fly path uses — and
becomes one shard, written to temporary names and renamed. The old manifest is removed before the first shard is
written and the new one is written (tmp + rename) after the last, so an interrupted run never leaves a directory
that looks prepared. A re-run whose inputs (size + mtime, else sha256), tokenizer and options are unchanged does
nothing.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from q38.train.data.loader import (
    IGNORE_INDEX, MAX_LINE_BYTES, DataError, encode_record, line_too_long, parse_record, resolve_data_path,
    validate_record,
)
from q38.train.data.formats import FORMATS, to_record
from q38.train.data.options import CHUNK_BYTES
from q38.train.data.tokenizer import load_tokenizer
from q38.train.data.shards import FORMAT, MANIFEST, VERSION, sha256_file, shard_files, token_dtype, tokenizer_identity

PARQUET_ROWS = 64  # rows of a Parquet row group decoded at once (each then bounded by --max-line-mb)
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
OWN_PREFIXES = ("shard_", ".shard_", f".{MANIFEST}.tmp-")  # the files this command writes besides the manifest


def _pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading Parquet needs pyarrow (pip install pyarrow); or convert the file to JSONL "
                        "({\"text\": ...} or {\"messages\": [...]} per line)") from None
    return pq


def _kind(f: Path) -> str:
    """The reader of a file: by suffix (JSON Lines when unknown); a ``.json`` file holding one array is "jsonarray"."""
    from q38.train.data.readers import is_json_array

    kind = SUFFIXES.get(f.suffix, "jsonl")
    return "jsonarray" if f.suffix == ".json" and is_json_array(f) else kind


def expand_inputs(inputs: Sequence[str], split: str | None = None) -> list[tuple[Path, str]]:
    """Files (``.jsonl``, ``.json``, ``.parquet``, ``.arrow``, ``.csv``), directories of them (sorted), Hugging Face
    ``save_to_disk`` directories (their Arrow files; ``split`` of a ``DatasetDict``), or ``builtin:NAME``. Every file
    is a regular file (a FIFO or device is refused, never waited on); a file found in a directory lies inside it (a
    symlink only to a file inside the directory: ``q38.files.inside``)."""
    from q38.train.data.readers import hf_dataset_files, is_hf_dataset_dir
    from q38.files import CheckpointMismatch, inside

    out: list[tuple[Path, str]] = []
    hf_dirs = 0
    for spec in inputs:
        p = resolve_data_path(spec)
        try:
            if is_hf_dataset_dir(p):
                out += [(f.resolve(), "arrow") for f in hf_dataset_files(p, split)]
                hf_dirs += 1
            elif p.is_dir():
                names = sorted(f.name for f in p.iterdir() if f.suffix in SUFFIXES and not f.is_dir())
                if not names:
                    raise DataError(f"{p} holds no .jsonl, .json, .parquet, .arrow or .csv files (nor is it a "
                                    f"Hugging Face save_to_disk directory)")
                files = [inside(p, n, f"input {p}", follow=True) for n in names]
                out += [(f.resolve(), _kind(f)) for f in files]
            elif p.exists() or p.is_symlink():
                _regular(p)  # named by the user: a symlink is followed, but to a regular file only
                out.append((p.resolve(), _kind(p)))
            else:
                raise DataError(f"input {spec} not found; expected a JSONL / JSON / Parquet / Arrow / CSV file, a "
                                f"directory of them or a Hugging Face save_to_disk directory")
        except CheckpointMismatch as e:
            raise DataError(str(e)) from None
    if not out:
        raise DataError("no inputs; pass one or more JSONL / Parquet files or directories")
    if split is not None and not hf_dirs:
        raise DataError(f"--split {split} given but no input is a Hugging Face dataset directory; drop --split")
    return out


def _regular(f: Path) -> None:
    """``f`` (a path given on the command line, a symlink followed) is a regular file: a FIFO, device or socket is
    named, never opened."""
    from q38.files import open_regular

    with open_regular(f, "input", follow=True):
        pass


def plan_chunks(files: Sequence[tuple[Path, str]], chunk_bytes: int,
                max_line: int = MAX_LINE_BYTES) -> list[dict[str, Any]]:
    """One chunk per ~chunk_bytes of each JSONL file (cut after a newline) or per Parquet row group. A line over
    ``max_line`` bytes is refused (file and line) before it is parsed: a chunk holds at most
    ``chunk_bytes + max_line`` bytes."""
    chunks = []
    for fi, (f, kind) in enumerate(files):
        if kind == "parquet":
            meta = _pyarrow().ParquetFile(f).metadata
            for g in range(meta.num_row_groups):
                chunks.append({"file": str(f), "source": fi, "kind": kind, "group": g,
                               "bytes": meta.row_group(g).total_byte_size, "max_line": max_line})
            continue
        if kind == "arrow":
            from q38.train.data.readers import arrow_chunks

            chunks += [dict(c, file=str(f), source=fi, kind=kind, max_line=max_line)
                       for c in arrow_chunks(f, chunk_bytes)]
            continue
        if kind in ("csv", "jsonarray"):  # read start to end by one worker
            chunks.append({"file": str(f), "source": fi, "kind": kind, "bytes": f.stat().st_size,
                           "max_line": max_line})
            continue
        size = f.stat().st_size
        start = 0
        with open(f, "rb") as fh:
            while start < size:
                end = min(size, start + chunk_bytes)
                if end < size:
                    fh.seek(end)
                    rest = fh.readline(max_line + 1)
                    if len(rest) > max_line and not rest.endswith(b"\n"):
                        raise line_too_long(f"{f}:{_line_of(str(f), end)}", max_line)
                    end += len(rest)
                chunks.append({"file": str(f), "source": fi, "kind": kind, "start": start, "end": end,
                               "bytes": end - start, "max_line": max_line})
                start = end
    for i, c in enumerate(chunks):
        c["name"] = f"shard_{i:06d}"
    return chunks


def _records(chunk: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` of a chunk; ``where`` names the file and line (JSONL) or row (Parquet)."""
    f = chunk["file"]
    if chunk["kind"] == "parquet":  # decoded PARQUET_ROWS rows at a time, each record bounded before it is converted
        from q38.train.data.readers import bounded_rows

        g, row = chunk["group"], 0
        for batch in _pyarrow().ParquetFile(f).iter_batches(batch_size=PARQUET_ROWS, row_groups=[g]):
            yield from bounded_rows(batch, lambda k, r=row: f"{f}: row group {g} row {r + k}",
                                    chunk.get("max_line", MAX_LINE_BYTES))
            row += batch.num_rows
        return
    if chunk["kind"] in ("arrow", "csv", "jsonarray"):
        from q38.train.data import readers

        read = {"arrow": readers.arrow_records, "csv": readers.csv_records,
                "jsonarray": readers.json_array_records}[chunk["kind"]]
        yield from read(chunk)
        return
    with open(f, "rb") as fh:
        fh.seek(chunk["start"])
        data = fh.read(chunk["end"] - chunk["start"])
    first_line = None
    for k, raw in enumerate(data.split(b"\n")):
        if len(raw) > chunk.get("max_line", MAX_LINE_BYTES):
            raise line_too_long(f"{f}:{_line_of(f, chunk['start']) + k}", chunk.get("max_line", MAX_LINE_BYTES))
        if not raw.strip():
            continue
        try:
            rec = parse_record(raw, "\0")
        except DataError as e:
            first_line = first_line or _line_of(f, chunk["start"])
            raise DataError(str(e).replace("\0", f"{f}:{first_line + k}")) from None
        except UnicodeDecodeError as e:
            first_line = first_line or _line_of(f, chunk["start"])
            raise DataError(f"{f}:{first_line + k}: malformed JSON or UTF-8 ({e}); each line must be one JSON "
                            f"object") from None
        yield (f, chunk["start"], k), rec


def _line_of(path: str, offset: int) -> int:
    """1-based line number of the byte at ``offset`` (only computed for an error message)."""
    n = 1
    with open(path, "rb") as fh:
        left = offset
        while left > 0:
            b = fh.read(min(left, 1 << 22))
            n += b.count(b"\n")
            left -= len(b)
    return n


def _where(w: Any) -> str:
    if isinstance(w, tuple):
        f, start, k = w
        return f"{f}:{_line_of(f, start) + k}"
    return w


_TOK = None


def _init_worker(tokenizer_spec: str) -> None:
    global _TOK
    _TOK = load_tokenizer(tokenizer_spec)


def tokenize_chunk(chunk: dict[str, Any], out_dir: str, dtype: str, train_on: str = "assistant") -> dict[str, Any]:
    """Tokenize one chunk into shard files (tmp + rename); returns the shard's manifest entry."""
    tok = _TOK
    dt = np.dtype(dtype)
    top = np.iinfo(dt).max
    max_id = -1
    ids_parts: list[np.ndarray] = []
    masked: list[tuple[int, np.ndarray]] = []  # (token offset, mask) of the documents with non-target tokens
    lengths: list[int] = []
    n = 0
    fmt = chunk.get("format", "auto")
    for where, rec in _records(chunk):
        try:
            rec = to_record(rec, fmt, "\0")
            validate_record(rec, "\0")
        except DataError as e:
            raise DataError(str(e).replace("\0", _where(where))) from None
        try:
            ids, labels = encode_record(rec, tok, train_on=train_on)
        except DataError as e:
            raise DataError(f"{_where(where)}: {e}") from None
        if not ids:
            continue
        a = np.array(ids, dtype=np.int64)
        if labels != ids:  # list comparison in C: the common all-target case never builds a mask
            lab = np.array(labels, dtype=np.int64)
            m = lab != IGNORE_INDEX
            if not np.array_equal(lab[m], a[m]):
                raise DataError(f"{_where(where)}: the tokenizer produced labels that are not the input ids; shards "
                                f"store a loss mask only")
            masked.append((n, m))
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi > top:
            bad = hi if hi > top else lo
            raise DataError(f"{_where(where)}: token id {bad} does not fit {dt.name} (the tokenizer's vocab_size is "
                            f"{tok.vocab_size}); the tokenizer is inconsistent")
        max_id = max(max_id, hi)
        ids_parts.append(a.astype(dt))  # stored narrow at once: a chunk never holds its tokens as int64
        lengths.append(len(a))
        n += len(a)
    ids_all = np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=dt)
    any_masked = bool(masked)
    targets = n - sum(int((~m).sum()) for _, m in masked)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    arrays = {"tokens": ids_all, "docs": offsets}
    if any_masked:
        mask_all = np.ones(n, dtype=np.uint8)
        for off, m in masked:
            mask_all[off:off + len(m)] = m
        arrays["mask"] = mask_all
    names = shard_files(chunk["name"])
    files = {}
    out = Path(out_dir)
    for kind, arr in arrays.items():
        final = out / names[kind]
        tmp = out / f".{names[kind]}.tmp-{os.getpid()}"
        data = arr.tobytes()
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        files[kind] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return {"name": chunk["name"], "source": chunk["source"], "tokens": int(len(ids_all)), "docs": len(lengths),
            "targets": targets, "max_token_id": max_id, "mask": any_masked, "files": files,
            "input_bytes": chunk["bytes"]}


def _source_entries(files: Sequence[tuple[Path, str]], old: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Size, mtime and sha256 of each input (the hash reused from ``old`` when size and mtime are unchanged)."""
    prev = {s["path"]: s for s in (old or {}).get("sources", [])}
    out = []
    for f, kind in files:
        st = f.stat()
        p = prev.get(str(f))
        if p is not None and p["size"] == st.st_size and p["mtime_ns"] == st.st_mtime_ns:
            digest = p["sha256"]
        else:
            digest = sha256_file(f)
        out.append({"path": str(f), "format": kind, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                    "sha256": digest})
    return out


def _same_content(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    key = lambda s: (s["path"], s["size"], s["sha256"])  # noqa: E731
    return [key(s) for s in a] == [key(s) for s in b]


def is_prepared_output(d: Path) -> bool:
    """``d`` is an earlier output of ``prepare-data``: its manifest says so, or (an interrupted preparation) it holds
    only shard files and temporary files of this command."""
    try:
        if json.loads((d / MANIFEST).read_text()).get("format") == FORMAT:
            return True
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    return all(f.is_file() and f.name.startswith(OWN_PREFIXES) for f in d.iterdir())


def prepare_data(inputs: Sequence[str], out_dir: str | os.PathLike, *, tokenizer: str = "byte",
                 workers: int | None = None, chunk_bytes: int = CHUNK_BYTES, progress: bool = True,
                 train_on: str = "assistant", overwrite: bool = False, record_format: str = "auto",
                 split: str | None = None, log=print, max_line_bytes: int = MAX_LINE_BYTES) -> dict[str, Any]:
    """Prepare (or confirm up to date) ``out_dir`` from ``inputs``; returns the manifest (with ``"skipped": True``
    when nothing had to be done). ``train_on`` picks the targets of chat records (``q38.train.data.chat``);
    ``record_format`` the records' shape (``q38.train.data.formats``: auto, messages, sharegpt, alpaca, text); ``split``
    the split of a Hugging Face ``DatasetDict`` directory.

    ``out_dir`` follows ``dirs.check_output_dir``: new, empty, an earlier output of this command, or (with
    ``overwrite``) another non-empty directory; never a run or checkpoint directory, nor one that is, holds or lies
    inside an input. A preparation that fails removes the directories it made."""
    from q38.train.io.dirs import check_output_dir

    out = Path(out_dir)
    if record_format not in FORMATS:
        raise DataError(f"--format is {record_format!r}; expected one of {', '.join(FORMATS)}")
    files = expand_inputs(inputs, split)
    check_output_dir(out, [resolve_data_path(i) for i in inputs], what="--out", own=is_prepared_output,
                     overwrite=overwrite)
    made = [d for d in (out, *out.parents) if not d.exists()]
    try:
        return _prepare_data(files, out, tokenizer, workers, chunk_bytes, progress, train_on, log, record_format,
                             max_line_bytes)
    except BaseException:
        for d in made:  # innermost first
            _remove_own_files(d)
        raise


def _remove_own_files(d: Path) -> None:
    """The shard and temporary files of a failed preparation in ``d``, then ``d`` itself if that empties it."""
    try:
        for f in d.iterdir():
            if f.is_file() and f.name.startswith(OWN_PREFIXES):
                f.unlink()
        d.rmdir()
    except OSError:
        pass


def _prepare_data(files: Sequence[tuple[Path, str]], out: Path, tokenizer: str, workers: int | None,
                  chunk_bytes: int, progress: bool, train_on: str, log, record_format: str = "auto",
                  max_line_bytes: int = MAX_LINE_BYTES) -> dict[str, Any]:
    tok = load_tokenizer(tokenizer)
    ident = dict(tokenizer_identity(tok), spec=tokenizer)
    dtype = token_dtype(tok.vocab_size)
    old = _read_manifest(out)
    sources = _source_entries(files, old)
    if old is not None and old.get("record_format", "auto") == record_format \
            and _up_to_date(out, old, ident, dtype.name, train_on, sources):
        log(f"q38 prepare-data: {out} is up to date ({old['num_tokens']:,} tokens, {old['num_docs']:,} "
            f"documents); nothing to do")
        return dict(old, skipped=True)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a directory; choose a directory")
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists():
        (out / MANIFEST).unlink()  # from here on the directory does not look prepared until the new manifest lands
    chunks = plan_chunks(files, chunk_bytes, max_line_bytes)
    for c in chunks:
        c["format"] = record_format
    n_workers = max(1, min(workers or os.cpu_count() or 1, len(chunks)))
    t0 = time.perf_counter()
    results = _tokenize_chunks(chunks, out, tokenizer, dtype.name, train_on, n_workers, progress)
    manifest = {
        "format": FORMAT, "version": VERSION, "tokenizer": ident, "token_dtype": dtype.name, "train_on": train_on,
        "record_format": record_format, "sources": sources, "shards": [{k: v for k, v in r.items() if k != "input_bytes"} for r in results],
        "num_tokens": sum(r["tokens"] for r in results), "num_docs": sum(r["docs"] for r in results),
        "num_targets": sum(r["targets"] for r in results),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _check_trainable(manifest, files, train_on)
    manifest["prepare_seconds"], manifest["workers"] = time.perf_counter() - t0, n_workers
    _write_json(out / MANIFEST, manifest)
    keep = {n for r in results for n in shard_files(r["name"]).values()} | {MANIFEST}
    for f in out.iterdir():  # shards of an earlier preparation that this one did not rewrite, stale tmp files
        if f.is_file() and f.name not in keep and (f.name.startswith("shard_") or f.name.startswith(".shard_")):
            f.unlink()
    dt = manifest["prepare_seconds"]
    log(f"q38 prepare-data: wrote {out}: {len(results)} shards, {manifest['num_tokens']:,} tokens "
        f"({dtype.name}), {manifest['num_docs']:,} documents, {manifest['num_targets']:,} targets in {dt:.1f}s "
        f"({manifest['num_tokens'] / max(dt, 1e-9):,.0f} tokens/s, {n_workers} workers)")
    return manifest


def _read_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest of an earlier preparation in ``out`` (None: none, or not readable: the inputs are redone)."""
    if not (out / MANIFEST).is_file():
        return None
    try:
        return json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError):
        return None


def _up_to_date(out: Path, old: dict[str, Any], ident: dict[str, Any], dtype: str, train_on: str,
                sources: list[dict[str, Any]]) -> bool:
    """Whether ``old`` was made from the same input contents with the same tokenizer, token dtype and targets, and
    every shard file it names is there with its size (then only the inputs' mtimes are refreshed)."""
    from q38.train.data.shards import verify_shard_files

    tk = old.get("tokenizer", {})
    same = (old.get("format") == FORMAT and old.get("version") == VERSION and old.get("token_dtype") == dtype
            and all(tk.get(k) == ident[k] for k in ("sha256", "kind", "vocab_size"))
            and old.get("train_on", "assistant") == train_on and _same_content(old.get("sources", []), sources))
    if not same:
        return False
    try:
        verify_shard_files(out, old)
    except DataError:
        return False
    if [s["mtime_ns"] for s in old["sources"]] != [s["mtime_ns"] for s in sources]:
        old["sources"] = sources
        _write_json(out / MANIFEST, old)
    return True


def _tokenize_chunks(chunks: list[dict[str, Any]], out: Path, tokenizer: str, dtype: str, train_on: str,
                     n_workers: int, progress: bool) -> list[dict[str, Any]]:
    """Every chunk tokenized into its shard (in ``n_workers`` processes), with a byte progress bar; the shards'
    records sorted by name."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    bar = tqdm(total=sum(c["bytes"] for c in chunks), unit="B", unit_scale=True, desc="q38 prepare-data",
               disable=None if progress else True, file=sys.stderr, dynamic_ncols=True)
    tokens = 0
    try:
        if n_workers == 1:
            _init_worker(tokenizer)
            it = (tokenize_chunk(c, str(out), dtype, train_on) for c in chunks)
            pool = None
        else:
            ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
            pool = ctx.Pool(n_workers, initializer=_init_worker, initargs=(tokenizer,))
            it = pool.imap_unordered(_star, [(c, str(out), dtype, train_on) for c in chunks])
        try:
            for r in it:
                results.append(r)
                tokens += r["tokens"]
                bar.update(r["input_bytes"])
                bar.set_postfix(tokens=f"{tokens:,}", tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):,.0f}")
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    finally:
        bar.close()
    return sorted(results, key=lambda r: r["name"])


def _check_trainable(manifest: dict[str, Any], files: Sequence[tuple[Path, str]], train_on: str) -> None:
    """Inputs without a record, or without one trainable target under ``train_on``, are refused."""
    if manifest["num_docs"] == 0:
        raise DataError(f"the inputs ({', '.join(str(f) for f, _ in files)}) hold no records; expected "
                        f"{{\"text\": ...}} or {{\"messages\": [...]}} records")
    if manifest["num_targets"] == 0:
        raise DataError(
            f"the inputs ({', '.join(str(f) for f, _ in files)}) hold {manifest['num_docs']:,} documents but no "
            f"trainable target under --train-on {train_on} (chat records without assistant turns?); pass "
            f"--train-on all to train on every token, or add text records or assistant replies"
        )


def _star(args):
    return tokenize_chunk(*args)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
