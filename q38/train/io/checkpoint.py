"""Training checkpoints: sharded ``torch.distributed.checkpoint`` (DCP) shards of the ``TrainState`` plus ``meta.json``.

Layout of a run directory::

    OUT_DIR/metrics.jsonl
    OUT_DIR/checkpoints/latest                  "step_000050" (written atomically; informative)
    OUT_DIR/checkpoints/step_000050/.metadata   DCP index
    OUT_DIR/checkpoints/step_000050/__*_*.distcp DCP shards: {"params.<path>", "exp_avg.<path>", "exp_avg_sq.<path>", "step"}
                                                 (bf16 + remainder masters: "params.<path>" the bf16 high half and
                                                 "master_remainder.<path>" the int16 low half; joined on load;
                                                 offloaded masters, train.offload_optimizer: "params.<path>" the
                                                 host fp32 master, as an fp32-master run saves it)
    OUT_DIR/checkpoints/step_000050/meta.json   step, model + train config, data position, layout, versions
    OUT_DIR/checkpoints/step_000050/rng/rank_00000.pt  each rank's torch RNG states

A checkpoint is written into ``step_000050.tmp-<token>`` and renamed to ``step_000050`` only once every shard and
``meta.json`` are on disk, so a crash during a save never touches the previous checkpoint, and every directory
named ``step_<digits>`` is complete. ``keep_last`` deletes only directories whose names match that pattern inside
the checkpoints directory. Parameters sharded as DTensors are saved sharded; DCP reshards on load (a checkpoint
saved on N ranks loads on M ranks or on one process, e.g. for ``q38 convert --to-hf``).
"""

import contextlib
import io
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.utils._pytree as pytree

from q38.model_config import ModelConfig
from q38.pytree import named_leaves, tree_map
from q38.train.io import untrusted
from q38.files import (  # noqa: F401  (CheckpointMismatch, UnsafeCheckpoint: re-exported)
    CheckpointMismatch, UnsafeCheckpoint, check_config_bounds, inside, load_json, open_regular, sha256_file,
)
from q38.train.io.untrusted import SAVED_DTYPES, check_keys, hashing_writer, safe_reader, streamed_hashes, tiles

FORMAT = "q38-checkpoint/1"
CHECKPOINTS = "checkpoints"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"  # written last: every file's size, and the sha256 of the small ones
SMALL_FILE_BYTES = 1 << 20  # files up to this size are checksummed (metadata, meta.json, RNG states)
LATEST_FILE = "latest"
STEP_RE = re.compile(r"^step_(\d{6,})$")
TMP_RE = re.compile(r"^step_\d{6,}\.tmp-[0-9A-Za-z]+$")


def step_dir_name(step: int) -> str:
    return f"step_{int(step):06d}"


# ---- finding checkpoints ------------------------------------------------------------------------------------------


def is_checkpoint(path: Path) -> bool:
    """Looks like a complete checkpoint (cheap; ``verify_checkpoint`` checks sizes and checksums)."""
    return (path / META_FILE).is_file() and (path / ".metadata").is_file() and (path / MANIFEST_FILE).is_file()


