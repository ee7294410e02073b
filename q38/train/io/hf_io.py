"""Moving a model between Hugging Face directories and q38 state at the scale of the model: no process ever holds
more than its own shards plus a few tensors in flight.

* ``load_hf_sharded``: ``init_from`` a HF directory on a mesh; each rank reads, with safetensors ``get_slice``, only
  the slices of HF tensors that fall in its shards (a grouped Qwen3-Next projection: that one tensor, keeping the
  slice).
* ``export_checkpoint``: a q38 checkpoint → a HF directory (``q38 convert --to-hf``, ``run.save_hf``). One process
  or every rank of a process group: rank ``r`` writes output files ``r, r + W, ...``, reading from the DCP checkpoint
  only the parameters those files hold, one conversion rule at a time. Byte-identical to ``q38.hf.save_hf`` of the
  same parameters, however it is split.
* ``import_hf``: a HF directory → a q38 checkpoint (``q38 convert --from-hf``) through DCP with a save planner that
  reads each tensor only when DCP writes it (and the zero AdamW moments the same way); under a process group each
  rank writes a share of the tensors.

Every path checks on each rank what it reads and agrees on failure with one collective (``all_ranks_ok``), so a
corrupt file is one clear error on every rank, never one rank raising while the others wait.

Why safetensors slices rather than torch DCP's ``HuggingFaceStorageReader``: that reader maps HF keys one-to-one onto
state-dict keys, while q38's leaves are conversions of HF tensors (fused experts assembled from per-expert keys,
the conv weight reshaped, grouped projections split); the slice reader serves each of those with the rule tables of
``q38.hf`` that ``load_hf`` and ``save_hf`` use too.
"""

import fnmatch
import os
from pathlib import Path
from typing import Any, Callable

import torch

from q38.model_config import ConfigError, ModelConfig
from q38.fp8 import FP8_DTYPE, Fp8Format, default_quantized
from q38.hf import (
    DEFAULT_MAX_SHARD_BYTES, ExportExtras, HFReader, export_tmp_dir, fp8_dtypes, open_hf, plan_export, publish_export,
)
from q38.train.io.checkpoint import (
    _barrier, _broadcast, _dcp_load, _dist, _fsync_dir, _rank, check_saved_params, checkpoint_reader, master_dtypes,
    read_meta,
    saved_tensors,
    shared_tmp_dir, write_checkpoint,
)


def _world() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


class RankFailed(ConfigError):
    """Another rank failed during a collective load or export; the message carries that rank's one line."""


def all_ranks_ok(fn: Callable[[], Any], what: str):
    """Run ``fn`` on every rank and agree on the outcome with one ``all_gather_object``: a rank whose ``fn``
    raised re-raises its own error; every other rank raises ``RankFailed`` naming that rank and its message. So a
    bad file read by one rank stops every rank at the same point instead of leaving the others in a collective."""
    err: Exception | None = None
    out = None
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001  (re-raised below, on this rank and as RankFailed on the others)
        err = e
    d = _dist()
    if d is None:
        if err is not None:
            raise err
        return out
    msgs: list = [None] * d.get_world_size()
    d.all_gather_object(msgs, None if err is None else f"{type(err).__name__}: {str(err).splitlines()[0]}")
    if err is not None:
        raise err
    bad = [(r, m) for r, m in enumerate(msgs) if m]
    if bad:
        r, m = bad[0]
        raise RankFailed(f"{what} failed on rank {r}: {m}")
    return out


# ---- HF → sharded parameters ----------------------------------------------------------------------------------------


def load_hf_sharded(path: str | os.PathLike, mesh, *, dtype=None, device=None, mtp_num_layers: int | None = None,
                    mtp_shared_layer: bool | None = None):
    """``(ModelConfig, params)`` of a HF directory as DTensors on ``mesh``: each rank reads only its shards'
    slices (of a block-FP8 weight: the slice's e4m3 values and the scales of the blocks it touches, dequantized).
    Equal to ``shard(load_hf(path))`` (tested on every shipped layout)."""
    from q38.parallel.mesh import build_sharded

    src = all_ranks_ok(lambda: open_hf(path, mtp_num_layers=mtp_num_layers, mtp_shared_layer=mtp_shared_layer),
                       f"opening {path}")

    def read():
        with HFReader(src, dtype=dtype, device=device) as reader:
            return build_sharded(src.config, mesh, lambda leaf, info, index: reader.block(leaf, index))

    return src.config, all_ranks_ok(read, f"reading {path}")


# ---- q38 checkpoint → HF ----------------------------------------------------------------------------------------------


