"""LoRA runs (docs/finetuning.md#lora): the train state of a ``peft`` run and the reference its checkpoints keep to
the frozen base.

A LoRA checkpoint holds the adapters, their AdamW moments and the step (no base weights), and ``meta.json`` names
the base: ``{"init_from": path, "sha256": ...}`` (the hash of a Hugging Face directory's safetensors index, or of the
headers of its safetensors files when it has no index; of a q38 checkpoint's manifest), or for a fresh base
``{"init_from": null, "seed": N}``. A resume rebuilds the base from that reference and refuses another one.
"""

import hashlib
import json
from pathlib import Path

import torch

from q38.errors import ConfigError
from q38.lora import PeftConfig, add_adapters, check_runnable


class BaseMismatch(ConfigError):
    """A LoRA checkpoint was trained on another base than the run names."""


def _safetensors_headers_sha256(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode())
            h.update(fh.read(min(n, 100 << 20)))
    return h.hexdigest()


def _file_sha256(f: Path) -> str:
    from q38.train.io.untrusted import open_regular

    h = hashlib.sha256()
    with open_regular(f, str(f), follow=True) as fh:  # a Hugging Face cache links its files to blobs
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def base_reference(init_from: str | None, seed: int) -> dict:
    """What identifies a LoRA run's base: its path and a hash of its index (see the module docstring)."""
    if not init_from:
        return {"init_from": None, "seed": int(seed)}
    from q38.train.io.checkpoint import MANIFEST_FILE, is_checkpoint, resolve_checkpoint

    p = Path(init_from)
    if (p / "config.json").is_file() and not is_checkpoint(p):
        index = p / "model.safetensors.index.json"
        digest = _file_sha256(index) if index.is_file() else _safetensors_headers_sha256(p)
        return {"init_from": str(p), "sha256": digest}
    ck = resolve_checkpoint(p)
    return {"init_from": str(ck), "sha256": _file_sha256(ck / MANIFEST_FILE)}


def check_base(meta: dict, ref: dict, where: str) -> None:
    """Refuse to resume the LoRA checkpoint ``where`` (its ``meta``) on another base than ``ref``."""
    saved = (meta.get("peft") or {}).get("base")
    if saved is None:
        raise BaseMismatch(f"{where} is not a LoRA checkpoint (its meta.json has no peft.base) but the run config has "
                           "a peft section; resume it without peft, or start the LoRA run in a new run.out_dir")
    if saved.get("sha256") != ref.get("sha256") or saved.get("seed") != ref.get("seed"):
        raise BaseMismatch(f"{where} trained its adapters on base {json.dumps(saved)}, but this run's base is "
                           f"{json.dumps(ref)}; set init_from to the checkpoint's base, or use a new run.out_dir")


def lora_state(base, model_config, train_config, peft: PeftConfig, *, seed: int, mesh=None, device=None,
               kernels=None, empty: bool = False):
    """The state of a LoRA run over ``base`` (parameters, or DTensors on ``mesh``): adapters added (each rank
    drawing only its shards; ``empty``: allocated only, a resume's load target), the base in the compute dtype,
    moments for the adapters only."""
    from q38.kernels import DEFAULT_KERNELS
    from q38.train.core.state import state_from_params

    check_runnable(peft)
    make = None
    if mesh is not None:
        from q38.parallel.mesh import adapter_maker

        make = adapter_maker(mesh, seed=seed, device=device, empty=empty)
    elif empty:
        make = lambda path, info, like: torch.empty(info.shape, device=like.device)  # noqa: E731
    params = add_adapters(base, peft, seed=seed, make=make, base_dtype=train_config.torch_param_dtype)
    return state_from_params(params, model_config, train_config, kernels=kernels or DEFAULT_KERNELS, peft=peft)
