"""The rules every file q38 reads from outside follows, whatever its format (checkpoints, Hugging Face model and
dataset directories, safetensors indexes, prepared data, prompt files): names taken from a file resolve inside their
directory (``inside``), no final symlink or FIFO is opened (``open_regular``), reads are bounded (``read_bounded``),
JSON is parsed under a nesting bound (``parse_json`` / ``load_json``) and a model config's numbers under size bounds
(``check_config_bounds``).

Everything here refuses bad input with ``UnsafeCheckpoint`` / ``CheckpointMismatch`` (``ConfigError``s: one line
through the CLI, exit 2) naming the file and the entry. Nothing of a refused file is run, allocated or followed.

A bottom-floor module beside ``q38.errors``: it imports nothing of q38 but the errors (and not torch), so the model's
Hugging Face I/O, the data pipeline and the checkpoint code share it without importing each other.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from q38.errors import ConfigError

MAX_JSON_BYTES = 64 << 20  # meta.json, manifest.json, config.json, a safetensors header
MAX_LINE_BYTES = 16 << 20  # a JSONL line longer than this is refused before it is parsed (prepare-data --max-line-mb,
# a generate prompts file); the same bound holds for one record of every other data source (Arrow, Parquet, CSV)


class CheckpointMismatch(ConfigError):
    """A checkpoint was made for another model, or is not (or no longer) a q38 checkpoint; the message says why."""


class UnsafeCheckpoint(CheckpointMismatch):
    """A checkpoint file asks for something a q38 checkpoint never holds (a type, a path, a size); nothing of it was
    run, followed or allocated."""


def refuse_unsafe(where: str, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"{where}: refused: {what} (a crafted or damaged checkpoint; nothing in it was run or "
                            "followed); load only checkpoints written by q38 or torch.distributed.checkpoint")


def _refuse_path(where: str, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"{where}: refused: {what} (a crafted or damaged input; nothing outside it was opened)")


# ---- paths --------------------------------------------------------------------------------------------------------


def inside(root: str | os.PathLike, rel: Any, what: str, *, follow: bool = False, kind: str = "file") -> Path:
    """``root/rel`` for a name ``rel`` taken from a file (a manifest entry, a storage entry's ``relative_path``, a
    data manifest, a dataset's split or data file, a safetensors index entry): refused unless it is a non-empty
    relative POSIX path without ``..``, ``.`` or empty parts, no component is a symlink, and it is a regular file
    (``kind="dir"``: a directory) inside ``root`` (not a FIFO, device or directory). ``what`` names the entry in the
    one-line refusal.

    ``follow``: a final symlink is followed when what it names (resolved) lies inside ``root`` too, or, for a
    Hugging Face hub cache snapshot (``root`` is ``<repo>/snapshots/<revision>``), inside that repository's
    ``<repo>/blobs`` (the hub cache links each file of a snapshot to its blob); every other symlink is refused, so
    nothing outside the input is opened (docs/checkpoints.md#what-a-checkpoint-may-name)."""
    if not isinstance(rel, str) or not rel or len(rel) > 4096 or "\x00" in rel or "\\" in rel:
        raise _refuse_path(what, f"file name {describe(rel)} is not a plain relative path")
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise _refuse_path(what, f"file name {rel!r} leaves its directory or is not a plain relative path")
    root = Path(root)
    p = root
    for i, part in enumerate(parts):
        p = p / part
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            raise CheckpointMismatch(f"{what}: {p} is missing") from None
        except OSError as e:
            raise CheckpointMismatch(f"{what}: {p} cannot be read ({e.strerror or e})") from None
        last = i == len(parts) - 1
        if stat.S_ISLNK(st.st_mode) and follow and last and kind == "file":
            target = _link_target_inside(root, p, rel, what)
            try:
                st = os.stat(target)
            except OSError as e:
                raise CheckpointMismatch(f"{what}: {p} is a broken link ({e.strerror or e})") from None
        elif stat.S_ISLNK(st.st_mode):
            raise _refuse_path(what, f"{rel!r} is a symbolic link ({p})")
        if not last and not stat.S_ISDIR(st.st_mode):
            raise _refuse_path(what, f"{rel!r}: {p} is not a directory")
        if last and kind == "dir" and not stat.S_ISDIR(st.st_mode):
            raise _refuse_path(what, f"{rel!r} is not a directory ({file_kind(st.st_mode)})")
        if last and kind == "file" and not stat.S_ISREG(st.st_mode):
            raise _refuse_path(what, f"{rel!r} is not a regular file ({file_kind(st.st_mode)})")
    return p


def _link_target_inside(root: Path, link: Path, rel: str, what: str) -> Path:
    """What the symlink ``link`` (a file of ``root``) resolves to, refused unless it lies inside ``root`` or, in a
    Hugging Face hub cache snapshot, inside its repository's ``blobs`` folder (see ``inside``)."""
    base = Path(os.path.realpath(root))
    target = Path(os.path.realpath(link))
    allowed = [base]
    if base.parent.name == "snapshots":  # <cache>/models--org--name/snapshots/<revision>
        allowed.append(base.parent.parent / "blobs")
    if not any(target == a or a in target.parents for a in allowed):
        where = " or its hub cache blobs" if len(allowed) > 1 else ""
        raise _refuse_path(what, f"{rel!r} is a symbolic link to {target}, outside {base}{where}; copy the file into "
                      "the directory (cp -L) instead of linking it")
    return target


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (for refusals: "a FIFO", "a directory", ...)."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


@contextmanager
def open_regular(path: str | os.PathLike, what: str, *, follow: bool = False) -> Iterator[io.BufferedReader]:
    """``open(path, "rb")`` that never follows a final symlink (unless ``follow``) and never blocks on a FIFO: the
    file must be regular when opened (checked on the open descriptor)."""
    try:
        nofollow = 0 if follow else os.O_NOFOLLOW
        fd = os.open(path, os.O_RDONLY | nofollow | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointMismatch(f"{what}: {path} is missing") from None
    except OSError as e:
        if os.path.islink(path):
            raise _refuse_path(what, f"{path} is a symbolic link") from None
        raise CheckpointMismatch(f"{what}: {path} cannot be read ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse_path(what, f"{path} is not a regular file ({file_kind(st.st_mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        yield f


def read_bounded(path: str | os.PathLike, limit: int, what: str, *, follow: bool = False) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (refused, with both numbers, before reading more)."""
    with open_regular(path, what, follow=follow) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise refuse_unsafe(what, f"{path} is {size} bytes, more than the {limit} a q38 checkpoint's file of this kind "
                          "can hold")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise refuse_unsafe(what, f"{path} grew past {limit} bytes while being read")
    return data


def load_json(path: str | os.PathLike, what: str, limit: int = MAX_JSON_BYTES, *, follow: bool = False) -> Any:
    """A JSON file read under ``read_bounded``, nested at most ``MAX_JSON_DEPTH`` deep; a deeper nesting or a
    malformed file is one ``CheckpointMismatch``."""
    data = read_bounded(path, limit, what, follow=follow)
    return parse_json(data, what if str(path) in what else f"{what}: {path}", CheckpointMismatch)


MAX_JSON_DEPTH = 100  # arrays / objects inside each other in any JSON q38 parses (a model config nests 4 deep)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_CHUNK = 1 << 22  # brackets scanned at once (bounded memory for the running depth)


def json_depth_over(data: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``data`` nests arrays and objects more than ``limit`` deep, found without parsing it,
    at C speed: escaped backslashes and quotes dropped, then every string (the text between quotes), then everything
    but brackets; the deepest running count of open brackets is the depth. A bound that does not depend on the
    interpreter's recursion limit or the caller's stack depth. Text that is not JSON may pass (the parser then names
    its fault)."""
    import numpy as np

    if isinstance(data, str):
        if data.count("[") + data.count("{") <= limit:
            return False
        data = data.encode("utf-8", "surrogatepass")
    else:
        data = bytes(data)
        if data.count(b"[") + data.count(b"{") <= limit:
            return False
    if b"\\" in data:  # an escaped quote does not end a string (backslash pairs first: \\" does)
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    s = np.frombuffer(b"".join(data.split(b'"')[::2]).translate(None, _NOT_BRACKET), np.uint8)
    depth = 0
    for a in range(0, len(s), _DEPTH_CHUNK):
        part = s[a:a + _DEPTH_CHUNK]
        run = np.cumsum(np.where((part == ord("[")) | (part == ord("{")), 1, -1), dtype=np.int64) + depth
        if run.max() > limit:
            return True
        depth = int(run[-1])
    return False


def parse_json(data: bytes | str, where: str, error: type[Exception] = ConfigError,
               limit: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(data)`` refused with one ``error`` naming ``where`` when ``data`` nests deeper than ``limit``
    (checked before parsing) or is not valid JSON / UTF-8."""
    if json_depth_over(data, limit):
        raise error(f"{where}: JSON nested too deeply (more than {limit} levels of arrays / objects inside each "
                    "other, deeper than any file q38 reads); fix or regenerate the file")
    try:
        return json.loads(data)
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to read; fix or regenerate the file") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{where} is not valid JSON ({' '.join(str(e).split())[:200]})") from None


MAX_CONFIG_INT = 1 << 40  # any integer of a model config (sizes, counts, ids)
MAX_CONFIG_LIST = 4096  # entries of a list in a model config (layer_types, ...)
MAX_CONFIG_LAYERS = 4096  # num_hidden_layers and its kin: the loaders loop over layers before any tensor exists
LAYER_COUNT_KEYS = ("num_hidden_layers", "mtp_num_hidden_layers", "num_nextn_predict_layers", "mtp_num_layers",
                    "num_experts", "num_local_experts", "n_routed_experts")


def check_config_bounds(cfg: Any, where: str) -> None:
    """A model config from a file (``meta.json``'s ``model_config``, a HF ``config.json``) holds only JSON scalars,
    short lists and small tables, with every integer at most ``MAX_CONFIG_INT`` and the layer and expert counts at
    most ``MAX_CONFIG_LAYERS`` (building even the shapes of a model loops over them). Refused with the number and
    the limit, before the config is used."""
    def walk(x: Any, path: str, depth: int) -> None:
        if depth > 6:
            raise refuse_unsafe(where, f"{path} nests deeper than a model config does")
        if isinstance(x, dict):
            if len(x) > MAX_CONFIG_LIST:
                raise refuse_unsafe(where, f"{path} has {len(x)} entries, more than {MAX_CONFIG_LIST}")
            for k, v in x.items():
                walk(v, f"{path}.{str(k)[:60]}" if path else str(k)[:60], depth + 1)
        elif isinstance(x, list):
            if len(x) > MAX_CONFIG_LIST:
                raise refuse_unsafe(where, f"{path} has {len(x)} entries, more than {MAX_CONFIG_LIST}")
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]", depth + 1)
        elif isinstance(x, bool) or x is None:
            return
        elif isinstance(x, int):
            lim = MAX_CONFIG_LAYERS if path.rpartition(".")[2] in LAYER_COUNT_KEYS else MAX_CONFIG_INT
            if abs(x) > lim:
                raise refuse_unsafe(where, f"{path} = {str(x)[:30]} exceeds the limit {lim}")
        elif isinstance(x, float):
            return
        elif isinstance(x, str):
            if len(x) > 1 << 16:
                raise refuse_unsafe(where, f"{path} is a string of {len(x)} characters")
        else:
            raise refuse_unsafe(where, f"{path} holds {describe(x)}")

    if not isinstance(cfg, dict):
        raise refuse_unsafe(where, f"the model config is {describe(cfg)}, not a table")
    walk(cfg, "", 0)


def describe(x: Any) -> str:
    """A bounded description of an object from a hostile file (never its full repr: that can be huge or recurse)."""
    if isinstance(x, type) or callable(x):
        return f"{getattr(x, '__module__', '?')}.{getattr(x, '__qualname__', type(x).__name__)}"
    if type(x) in (int, bool, float) or x is None:
        return repr(x)[:40]
    if type(x) is str:
        return repr(x[:60]) + ("..." if len(x) > 60 else "")
    if type(x) in (tuple, list, dict) or (isinstance(x, tuple) and type(x).__name__ == "Size"):  # torch.Size
        return f"({type(x).__name__} of {len(x)})"
    return f"a {type(x).__name__}"


def sha256_file(path: Path, *, follow: bool = False) -> str:
    """The SHA-256 of a regular file, read in 1 MiB pieces (``follow``: a symlink to a regular file is read too)."""
    h = hashlib.sha256()
    with open_regular(path, str(path), follow=follow) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
