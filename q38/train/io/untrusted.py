"""Reading q38 checkpoints that may come from anywhere: DCP's ``.metadata`` read by an allow-list unpickler and
checked field by field, and the streamed checksums of the DCP shard files' chunks (computed while DCP writes them,
checked while q38 reads them back). The file rules every input shares (``inside``, bounded reads and JSON, config
bounds) are ``q38.files``.

Everything here refuses bad input with ``UnsafeCheckpoint`` / ``CheckpointMismatch`` (``ConfigError``s: one line
through the CLI, exit 2) naming the file and the entry. Nothing of a refused file is run, allocated or followed.

Leaf module of the checkpoint code: ``q38.train.io.checkpoint`` imports it, never the other way round.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import struct
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import xxhash

from q38.files import CheckpointMismatch, UnsafeCheckpoint, describe, inside, open_regular, read_bounded, refuse_unsafe

# ---- limits (every number a hostile file could inflate is checked against one of these before it is used) -------
MAX_METADATA_BYTES = 256 << 20  # DCP's .metadata (a 2.4T-parameter run on a few thousand ranks stays well below)
MAX_PICKLE_STACK = 100_000  # items on the unpickler's stack at once (DCP batches 1000 dict items per mark)
MAX_PICKLE_MARKS = 32  # nested marks (q38's metadata nests 4 deep)
MAX_NDIM = 8  # dimensions of one tensor
MAX_DIM = 1 << 40  # elements along one dimension
MAX_TENSOR_ELEMENTS = 1 << 42  # elements of one (global) tensor: 4 Ti, far above any single tensor of the 2.4T model
MAX_KEY_CHARS = 1024  # a state-dict key
MAX_CHUNKS = 10_000_000  # saved chunks over all tensors
TORCH_SAVE_SLACK = 1 << 16  # bytes a torch.save of one tensor adds around its data (zip headers, pickle; ~1.5 KB)
SAVED_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                          torch.int16, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8, torch.bool})

HASH_SIDECAR_RE = re.compile(r"^__\d+_chunks\.json$")  # a rank's streamed chunk checksums, for the manifest
DISTCP_RE = re.compile(r"^__\d+_\d+\.distcp$")  # the shard files DCP's FileSystemWriter names
HASHING = True  # off only in benchmarks/checkpoint_io.py --hash-cost (what the hashes cost): no hash written or checked
# The checksum of each stored DCP chunk (a manifest entry's ``chunk_hash``): XXH3-128 over the chunk's identity (shard
# file name, byte offset), its bytes and its length, so a chunk moved, swapped or cut short does not match. An entry
# without ``chunk_hash`` was written by q38 before XXH3-128: plain SHA-256 of the bytes, still read and checked.
CHUNK_HASH = "xxh3-128"
CHUNK_HASHES = (CHUNK_HASH, "sha256")


# ---- DCP .metadata: an allow-list unpickler -------------------------------------------------------------------------
# DCP stores its index as a pickle; DCP's own reader unpickles it with plain ``pickle.load``, so a crafted file runs
# any code. The index is plain data, so q38 reads it with pickle's pure-Python unpickler restricted to: the opcodes
# DCP's pickles use (protocol 2-5, no persistent ids, no extensions, no sets, no bytes), the classes q38's own saves
# hold (DCP's metadata dataclasses, torch dtypes, torch.Size, a path), calls only of torch.Size(ints),
# _get_layout("torch.strided") and the memory-format enum, instance state only for the dataclasses and only their
# known fields, and bounded stack, nesting and file size. The result is then checked field by field
# (``check_metadata``). torch's own weights-only unpickler cannot serve: it refuses the protocol DCP writes.


def _dcp_classes() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as m

    out = {(m.__name__, c.__name__): c for c in (m.Metadata, m.MetadataIndex, m.StorageMeta,
                                                m.TensorStorageMetadata, m.ChunkStorageMetadata,
                                                m.TensorProperties)}
    out[(fs.__name__, "_StorageInfo")] = fs._StorageInfo
    return out


def _fields(cls) -> frozenset[str]:
    import dataclasses

    return frozenset(f.name for f in dataclasses.fields(cls))


def _opcodes(*names: str) -> frozenset[int]:
    return frozenset(getattr(pickle, n)[0] for n in names)


_ALLOWED_OPS = _opcodes(
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK",
    "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1",
    "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND", "APPENDS",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
    "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "MEMOIZE",
    "GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD",
)


def _is_size(x: Any) -> bool:
    return type(x) is torch.Size


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Pickle's pure-Python unpickler with every opcode that builds or calls something replaced by a checked one."""

    def __init__(self, data: bytes, where: str) -> None:
        self.src = io.BytesIO(data)  # pickle's pure-Python unpickler keeps only the file's read methods
        super().__init__(self.src)
        self.where = where
        self.classes = _dcp_classes()
        from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

        self.enum = _MEM_FORMAT_ENCODING
        from torch.distributed.checkpoint.metadata import MetadataIndex

        self.index_cls = MetadataIndex
        self.fields = {c: _fields(c) for c in self.classes.values()}
        self.dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
        cls = _MetadataUnpickler  # pickle's loop calls dispatch[op](self): unbound functions
        for op, fn in ((pickle.REDUCE, cls._reduce), (pickle.NEWOBJ, cls._newobj), (pickle.BUILD, cls._build),
                       (pickle.SETITEM, cls._setitem), (pickle.SETITEMS, cls._setitems),
                       (pickle.APPEND, cls._append), (pickle.APPENDS, cls._appends), (pickle.DICT, cls._dict)):
            self.dispatch[op[0]] = fn

    def bad(self, what: str) -> UnsafeCheckpoint:
        return refuse_unsafe(self.where, what)

    def find_class(self, module: str, name: str):
        if (module, name) in self.classes:
            return self.classes[(module, name)]
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype) and \
                getattr(torch, name) in SAVED_DTYPES:
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _get_layout
        if (module, name) == ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"):
            return self.enum
        if (module, name) == ("pathlib", "PosixPath"):
            return PurePosixPath  # the path a checkpoint was saved to: informative only, never opened
        raise self.bad(f"it asks to build {module}.{name}, which q38 checkpoint metadata never holds")

    def load(self):  # pickle's loop, with the opcode allow-list and the stack bounds
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)  # type: ignore[attr-defined]
        self.read = self._unframer.read
        self.readinto = self._unframer.readinto
        self.readline = self._unframer.readline
        self.metastack, self.stack = [], []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                op = key[0]
                if op not in _ALLOWED_OPS:
                    raise self.bad(f"pickle opcode {bytes([op])!r} at byte {self._pos()} is not one DCP "
                                   "metadata uses")
                dispatch[op](self)
                if len(self.stack) > MAX_PICKLE_STACK or len(self.metastack) > MAX_PICKLE_MARKS:
                    raise self.bad(f"it nests deeper or wider than checkpoint metadata does (stack "
                                   f"{len(self.stack)} > {MAX_PICKLE_STACK} or marks {len(self.metastack)} > "
                                   f"{MAX_PICKLE_MARKS})")
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    def _pos(self) -> int:
        """The offset of the opcode just read (inside a pickle frame: the frame is read ahead from the file)."""
        frame = self._unframer.current_frame
        ahead = len(frame.getbuffer()) - frame.tell() if frame is not None else 0
        return self.src.tell() - ahead - 1

    # -- calls --
    def _reduce(self):
        args = self.stack.pop()
        fn = self.stack[-1]
        if type(args) is not tuple:
            raise self.bad("a call with non-tuple arguments")
        if fn is torch.Size:
            ok = len(args) == 1 and type(args[0]) is tuple and len(args[0]) <= MAX_NDIM and \
                all(type(d) is int and 0 <= d <= MAX_DIM for d in args[0])
            if not ok:
                raise self.bad(f"torch.Size{describe(args)}: at most {MAX_NDIM} dimensions of 0..{MAX_DIM}")
            self.stack[-1] = torch.Size(args[0])
        elif fn is _get_layout:
            if args != ("torch.strided",):
                raise self.bad(f"layout {describe(args)}: q38 saves strided tensors only")
            self.stack[-1] = torch.strided
        elif fn is self.enum:
            if len(args) != 1 or type(args[0]) is not int or args[0] not in (0, 1, 2):
                raise self.bad(f"memory format {describe(args)}")
            self.stack[-1] = self.enum(args[0])
        elif fn is PurePosixPath:
            if not (len(args) <= 64 and all(type(a) is str and len(a) <= 4096 for a in args)):
                raise self.bad(f"path {describe(args)}")
            self.stack[-1] = PurePosixPath(*args)
        else:
            raise self.bad(f"it calls {describe(fn)}, which q38 checkpoint metadata never does")

    def _newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        if cls not in self.fields or args != ():
            raise self.bad(f"it creates {describe(cls)}{describe(args)}; only DCP's metadata dataclasses, without "
                           "arguments, are allowed")
        self.append(cls.__new__(cls))

    def _build(self):  # instance state: only a DCP dataclass instance, only its own fields
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls not in self.fields:
            raise self.bad(f"it sets the state of {describe(inst)}; only instances of DCP's metadata dataclasses may "
                           "have state")
        if cls.__name__ == "TensorProperties":
            if not (type(state) is tuple and len(state) == 5 and isinstance(state[0], torch.dtype)
                    and state[1] is torch.strided and type(state[2]) is bool and type(state[3]) is self.enum
                    and type(state[4]) is bool):
                raise self.bad(f"TensorProperties state {describe(state)}")
            inst.__setstate__(state)
            return
        if type(state) is not dict or not all(type(k) is str and k in self.fields[cls] for k in state):
            raise self.bad(f"{cls.__name__} state {describe(state)}: only the fields "
                           f"{sorted(self.fields[cls])} are allowed")
        if cls is self.index_cls and not (type(state.get("fqn")) is str and
                                          (state.get("offset") is None or _is_size(state.get("offset")))):
            raise self.bad(f"MetadataIndex {describe(state)}")  # checked before it is hashed as a dict key
        inst.__dict__.update(state)

    # -- containers: only plain lists and dicts; dict keys only of types that hash in bounded time --
    def _key(self, k):
        if type(k) is str or type(k) is int:
            return
        if type(k) is self.index_cls and type(k.__dict__.get("fqn")) is str and \
                (k.__dict__.get("offset") is None or _is_size(k.__dict__.get("offset"))):
            return
        raise self.bad(f"a dict key {describe(k)}")

    def _setitem(self):
        v = self.stack.pop()
        k = self.stack.pop()
        d = self.stack[-1]
        if type(d) is not dict:
            raise self.bad(f"an item set on {describe(d)}")
        self._key(k)
        d[k] = v

    def _setitems(self):
        items = self.pop_mark()
        d = self.stack[-1]
        if type(d) is not dict or len(items) % 2:
            raise self.bad(f"items set on {describe(d)}")
        for i in range(0, len(items), 2):
            self._key(items[i])
            d[items[i]] = items[i + 1]

    def _dict(self):
        items = self.pop_mark()
        d = {}
        for i in range(0, len(items) - 1, 2):
            self._key(items[i])
            d[items[i]] = items[i + 1]
        self.append(d)

    def _append(self):
        v = self.stack.pop()
        if type(self.stack[-1]) is not list:
            raise self.bad(f"an append to {describe(self.stack[-1])}")
        self.stack[-1].append(v)

    def _appends(self):
        items = self.pop_mark()
        if type(self.stack[-1]) is not list:
            raise self.bad(f"an append to {describe(self.stack[-1])}")
        self.stack[-1].extend(items)


