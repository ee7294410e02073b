"""LoRA runs (docs/finetuning.md#lora): the train state of a ``peft`` run and the reference its checkpoints keep to
the frozen base.

A LoRA checkpoint holds the adapters, their AdamW moments and the step (no base weights), and ``meta.json`` names
the base: for a Hugging Face directory ``{"init_from": path, "format": "tensor-sha256", "sha256": ..., "tensors":
{key: digest}}`` (the bytes of every tensor, ``weights_reference``), for a q38 checkpoint ``{"init_from": path,
"sha256": ...}`` (its manifest, which holds every file's SHA-256), for a fresh base ``{"init_from": null, "seed": N}``.
A resume and both exports rebuild the reference of the base at hand and refuse another one, naming the first tensor
that differs (``base_difference``).

``peft.base_dtype: fp8``: the base's projections are held in block-FP8 (``fp8_base``): a block-FP8 Hugging Face
checkpoint's e4m3 bits and scales kept as stored, anything else quantized per 128 × 128 block as each rank reads it.
"""

import hashlib
import json
import os
from contextlib import ExitStack
from pathlib import Path

import torch

from q38.errors import ConfigError
from q38.lora import PeftConfig, add_adapters


class BaseMismatch(ConfigError):
    """A LoRA checkpoint was trained on another base than the run names."""


# ---- the base reference ----------------------------------------------------------------------------------------------

EDITED = "(meta.json edited?)"  # ends base_difference's answer when the record, not the base, disagrees
REFERENCE_FORMAT = "tensor-sha256"  # a Hugging Face base known by the bytes of its tensors (the format key of a ref)
CHUNK_BYTES = 64 << 20  # the unit of work of the hash: a tensor's bytes in pieces of this size, dealt over ranks
SHORT = 16  # hex digits kept per tensor in meta.json (enough to name the one that changed; ``sha256`` covers all)
HASH_THREADS = 4  # hashlib and os.pread release the GIL: each rank hashes its share in this many threads


