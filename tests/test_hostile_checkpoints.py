"""Hostile checkpoints built only from the types a restricted metadata reader has to accept (issue 35).

Each case alters a real q38 checkpoint the way an attacker who can write the whole directory would (the manifest is
rewritten to match) and loads it with ``q38 convert --to-hf`` (or ``q38 train``) in a forked child process. Every
case must: exit 2 with one line naming the problem; leave no payload marker; leave the watched victim file outside
the checkpoint unread and unchanged (content, mtime, and atime on a filesystem that updates it); finish under a
timeout; and grow the child's peak RSS by less than ``MEM_BOUND``. The ``test_plain_dcp_*`` cases run the same
attacks against ``torch.distributed.checkpoint`` with its default reader, which shows they are real: the payload
runs, the victim is read, a FIFO or a hash bomb hangs, a flipped bit loads silently.
"""

import io
import json
import os
import pickle
import shutil
import signal
import struct
import sys
import time
from pathlib import Path

import pytest
import torch

from q38.cli import main
from q38.train.io import checkpoint as ck
from tests.run_utils import small_model_dict

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MEM_BOUND = 200 << 20  # peak RSS growth of a loading child over its parent, bytes
TIMEOUT = 30.0  # seconds for one refused load (they take well under one)
HANG = 2.0  # seconds after which a plain-DCP case counts as hung


# ---- harness --------------------------------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def in_child(fn, tmp: Path, timeout: float = TIMEOUT) -> dict:
    """Run ``fn()`` (returning an exit code) in a forked child with stderr to a file: its exit code (None when it
    was killed after ``timeout``), stderr lines, peak RSS growth over this process's RSS, and seconds taken."""
    err = tmp / f"stderr-{time.monotonic_ns()}"
    rss0 = err.with_suffix(".rss")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        code = 97
        try:
            try:  # the peak RSS counts from here (the child starts with the pages the fork gave it)
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass
            rss0.write_text(str(_rss()))
            fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 2)
            sys.stderr = os.fdopen(fd, "w", buffering=1)  # pytest's capture object is not fd 2
            torch.set_num_threads(1)  # no OpenMP pool after fork
            code = fn()
        except BaseException as e:  # noqa: BLE001
            print(f"child raised {type(e).__name__}: {e}", file=sys.stderr)
            code = 98
        finally:
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 96)
    status, ru = None, None
    while time.monotonic() - t0 < timeout:
        got, status, ru = os.wait4(pid, os.WNOHANG)
        if got:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, signal.SIGKILL)
        _, status, ru = os.wait4(pid, 0)
        status = None
    lines = [ln for ln in err.read_text().splitlines() if ln.strip()] if err.exists() else []
    code = os.waitstatus_to_exitcode(status) if status is not None else None
    base = int(rss0.read_text()) if rss0.exists() and rss0.read_text() else 0
    return {"code": code, "lines": lines, "grew": ru.ru_maxrss * 1024 - base, "s": time.monotonic() - t0}


class Victim:
    """A file outside the checkpoint: its content, mtime and (where the filesystem keeps it) atime are watched."""

    def __init__(self, tmp: Path) -> None:
        self.path = tmp / "victim.distcp"
        buf = io.BytesIO()
        torch.save(torch.arange(64, dtype=torch.float32), buf)
        self.data = buf.getvalue()
        self.path.write_bytes(self.data)
        old = time.time() - 3 * 86400
        os.utime(self.path, (old, old))  # relatime updates an atime older than a day on the next read
        st = os.stat(self.path)
        self.mtime, self.atime = st.st_mtime_ns, st.st_atime_ns
        probe = tmp / "atime-probe"
        probe.write_bytes(b"x")
        os.utime(probe, (old, old))
        a = os.stat(probe).st_atime_ns
        probe.read_bytes()
        self.atime_works = os.stat(probe).st_atime_ns != a

    def read(self) -> bool:
        """Whether anything read the victim (call before ``changed``, which reads it)."""
        return self.atime_works and os.stat(self.path).st_atime_ns != self.atime

    def changed(self) -> bool:
        return os.stat(self.path).st_mtime_ns != self.mtime or self.path.read_bytes() != self.data