def _get_layout(name: str):  # a marker: find_class hands this out for torch.serialization._get_layout
    raise AssertionError("never called")


def unpickle_metadata(path: Path, what: str | None = None):
    """DCP's ``Metadata`` from the ``.metadata`` file at ``path``, read by the allow-list unpickler (not yet checked:
    see ``check_metadata``)."""
    where = what or str(path)
    data = read_bounded(path, MAX_METADATA_BYTES, where)
    try:
        md = _MetadataUnpickler(data, where).load()
    except UnsafeCheckpoint:
        raise
    except RecursionError:
        raise refuse_unsafe(where, "it nests deeper than checkpoint metadata does") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError, KeyError,
            struct.error, MemoryError) as e:
        raise CheckpointMismatch(f"{where}: unreadable checkpoint metadata ({type(e).__name__}: "
                                 f"{' '.join(str(e).split())[:200]}); the checkpoint is corrupt") from None
    return md


# ---- DCP .metadata: the structure q38 writes ------------------------------------------------------------------------


def check_metadata(md: Any, ck_dir: Path, where: str, hashes: Mapping[str, Any] | None = None) -> None:
    """``md`` is what q38 (or plain DCP) writes for a state dict of tensors, field by field: a ``Metadata`` of
    ``TensorStorageMetadata`` entries (no ``BytesStorageMetadata``: q38 saves none, and DCP would hand such bytes to
    ``torch.load(weights_only=False)``), shapes within ``MAX_NDIM`` / ``MAX_DIM`` / ``MAX_TENSOR_ELEMENTS``, chunks
    inside their tensors, one storage entry per chunk, each naming a ``*.distcp`` file inside ``ck_dir`` and a byte
    range inside that file no longer than the chunk's data plus ``TORCH_SAVE_SLACK``. With ``hashes`` (the
    manifest's files), each storage entry's byte range is one the manifest hashed."""
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as m

    def need(cond: object, what: str) -> None:
        if not cond:
            raise refuse_unsafe(where, what)

    need(type(md) is m.Metadata, f"it holds {describe(md)}, not DCP checkpoint metadata")
    sdm = md.__dict__.get("state_dict_metadata")
    need(type(sdm) is dict and sdm, "state_dict_metadata is not a non-empty dict")
    n_chunks = 0
    chunk_of: dict[tuple[str, tuple[int, ...]], int] = {}  # (key, offsets) -> bytes of its data
    for key, tm in sdm.items():
        need(type(key) is str and 0 < len(key) <= MAX_KEY_CHARS, f"state-dict key {describe(key)}")
        if type(tm) is m.BytesStorageMetadata:
            need(False, f"{key!r} is stored as pickled bytes; q38 saves tensors only, and DCP would unpickle them "
                        "with torch.load(weights_only=False)")
        need(type(tm) is m.TensorStorageMetadata, f"{key!r}: {describe(tm)} is not tensor storage metadata")
        props, size, chunks = (tm.__dict__.get(f) for f in ("properties", "size", "chunks"))
        need(type(props) is m.TensorProperties, f"{key!r}: properties {describe(props)}")
        pd = props.__dict__
        need(pd.get("dtype") in SAVED_DTYPES and pd.get("layout") is torch.strided and
             type(pd.get("requires_grad")) is bool and type(pd.get("pin_memory")) is bool and
             pd.get("memory_format") in (torch.contiguous_format, torch.channels_last, torch.preserve_format),
             f"{key!r}: tensor properties {describe(pd.get('dtype'))}")
        need(_is_size(size) and len(size) <= MAX_NDIM and all(0 <= d <= MAX_DIM for d in size),
             f"{key!r}: shape {describe(size)}")
        numel = 1
        for d in size:
            numel *= d
        need(numel <= MAX_TENSOR_ELEMENTS, f"{key!r}: shape {list(size)} has {numel} elements, more than the "
                                           f"{MAX_TENSOR_ELEMENTS} limit")
        need(type(chunks) is list and chunks, f"{key!r}: chunks {describe(chunks)}")
        n_chunks += len(chunks)
        need(n_chunks <= MAX_CHUNKS, f"more than {MAX_CHUNKS} saved chunks")
        item = pd["dtype"].itemsize
        for c in chunks:
            need(type(c) is m.ChunkStorageMetadata, f"{key!r}: chunk {describe(c)}")
            off, sz = c.__dict__.get("offsets"), c.__dict__.get("sizes")
            need(_is_size(off) and _is_size(sz) and len(off) == len(sz) == len(size) and
                 all(o + s <= d for o, s, d in zip(off, sz, size)),
                 f"{key!r}: chunk at {describe(off)} of {describe(sz)} is not inside its shape {list(size)}")
            cn = 1
            for s in sz:
                cn *= s
            chunk_of[(key, tuple(off))] = cn * item
    pdata = md.__dict__.get("planner_data")
    if pdata is not None:
        need(type(pdata) is dict and all(type(k) is str and k in sdm and type(v) is tuple and 0 < len(v) <= 16 and
                                         all(type(x) in (str, int) for x in v) for k, v in pdata.items()),
             "planner_data is not DCP's {key: path} mapping of these keys")
    sm = md.__dict__.get("storage_meta")
    need(sm is None or type(sm) is m.StorageMeta, f"storage_meta {describe(sm)}")
    need(md.__dict__.get("version") is None or type(md.__dict__.get("version")) is str, "version")
    sdata = md.__dict__.get("storage_data")
    need(type(sdata) is dict and len(sdata) == len(chunk_of),
         f"storage_data holds {describe(sdata)}, not one entry for each of the {len(chunk_of)} saved chunks")
    sizes: dict[str, int] = {}
    for idx, info in sdata.items():
        need(type(idx) is m.MetadataIndex and _is_size(idx.__dict__.get("offset")),
             f"storage key {describe(idx)}")
        fqn, off = idx.fqn, tuple(idx.offset)
        need((fqn, off) in chunk_of, f"storage entry {fqn!r} at {list(off)} names no saved chunk")
        need(type(info) is fs._StorageInfo, f"{fqn!r}: storage {describe(info)}")
        d = info.__dict__
        rel, start, length = d.get("relative_path"), d.get("offset"), d.get("length")
        need(d.get("transform_descriptors") is None, f"{fqn!r}: stream transforms (q38 saves none)")
        need(type(start) is int and type(length) is int and start >= 0 and length > 0,
             f"{fqn!r}: byte range {describe(start)}+{describe(length)}")
        data_bytes = chunk_of[(fqn, off)]
        need(data_bytes <= length <= data_bytes + TORCH_SAVE_SLACK,
             f"{fqn!r}: {length} stored bytes for a chunk of {data_bytes} data bytes (limit: data + "
             f"{TORCH_SAVE_SLACK})")
        if type(rel) is not str or not DISTCP_RE.match(rel):
            need(False, f"{fqn!r}: storage file {describe(rel)} is not a DCP shard file name (__<rank>_<n>.distcp)")
        if rel not in sizes:
            with open_regular(inside(ck_dir, rel, where), f"{where} ({fqn!r})") as f:
                sizes[rel] = os.fstat(f.fileno()).st_size
        need(start + length <= sizes[rel], f"{fqn!r}: bytes {start}..{start + length} of {rel}, which has "
                                           f"{sizes[rel]}")
        if hashes is not None:
            ent = hashes.get(rel)
            chunks = ent.get("chunks") if isinstance(ent, dict) else None
            if chunks is not None:
                h = chunks.get(str(start)) if isinstance(chunks, dict) else None
                need(isinstance(h, list) and len(h) == 2 and h[0] == length,
                     f"{fqn!r}: bytes {start}..{start + length} of {rel} are not a range the manifest hashed")