def write_manifest(ck_dir: Path) -> None:
    """``manifest.json``: every file under ``ck_dir`` with its size and SHA-256; a DCP shard file with the checksum of
    each stored chunk instead (``chunks``: {byte offset: [length, checksum]}, covering the file front to back;
    ``chunk_hash``: ``untrusted.chunk_hasher``). The shard files' checksums were computed by the writer while it
    wrote them (``untrusted.hashing_writer``); only files without such a record (the small ones: ``.metadata``, ``meta.json``, RNG states) are read here. Written last (fsynced), so a checkpoint with a
    manifest that verifies is complete."""
    streamed = streamed_hashes(ck_dir)
    files = {}
    for f in sorted(p for p in ck_dir.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
        rel = f.relative_to(ck_dir).as_posix()
        size = f.stat().st_size
        got = streamed.get(rel)
        if got is not None and got.get("size") == size and tiles(got):
            files[rel] = got
        elif size <= SMALL_FILE_BYTES or untrusted.HASHING:
            files[rel] = {"size": size, "sha256": sha256_file(f)}
        else:  # hashing switched off (benchmarks/checkpoint_io.py --hash-cost): sizes only, as before the hashes
            files[rel] = {"size": size, "sha256": None}
    _write_json(ck_dir / MANIFEST_FILE, {"format": FORMAT, "files": files})


def _manifest_files(path: Path) -> dict[str, Any]:
    """The ``files`` table of ``path/manifest.json`` (read bounded; one ``CheckpointMismatch`` if malformed)."""
    mf = path / MANIFEST_FILE
    manifest = load_json(mf, str(mf))
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files or not all(
            isinstance(k, str) and isinstance(v, dict) and type(v.get("size")) is int and v["size"] >= 0
            for k, v in files.items()):
        raise CheckpointMismatch(f"{mf} is unreadable or malformed (no table of files with sizes)")
    return files


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """None if the checkpoint at ``path`` is complete and intact, else why not (one phrase). Every file the manifest
    names must be a regular file inside ``path`` (no ``..``, absolute path, symlink, FIFO or device) of the recorded
    size; files up to ``SMALL_FILE_BYTES`` are hashed here; the DCP shard files are checked chunk by chunk as they
    are loaded (their chunk hashes must cover each file front to back)."""
    path = Path(path)
    if not path.is_dir():
        return "does not exist" if not path.exists() else "is not a directory"
    mf = path / MANIFEST_FILE
    if not mf.exists() and not mf.is_symlink():
        return f"no {MANIFEST_FILE} (an interrupted save, or not a q38 checkpoint)"
    try:
        files = _manifest_files(path)
    except CheckpointMismatch as e:
        return f"{MANIFEST_FILE} is unreadable or malformed ({str(e).removeprefix(str(mf) + ': ')})"
    for req in (META_FILE, ".metadata"):
        if req not in files:
            return f"{MANIFEST_FILE} does not list {req}"
    for rel, info in files.items():
        try:
            f = inside(path, rel, f"{MANIFEST_FILE} entry {rel!r}")
            with open_regular(f, f"{MANIFEST_FILE} entry {rel!r}") as fh:
                size = os.fstat(fh.fileno()).st_size
        except CheckpointMismatch as e:
            if "is missing" in str(e):
                return f"{rel} is missing"
            return str(e).split(" (a crafted")[0].replace(": refused: ", ": ")
        if size != info.get("size"):
            return f"{rel} is {size} bytes, the manifest says {info.get('size')} (truncated or altered)"
        if "chunks" in info:
            if not tiles(info):
                return f"{MANIFEST_FILE}: the chunk hashes of {rel} do not cover the file"
        elif size <= SMALL_FILE_BYTES or info.get("sha256"):
            if not isinstance(info.get("sha256"), str):
                if size <= SMALL_FILE_BYTES:
                    return f"{MANIFEST_FILE} holds no checksum for {rel}"
            elif sha256_file(f) != info["sha256"]:
                return f"{rel} does not match its checksum in {MANIFEST_FILE} (altered or corrupt)"
    return None


def step_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_<digits>`` directory in ``root``, complete or not, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir())