def _hf_tensors(d: Path) -> dict[str, tuple[Path, int, int, str, list]]:
    """``{key: (file, start, end, dtype, shape)}`` of the tensors a Hugging Face directory's reader reads: those its
    ``model.safetensors.index.json`` maps (each in the file it names), else those of its ``*.safetensors`` files
    (a key in two files refused). Byte ranges are absolute file offsets, checked inside the file."""
    from q38.files import MAX_JSON_BYTES, inside, load_json, open_regular

    index = d / "model.safetensors.index.json"
    wanted: dict[str, str] | None = None
    if index.is_file():
        wm = (load_json(inside(d, index.name, "init_from", follow=True), str(index), follow=True) or {})
        wm = wm.get("weight_map") if isinstance(wm, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise BaseMismatch(f"{index}: no weight_map of tensor names to file names; not a Hugging Face index")
        wanted = wm
        names = sorted(set(wm.values()))
    else:
        names = sorted(f.name for f in d.glob("*.safetensors"))
    out: dict[str, tuple[Path, int, int, str, list]] = {}
    for name in names:
        f = inside(d, name, "init_from", follow=True)  # a plain file inside the base (a HF cache links to blobs)
        with open_regular(f, str(f), follow=True) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 <= n <= min(MAX_JSON_BYTES, size - 8):
                raise BaseMismatch(f"{f}: not a safetensors file (its header length does not fit the file)")
            try:
                header = json.loads(fh.read(n))
            except (ValueError, RecursionError):
                raise BaseMismatch(f"{f}: the safetensors header is not JSON") from None
        if not isinstance(header, dict):
            raise BaseMismatch(f"{f}: the safetensors header is not a JSON object")
        for key, v in header.items():
            if key == "__metadata__" or (wanted is not None and wanted.get(key) != name):
                continue
            try:
                a, b = v["data_offsets"]
                ok = type(a) is int and type(b) is int and 0 <= a <= b and 8 + n + b <= size
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise BaseMismatch(f"{f}: tensor {str(key)[:80]!r} has byte offsets outside the file")
            if key in out:
                raise BaseMismatch(f"{d}: tensor {key!r} is in both {out[key][0].name} and {name}; a base holds each "
                                   "tensor once")
            out[key] = (f, 8 + n + a, 8 + n + b, str(v.get("dtype")), list(v.get("shape") or []))
    if wanted is not None:
        missing = sorted(set(wanted) - set(out))
        if missing:
            raise BaseMismatch(f"{index} maps {missing[0]!r} to {wanted[missing[0]]}, which does not hold it")
    return out


def _hash_chunks(chunks: list[tuple[Path, int, int]]) -> list[bytes]:
    """The SHA-256 of each ``(file, start, end)`` byte range, in threads (one open descriptor per file)."""
    from concurrent.futures import ThreadPoolExecutor

    from q38.files import open_regular

    with ExitStack() as stack:
        fds = {f: stack.enter_context(open_regular(f, str(f), follow=True)).fileno()
               for f in dict.fromkeys(f for f, _, _ in chunks)}

        def one(c):
            f, a, b = c
            h = hashlib.sha256()
            pos = a
            while pos < b:
                got = os.pread(fds[f], min(b - pos, 8 << 20), pos)
                if not got:
                    raise BaseMismatch(f"{f}: ends at byte {pos}, before the tensor data its header names")
                h.update(got)
                pos += len(got)
            return h.digest()

        with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
            return list(pool.map(one, chunks))


def _world():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def weights_reference(d: Path) -> dict:
    """The reference of a Hugging Face base directory by its weights: every tensor's bytes (as its reader reads
    them) hashed in ``CHUNK_BYTES`` pieces, the pieces dealt round-robin over the ranks of the default process group
    (each rank hashes ~1/world of the bytes, in ``HASH_THREADS`` threads) and gathered; a tensor's digest is the
    SHA-256 of its dtype, shape and piece digests, the base's (``sha256``) that of every ``key digest`` line in key
    order. Neither depends on the world size nor on how the base is split into files. Collective under a process
    group: every rank calls it (an error on any rank is raised on every rank, never left in the gather).

    Why pieces of the stored tensors rather than the bytes the load reads anyway: a rank reads slices of q38 leaves
    that depend on the layout (and an FP8 shard reads whole covering blocks, shared with its neighbours), so a
    digest of what each rank reads would change with the world size; fixed-size pieces of the file's tensors are the
    same for every layout, and dealt round-robin they balance the ranks to within one piece."""
    dist = _world()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    err, mine, tensors = None, {}, {}
    try:
        tensors = _hf_tensors(d)
        chunks = [(k, f, a, min(a + CHUNK_BYTES, b)) for k, (f, s, b, _, _) in sorted(tensors.items())
                  for a in range(s, b, CHUNK_BYTES)]
        share = list(range(rank, len(chunks), world))
        mine = dict(zip(share, _hash_chunks([chunks[i][1:] for i in share])))
    except Exception as e:  # noqa: BLE001  (raised below on every rank)
        err = e
    if dist is not None:
        got: list = [None] * world
        dist.all_gather_object(got, (None if err is None else f"{type(err).__name__}: {err}", mine))
        if err is None:
            bad = next(((r, m) for r, (m, _) in enumerate(got) if m), None)
            if bad is not None:
                raise BaseMismatch(f"hashing the base {d} failed on rank {bad[0]}: {bad[1]}")
            for _, part in got:
                mine.update(part)
    if err is not None:
        raise err
    per_key: dict[str, list[bytes]] = {k: [] for k in tensors}
    for i, (k, *_) in enumerate(chunks):
        per_key[k].append(mine[i])
    digests = {}
    for k, (_, _, _, dt, shape) in sorted(tensors.items()):
        h = hashlib.sha256(f"{dt} {shape}\n".encode())
        for c in per_key[k]:
            h.update(c)
        digests[k] = h.hexdigest()
    total = hashlib.sha256("".join(f"{k} {v}\n" for k, v in digests.items()).encode()).hexdigest()
    return {"init_from": str(d), "format": REFERENCE_FORMAT, "chunk_bytes": CHUNK_BYTES, "sha256": total,
            "tensors": {k: v[:SHORT] for k, v in digests.items()}}


def _legacy_headers_sha256(d: Path) -> str:
    """What q38 recorded for a Hugging Face base before ``REFERENCE_FORMAT``: the hash of its safetensors index, or
    of its files' headers (kept to check the checkpoints written then; it does not cover the weights' bytes)."""
    from q38.files import open_regular, sha256_file

    index = d / "model.safetensors.index.json"
    if index.is_file():
        return sha256_file(index, follow=True)
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")):
        with open_regular(f, "init_from", follow=True) as fh:  # a FIFO or device is refused, never waited on
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode())
            h.update(fh.read(min(n, 100 << 20)))
    return h.hexdigest()