def check_keys(md: Any, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None,
               allowed: set[str] | None, where: str) -> None:
    """Every key the loader asks for is saved with that global shape (and a dtype q38 saves); every saved key is one
    q38 writes for this model (``allowed``; None: not checked)."""
    sdm = md.state_dict_metadata
    if allowed is not None:
        extra = sorted(k for k in sdm if k not in allowed)
        if extra:
            raise CheckpointMismatch(f"{where}: holds {len(extra)} tensor(s) a q38 checkpoint of this model never "
                                     f"does ({', '.join(repr(k[:80]) for k in extra[:3])}); not a checkpoint of this "
                                     "model")
    for k, (shape, _dtype) in (expected or {}).items():
        tm = sdm.get(k)
        if tm is None:
            raise CheckpointMismatch(f"{where}: lacks the tensor {k!r}; not a q38 checkpoint of this model")
        if tuple(tm.size) != tuple(shape):
            raise CheckpointMismatch(f"{where}: {k!r} is saved with shape {list(tm.size)}, this model needs "
                                     f"{list(shape)}")


# ---- streamed hashes ------------------------------------------------------------------------------------------------


OVERLAP_BYTES = 1 << 20  # a write this large runs on a thread while the checksum takes it in


def chunk_hasher(algo: str, name: str, offset: int):
    """A running checksum of the chunk of shard file ``name`` at byte ``offset`` (``chunk_digest`` ends it)."""
    if algo == CHUNK_HASH:
        return xxhash.xxh3_128(f"q38-chunk\0{name}\0{offset}\0".encode())
    return hashlib.sha256()  # the manifests written before CHUNK_HASH: the bytes alone