def _meta_pickle(d: Path):
    """The checkpoint's ``Metadata`` (read with plain pickle: these are files this test wrote itself)."""
    return pickle.loads((d / ".metadata").read_bytes())


def _seal(d: Path) -> None:
    """Rewrite ``manifest.json`` to match the directory as it is now (as an attacker can): sizes and SHA-256 of
    every regular file; links and special files are listed with the size of what they name (0 for a FIFO)."""
    import hashlib

    files = {}
    for p in sorted(d.rglob("*")):
        rel = p.relative_to(d).as_posix()
        if rel == "manifest.json" or (p.is_dir() and not p.is_symlink()):
            continue
        if p.is_symlink() or not p.is_file():
            try:
                size = 0 if not p.exists() or not p.is_file() or str(os.path.realpath(p)).startswith("/dev/") \
                    else p.stat().st_size
            except OSError:
                size = 0
            files[rel] = {"size": size, "sha256": None}
            continue
        files[rel] = {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    (d / "manifest.json").write_text(json.dumps({"format": ck.FORMAT, "files": files}))


def _write_md(d: Path, md) -> None:
    (d / ".metadata").write_bytes(pickle.dumps(md, protocol=4))


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).write_text('ran')",)


# ---- the cases: each alters a checkpoint directory in place ---------------------------------------------------------


def _first_key(md) -> str:
    return next(k for k in md.state_dict_metadata if k.startswith("params."))


def case_bytes_code(d: Path, tmp: Path, victim: Victim) -> str:
    """A tensor key declared as pickled bytes whose bytes are a payload: DCP hands them to
    ``torch.load(weights_only=False)``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    md = _meta_pickle(d)
    k = _first_key(md)
    f = next(d.glob("*.distcp"))
    payload = pickle.dumps(_Payload(tmp / "MARKER"), protocol=2)
    start = f.stat().st_size
    with open(f, "ab") as fh:
        fh.write(payload)
    md.state_dict_metadata[k] = BytesStorageMetadata()
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != k}
    md.storage_data[MetadataIndex(k)] = _StorageInfo(f.name, start, len(payload))
    _write_md(d, md)
    return "BytesStorageMetadata"


def _build_pickle(module: str, name: str, state) -> bytes:
    """A pickle that BUILDs ``state`` onto the global ``module.name`` itself (a class or a function)."""
    body = pickle.dumps(state, protocol=4)[2:-1]  # the state's opcodes without PROTO/STOP (and its FRAME)
    if body[:1] == pickle.FRAME:
        body = body[9:]
    return b"\x80\x04" + pickle.GLOBAL + f"{module}\n{name}\n".encode() + body + pickle.BUILD + pickle.STOP


def case_build_on_class(d: Path, tmp: Path, victim: Victim) -> str:
    """BUILD on an allowed class: every ``PosixPath`` in the process would gain the attacker's attribute."""
    (d / ".metadata").write_bytes(_build_pickle("pathlib", "PosixPath", (None, {"q38_pwned": str(victim.path)})))
    return "sets the state of"


def case_build_on_function(d: Path, tmp: Path, victim: Victim) -> str:
    (d / ".metadata").write_bytes(_build_pickle("torch.serialization", "_get_layout", {"cache": {"x": 1}}))
    return "sets the state of"


def _all_storage_to(d: Path, rel: str) -> None:
    md = _meta_pickle(d)
    for info in md.storage_data.values():
        info.relative_path = rel
    _write_md(d, md)


def case_dotdot(d: Path, tmp: Path, victim: Victim) -> str:
    _all_storage_to(d, os.path.relpath(victim.path, d))
    return "is not a DCP shard file name"


def case_absolute(d: Path, tmp: Path, victim: Victim) -> str:
    _all_storage_to(d, str(victim.path))
    return "is not a DCP shard file name"