def _leaf_loader(ck: Path, reader, saved: dict) -> Callable[[tuple[str, ...]], tuple]:
    """``load(names)``: those parameters, whole, from the DCP checkpoint (this process alone; in their saved dtype:
    each output tensor is cast, or quantized, to its own export dtype)."""

    from q38.train.io.checkpoint import _convert_masters, _master_conversions

    masters = master_dtypes(saved)  # a bf16 + remainder master is read as its fp32 master, joined

    def load(names: tuple[str, ...]) -> tuple:
        sd = {}
        for q in names:
            shape, dt = masters[f"params.{q}"]
            sd[f"params.{q}"] = torch.empty(shape, dtype=dt, device="cpu")  # on its way to a file
        _, joined = _master_conversions(sd, saved)
        _dcp_load(sd, ck, reader, collective=False)
        _convert_masters(sd, {}, joined)
        return tuple(sd[f"params.{q}"] for q in names)

    return load


SOURCE = "source"  # export_checkpoint's dtype: each tensor as the source checkpoint stored it (see export_dtypes)
FP8 = "fp8"  # export_checkpoint's dtype: block-FP8


def export_dtypes(meta: dict, dtype, saved: dict) -> tuple[Callable[[str], torch.dtype], Fp8Format | None]:
    """``(dtype of each q38 leaf, block-FP8 format or None)`` of an export of a checkpoint with metadata ``meta``.

    ``dtype``: a torch dtype casts every leaf; ``None`` keeps the saved dtypes; ``"source"``: each leaf in the dtype
    the checkpoint's source stored it in (``meta["source_format"]``, recorded when a Hugging Face checkpoint was
    imported or used as ``init_from``; block-FP8 again for an FP8 source), or, without a source, the run's compute
    dtype (``train_config.param_dtype``) with the ``fp32_params`` leaves in fp32; ``"fp8"``: block-FP8 (the leaves
    the source quantized, or by default the projections: ``q38.fp8.DEFAULT_QUANTIZED``), every other leaf as
    ``"source"`` gives it (bf16 where that would be fp32 masters)."""
    from q38.model import generic_path
    from q38.train.core.step_config import TrainConfig

    if isinstance(dtype, torch.dtype):
        return (lambda q: dtype), None
    if dtype is None:
        return (lambda q: saved[f"params.{q}"][1]), None
    if dtype not in (SOURCE, FP8):
        raise ValueError(f"export dtype must be a torch dtype, None, {SOURCE!r} or {FP8!r}; got {dtype!r}")
    src = meta.get("source_format") or None
    tc = meta.get("train_config") or {}
    if src is not None:
        table = src["dtypes"]

        def stored(q: str) -> torch.dtype:
            name = table.get(q, table.get(generic_path(q)))
            if name is None:  # a leaf the source did not have
                return getattr(torch, tc.get("param_dtype", "bfloat16"))
            return getattr(torch, name)
    else:
        tconf = TrainConfig.from_dict({k: v for k, v in tc.items() if k in ("param_dtype", "fp32_params")})
        stored = tconf.compute_dtype
    fmt = Fp8Format.from_dict(src["fp8"]) if src is not None and src.get("fp8") else None
    if dtype == SOURCE:
        return stored, fmt
    quantized = (lambda q: stored(q) == FP8_DTYPE) if fmt is not None else default_quantized

    def unquantized(q: str) -> torch.dtype:
        dt = stored(q)
        return torch.bfloat16 if src is None and dt == torch.float32 and not _is_fp32_leaf(q, tc) else dt

    return fp8_dtypes(unquantized, quantized), fmt or Fp8Format()


def source_fp32_params(source_format: dict | None) -> tuple[str, ...]:
    """The vector leaf kinds (``layers.*.mixer.A_log``) a source stores in fp32 beside 16-bit (or FP8) weights: the
    ones a run from it keeps in fp32 in compute (added to ``train.fp32_params``). A source all in fp32 marks none.
    Only 1-D leaves (decays, biases, norm weights: the layers compute with them in fp32 and return the activation's
    dtype); a matrix stored in fp32 is exported in fp32 again but computed in ``param_dtype`` (a matmul takes one
    dtype)."""
    from q38.model import declared_params, generic_path

    if not source_format:
        return ()
    dtypes = source_format["dtypes"]
    if not any(dt in ("bfloat16", "float16", "float8_e4m3fn") for dt in dtypes.values()):
        return ()
    decl = declared_params()
    kinds = {generic_path(k) for k, dt in dtypes.items() if dt in ("float32", "float64")}
    return tuple(sorted(k for k in kinds if k in decl and len(decl[k].shape) == 1))