def _is_hf_dir(p: Path) -> bool:
    from q38.train.io.checkpoint import is_checkpoint

    return (p / "config.json").is_file() and not is_checkpoint(p)


def base_reference(init_from: str | None, seed: int) -> dict:
    """What identifies a LoRA run's base (docs/checkpoints.md#the-base-of-a-lora-run): a Hugging Face directory by
    its weights (``weights_reference``; collective under a process group), a q38 checkpoint by its manifest (which
    holds the SHA-256 of every file, checked when it is read), a fresh base by its seed."""
    if not init_from:
        return {"init_from": None, "seed": int(seed)}
    from q38.train.io.checkpoint import MANIFEST_FILE, resolve_checkpoint
    from q38.files import sha256_file

    p = Path(init_from)
    if _is_hf_dir(p):
        return weights_reference(p)
    ck = resolve_checkpoint(p)
    return {"init_from": str(ck), "sha256": sha256_file(ck / MANIFEST_FILE, follow=True)}


def base_difference(saved: dict, ref: dict) -> tuple[str | None, str | None]:
    """``(what differs, note)`` between the base a checkpoint recorded (``saved``) and the one at hand (``ref``, of
    ``base_reference``): ``what`` names the first tensor (in key order) that changed, is missing or is new, or None
    when they are the same base. Both records are checked: the whole-base digest and every per-tensor digest must
    match (an edited entry of either is refused, never outvoted by the other). A checkpoint written before
    ``REFERENCE_FORMAT`` recorded the hash of the base's safetensors index or headers only: it is checked that way
    and accepted with ``note`` saying that the weights themselves could not be compared."""
    if saved.get("init_from") is None or ref.get("init_from") is None:
        if saved.get("init_from") is None and ref.get("init_from") is None and saved.get("seed") == ref.get("seed"):
            return None, None
        return "one is drawn from a seed, the other read from init_from", None
    if saved.get("format") != ref.get("format"):
        if saved.get("format") is None and ref.get("format") == REFERENCE_FORMAT:  # written before weights hashing
            if saved.get("sha256") != _legacy_headers_sha256(Path(ref["init_from"])):
                return "its safetensors index or headers differ", None
            return None, (f"this checkpoint recorded only a hash of its base's safetensors index/headers (q38 before "
                          f"weights hashing): the weights of {ref['init_from']} cannot be compared with those it was "
                          "trained on; a checkpoint saved from now on records them")
        return "one is a Hugging Face directory, the other a q38 checkpoint", None
    old, new = saved.get("tensors") or {}, ref.get("tensors") or {}
    if not isinstance(old, dict):
        return f"its recorded per-tensor digests are not a table {EDITED}", None
    same_whole = saved.get("sha256") == ref.get("sha256")
    for k in sorted(set(old) | set(new), key=str):
        what = ("is missing" if k not in new else "is new" if k not in old else "differs" if old[k] != new[k]
                else None)
        if what is None:
            continue
        if same_whole:  # the weights hash as recorded: the per-tensor record was changed
            return f"its whole-base digest matches but the recorded digest of tensor {str(k)[:80]} {what} {EDITED}", \
                None
        return f"tensor {str(k)[:80]} {what}", None
    if same_whole:
        return None, None
    if ref.get("format") is None:
        return "its manifest differs", None
    if old:  # every tensor matches its recorded digest: the recorded whole-base digest was changed
        return f"every tensor matches its recorded digest but the whole-base digest does not {EDITED}", None
    return "its weights differ", None