def chunk_digest(algo: str, h, length: int) -> str:
    if algo == CHUNK_HASH:
        h.update(struct.pack("<Q", length))
    return h.hexdigest()


class _HashingStream(io.RawIOBase):
    """A write stream that hashes what passes through it, span by span: a span ends at each ``tell()`` call (DCP's
    writer asks ``tell()`` before and after each item, so each span is one stored chunk). Each byte is hashed once;
    the spans' checksums (``chunk_hasher``), covering the file front to back, are the file's."""

    def __init__(self, raw, name: str) -> None:
        self.raw, self.name = raw, name
        self.span = chunk_hasher(CHUNK_HASH, name, 0)
        self.pos = self.start = 0
        self.spans: dict[int, tuple[int, str]] = {}
        self.pool = None

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        if len(mv) >= OVERLAP_BYTES:  # the write (a system call, without the GIL) runs beside the checksum
            if self.pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self.pool = ThreadPoolExecutor(1, thread_name_prefix="q38-checkpoint-write")
            done = self.pool.submit(self.raw.write, mv)
            self.span.update(mv)
            n = done.result()
        else:
            n = self.raw.write(mv)
            self.span.update(mv)
        if n is not None and n != len(mv):
            raise OSError(f"{self.name}: wrote {n} of {len(mv)} bytes")
        self.pos += len(mv)
        return len(mv)

    def tell(self) -> int:
        n = self.pos - self.start
        if n > 0:  # the span since the last tell() is one chunk; the next starts here
            self.spans[self.start] = (n, chunk_digest(CHUNK_HASH, self.span, n))
            self.span, self.start = chunk_hasher(CHUNK_HASH, self.name, self.pos), self.pos
        return self.pos

    def seek(self, *a):
        raise io.UnsupportedOperation("a hashed checkpoint stream is written front to back")

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.tell()
            self.raw.flush()
            if self.pool is not None:
                self.pool.shutdown()
        super().close()