def _replace_shards(d: Path, make) -> None:
    for f in d.glob("*.distcp"):
        f.unlink()
        make(f)


def case_symlink(d: Path, tmp: Path, victim: Victim) -> str:
    _replace_shards(d, lambda f: f.symlink_to(victim.path))
    return "symbolic link"


def case_fifo(d: Path, tmp: Path, victim: Victim) -> str:
    _replace_shards(d, lambda f: os.mkfifo(f))
    return "FIFO"


def case_dev_zero(d: Path, tmp: Path, victim: Victim) -> str:
    _replace_shards(d, lambda f: f.symlink_to("/dev/zero"))
    return "symbolic link"


def case_manifest_dotdot(d: Path, tmp: Path, victim: Victim) -> str:
    """The manifest names a file outside: checking its checksum would read it."""
    _seal(d)
    m = json.loads((d / "manifest.json").read_text())
    m["files"][os.path.relpath(victim.path, d)] = {"size": victim.path.stat().st_size, "sha256": "0" * 64}
    (d / "manifest.json").write_text(json.dumps(m))
    return "leaves its directory"


def case_meta_fifo(d: Path, tmp: Path, victim: Victim) -> str:
    (d / "meta.json").unlink()
    os.mkfifo(d / "meta.json")
    return "FIFO"


def case_rng_symlink(d: Path, tmp: Path, victim: Victim) -> str:
    (d / "rng" / "rank_00000.pt").unlink()
    (d / "rng" / "rank_00000.pt").symlink_to(victim.path)
    return "symbolic link"


def case_mark_bomb(d: Path, tmp: Path, victim: Victim) -> str:
    (d / ".metadata").write_bytes(b"\x80\x04" + pickle.MARK * 200_000 + pickle.STOP)
    return "nests deeper"


def _hash_bomb(levels: int = 120) -> bytes:
    """A dict whose key is a tuple DAG of 2**levels leaves in a few hundred bytes: hashing it never ends."""
    out = [b"\x80\x04", pickle.EMPTY_DICT, pickle.MEMOIZE, pickle.EMPTY_TUPLE, pickle.MEMOIZE, pickle.POP]
    for i in range(1, levels + 1):
        out += [pickle.BINGET, bytes([i]), pickle.BINGET, bytes([i]), pickle.TUPLE2, pickle.MEMOIZE, pickle.POP]
    out += [pickle.BINGET, bytes([levels + 1]), pickle.NONE, pickle.SETITEM, pickle.STOP]
    return b"".join(out)


def case_hash_bomb(d: Path, tmp: Path, victim: Victim) -> str:
    (d / ".metadata").write_bytes(_hash_bomb())
    return "a dict key"


def case_deep_list(d: Path, tmp: Path, victim: Victim) -> str:
    """planner_data holding a list nested 20 000 deep through the memo (the unpickler's stack never grows)."""
    md = _meta_pickle(d)
    md.planner_data = None
    good = pickle.dumps(md, protocol=2)  # no frames: opcodes can be spliced in
    base, n = 1 << 20, 20_000

    def put(i):
        return pickle.LONG_BINPUT + struct.pack("<I", base + i)

    def get(i):
        return pickle.LONG_BINGET + struct.pack("<I", base + i)

    deep = [pickle.EMPTY_LIST, put(0), pickle.POP]
    for i in range(n):
        deep += [pickle.EMPTY_LIST, get(i), pickle.APPEND, put(i + 1), pickle.POP]
    deep.append(get(n))
    at = good.index(b"planner_data")
    none_at = good.index(pickle.NONE, at)
    (d / ".metadata").write_bytes(good[:none_at] + b"".join(deep) + good[none_at + 1:])
    return "planner_data"


def case_absurd_shape(d: Path, tmp: Path, victim: Victim) -> str:
    md = _meta_pickle(d)
    k = _first_key(md)
    tm = md.state_dict_metadata[k]
    tm.size = torch.Size([1 << 40, 1 << 40])
    _write_md(d, md)
    return "more than the"


