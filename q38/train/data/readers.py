"""Record readers for ``q38 prepare-data`` inputs beyond JSONL and Parquet: Hugging Face dataset directories
(``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``), Arrow files, CSV files and JSON files holding one array
of records. Every reader streams: Arrow record batches are read from a memory map one at a time, CSV in blocks,
a JSON array one record at a time, so memory does not grow with the file.

A ``save_to_disk`` directory holds ``state.json`` (its Arrow files in order, under ``_data_files``) and
``dataset_info.json``; a ``DatasetDict`` directory holds ``dataset_dict.json`` (``{"splits": [...]}``) and one such
directory per split. The Arrow files are Arrow IPC streams (the Arrow IPC file format is read too).

pyarrow reads them; it comes with the ``hf-data`` extra (``pip install 'q38[hf-data]'``, which installs Hugging
Face ``datasets``, itself built on pyarrow).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from q38.errors import DataError

EXTRA = "pip install 'q38[hf-data]'"
JSON_BLOCK = 1 << 20


def pyarrow_modules(what: str):
    try:
        import pyarrow as pa
        import pyarrow.csv  # noqa: F401
        import pyarrow.ipc  # noqa: F401
    except ImportError:
        raise DataError(f"reading {what} needs pyarrow, which the hf-data extra installs: {EXTRA}") from None
    return pa


# ---- Hugging Face dataset directories ------------------------------------------------------------------------------


def is_hf_dataset_dir(d: Path) -> bool:
    return d.is_dir() and any((d / n).exists() or (d / n).is_symlink() for n in ("state.json", "dataset_dict.json"))


def _dataset_json(d: Path, name: str):
    """``d/name`` parsed under the checkpoint reader's rules (a regular file inside ``d``, bounded, nested at most
    ``MAX_JSON_DEPTH`` deep): one ``DataError`` otherwise."""
    from q38.files import CheckpointMismatch, inside, load_json

    try:
        return load_json(inside(d, name, f"data: {d / name}", follow=True), f"data: {d / name}", follow=True)
    except CheckpointMismatch as e:
        raise DataError(str(e)) from None


def hf_dataset_files(d: Path, split: str | None) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory, in order; for a ``DatasetDict``, those of ``split`` (default:
    the only split, or ``train``). Every split and file named must lie inside ``d`` (``q38.files.inside``: a plain
    relative name, no ``..``, no absolute path, no symlink leading out), a directory or a regular file; nothing
    outside is opened."""
    from q38.files import CheckpointMismatch, inside

    if (d / "dataset_dict.json").exists() or (d / "dataset_dict.json").is_symlink():
        index = _dataset_json(d, "dataset_dict.json")
        splits = index.get("splits") if isinstance(index, dict) else None
        if not (isinstance(splits, list) and splits and all(isinstance(s, str) for s in splits)):
            raise DataError(f"{d / 'dataset_dict.json'} is not a Hugging Face DatasetDict index ({{\"splits\": "
                            f"[...]}}); save the dataset again with save_to_disk")
        if split is None:
            split = splits[0] if len(splits) == 1 else "train" if "train" in splits else None
            if split is None:
                raise DataError(f"{d} is a DatasetDict with splits {', '.join(splits)}; choose one with "
                                "--split")
        if split not in splits:
            raise DataError(f"{d} has no split {split!r}; its splits: {', '.join(splits)}; choose one "
                            "with --split")
        if "/" in split or split in (".", ".."):  # a split is one directory of ``d``
            raise DataError(f"data: split {split!r} of {d / 'dataset_dict.json'} is not a plain directory name "
                            f"(it would leave {d}); refused, nothing outside was opened; save the dataset again "
                            "with save_to_disk")
        try:
            sub = inside(d, split, f"data: split {split!r} of {d / 'dataset_dict.json'}", kind="dir")
        except CheckpointMismatch as e:
            raise DataError(str(e)) from None
        return hf_dataset_files(sub, None)
    if split is not None:
        raise DataError(f"--split {split} given but {d} is a single Dataset (no dataset_dict.json); drop --split")
    state = d / "state.json"
    raw = _dataset_json(d, "state.json")
    try:
        files = [f["filename"] for f in raw["_data_files"]]
        assert isinstance(raw["_data_files"], list)
    except (KeyError, TypeError, AssertionError):
        raise DataError(f"{state} is not a Hugging Face save_to_disk state (\"_data_files\": [{{\"filename\": "
                        f"...}}]); save the dataset again with save_to_disk") from None
    if not files:
        raise DataError(f"{state} lists no Arrow files; the dataset is empty")
    out = []
    for f in files:
        try:  # a plain name of a regular file of ``d``; a symlink only into ``d``
            out.append(inside(d, f, f"data: file listed in {state}", follow=True))
        except CheckpointMismatch as e:
            raise DataError(str(e)) from None
    return out