def init_source_format(init_from) -> dict | None:
    """The ``source_format`` of a run's ``init_from``: a Hugging Face directory's (``HFSource.source_format``), the
    one a q38 checkpoint's metadata carries, or None."""
    from q38.train.io.checkpoint import is_checkpoint, resolve_checkpoint

    if not init_from:
        return None
    src = Path(init_from)
    if (src / "config.json").is_file() and not is_checkpoint(src):
        from q38.train.io.dirs import check_safetensors_dir

        check_safetensors_dir(src, "init_from")  # config.json parses, every safetensors file is whole
        return open_hf(src).source_format()
    return read_meta(resolve_checkpoint(src)).get("source_format")


def _is_fp32_leaf(q: str, tc: dict) -> bool:
    from q38.train.core.step_config import DEFAULT_FP32_PARAMS

    return any(fnmatch.fnmatchcase(q, pat) for pat in tc.get("fp32_params", DEFAULT_FP32_PARAMS))


def export_checkpoint(ck: str | os.PathLike, out: str | os.PathLike, *, dtype=None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, extras: ExportExtras | None = None) -> Path:
    """Write the parameters of the q38 checkpoint ``ck`` as a HF directory ``out`` (atomic: built in a temporary
    sibling, renamed when every rank's files are complete). Collective under a process group (each rank writes its
    share of the files); at most one conversion rule's tensors in memory per rank. ``dtype``: a torch dtype (cast
    every tensor), ``None`` (the saved dtype), ``"source"`` (each tensor in the dtype of the Hugging Face checkpoint
    the run started from, block-FP8 included) or ``"fp8"`` (block-FP8): see ``export_dtypes``. ``extras``: the
    tokenizer files, ``generation_config.json`` and token ids written with the weights. (A LoRA checkpoint
    holds adapters, not a model: ``q38.train.io.peft_export.export_merged`` writes its merged model.)"""
    ck, out = Path(ck), Path(out)

    def prepare():
        meta = read_meta(ck)
        if meta.get("peft"):
            raise ConfigError(f"{ck} is a LoRA checkpoint (adapters only); export its merged model with "
                              "q38.train.io.peft_export.export_merged (`q38 convert --to-hf`)")
        cfg = ModelConfig.from_dict(meta["model_config"], source=f"{ck}/meta.json")
        reader = checkpoint_reader(ck)
        check_saved_params(reader, cfg, ck)  # the index agrees with meta.json's model before anything is allocated
        saved = saved_tensors(ck, reader)
        missing = [q for q in _param_names(cfg) if f"params.{q}" not in saved]
        if missing:
            raise ConfigError(f"checkpoint {ck} lacks parameters {missing[:4]} (not a q38 checkpoint of "
                              f"{cfg.model_type}?)")
        # bf16 + remainder masters export as the fp32 masters they are (joined as each is read)
        dtypes, fp8 = export_dtypes(meta, dtype, master_dtypes(saved))
        export = plan_export(cfg, dtypes, max_shard_bytes=max_shard_bytes, fp8=fp8)
        return reader, saved, export

    reader, saved, export = all_ranks_ok(prepare, f"reading checkpoint {ck}")
    return write_export(export, out, lambda: _leaf_loader(ck, reader, saved), f"exporting {ck} to {out}", extras)


def write_export(export, out: Path, make_load: Callable[[], Callable[[tuple[str, ...]], tuple]], what: str,
                 extras: ExportExtras | None = None) -> Path:
    """The collective half of an export: every rank writes output files ``rank, rank + W, ...`` of ``export`` (a
    ``q38.hf.HFExport``) into a shared temporary sibling of ``out``, reading the q38 leaves of each conversion rule
    through ``make_load()(names)`` (called once per rank); rank 0 then writes ``config.json`` (and the index, and
    ``extras``) and renames the directory over ``out``. A failure on any rank is one error on every rank
    (``all_ranks_ok``)."""
    rank, world = _rank(), _world()
    with shared_tmp_dir(export_tmp_dir(out, _broadcast(os.urandom(4).hex()))) as tmp:
        def write():
            load = make_load()
            for i in range(rank, len(export.files), world):
                export.write_file(tmp, i, load)

        all_ranks_ok(write, what)
        if rank == 0:
            export.write_metadata(tmp, extras)
            _fsync_dir(tmp)
            publish_export(tmp, out)
            _fsync_dir(out.parent)
    _barrier()
    return out