def case_chunk_bigger_than_its_bytes(d: Path, tmp: Path, victim: Victim) -> str:
    """A shape within the limits whose data the file cannot hold: 1 Gi elements claimed for a few KB."""
    md = _meta_pickle(d)
    k = _first_key(md)
    tm = md.state_dict_metadata[k]
    tm.size = torch.Size([1 << 15, 1 << 15])
    for c in tm.chunks:
        c.sizes = torch.Size([1 << 15, 1 << 15])
        c.offsets = torch.Size([0, 0])
    for i in list(md.storage_data):
        if i.fqn == k:
            md.storage_data[type(i)(k, torch.Size([0, 0]))] = md.storage_data.pop(i)
    _write_md(d, md)
    return "data bytes"


def _edit_meta(d: Path, fn) -> None:
    meta = json.loads((d / "meta.json").read_text())
    fn(meta)
    (d / "meta.json").write_text(json.dumps(meta))


def case_meta_absurd_size(d: Path, tmp: Path, victim: Victim) -> str:
    _edit_meta(d, lambda m: m["model_config"].update(hidden_size=10**15))
    return "exceeds the limit"


def case_meta_absurd_layers(d: Path, tmp: Path, victim: Victim) -> str:
    _edit_meta(d, lambda m: m["model_config"].update(num_hidden_layers=10**8, layer_types=None))
    return "exceeds the limit 4096"


def case_meta_step_lie(d: Path, tmp: Path, victim: Victim) -> str:
    _edit_meta(d, lambda m: m.update(step=7))
    return "step 7, but the checkpoint directory is step_000001"