def newest_verified(root: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest checkpoint in ``root`` that verifies, and one line per newer one skipped (naming it and why)."""
    skipped = []
    for _, p in reversed(step_dirs(root)):
        why = verify_checkpoint(p)
        if why is None:
            return p, skipped
        skipped.append(f"skipped checkpoint {p}: {why}")
    return None, skipped


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete checkpoints in a checkpoints directory, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and is_checkpoint(p):
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step in ``root`` (a checkpoints directory), or None."""
    ck, _ = newest_verified(root)
    return ck


def resolve_checkpoint(path: str | os.PathLike, on_skip=None) -> Path:
    """A checkpoint directory, a run's ``checkpoints`` directory or a run directory → one checkpoint (the newest
    that verifies; ``on_skip(line)`` is called for each newer one skipped)."""
    p = Path(path)
    if is_checkpoint(p) or any((p / n).exists() or (p / n).is_symlink() for n in (META_FILE, MANIFEST_FILE)):
        why = verify_checkpoint(p)
        if why is not None:
            raise CheckpointMismatch(f"checkpoint {p} does not verify: {why}")
        return p
    skipped: list[str] = []
    for root in (p / CHECKPOINTS, p):
        ck, sk = newest_verified(root)
        skipped += sk
        if ck is not None:
            for line in sk:
                if on_skip is not None:
                    on_skip(line)
            return ck
    what = "does not exist" if not p.exists() else "holds no complete q38 checkpoint"
    if skipped:
        what = f"holds no checkpoint that verifies ({skipped[0].removeprefix('skipped checkpoint ')})"
    raise FileNotFoundError(
        f"{p} {what}; pass a run directory (with checkpoints/step_*), a checkpoints directory or a checkpoint "
        f"directory (with {META_FILE})"
    )


def read_meta(path: str | os.PathLike) -> dict:
    """``meta.json`` of the checkpoint at ``path`` (read bounded, never through a symlink); its ``step`` must be a
    non-negative int and, for a ``step_<digits>`` directory, the step of its name."""
    f = Path(path) / META_FILE
    meta = load_json(f, f"{f}")
    if not isinstance(meta, dict):
        raise CheckpointMismatch(f"{f}: not a JSON object; is this a q38 checkpoint?")
    if meta.get("format") != FORMAT:
        raise CheckpointMismatch(f"{f}: format {str(meta.get('format'))[:60]!r}, expected {FORMAT!r}")
    step = meta.get("step")
    if type(step) is not int or not 0 <= step < 1 << 62:
        raise CheckpointMismatch(f"{f}: step {str(step)[:40]!r} is not a step number")
    m = STEP_RE.match(Path(path).name)
    if m and int(m.group(1)) != step:
        raise CheckpointMismatch(f"{f}: step {step}, but the checkpoint directory is {Path(path).name}; the "
                                 "checkpoint was altered")
    if not isinstance(meta.get("model_config"), dict):
        raise CheckpointMismatch(f"{f}: no model_config table; is this a q38 checkpoint?")
    check_config_bounds(meta["model_config"], f"{f} model_config")
    pd = meta.get("param_dtype", "float32")
    if not (isinstance(pd, str) and isinstance(getattr(torch, pd, None), torch.dtype) and
            getattr(torch, pd) in SAVED_DTYPES):
        raise CheckpointMismatch(f"{f}: param_dtype {str(pd)[:40]!r} is not a dtype q38 saves")
    return meta


# ---- model-config checks --------------------------------------------------------------------------------------------


# Fields of a model config that describe its tokenizer, not its weights: an export writes the tokenizer's ids there
# (docs/hf_checkpoints.md#what-an-export-holds), so a checkpoint and a config that differ only in them hold one model.
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def config_diff(expected: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    """``["hidden_size: checkpoint 64, config 128", ...]`` over the union of keys (``TOKEN_ID_FIELDS`` aside)."""
    out = []
    for k in sorted((set(expected) | set(got)) - set(TOKEN_ID_FIELDS)):
        a, b = expected.get(k, "<absent>"), got.get(k, "<absent>")
        if a != b:
            out.append(f"{k}: checkpoint {a!r}, config {b!r}")
    return out


def check_model_config(meta: Mapping[str, Any], model: ModelConfig, where: str) -> None:
    """Refuse a checkpoint whose recorded model config differs from ``model`` (naming the differing fields)."""
    stored = ModelConfig.from_dict(meta["model_config"], source=f"{where}/{META_FILE}").to_dict()
    diff = config_diff(stored, model.to_dict())
    if diff:
        shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
        raise CheckpointMismatch(
            f"checkpoint {where} was made for another model config ({shown}); train the checkpoint's model, "
            "or start a new run (another run.out_dir, or run.resume: false with an empty out_dir)"
        )


# ---- distributed helpers (no-ops on one process) -----------------------------------------------------------------


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def _barrier() -> None:
    d = _dist()
    if d:
        d.barrier()


def _broadcast(obj):
    d = _dist()
    if not d:
        return obj
    box = [obj]
    d.broadcast_object_list(box, src=0)
    return box[0]


def _dcp_save(state_dict: dict, path: Path, planner=None) -> None:
    """DCP save; with a ``planner`` (one that produces tensors as they are written) through DCP's serial writer,
    which asks for one tensor after the other (``per_thread_copy_ahead=0``: no read-ahead)."""
    import torch.distributed.checkpoint as dcp

    kw = {} if planner is None else {"thread_count": 1, "per_thread_copy_ahead": 0}
    writer = hashing_writer(path, **kw)  # the shard files' SHA-256, computed as they stream out
    with warnings.catch_warnings():  # one process: DCP warns that it runs without a process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state_dict, storage_writer=writer, no_dist=_dist() is None, planner=planner)


def checkpoint_reader(path: str | os.PathLike):
    """A DCP storage reader for the checkpoint at ``path`` (``q38.train.io.untrusted.safe_reader``): its ``.metadata``
    read by the allow-list unpickler and checked field by field at once (an unsafe or corrupt one raises here, on
    every rank, before any collective); each stored chunk checked against the manifest's SHA-256 as it is read."""
    path = Path(path)
    files = None
    if (path / MANIFEST_FILE).exists() or (path / MANIFEST_FILE).is_symlink():
        files = _manifest_files(path)
    reader = safe_reader(path, files)
    reader.read_metadata()
    return reader


def _dcp_load(state_dict: dict, path: Path, reader=None, *, collective: bool = True,
              model: ModelConfig | None = None) -> None:
    """Load ``state_dict``'s tensors (DTensors: this rank's shards only) from the checkpoint at ``path``.
    ``collective=False``: this process alone (each rank may then load different keys). Before anything is read,
    every requested key must be saved with its global shape and, with ``model``, every saved key must be one q38
    writes for that model."""
    import torch.distributed.checkpoint as dcp

    reader = reader or checkpoint_reader(path)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()}
    check_keys(reader.read_metadata(), expected, expected_keys(model) if model is not None else None,
               f"checkpoint {path}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state_dict, storage_reader=reader, no_dist=_dist() is None or not collective)
        except Exception as e:  # DCP wraps a rank's refusal in a CheckpointException: raise the refusal itself
            inner = _refusal_in(e)
            if inner is None:
                raise
            raise inner from None


def _refusal_in(e: BaseException) -> CheckpointMismatch | None:
    """The ``CheckpointMismatch`` a rank raised inside DCP, unwrapped from DCP's ``CheckpointException``."""
    for _ in range(8):
        if isinstance(e, CheckpointMismatch):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
            e = inner[0] if isinstance(inner, tuple) and inner else getattr(inner, "exc", inner)
        elif e.__cause__ is not None:
            e = e.__cause__
        else:
            return None
        if not isinstance(e, BaseException):
            return None
    return None


def saved_tensors(path: Path, reader=None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (global shape, dtype)}`` of every tensor in the DCP checkpoint at ``path`` (from its metadata)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = (reader or checkpoint_reader(path)).read_metadata()
    return {k: (tuple(m.size), m.properties.dtype) for k, m in md.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rng_state() -> dict:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(st: Mapping[str, Any]) -> None:
    torch.set_rng_state(st["cpu"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


# ---- writing --------------------------------------------------------------------------------------------------------


def state_dict_of(tree) -> dict:
    """``{dotted path: tensor}`` of a pytree (a ``TrainState`` gives params.*, exp_avg.*, exp_avg_sq.*, step); a LoRA
    run's frozen base is left out (its checkpoint references the base instead: ``q38.train.io.peft``)."""
    from q38.train.core.state import frozen_names

    frozen = frozen_names(tree)
    sd = {n: t for n, t in named_leaves(tree) if n not in frozen}
    for k in [k for k in sd if k.startswith("host_master.")]:  # an offloaded master is saved as the fp32 master it
        sd[f"params.{k.removeprefix('host_master.')}"] = sd.pop(k)  # is: the checkpoint of an fp32-master run
    return sd


def write_checkpoint(final: str | os.PathLike, state, meta: Mapping[str, Any], *, planner=None) -> Path:
    """Write ``state`` (a ``TrainState`` or a ``{key: tensor}`` dict; DCP shards, every rank) and ``meta`` (rank 0)
    into a temporary sibling of ``final``, then rename it to ``final``. Collective when a process group is
    initialised. ``planner``: a DCP save planner (``q38.train.io.hf_io`` streams an import through one)."""
    final = Path(final)
    if not final.name:
        raise ValueError(f"checkpoint path {str(final)!r} has no directory name")
    rank = _rank()
    with shared_tmp_dir(_tmp_name(final)) as tmp:
        sd = state if isinstance(state, dict) else state_dict_of(state)
        _dcp_save(sd, tmp) if planner is None else _dcp_save(sd, tmp, planner)
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
        _barrier()
        if rank == 0:
            _publish(tmp, final, meta)
    _barrier()
    return final


def _tmp_name(final: Path) -> Path:
    """A fresh temporary sibling of ``final``, the same name on every rank. Collective."""
    token = _broadcast(f"{os.getpid()}x{int(time.time() * 1000) % 10**8}")
    return final.parent / f"{final.name}.tmp-{token}"


def _make_shared_dir(tmp: Path) -> Path:
    """``tmp`` made by rank 0 for every rank to write into. Collective."""
    if _rank() == 0:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    _barrier()
    return tmp


@contextlib.contextmanager
def shared_tmp_dir(tmp: Path) -> Iterator[Path]:
    """``tmp`` made by rank 0 for every rank to write into, and removed by rank 0 when the enclosed writes fail (a
    complete one is renamed away by then). Collective on entry."""
    _make_shared_dir(tmp)
    ok = False
    try:
        yield tmp
        ok = True
    finally:
        if not ok and _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, final: Path, meta: Mapping[str, Any]) -> None:
    """Rank 0, once every rank's shards are in ``tmp``: ``meta.json``, then the manifest (last: its presence and a
    match mark the checkpoint complete), then the rename to ``final``."""
    _write_json(tmp / META_FILE, dict(meta, format=FORMAT))
    write_manifest(tmp)
    _fsync_dir(tmp)
    old = None
    if final.exists():  # re-saving the same step: move the old one aside, then drop it
        old = final.parent / f"{final.name}.tmp-old{tmp.name.rpartition('.tmp-')[2]}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _point_latest(root: Path, step: int, keep_last: int) -> None:
    if _rank() == 0:
        tmp = root / f"{LATEST_FILE}.tmp-{os.getpid()}"
        tmp.write_text(step_dir_name(step) + "\n")
        os.replace(tmp, root / LATEST_FILE)
        prune(root, keep_last)
    _barrier()


def save_checkpoint(root: str | os.PathLike, state, meta: Mapping[str, Any], *, keep_last: int = 0) -> Path:
    """Save ``state`` as ``root/step_<step>`` (atomic), point ``root/latest`` at it and keep the last ``keep_last``
    checkpoints (0: all). Collective when a process group is initialised."""
    root = Path(root)
    step = int(meta["step"])
    path = write_checkpoint(root / step_dir_name(step), state, meta)
    _point_latest(root, step, keep_last)
    return path


class AsyncSave:
    """One checkpoint written in the background while training goes on (``run.async_save``).

    ``AsyncSave(root, state, meta, group=...)`` stages this rank's shards of ``state`` to host memory (pinned on an
    accelerator; the staged copy is what gets written, so later steps cannot change it), writes its RNG state, and
    starts DCP's ``async_save`` on a thread, coordinating over ``group`` (a gloo group of its own, so its collectives
    never interleave with the step's). ``running()`` asks this rank's write; once every rank's has finished (the
    trainer agrees on that with the step's stop-flag all-reduce) ``finish()`` publishes it as ``save_checkpoint``
    does: ``meta.json`` and the manifest only after every rank's shards are on disk, then the rename and
    ``latest``. Until then the directory is a ``.tmp-`` one: a kill -9 at any moment leaves the newest complete
    checkpoint as it was, and the next save prunes the leftover. A failed write raises from ``finish()``."""

    def __init__(self, root: str | os.PathLike, state, meta: Mapping[str, Any], *, keep_last: int = 0,
                 group=None, pinned: bool = False) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.root, self.meta, self.keep_last = Path(root), dict(meta), keep_last
        self.step = int(meta["step"])
        self.final = self.root / step_dir_name(self.step)
        self.tmp = _make_shared_dir(_tmp_name(self.final))
        (self.tmp / "rng").mkdir(exist_ok=True)
        torch.save(rng_state(), self.tmp / "rng" / f"rank_{_rank():05d}.pt")
        sd = _stageable(state if isinstance(state, dict) else state_dict_of(state))
        stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=False))
        if _dist() is None:  # one process: DCP warns from its writer thread, after any catch_warnings here ended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        self._stager = stager
        self.future = dcp.async_save(sd, storage_writer=hashing_writer(self.tmp), process_group=group,
                                     async_stager=stager, no_dist=_dist() is None)

    def running(self) -> bool:
        """Whether this rank's background write is still going."""
        return not self.future.done()

    def finish(self) -> Path:
        """Wait for this rank's write (raising its error), then publish the checkpoint. Collective."""
        try:
            self.future.result()
        finally:
            self._stager.close()
        _barrier()
        if _rank() == 0:
            _publish(self.tmp, self.final, self.meta)
        _barrier()
        _point_latest(self.root, self.step, self.keep_last)
        return self.final


def _stageable(sd: dict) -> dict:
    """``sd`` with every tensor copied (this rank's shards; a DTensor rewrapped around its copy). A donated step
    (``train_step(..., donate=True)``) writes the state's buffers in place right after the save returns; these copies
    are what DCP's stager reads. (Handed the buffers of a state that donated steps keep, DCP's stager failed on 2
    gloo ranks with "copy_() on an invalid python storage"; a pure step's fresh tensors never showed it.)"""
    import torch
    from torch.distributed.tensor import DTensor

    def copy(t):
        if isinstance(t, DTensor):
            return DTensor.from_local(t._local_tensor.clone(), t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
        return t.clone() if isinstance(t, torch.Tensor) else t

    return {k: copy(t) for k, t in sd.items()}


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints (0: keep all) and leftovers of interrupted saves.

    Only entries of ``root`` whose names match ``step_<digits>`` or ``step_<digits>.tmp-<token>`` are touched."""
    if not str(root) or not root.is_dir():
        return []
    removed = []
    doomed = [p for _, p in list_checkpoints(root)[:-keep_last]] if keep_last > 0 else []
    doomed += [p for p in root.iterdir() if TMP_RE.match(p.name) and p.is_dir()]
    for p in doomed:
        if p.parent == root and (STEP_RE.match(p.name) or TMP_RE.match(p.name)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


# ---- reading --------------------------------------------------------------------------------------------------------


def load_checkpoint(path: str | os.PathLike, template) -> tuple[Any, dict]:
    """Load the checkpoint at ``path`` into the shapes, dtypes and placements of ``template`` (a ``TrainState``;
    plain tensors or DTensors). Returns ``(state, meta)``; refuses another model config and restores this rank's
    RNG state."""
    path = Path(path)
    meta = read_meta(path)
    check_model_config(meta, template.model_config, str(path))
    flat, spec = pytree.tree_flatten(template)
    names = [n for n, _ in named_leaves(template)]
    sd = dict(zip(names, flat))
    fresh = {}
    from q38.train.core.state import frozen_names

    for n in frozen_names(template):  # a LoRA run's base: the template already holds it (built from the reference)
        fresh[n] = sd.pop(n)
    if "router_bias" in sd and not (meta.get("train_config") or {}).get("aux_loss_free"):
        fresh["router_bias"] = sd.pop("router_bias")  # aux_loss_free switched on at resume: start from zero bias
    # offloaded masters (q38.offload): "params.<path>" loads into the host fp32 master, then cast into the device leaf
    compute = {}
    for k in [k for k in sd if k.startswith("host_master.")]:
        q = f"params.{k.removeprefix('host_master.')}"
        compute[q], sd[q] = sd[q], sd.pop(k)
    reader = checkpoint_reader(path)
    split, joined = _master_conversions(sd, saved_tensors(path, reader))
    _dcp_load(sd, path, reader, model=template.model_config)
    _convert_masters(sd, split, joined)
    for q, leaf in compute.items():
        _local(leaf).copy_(_local(sd[q]))  # master.to(param_dtype): a cast copy, round to nearest even
        sd[f"host_master.{q.removeprefix('params.')}"], sd[q] = sd[q], leaf
    saved_step = _scalar(sd["step"]) if "step" in sd else meta["step"]
    if saved_step != meta["step"]:
        raise CheckpointMismatch(f"checkpoint {path}: {META_FILE} says step {meta['step']}, its saved state is at step "
                                 f"{saved_step}; the checkpoint was altered or mixed from two saves")
    sd.update(fresh)
    state = pytree.tree_unflatten([sd[n] for n in names], spec)
    rng_dir = path / "rng"
    own = f"rng/rank_{_rank():05d}.pt"
    rel = own if (path / own).exists() else "rng/rank_00000.pt"
    if (path / rel).exists() or (path / rel).is_symlink():
        rng_file = inside(path, rel, f"checkpoint {path}")
        with open_regular(rng_file, str(rng_file)) as fh:
            set_rng_state(torch.load(io.BytesIO(fh.read(1 << 24)), weights_only=True))
    del rng_dir
    return state, meta


def _like(t, dtype):
    """An empty tensor shaped and placed like ``t`` (a DTensor: its local shard) in ``dtype``."""
    if not hasattr(t, "to_local"):
        return torch.empty(t.shape, dtype=dtype, device=t.device)
    from torch.distributed.tensor import DTensor

    local = t.to_local()
    return DTensor.from_local(torch.empty(local.shape, dtype=dtype, device=local.device), t.device_mesh,
                              t.placements, run_check=False, shape=t.shape, stride=t.stride())


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _master_conversions(sd: dict, saved: dict) -> tuple[dict, dict]:
    """Load a checkpoint saved with another ``train.master_dtype`` exactly (``q38.remainder``), leaf by leaf:
    ``split``: {parameter path: (high, remainder)} of the template's bf16 + remainder leaves saved as fp32 masters
    (``sd`` then loads each fp32 master into a temporary, split after the load); ``joined``: {parameter path:
    remainder temporary} of the template's fp32 masters saved as bf16 + remainder (``sd`` loads the high half into
    the fp32 leaf, a cast that is exact, and the remainder into the temporary; ``_convert_masters`` joins them)."""
    split, joined = {}, {}
    for k in [k for k in sd if k.startswith("params.")]:
        q = k.removeprefix("params.")
        rk = f"master_remainder.{q}"
        if rk in sd and rk not in saved:  # saved as an fp32 master (or another dtype): loaded in fp32, then split
            split[q] = (sd[k], sd.pop(rk))
            sd[k] = _like(split[q][0], torch.float32)
        elif rk not in sd and rk in saved and sd[k].dtype == torch.float32:  # saved split, wanted as fp32
            joined[q] = sd[rk] = _like(sd[k], torch.int16)
    return split, joined


def _convert_masters(sd: dict, split: dict, joined: dict) -> None:
    """After the load: ``_master_conversions``' leaves split into their template's halves, or joined in place."""
    from q38 import remainder as rm

    for q, (high, rem) in split.items():
        master = sd[f"params.{q}"]
        rm.split_(_local(master).contiguous(), _local(high), _local(rem))
        sd[f"params.{q}"], sd[f"master_remainder.{q}"] = high, rem
    for q, rem in joined.items():
        master = sd[f"params.{q}"]
        _local(master).copy_(rm.join(_local(master).to(torch.bfloat16), _local(sd.pop(f"master_remainder.{q}"))))


def master_dtypes(saved: dict) -> dict:
    """``saved`` (``saved_tensors``) with each bf16 + remainder parameter's dtype given as its master's, fp32 (what
    ``load_params`` returns and an export of the saved dtypes writes)."""
    out = dict(saved)
    for k in saved:
        if k.startswith("master_remainder."):
            q = f"params.{k.removeprefix('master_remainder.')}"
            if q in out:
                out[q] = (out[q][0], torch.float32)
    return out


def _scalar(t) -> int:
    """The value of a saved 0-dim step tensor (a plain tensor, or a DTensor replicated on every rank)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.reshape(-1)[0].item()) if local.numel() else -1


def check_saved_params(reader, model: ModelConfig, path) -> None:
    """Before any tensor is allocated: the checkpoint's index (``reader``) holds every parameter of ``model`` with
    its shape, and no tensor a q38 checkpoint of ``model`` never holds."""
    from q38.model import init_params

    want = {f"params.{n}": (tuple(t.shape), t.dtype) for n, t in named_leaves(init_params(model, device="meta"))}
    check_keys(reader.read_metadata(), want, expected_keys(model), f"checkpoint {path}")


def expected_keys(model: ModelConfig) -> set[str]:
    """Every tensor key a q38 checkpoint of ``model`` may hold: ``params.<leaf>``, the two AdamW moments of each,
    its ``master_remainder`` (bf16 + remainder masters), ``step`` and the router bias of ``aux_loss_free``; for a
    LoRA run, a weight's frozen ``.base`` and its adapter matrices (``q38.lora.ADAPTER_KEYS``) in place of the
    weight."""
    from q38.lora import ADAPTER_KEYS
    from q38.model import init_params

    names = [n for n, _ in named_leaves(init_params(model, device="meta"))]
    names += [f"{n}.{k}" for n in names for k in ("base", *ADAPTER_KEYS)]
    moments = {f"{p}.{n}{q}" for p in ("exp_avg", "exp_avg_sq") for n in names for q in ("", ".codes", ".scales")}
    remainders = {f"master_remainder.{n}" for n in names}  # bf16 + remainder masters (q38.remainder)
    return ({f"params.{n}" for n in names} | moments | remainders
            | {"step", "router_bias"})  # (.codes/.scales: int8 moments)


def empty_params(model: ModelConfig, *, device=None, dtype=None, mesh=None):
    """Uninitialised parameter tensors of ``model`` (the targets a checkpoint loads into); with ``mesh``, DTensors of
    which each rank allocates only its own shards."""
    if mesh is not None:
        from q38.parallel.mesh import empty_sharded

        return empty_sharded(model, mesh, device=device, dtype=dtype)
    from q38.model import init_params

    meta_params = init_params(model, device="meta", dtype=dtype)
    return tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), meta_params)