# ---- Arrow ---------------------------------------------------------------------------------------------------------


def _open_arrow(path: str):
    """The record batches of an Arrow file (IPC stream, else IPC file format), memory-mapped, each checked with
    pyarrow's full validation (offsets and lengths inside their buffers, valid UTF-8) before it is returned: a
    batch whose string offsets point past its data would otherwise be read past the end of the map."""
    from q38.files import CheckpointMismatch, open_regular

    pa = pyarrow_modules("Arrow files")
    try:
        with open_regular(path, f"data: {path}", follow=True):  # a regular file: no FIFO or device is mapped
            pass
    except CheckpointMismatch as e:
        raise DataError(str(e)) from None
    src = pa.memory_map(str(path), "r")
    try:
        batches = iter(pa.ipc.open_stream(src))
    except pa.ArrowInvalid:
        try:
            f = pa.ipc.open_file(src)
        except pa.ArrowInvalid as e:
            raise DataError(f"{path} is not an Arrow IPC stream or file ({_one_line(e)}); expected the .arrow files "
                            f"Hugging Face datasets writes") from None
        batches = (f.get_batch(i) for i in range(f.num_record_batches))
    i = 0
    while True:
        try:
            batch = next(batches)
            batch.validate(full=True)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: record batch {i} is corrupt ({_one_line(e)}); nothing of it was read; write "
                            "the file again (e.g. Dataset.save_to_disk)") from None
        yield batch
        i += 1


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def bounded_rows(batch, where, limit: int) -> Iterator[tuple[str, Any]]:
    """``(where(k), record)`` of each row ``k`` of a validated record batch (null fields dropped), each refused
    before it becomes Python objects when its Arrow data exceed ``limit`` bytes (the per-record bound: the JSONL
    line bound, ``prepare-data --max-line-mb``). Rows are converted a batch at a time when the batch is within
    ``limit``, else one at a time, so memory never holds more than ``limit`` bytes of Arrow data as Python objects."""
    from q38.train.data.loader import record_too_large

    def clean(rec):
        return {k: v for k, v in rec.items() if v is not None}

    if batch.nbytes <= limit:
        for k, rec in enumerate(batch.to_pylist()):
            yield where(k), clean(rec)
        return
    for k in range(batch.num_rows):
        row = batch.slice(k, 1)
        if row.nbytes > limit:
            raise record_too_large(where(k), row.nbytes, limit)
        yield where(k), clean(row.to_pylist()[0])


def arrow_chunks(path: Path, chunk_bytes: int) -> list[dict[str, Any]]:
    """Runs of consecutive record batches of about ``chunk_bytes`` each: ``{"batches": (first, stop), "row":
    first row, "bytes"}``."""
    out: list[dict[str, Any]] = []
    first = row = n_rows = size = 0
    i = -1
    for i, batch in enumerate(_open_arrow(str(path))):
        size += batch.nbytes
        n_rows += batch.num_rows
        if size >= chunk_bytes:
            out.append({"batches": (first, i + 1), "row": row, "bytes": size})
            first, row, size = i + 1, row + n_rows, 0
            n_rows = 0
    if i + 1 > first or not out:
        out.append({"batches": (first, i + 1), "row": row, "bytes": size})
    return out