def check_base(meta: dict, ref: dict, where: str) -> str | None:
    """Refuse to resume the LoRA checkpoint ``where`` (its ``meta``) on another base than ``ref``; the note of
    ``base_difference`` (or None) when it is the same base."""
    peft = meta.get("peft")
    saved = peft.get("base") if isinstance(peft, dict) else None
    if saved is not None and not isinstance(saved, dict):
        raise BaseMismatch(f"{where}/meta.json: peft.base is {type(saved).__name__}, not the table q38 records (its "
                           "init_from, sha256 and tensors); the checkpoint's metadata was edited: resume from another "
                           "checkpoint or start in a new run.out_dir")
    if saved is None:
        raise BaseMismatch(f"{where} is not a LoRA checkpoint (its meta.json has no peft.base) but the run config has "
                           "a peft section; resume it without peft, or start the LoRA run in a new run.out_dir")
    what, note = base_difference(saved, ref)
    if what is not None and what.endswith(EDITED):
        raise BaseMismatch(f"{where}/meta.json: its record of the base contradicts itself ({what}); resume from a "
                           "checkpoint whose meta.json is as the run wrote it")
    if what is not None:
        raise BaseMismatch(f"{where} trained its adapters on another base than {ref.get('init_from') or 'the seed'} "
                           f"({what}; recorded base {saved.get('init_from') or 'seed ' + str(saved.get('seed'))}); "
                           "set init_from to the base it was trained on, unchanged, or use a new run.out_dir")
    return note