def hashing_writer(path: str | os.PathLike, **kw):
    """DCP's ``FileSystemWriter`` whose shard files are hashed as they are written (the checksum of each stored
    chunk, ``chunk_hasher``; together they cover the file). After its ``write_data`` each rank leaves
    ``__<rank>_chunks.json`` beside its shards; the manifest (``write_manifest``) takes the hashes from there
    instead of reading the files again."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFS(FileSystem):
        def __init__(self):
            super().__init__()
            self.streams: dict[str, _HashingStream] = {}

        @contextmanager
        def create_stream(self, p, mode):
            with super().create_stream(p, mode) as raw:
                if mode != "wb" or not DISTCP_RE.match(Path(p).name) or not HASHING:
                    yield raw
                    return
                s = _HashingStream(raw, Path(p).name)
                yield s
                s.close()
                self.streams[Path(p).name] = s

    class HashingWriter(FileSystemWriter):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.fs = HashingFS()

        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            if not HASHING:
                return fut
            results = fut.wait() if hasattr(fut, "wait") else fut.result()
            out: dict[str, Any] = {}
            for wr in results:
                info = wr.storage_data
                s = self.fs.streams.get(info.relative_path)
                if s is None:
                    continue
                e = out.setdefault(info.relative_path, {"size": s.pos, "chunk_hash": CHUNK_HASH, "chunks": {}})
                span = s.spans.get(info.offset)
                if span is not None and span[0] == info.length:
                    e["chunks"][str(info.offset)] = [span[0], span[1]]
            prefix = plan.storage_data.prefix  # "__<rank>_"
            side = Path(self.path) / f"{prefix}chunks.json"
            tmp = side.with_name(side.name + ".tmp")
            with open(tmp, "w") as f:
                json.dump(out, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, side)
            return fut

    return HashingWriter(str(path), **kw)


def streamed_hashes(ck_dir: Path) -> dict[str, dict]:
    """The hashes every rank's writer left in ``ck_dir`` (the sidecar files are removed: the manifest holds them)."""
    out: dict[str, dict] = {}
    for side in sorted(p for p in ck_dir.iterdir() if HASH_SIDECAR_RE.match(p.name)):
        out.update(json.loads(side.read_text()))
        side.unlink()
    return out