def load_params(path: str | os.PathLike, *, device=None, dtype=None, mesh=None) -> tuple[ModelConfig, Any, dict]:
    """``(model config, params, meta)`` of a q38 checkpoint (a checkpoint, checkpoints or run directory); the
    optimizer moments are not read; bf16 + remainder masters are joined into their fp32 masters. ``dtype``: cast,
    or ``dtype(path)`` per parameter (default: the dtype the parameters were saved in). ``mesh``: the parameters as
    DTensors of that mesh's layout, each rank reading only its shards."""
    path = resolve_checkpoint(path)
    meta = read_meta(path)
    cfg = ModelConfig.from_dict(meta["model_config"], source=f"{path}/{META_FILE}")
    saved = getattr(torch, meta.get("param_dtype", "float32"))
    reader = checkpoint_reader(path)
    check_saved_params(reader, cfg, path)
    params = empty_params(cfg, device=device, dtype=saved, mesh=mesh)
    sd = {f"params.{n}": t for n, t in named_leaves(params)}
    # bf16 + remainder masters: each high half loads into its fp32 leaf (exact) and is joined with its remainder
    _, joined = _master_conversions(sd, saved_tensors(path, reader))
    _dcp_load(sd, path, reader, model=cfg)
    _convert_masters(sd, {}, joined)
    if callable(dtype):  # a dtype per parameter (TrainConfig.compute_dtype)
        from q38.pytree import tree_map_with_path

        params = tree_map_with_path(lambda p, t: t.to(dtype(p)), params)
    elif dtype is not None and dtype != saved:
        params = tree_map(lambda t: t.to(dtype), params)
    return cfg, params, meta