def arrow_records(chunk: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    from q38.train.data.loader import MAX_LINE_BYTES

    f = chunk["file"]
    first, stop = chunk["batches"]
    row = chunk["row"]
    for i, batch in enumerate(_open_arrow(f)):
        if i >= stop:
            break
        if i < first:
            continue
        yield from bounded_rows(batch, lambda k, r=row: f"{f}: row {r + k}", chunk.get("max_line", MAX_LINE_BYTES))
        row += batch.num_rows


# ---- CSV and JSON arrays -------------------------------------------------------------------------------------------


def csv_records(chunk: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Rows of a CSV file with a header line (row 1 = the first line after the header), read in blocks of the
    per-record bound (``prepare-data --max-line-mb``): a row longer than a block is refused, never read whole."""
    from q38.train.data.loader import MAX_LINE_BYTES

    pa = pyarrow_modules("CSV files")
    f = chunk["file"]
    limit = chunk.get("max_line", MAX_LINE_BYTES)
    row = 1
    try:
        reader = pa.csv.open_csv(f, read_options=pa.csv.ReadOptions(block_size=max(limit, 1 << 10)))
        for batch in reader:
            yield from bounded_rows(batch, lambda k, r=row: f"{f}: row {r + k}", limit)
            row += batch.num_rows
    except pa.ArrowInvalid as e:
        if "straddl" in str(e):  # a row (or the header) longer than one block
            from q38.train.data.loader import record_too_large

            raise record_too_large(f"{f}: row {row} or after", limit + 1, limit) from None
        raise DataError(f"{f}: not readable as CSV with a header line ({_one_line(e)})") from None


def is_json_array(path: Path) -> bool:
    """Whether the file's first non-blank character is ``[`` (a JSON array, not JSON Lines)."""
    with open(path, "rb") as fh:
        while block := fh.read(4096):
            s = block.lstrip()
            if s:
                return s[:1] == b"["
    return False


def json_array_records(chunk: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The elements of a JSON file holding one array, decoded one at a time from a sliding buffer. A record whose
    text exceeds the per-record bound (``prepare-data --max-line-mb``) is refused before it is decoded, so memory
    holds at most about twice the bound; each record nests at most ``MAX_JSON_DEPTH`` deep."""
    from q38.train.data.loader import MAX_LINE_BYTES, record_too_large
    from q38.files import MAX_JSON_DEPTH, json_depth_over

    f = chunk["file"]
    limit = chunk.get("max_line", MAX_LINE_BYTES)
    dec = json.JSONDecoder()
    with open(f, encoding="utf-8") as fh:
        try:
            buf, pos, eof, k = fh.read(JSON_BLOCK), 0, False, 0
            block = JSON_BLOCK

            def skip() -> None:
                nonlocal pos
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1

            def more() -> bool:
                nonlocal buf, pos, eof
                data = fh.read(block)
                eof = not data
                buf, pos = buf[pos:] + data, 0
                return bool(data)

            skip()
            while pos >= len(buf) and more():
                skip()
            if buf[pos:pos + 1] != "[":
                raise DataError(f"{f}: expected a JSON array of records")
            pos += 1
            expect_comma = False
            while True:
                skip()
                if pos >= len(buf):
                    if not more():
                        raise DataError(f"{f}: the JSON array ends early (after record {k}); the file is truncated")
                    continue
                c = buf[pos]
                if c == "]":
                    return
                if expect_comma:
                    if c != ",":
                        raise DataError(f"{f}: record {k}: expected ',' or ']' between records, got {c!r}")
                    pos += 1
                    expect_comma = False
                    continue
                try:
                    obj, end = dec.raw_decode(buf, pos)
                    if end == len(buf) and not eof:
                        raise ValueError  # a number or literal may continue in the next block
                except RecursionError:
                    raise DataError(f"{f}: record {k}: JSON nested too deeply to read (more than {MAX_JSON_DEPTH} "
                                    "levels of arrays / objects)") from None
                except ValueError as e:
                    if len(buf) - pos > limit:  # more than the bound read and the record not complete
                        raise record_too_large(f"{f}: record {k}", len(buf) - pos, limit) from None
                    if eof:
                        msg = getattr(e, "msg", "incomplete")
                        raise DataError(f"{f}: record {k}: malformed JSON ({msg})") from None
                    block = min(block * 2, limit + 1 - (len(buf) - pos)) if len(buf) - pos <= limit else block
                    more()
                    continue
                if end - pos > limit:
                    raise record_too_large(f"{f}: record {k}", end - pos, limit)
                if json_depth_over(buf[pos:end]):
                    raise DataError(f"{f}: record {k}: JSON nested too deeply (more than {MAX_JSON_DEPTH} levels "
                                    "of arrays / objects); each record must be one JSON object of text or messages")
                yield f"{f}: record {k}", obj
                k += 1
                pos = end
                expect_comma = True
                block = JSON_BLOCK
        except UnicodeDecodeError as e:
            raise DataError(f"{f}: not valid UTF-8 ({e})") from None


__all__ = ["EXTRA", "is_hf_dataset_dir", "hf_dataset_files", "arrow_chunks", "arrow_records", "csv_records",
           "is_json_array", "json_array_records"]