def tiles(entry: Mapping[str, Any]) -> bool:
    """The manifest entry's chunk hashes cover its file exactly, front to back (so checking every chunk checks every
    byte)."""
    chunks = entry.get("chunks")
    if not isinstance(chunks, dict) or not chunks:
        return False
    try:
        spans = sorted((int(o), int(v[0])) for o, v in chunks.items())
    except (TypeError, ValueError, IndexError):
        return False
    pos = 0
    for o, n in spans:
        if o != pos or n <= 0:
            return False
        pos += n
    return pos == entry.get("size")


# ---- reading DCP shards ---------------------------------------------------------------------------------------------


class _BufferFile(io.RawIOBase):
    """A read-only file over a memoryview (``io.BytesIO`` would copy it): what torch's zip reader needs of a chunk."""

    def __init__(self, mv: memoryview) -> None:
        self.mv, self.pos = mv, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = max(0, off if whence == 0 else self.pos + off if whence == 1 else len(self.mv) + off)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self.mv) - self.pos))
        b[:n] = self.mv[self.pos:self.pos + n]
        self.pos += n
        return n


def _load_chunk(mv: memoryview, storage: torch.UntypedStorage):
    """``torch.load(weights_only=True)`` of the ``torch.save`` archive in ``mv`` (the front of the buffer ``storage``
    views), its tensor's storage a view of that buffer rather than a copy (what ``torch.load(mmap=True)`` does with a
    file): torch's weights-only unpickler over torch's zip reader, as ``torch.load`` runs them."""
    import torch._weights_only_unpickler as weights_only
    from torch.serialization import _is_torchscript_zip, _load, _open_zipfile_reader

    with _open_zipfile_reader(_BufferFile(mv)) as z:
        if _is_torchscript_zip(z):
            raise ValueError("a TorchScript archive, not a saved tensor")
        return _load(z, "cpu", weights_only, overall_storage=storage, encoding="utf-8")