def _param_names(cfg: ModelConfig) -> list[str]:
    from q38.model import abstract_params, is_param_info
    from q38.pytree import named_leaves

    return [p for p, info in named_leaves(abstract_params(cfg), is_leaf=is_param_info) if info is not None]


# ---- HF → q38 checkpoint --------------------------------------------------------------------------------------------


def _lazy_planner(make: Callable[[str], torch.Tensor]):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class LazySavePlanner(DefaultSavePlanner):
        """Plans from ``meta`` tensors; each tensor is produced by ``make(key)`` only when DCP writes it, and its
        memory is released when the next one is asked for. This relies on DCP's serial writer (which
        ``write_checkpoint`` selects for a planner): it asks for item k + 1 only after item k is in the file. (The
        writer also keeps each written tensor in a dict for its safetensors format; the release keeps that from
        holding the whole state.)"""

        _last = None

        def resolve_data(self, write_item):
            if self._last is not None:
                self._last.untyped_storage().resize_(0)
            t = make(write_item.index.fqn)
            self._last = t if t.numel() > 1 else None  # the step scalar belongs to the caller
            return t

    return LazySavePlanner()


def _share(sizes: dict[str, int], world: int) -> list[set[str]]:
    """Keys split over ``world`` ranks, largest first onto the least-loaded rank (balanced bytes)."""
    load = [0] * world
    out: list[set[str]] = [set() for _ in range(world)]
    for k in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].add(k)
        load[r] += sizes[k]
    return out


def import_hf(src: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype | None = None,
              mtp_num_layers: int | None = None, mtp_shared_layer: bool | None = None,
              train_config=None) -> tuple[ModelConfig, dict]:
    """Write the HF directory ``src`` as a q38 checkpoint ``out`` (parameters, zero AdamW moments, step 0), streamed:
    each tensor is read (and each moment made) only when DCP writes it. Collective under a process group (each rank
    writes a share of the tensors). ``dtype`` None keeps each stored dtype (block-FP8 weights dequantized to fp32);
    the metadata records the source's dtypes and FP8 format (``source_format``) for an export in the same form.
    Returns ``(config, meta)``."""
    import q38
    from q38.train.core.step_config import TrainConfig

    src, out = Path(src), Path(out)
    hf = all_ranks_ok(lambda: open_hf(src, mtp_num_layers=mtp_num_layers, mtp_shared_layer=mtp_shared_layer),
                      f"opening {src}")
    cfg = hf.config
    tc = train_config or TrainConfig()
    if tc.aux_loss_free:
        raise ConfigError("import_hf writes no router bias; import with a train config without aux_loss_free")
    shapes = {q: tuple(s) for q, s in _abstract_shapes(cfg).items()}

    reader = HFReader(hf, dtype=dtype)
    dtypes = {q: dtype or reader.stored_dtype(q) for q in shapes}
    plan = {f"params.{q}": (shapes[q], dtypes[q]) for q in shapes}
    plan.update({f"{m}.{q}": (shapes[q], torch.float32) for m in ("exp_avg", "exp_avg_sq") for q in shapes})
    sizes = {k: dt.itemsize * int(torch.Size(s).numel()) for k, (s, dt) in plan.items()}
    mine = _share(sizes, _world())[_rank()]
    sd: dict[str, torch.Tensor] = {k: torch.empty(s, dtype=dt, device="meta") for k, (s, dt) in plan.items()
                                   if k in mine}
    sd["step"] = torch.zeros((), dtype=torch.int64, device="cpu")  # written to a file, never to a collective

    def make(key: str) -> torch.Tensor:
        if key == "step":
            return sd["step"]
        kind, q = key.split(".", 1)
        if kind != "params":
            return torch.zeros(shapes[q], dtype=torch.float32, device="cpu")
        return reader.block(q, tuple(slice(0, n) for n in shapes[q]))

    # the dtype a load allocates every parameter in: the widest stored one (an fp32 A_log beside bf16 weights loads
    # unrounded)
    widest = max(set(dtypes.values()), key=lambda dt: dt.itemsize)
    meta = {"step": 0, "model_config": cfg.to_dict(), "train_config": tc.to_dict(),
            "param_dtype": str(widest).removeprefix("torch."), "source": str(src), "data": None,
            "source_format": hf.source_format(),
            "q38_version": q38.__version__, "torch_version": torch.__version__}
    with reader:
        all_ranks_ok(lambda: write_checkpoint(out, sd, meta, planner=_lazy_planner(make)), f"importing {src}")
    return cfg, meta


def _abstract_shapes(cfg: ModelConfig) -> dict:
    from q38.hf import _abstract_shapes as shapes

    return shapes(cfg)
