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
    return d.is_dir() and ((d / "state.json").is_file() or (d / "dataset_dict.json").is_file())


def hf_dataset_files(d: Path, split: str | None) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory, in order; for a ``DatasetDict``, those of ``split`` (default:
    the only split, or ``train``)."""
    if (d / "dataset_dict.json").is_file():
        try:
            splits = json.loads((d / "dataset_dict.json").read_text())["splits"]
            assert isinstance(splits, list) and all(isinstance(s, str) for s in splits)
        except (OSError, ValueError, KeyError, TypeError, AssertionError):
            raise DataError(f"{d / 'dataset_dict.json'} is not a Hugging Face DatasetDict index ({{\"splits\": "
                            f"[...]}}); save the dataset again with save_to_disk") from None
        if split is None:
            split = splits[0] if len(splits) == 1 else "train" if "train" in splits else None
            if split is None:
                raise DataError(f"{d} is a DatasetDict with splits {', '.join(splits)}; choose one with --split")
        if split not in splits:
            raise DataError(f"{d} has no split {split!r}; its splits: {', '.join(splits)}; choose one with --split")
        return hf_dataset_files(d / split, None)
    if split is not None:
        raise DataError(f"--split {split} given but {d} is a single Dataset (no dataset_dict.json); drop --split")
    state = d / "state.json"
    try:
        files = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        assert all(isinstance(f, str) and "/" not in f and "\\" not in f and f not in ("", ".", "..") for f in files)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise DataError(f"{state} is not a Hugging Face save_to_disk state (\"_data_files\": [{{\"filename\": "
                        f"...}}]); save the dataset again with save_to_disk") from None
    out = [d / f for f in files]
    for f in out:
        if not f.is_file():
            raise DataError(f"{f} listed in {state} is missing; the dataset directory is incomplete")
    if not out:
        raise DataError(f"{state} lists no Arrow files; the dataset is empty")
    return out


# ---- Arrow ---------------------------------------------------------------------------------------------------------


def _open_arrow(path: str):
    """A record-batch reader over the memory-mapped Arrow file (IPC stream, else IPC file format)."""
    pa = pyarrow_modules("Arrow files")
    src = pa.memory_map(str(path), "r")
    try:
        return pa.ipc.open_stream(src)
    except pa.ArrowInvalid:
        pass
    try:
        f = pa.ipc.open_file(src)
    except pa.ArrowInvalid as e:
        raise DataError(f"{path} is not an Arrow IPC stream or file ({e}); expected the .arrow files Hugging Face "
                        f"datasets writes") from None
    return (f.get_batch(i) for i in range(f.num_record_batches))


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
    f = chunk["file"]
    first, stop = chunk["batches"]
    row = chunk["row"]
    for i, batch in enumerate(_open_arrow(f)):
        if i >= stop:
            break
        if i < first:
            continue
        for rec in batch.to_pylist():
            yield f"{f}: row {row}", {k: v for k, v in rec.items() if v is not None}
            row += 1


# ---- CSV and JSON arrays -------------------------------------------------------------------------------------------


def csv_records(chunk: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Rows of a CSV file with a header line (row 1 = the first line after the header)."""
    pa = pyarrow_modules("CSV files")
    f = chunk["file"]
    try:
        reader = pa.csv.open_csv(f)
        row = 1
        for batch in reader:
            for rec in batch.to_pylist():
                yield f"{f}: row {row}", {k: v for k, v in rec.items() if v is not None}
                row += 1
    except pa.ArrowInvalid as e:
        raise DataError(f"{f}: not readable as CSV with a header line ({e})") from None


def is_json_array(path: Path) -> bool:
    """Whether the file's first non-blank character is ``[`` (a JSON array, not JSON Lines)."""
    with open(path, "rb") as fh:
        while block := fh.read(4096):
            s = block.lstrip()
            if s:
                return s[:1] == b"["
    return False


def json_array_records(chunk: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The elements of a JSON file holding one array, decoded one at a time from a sliding buffer."""
    f = chunk["file"]
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
                except ValueError as e:
                    if eof:
                        msg = getattr(e, "msg", "incomplete")
                        raise DataError(f"{f}: record {k}: malformed JSON ({msg})") from None
                    block *= 2
                    more()
                    continue
                yield f"{f}: record {k}", obj
                k += 1
                pos = end
                expect_comma = True
                block = JSON_BLOCK
        except UnicodeDecodeError as e:
            raise DataError(f"{f}: not valid UTF-8 ({e})") from None


__all__ = ["EXTRA", "is_hf_dataset_dir", "hf_dataset_files", "arrow_chunks", "arrow_records", "csv_records",
           "is_json_array", "json_array_records"]