def _read_full(fh, offset: int, mv: memoryview) -> int:
    fh.seek(offset)
    got = 0
    while got < len(mv):
        n = fh.readinto(mv[got:])
        if not n:
            break
        got += n
    return got


def safe_reader(path: str | os.PathLike, manifest_files: Mapping[str, Any] | None = None):
    """A DCP storage reader for the checkpoint at ``path`` that: reads ``.metadata`` with the allow-list unpickler
    and checks it (``check_metadata``) once; opens only ``*.distcp`` files inside the checkpoint, regular files,
    never through a symlink; reads each stored chunk once into one reused buffer, checks its checksum against the
    manifest's (when the manifest holds chunk checksums), and only then unpickles it with torch's weights-only
    unpickler (its tensor a view of the buffer, copied once into its target); checks the loaded tensor's dtype and
    shape against the metadata; and refuses byte items (DCP would unpickle those with ``weights_only=False``)."""
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class SafeReader(FileSystemReader):
        _cached: Metadata | None = None

        def read_metadata(self, *args, **kwargs) -> Metadata:
            if self._cached is None:
                root = Path(self.path)
                name = ".metadata" if kwargs.get("rank") is None else f"__{kwargs['rank']}.metadata"
                f = inside(root, name, f"{root}/{name}")
                md = unpickle_metadata(f)
                check_metadata(md, root, str(f), manifest_files)
                if md.storage_meta is None:
                    md.storage_meta = StorageMeta()
                md.storage_meta.load_id = self.load_id
                self._cached = md
            return self._cached

        def read_data(self, plan, planner):
            root = Path(self.path)
            md = self.read_metadata()
            per_file: dict[str, list] = {}
            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO:
                    raise refuse_unsafe(str(root), f"{req.storage_index.fqn!r} is a byte item (q38 saves tensors only)")
                per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
            longest = max((self.storage_data[r.storage_index].length for r in plan.items), default=0)
            buf = torch.empty(longest, dtype=torch.uint8)  # every chunk is read into it, one after the other
            for rel, reqs in per_file.items():
                self._read_file(root, rel, reqs, md, planner, memoryview(buf.numpy()), buf.untyped_storage())
            fut: Future = Future()
            fut.set_result(None)
            return fut

        def _read_file(self, root: Path, rel: str, reqs: list, md, planner, buf: memoryview, storage) -> None:
            f = inside(root, rel, f"{root}/.metadata")
            ent = (manifest_files or {}).get(rel)
            chunk_hashes = ent.get("chunks") if isinstance(ent, dict) else None
            algo = ent.get("chunk_hash", "sha256") if isinstance(ent, dict) else None
            if chunk_hashes is not None and algo not in CHUNK_HASHES:
                raise CheckpointMismatch(f"{f}: the manifest names the chunk checksum {str(algo)[:40]!r}, which "
                                         f"this q38 does not know ({', '.join(CHUNK_HASHES)})")
            by_item: dict[Any, list] = {}
            for req in reqs:
                by_item.setdefault(req.storage_index, []).append(req)
            with open_regular(f, str(f)) as fh:
                for idx, rs in sorted(by_item.items(), key=lambda kv: self.storage_data[kv[0]].offset):
                    info = self.storage_data[idx]
                    mv = buf[:info.length]
                    got = _read_full(fh, info.offset, mv)
                    if got != info.length:
                        raise CheckpointMismatch(f"{f}: {got} bytes at {info.offset}, the metadata says "
                                                 f"{info.length} (truncated)")
                    if chunk_hashes is not None and HASHING:
                        want = chunk_hashes.get(str(info.offset)) if isinstance(chunk_hashes, dict) else None
                        h = chunk_hasher(algo, rel, info.offset)
                        h.update(mv)
                        if not (isinstance(want, list) and len(want) == 2 and
                                chunk_digest(algo, h, info.length) == want[1]):
                            raise CheckpointMismatch(
                                f"{f}: bytes {info.offset}..{info.offset + info.length} ({idx.fqn!r}) do not "
                                f"match their checksum in the manifest (altered or corrupt); use another checkpoint")
                    tm = md.state_dict_metadata[idx.fqn]
                    try:
                        t = _load_chunk(mv, storage)
                    except Exception as e:  # noqa: BLE001  (a corrupt record: one line naming it)
                        raise CheckpointMismatch(f"{f}: the chunk of {idx.fqn!r} at byte {info.offset} does not "
                                                 f"load ({' '.join(str(e).split())[:200]})") from None
                    chunk = next((c for c in tm.chunks if tuple(c.offsets) == tuple(idx.offset)), None)
                    if type(t) is not torch.Tensor or t.dtype != tm.properties.dtype or chunk is None or \
                            tuple(t.shape) != tuple(chunk.sizes):
                        raise CheckpointMismatch(f"{f}: the chunk of {idx.fqn!r} at byte {info.offset} holds "
                                                 f"{describe(t)} {getattr(t, 'dtype', '')} "
                                                 f"{list(getattr(t, 'shape', []))}, the metadata says "
                                                 f"{tm.properties.dtype} {list(chunk.sizes) if chunk else '?'}")
                    for req in rs:
                        part = narrow_tensor_by_index(t, req.storage_offsets, req.lengths)
                        target = planner.resolve_tensor(req).detach()
                        if target.size() != part.size():
                            raise CheckpointMismatch(f"{f}: {idx.fqn!r}: a stored part of {list(part.size())} "
                                                     f"for a target of {list(target.size())}")
                        target.copy_(part)
                        planner.commit_tensor(req, target)
                    del t  # a view of the buffer, which the next chunk overwrites

    return SafeReader(str(path))