def case_flipped_bit(d: Path, tmp: Path, victim: Victim) -> str:
    """An accident, not an attack: one bit of a parameter's stored bytes flips (the manifest stays as saved)."""
    md = _meta_pickle(d)
    k = _first_key(md)
    info = next(s for i, s in md.storage_data.items() if i.fqn == k)
    f = d / info.relative_path
    b = bytearray(f.read_bytes())
    b[info.offset + info.length // 2] ^= 0x10
    f.write_bytes(bytes(b))
    return "do not match their checksum"


def _equal_chunks(d: Path) -> tuple:
    """Two stored chunks of one shard file with the same length (two tensors of one shape and dtype)."""
    md = _meta_pickle(d)
    seen: dict = {}
    for i, info in md.storage_data.items():
        key = (info.relative_path, info.length)
        if key in seen:
            return seen[key], info
        seen[key] = info
    pytest.fail("the test checkpoint holds no two chunks of one length in one file")


def case_swapped_chunks(d: Path, tmp: Path, victim: Victim) -> str:
    """Two chunks of the same length trade places in their shard file, and their manifest entries trade places too:
    a checksum of the bytes alone, looked up by offset, still matches, and the two tensors would load swapped. The
    checksum covers the chunk's file and offset, so it does not."""
    a, b = _equal_chunks(d)
    f = d / a.relative_path
    raw = bytearray(f.read_bytes())
    ra, rb = bytes(raw[a.offset:a.offset + a.length]), bytes(raw[b.offset:b.offset + b.length])
    assert ra != rb
    raw[a.offset:a.offset + a.length], raw[b.offset:b.offset + b.length] = rb, ra
    f.write_bytes(bytes(raw))
    m = json.loads((d / "manifest.json").read_text())
    chunks = m["files"][a.relative_path]["chunks"]
    chunks[str(a.offset)], chunks[str(b.offset)] = chunks[str(b.offset)], chunks[str(a.offset)]
    (d / "manifest.json").write_text(json.dumps(m))
    return "do not match their checksum"


CASES = [case_bytes_code, case_build_on_class, case_build_on_function, case_dotdot, case_absolute, case_symlink,
         case_fifo, case_dev_zero, case_manifest_dotdot, case_meta_fifo, case_rng_symlink, case_mark_bomb,
         case_hash_bomb, case_deep_list, case_absurd_shape, case_chunk_bigger_than_its_bytes, case_meta_absurd_size,
         case_meta_absurd_layers, case_meta_step_lie, case_flipped_bit, case_swapped_chunks]
# the attacker's manifest is part of the case / an accident
NO_RESEAL = {case_manifest_dotdot, case_flipped_bit, case_swapped_chunks}


def _state(seed: int = 1):
    from q38.model_config import ModelConfig
    from q38.train.core.step_config import TrainConfig
    from q38.train.core.state import init_state

    return init_state(ModelConfig.from_dict(small_model_dict()), TrainConfig(), seed=seed)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A q38 checkpoint of the small test model at step 1 (saved by q38's writer; no training needed), copied for
    each case."""
    import q38.hf  # noqa: F401  (imported here once, so each forked child starts with it)
    import q38.train.io.hf_io  # noqa: F401

    root = tmp_path_factory.mktemp("good")
    state = _state()
    sd = ck.state_dict_of(state)
    sd["step"] = torch.tensor(1)
    meta = {"step": 1, "model_config": state.model_config.to_dict(), "param_dtype": "float32"}
    return ck.write_checkpoint(root / "checkpoints" / "step_000001", sd, meta)


def _check(res: dict, expect: str, victim: Victim, marker: Path) -> str:
    assert res["code"] is not None, f"hung (killed after {TIMEOUT} s)"
    assert res["code"] == 2 and len(res["lines"]) == 1, res
    assert expect in res["lines"][0], res["lines"]
    assert not marker.exists(), "the payload ran"
    assert not victim.read(), "the victim outside the checkpoint was read"
    assert not victim.changed(), "the victim outside the checkpoint was changed"
    assert res["grew"] < MEM_BOUND, f"peak RSS grew by {res['grew'] >> 20} MiB"
    return res["lines"][0]


SLOW = {case_build_on_function, case_absolute, case_dev_zero, case_meta_fifo, case_rng_symlink, case_mark_bomb,
        case_deep_list, case_chunk_bigger_than_its_bytes, case_meta_absurd_layers}  # kin of a default case


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES],
                         ids=lambda c: c.__name__.removeprefix("case_"))
def test_hostile_checkpoint_is_refused(case, good, tmp_path):
    d = tmp_path / "step_000001"
    shutil.copytree(good, d, symlinks=True)
    victim = Victim(tmp_path)
    expect = case(d, tmp_path, victim)
    if case not in NO_RESEAL:
        _seal(d)
    out = tmp_path / "hf"
    res = in_child(lambda: main(["convert", "--to-hf", str(d), str(out)]), tmp_path)
    line = _check(res, expect, victim, tmp_path / "MARKER")
    assert str(d) in line or d.name in line  # names the checkpoint or its file
    assert not out.exists()


def test_step_lie_outside_a_step_directory_is_caught_by_the_saved_step(good, tmp_path):
    """A checkpoint copied under another name (as ``run.resume_from`` may name it): meta.json's step is checked
    against the step the saved state holds when the state is loaded."""
    d = tmp_path / "mine"
    shutil.copytree(good, d, symlinks=True)
    _edit_meta(d, lambda m: m.update(step=7))
    _seal(d)
    victim = Victim(tmp_path)
    template = _state(seed=2)

    def resume() -> int:
        try:
            ck.load_checkpoint(d, template)
        except ck.CheckpointMismatch as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0

    _check(in_child(resume, tmp_path), "its saved state is at step 1", victim, tmp_path / "MARKER")


def test_an_intact_checkpoint_still_converts_in_the_child(good, tmp_path):
    """The harness itself: the same load of an unaltered copy succeeds (exit 0) within the memory bound."""
    d = tmp_path / "step_000001"
    shutil.copytree(good, d, symlinks=True)
    res = in_child(lambda: main(["convert", "--to-hf", str(d), str(tmp_path / "hf")]), tmp_path)
    assert res["code"] == 0, res
    assert (tmp_path / "hf" / "config.json").is_file() and res["grew"] < MEM_BOUND


# ---- the same attacks against plain DCP (its default reader) ---------------------------------------------------------


@pytest.fixture
def plain(tmp_path):
    """A small checkpoint written by ``torch.distributed.checkpoint.save`` and the state dict that loads it."""
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "plain"
    dcp.save({"params.a": torch.arange(256, dtype=torch.float32), "params.b": torch.ones(4)}, checkpoint_id=str(d),
             no_dist=True)
    return d


def _plain_load(d: Path, check=None):
    def run() -> int:
        import torch.distributed.checkpoint as dcp

        sd = {"params.a": torch.zeros(256), "params.b": torch.zeros(4)}
        try:
            dcp.load(sd, checkpoint_id=str(d), no_dist=True)
        except BaseException:  # noqa: BLE001  (DCP's CheckpointException; what matters is what happened on the way)
            pass
        return check(sd) if check else 0

    return run


def test_plain_dcp_runs_the_bytes_payload(plain, tmp_path):
    victim = Victim(tmp_path)
    case_bytes_code(plain, tmp_path, victim)
    in_child(_plain_load(plain), tmp_path)
    assert (tmp_path / "MARKER").exists()


def test_plain_dcp_lets_build_change_a_class(plain, tmp_path):
    case_build_on_class(plain, tmp_path, Victim(tmp_path))

    def changed(sd) -> int:
        import pathlib

        if getattr(pathlib.PosixPath, "q38_pwned", None):
            (tmp_path / "MARKER").write_text("class changed")
        return 0

    res = in_child(_plain_load(plain, changed), tmp_path)
    assert (tmp_path / "MARKER").exists(), res


@pytest.mark.parametrize("how", [pytest.param("dotdot", marks=pytest.mark.slow),
                                 pytest.param("absolute", marks=pytest.mark.slow), "symlink"])
def test_plain_dcp_reads_outside_the_checkpoint(plain, tmp_path, how):
    victim = Victim(tmp_path)
    if not victim.atime_works:
        pytest.skip("this filesystem does not update atime: a read cannot be observed")
    {"dotdot": case_dotdot, "absolute": case_absolute, "symlink": case_symlink}[how](plain, tmp_path, victim)
    in_child(_plain_load(plain), tmp_path)
    assert victim.read()


@pytest.mark.slow
def test_plain_dcp_hangs_on_a_fifo(plain, tmp_path):
    case_fifo(plain, tmp_path, Victim(tmp_path))
    assert in_child(_plain_load(plain), tmp_path, timeout=HANG)["code"] is None


def test_plain_dcp_hangs_on_a_hash_bomb(plain, tmp_path):
    (plain / ".metadata").write_bytes(_hash_bomb())
    assert in_child(_plain_load(plain), tmp_path, timeout=HANG)["code"] is None


def test_plain_dcp_loads_a_flipped_bit_silently(plain, tmp_path):
    f = next(plain.glob("*.distcp"))
    raw = f.read_bytes()
    at = raw.index(torch.arange(256, dtype=torch.float32).numpy().tobytes()) + 4 * 100 + 2
    b = bytearray(raw)
    b[at] ^= 0x10
    f.write_bytes(bytes(b))

    def differs(sd) -> int:
        a = sd["params.a"]
        if (a != torch.arange(256, dtype=torch.float32)).sum() == 1:
            (tmp_path / "MARKER").write_text("loaded a wrong value")
        return 0

    in_child(_plain_load(plain, differs), tmp_path)
    assert (tmp_path / "MARKER").exists()


# ---- Hugging Face directories and prepared data ----------------------------------------------------------------------


def _hf_dir(tmp: Path) -> Path:
    """A small directory of the Hugging Face layout: config.json and one safetensors file."""
    from safetensors.torch import save_file

    d = tmp / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "hidden_size": 64,
                                               "num_hidden_layers": 2, "rope_scaling": None}))
    save_file({"w": torch.ones(4, 8), "b": torch.zeros(8)}, str(d / "model.safetensors"))
    return d


def _safetensors_header(f: Path, edit) -> None:
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (n - len(new)) if len(new) <= n else b""
    f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _hf_check(d: Path) -> int:
    from q38.train.io.dirs import check_safetensors_dir

    try:
        check_safetensors_dir(d, "init_from")
    except ValueError as e:  # ConfigError
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


@pytest.mark.parametrize("how", ["config_size", pytest.param("config_layers", marks=pytest.mark.slow), "header_shape",
                                 pytest.param("header_dtype", marks=pytest.mark.slow), "fifo"])
def test_hostile_hf_directory_is_refused(tmp_path, how):
    d = _hf_dir(tmp_path)
    victim = Victim(tmp_path)
    assert in_child(lambda: _hf_check(d), tmp_path)["code"] == 0  # the intact directory passes
    f = d / "model.safetensors"
    if how == "config_size":
        (d / "config.json").write_text(json.dumps({"hidden_size": 10**15}))
        expect = "hidden_size = 1000000000000000 exceeds the limit"
    elif how == "config_layers":
        (d / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 10**9}}))
        expect = "text_config.num_hidden_layers = 1000000000 exceeds the limit 4096"
    elif how == "header_shape":  # 2**40 elements claimed for the 128 bytes of "w"
        _safetensors_header(f, lambda h: h["w"].update(shape=[1 << 20, 1 << 20]))
        expect = "needs 4398046511104 bytes, its header gives it 128"
    elif how == "header_dtype":
        _safetensors_header(f, lambda h: h["w"].update(dtype="Q99"))
        expect = "dtype 'Q99'"
    else:
        f.unlink()
        os.mkfifo(f)
        expect = "FIFO"
    _check(in_child(lambda: _hf_check(d), tmp_path), expect, victim, tmp_path / "MARKER")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from q38.train.data.prepare import prepare_data

    out = tmp_path_factory.mktemp("prep") / "tiny"
    prepare_data(["builtin:tiny"], out, progress=False, log=lambda s: None, chunk_bytes=20_000)
    return out


def _rows(d: Path) -> int:
    from q38.train.data.loader import DataError
    from q38.train.data.shards import ShardRows
    from q38.train.data.tokenizer import ByteTokenizer

    try:
        import numpy as np

        src = ShardRows(d, 16, tokenizer=ByteTokenizer(), vocab_size=261)
        src.rows(np.arange(len(src)))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


@pytest.mark.parametrize("how", ["docs_past_tokens", pytest.param("docs_decreasing", marks=pytest.mark.slow),
                                 "count_lie", pytest.param("name_escape", marks=pytest.mark.slow), "symlink"])
def test_hostile_prepared_data_is_refused(prepared, tmp_path, how):
    import numpy as np

    d = tmp_path / "data"
    shutil.copytree(prepared, d)
    victim = Victim(tmp_path)
    man = json.loads((d / "manifest.json").read_text())
    s0 = man["shards"][0]
    docs_f = d / f"{s0['name']}.docs"
    docs = np.fromfile(docs_f, dtype=np.int64)
    if how == "docs_past_tokens":
        docs[1] = s0["tokens"] + 10**9
        docs.tofile(docs_f)
        expect = f"offset 1 is {s0['tokens'] + 10**9}, the shard has {s0['tokens']} tokens"
    elif how == "docs_decreasing":
        docs[2] = docs[1] - 1
        docs.tofile(docs_f)
        expect = "is below the one before it"
    elif how == "count_lie":
        man["num_tokens"] += 1
        (d / "manifest.json").write_text(json.dumps(man))
        expect = "is not the sum of its shards' tokens"
    elif how == "name_escape":
        s0["name"] = "../victim"
        (d / "manifest.json").write_text(json.dumps(man))
        expect = "has no plain file name"
    else:
        (d / f"{s0['name']}.tokens").unlink()
        (d / f"{s0['name']}.tokens").symlink_to(victim.path)
        expect = "symbolic link"
    _check(in_child(lambda: _rows(d), tmp_path), expect, victim, tmp_path / "MARKER")


def test_every_file_of_a_checkpoint_has_a_hash_computed_while_it_was_written(good):
    """The manifest hashes every file: the small ones whole (SHA-256), each DCP shard file chunk by chunk (the chunks
    cover the file front to back); every chunk's checksum is XXH3-128 of its file name and offset, its bytes on disk
    and its length, as docs/checkpoints.md defines it (computed here with xxhash directly)."""
    import hashlib
    import struct

    import xxhash

    from q38.train.io.untrusted import tiles

    files = json.loads((good / "manifest.json").read_text())["files"]
    on_disk = {p.relative_to(good).as_posix() for p in good.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(files) == on_disk and not any("chunks.json" in f for f in on_disk)  # the writers' records merged
    shards = [f for f in files if f.endswith(".distcp")]
    assert shards
    for rel, e in files.items():
        raw = (good / rel).read_bytes()
        assert e["size"] == len(raw)
        if rel in shards:
            assert tiles(e) and len(e["chunks"]) > 1 and e["chunk_hash"] == "xxh3-128"
            for off, (n, h) in e["chunks"].items():
                want = xxhash.xxh3_128(f"q38-chunk\0{rel}\0{off}\0".encode() + raw[int(off):int(off) + n] +
                                       struct.pack("<Q", n)).hexdigest()
                assert want == h
        else:
            assert e["sha256"] == hashlib.sha256(raw).hexdigest()


def test_a_lora_base_whose_shard_is_a_fifo_is_refused_not_waited_on(tmp_path):
    """A LoRA run hashes its base's safetensors files (no index file): a FIFO named like a shard is refused on the
    open descriptor; a plain ``open`` would wait for a writer forever (the alarm turns that into a failure)."""
    from q38.train.io.peft import base_reference

    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text("{}")
    os.mkfifo(d / "model-00001-of-00001.safetensors")

    def waited(*_):
        raise TimeoutError("base_reference waited on a FIFO")

    old = signal.signal(signal.SIGALRM, waited)
    signal.alarm(10)
    try:
        with pytest.raises(Exception, match="not a regular file") as e:
            base_reference(str(d), 0)
        assert not isinstance(e.value, TimeoutError)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _as_sha256_manifest(d: Path) -> None:
    """Rewrite the manifest as q38 wrote it before XXH3 (issue 40): each chunk's plain SHA-256, no ``chunk_hash``."""
    import hashlib

    m = json.loads((d / "manifest.json").read_text())
    for rel, e in m["files"].items():
        if "chunks" in e:
            raw = (d / rel).read_bytes()
            del e["chunk_hash"]
            e["chunks"] = {o: [n, hashlib.sha256(raw[int(o):int(o) + n]).hexdigest()] for o, (n, _) in
                           e["chunks"].items()}
    (d / "manifest.json").write_text(json.dumps(m))


def test_a_checkpoint_with_sha256_chunk_hashes_still_loads_and_is_checked(good, tmp_path):
    """Checkpoints written before the XXH3 checksums (SHA-256 per chunk) load to the same values, and a flipped bit in
    one is still refused; an unknown checksum name is refused by name."""
    d = tmp_path / "step_000001"
    shutil.copytree(good, d, symlinks=True)
    _as_sha256_manifest(d)
    want, _ = ck.load_checkpoint(good, _state(seed=2))
    got, _ = ck.load_checkpoint(d, _state(seed=2))
    for (n, a), (_, b) in zip(ck.named_leaves(want), ck.named_leaves(got)):
        assert torch.equal(a, b), n
    case_flipped_bit(d, tmp_path, None)
    with pytest.raises(BaseException) as e:
        ck.load_checkpoint(d, _state(seed=2))
    assert "do not match their checksum" in str(ck._refusal_in(e.value))
    d2 = tmp_path / "other"
    shutil.copytree(good, d2, symlinks=True)
    m = json.loads((d2 / "manifest.json").read_text())
    for ent in m["files"].values():
        if "chunks" in ent:
            ent["chunk_hash"] = "md5"
    (d2 / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BaseException) as e:
        ck.load_checkpoint(d2, _state(seed=2))
    assert "names the chunk checksum 'md5', which this q38 does not know" in str(ck._refusal_in(e.value))