def build_fp8_base(model_config, *, region, quantized, block: tuple[int, int], dtype, mesh=None, raw=None,
                   device=None):
    """The frozen base of a ``base_dtype: fp8`` run: every parameter ``quantized(path)`` as an ``Fp8Weight``
    (``bits`` and ``scale_inv`` each sharded on the weight's logical axes), every other in ``dtype`` (or
    ``dtype(path)``). Each rank
    builds only its own blocks: ``region(path, info, index)`` returns the fp32 values of block ``index`` (a tuple of
    slices) of parameter ``path``; a quantized shard reads the whole 128 × 128 blocks it touches and quantizes them
    (``amax / 448`` scales, as the released format does), so its bits and scales equal those of the whole tensor.
    ``raw(path, info, index, part)`` (a block-FP8 source): the stored ``bits`` / ``scale_inv`` of that block, kept
    as they are (no requantization); None for a parameter it does not hold in FP8 (then ``region`` is quantized)."""
    from torch.distributed.tensor import DTensor

    from q38.fp8 import Fp8Weight, quantize_blocks
    from q38.lora import scale_info
    from q38.model import abstract_params, is_param_info
    from q38.parallel.mesh import _contiguous_strides, local_index
    from q38.pytree import tree_map_with_path

    bo, bi = block

    def place(path, info, make_local):
        if mesh is None:
            return make_local(tuple(slice(0, n) for n in info.shape))
        placements = mesh.layout.placements_of_shapes([(path, info)], mesh.sizes)[path].dtensor_placements()
        local = make_local(local_index(info.shape, mesh, placements))
        return DTensor.from_local(local, mesh.device_mesh, placements, run_check=False,
                                  shape=torch.Size(info.shape), stride=_contiguous_strides(info.shape))

    def quantized_part(path, info, index, part):
        *lead, rows, cols = index
        o, i = info.shape[-2:]
        shape = tuple(sl.stop - sl.start for sl in index)
        if 0 in shape:
            return torch.empty(shape, dtype=torch.uint8 if part == "bits" else torch.float32, device=device)
        got = raw(path, info, index, part) if raw is not None else None
        if got is not None:
            return got
        if part == "bits":  # the whole blocks the shard touches
            r = slice(rows.start // bo * bo, min(-(-rows.stop // bo) * bo, o))
            c = slice(cols.start // bi * bi, min(-(-cols.stop // bi) * bi, i))
        else:  # index is a block range
            r = slice(rows.start * bo, min(rows.stop * bo, o))
            c = slice(cols.start * bi, min(cols.stop * bi, i))
        bits, scale = quantize_blocks(region(path, info, (*lead, r, c)), block)
        if part == "scale_inv":
            return scale
        # a copy: a view would keep the whole covering region's storage alive on this rank
        return bits[..., rows.start - r.start : rows.stop - r.start, cols.start - c.start : cols.stop - c.start].clone()

    def leaf(path, info):
        dt = dtype(path) if callable(dtype) else dtype  # TrainConfig.compute_dtype: fp32_params stay fp32
        if not quantized(path):
            return place(path, info, lambda index: region(path, info, index).to(dt))
        bits = place(f"{path}.bits", info, lambda index: quantized_part(path, info, index, "bits").contiguous())
        sinfo = scale_info(info, block)
        scale = place(f"{path}.scale_inv", sinfo, lambda index: quantized_part(path, info, index, "scale_inv"))
        return Fp8Weight(bits, scale, block=block, dtype=dt)

    return tree_map_with_path(leaf, abstract_params(model_config), is_leaf=is_param_info)


def _raw_fp8(src, reader):
    """``raw(path, info, index, part)`` for ``build_fp8_base`` over an opened block-FP8 Hugging Face
    checkpoint ``src``: the stored e4m3 bits (``uint8``) of block ``index`` of a q38 leaf, or its scales (``index``
    a range of blocks), read through the leaf's key rule; None for a leaf whose tensors are not all FP8. The scales
    are read per element and checked constant over each of q38's blocks (a q38 leaf assembled from several HF
    tensors, e.g. fused gate/up experts, keeps the release's scales only when their blocks line up)."""
    from safetensors import safe_open

    from q38.hf import CheckpointError
    from q38.fp8 import check_scales, dequantize, scale_key
    from q38.fp8 import covering as cover

    rules = src.leaf_rules()
    block = src.fp8.block
    bo, bi = block

    def read(key, hf_index, scales: bool):
        with safe_open(str(src.path / src.index[key]), framework="pt") as fh:
            sl = fh.get_slice(key)
            shape = tuple(sl.get_shape())
            rows, cols = hf_index if hf_index is not None else (slice(None), slice(None))
            rows, cols = (slice(*s.indices(n)[:2]) for s, n in zip((rows, cols), shape))
            if not scales:
                return sl[rows, cols].view(torch.uint8).clone()
        with safe_open(str(src.path / src.index[scale_key(key)]), framework="pt") as fh:
            br, bc = cover(rows, shape[0], bo), cover(cols, shape[1], bi)
            s = fh.get_slice(scale_key(key))[br, bc].float().clone()
        check_scales(s, f"{src.path / src.index[scale_key(key)]}: {scale_key(key)}", (br.start, bc.start))
        ones = torch.ones(rows.stop - rows.start, cols.stop - cols.start)
        return dequantize(ones, s, rows, cols, block)  # each element's scale

    def raw(path, info, index, part):
        rule, which = rules[path]
        if not all(k in src.quantized for k in rule.hf):
            return None
        if part == "bits":
            return rule.block(lambda i, hf_index: read(rule.hf[i], hf_index, False), which, index).contiguous()
        *lead, gr, gc = index
        o, i = info.shape[-2:]
        r, c = slice(gr.start * bo, min(gr.stop * bo, o)), slice(gc.start * bi, min(gc.stop * bi, i))
        each = rule.block(lambda i, hf_index: read(rule.hf[i], hf_index, True), which, (*lead, r, c))
        scale = each[..., ::bo, ::bi].contiguous()
        again = scale.repeat_interleave(bo, dim=-2)[..., : r.stop - r.start, :]
        if not torch.equal(again.repeat_interleave(bi, dim=-1)[..., : c.stop - c.start], each):
            raise CheckpointError(f"{src.path}: {path} is assembled from FP8 tensors whose {bo}x{bi} blocks do not "
                                  f"line up with its own (e.g. fused gate/up rows not a multiple of {bo}), so its "
                                  "scales cannot be kept as released; use peft.base_dtype: compute")
        return scale

    return raw


def fp8_base(model_config, init_from: str | None, *, seed: int, dtype, mesh=None, device=None):
    """The frozen base of a ``peft.base_dtype: fp8`` run (``build_fp8_base``): the projections the
    released FP8 checkpoints quantize (``q38.fp8.default_quantized``) as ``Fp8Weight`` s, every other leaf in
    ``dtype``; from ``init_from`` (a Hugging Face directory; a block-FP8 one keeps its bits and scales, in its own
    block size) or the seed's fresh init (quantized in 128 × 128 blocks). Each rank reads or draws only the blocks
    its shards touch."""
    from q38.fp8 import default_quantized
    from q38.layers.common import materialize

    if not init_from:
        def region(path, info, index):
            return materialize(info, path, seed=seed, device=device, dtype=torch.float32, index=index)

        return build_fp8_base(model_config, region=region, quantized=default_quantized, block=(128, 128),
                              dtype=dtype, mesh=mesh, device=device)
    from q38.hf import HFReader, open_hf
    from q38.train.io.checkpoint import CheckpointMismatch, config_diff

    src = open_hf(init_from)
    diff = config_diff(src.config.to_dict(), model_config.to_dict())
    if diff:
        raise CheckpointMismatch(f"init_from {init_from} holds another model than the config names "
                                 f"({'; '.join(diff[:6])}); set model: to {init_from} or to the matching preset")
    with HFReader(src, dtype=torch.float32, device=device) as reader:
        raw = _raw_fp8(src, reader) if src.fp8 is not None else None
        block = src.fp8.block if src.fp8 is not None else (128, 128)
        return build_fp8_base(model_config, region=lambda path, info, index: reader.block(path, index),
                              quantized=default_quantized, block=block, dtype=dtype, mesh=mesh, raw=raw,
                              device=device)


def lora_state(base, model_config, train_config, peft: PeftConfig, *, seed: int, mesh=None, device=None,
               kernels=None, empty: bool = False):
    """The state of a LoRA run over ``base`` (parameters, or DTensors on ``mesh``): adapters added (each rank
    drawing only its shards; ``empty``: allocated only, a resume's load target), the base in the compute dtype
    (fp32 for the ``train.fp32_params`` leaves; an ``Fp8Weight`` leaf of an FP8 base, ``fp8_base``, kept as it is),
    moments for the adapters only."""
    from q38.kernels import DEFAULT_KERNELS
    from q38.train.core.state import state_from_params

    make = None
    if mesh is not None:
        from q38.parallel.mesh import adapter_maker

        make = adapter_maker(mesh, seed=seed, device=device, empty=empty)
    elif empty:
        make = lambda path, info, like: torch.empty(info.shape, device=like.device)  # noqa: E731
    params = add_adapters(base, peft, seed=seed, make=make, base_dtype=train_config.compute_dtype)
    return state_from_params(params, model_config, train_config, kernels=kernels or DEFAULT_KERNELS, peft=peft)
