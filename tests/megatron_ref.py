"""Megatron-Core's own ``megatron/core/datasets/indexed_dataset.py`` (``IndexedDatasetBuilder`` and
``IndexedDataset``) as the independent reference for q38's Megatron corpus reader.

megatron-core's recent wheels require Python >= 3.12, so it cannot be a test dependency of this project (Python
3.11 is supported). The one module needed is pure Python and imports only numpy, torch and three small Megatron
helpers (a rank-0 logger, the object-storage helpers, the multi-storage-client switch), none of which a local-file
corpus uses. So the pinned wheel is fetched from PyPI with ``pip download`` (any interpreter, any platform: only the
pure-Python file is read), cached, and that module is loaded with stand-ins for those helpers.

    python tests/megatron_ref.py        # fetch into the cache now (.ci/run does this before the suite)

Cache: ``$Q38_TEST_CACHE`` or ``~/.cache/q38-tests``. When the download fails (no network to PyPI) the tests that
need the reference skip, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

VERSION = "0.19.2"
MODULE = "megatron/core/datasets/indexed_dataset.py"


def cache_dir() -> Path:
    return Path(os.environ.get("Q38_TEST_CACHE") or Path.home() / ".cache" / "q38-tests") / f"megatron-core-{VERSION}"


def fetch() -> Path:
    """The cached ``indexed_dataset.py`` of megatron-core ``VERSION`` (downloaded and extracted once). Raises
    ``RuntimeError`` saying why when it cannot be had."""
    d = cache_dir()
    target = d / "indexed_dataset.py"
    if target.is_file():
        return target
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--platform", "manylinux_2_28_x86_64", "-d", str(d), "-q", f"megatron-core=={VERSION}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not download megatron-core=={VERSION} from PyPI ({e})") from None
    wheels = sorted(d.glob(f"megatron_core-{VERSION}-*.whl"))
    if r.returncode or not wheels:
        raise RuntimeError(f"could not download megatron-core=={VERSION} from PyPI ({' '.join(cmd)}: "
                           f"{(r.stderr or r.stdout).strip().splitlines()[-1:] or r.returncode})")
    with zipfile.ZipFile(wheels[0]) as z:
        data = z.read(MODULE)
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    return target


def load() -> types.ModuleType:
    """megatron-core's ``indexed_dataset`` module, with stand-ins for the helpers it imports."""
    name = "megatron.core.datasets.indexed_dataset"
    if name in sys.modules:
        return sys.modules[name]
    path = fetch()

    def module(mod: str, **attrs) -> types.ModuleType:
        m = sys.modules.get(mod) or types.ModuleType(mod)
        m.__dict__.update(attrs)
        sys.modules[mod] = m
        return m

    class _Off:
        """Object storage is never used for local files: any use is an error."""

        def __init__(self, *a, **k) -> None:
            raise RuntimeError("object storage is not available in this test stand-in")

    def _not_object_storage(path: str) -> bool:
        return False

    class _MaybeMsc:
        open = staticmethod(open)

    class _Feature:
        @staticmethod
        def is_enabled() -> bool:
            return False

        @staticmethod
        def import_package():
            raise RuntimeError("multi-storage-client is not available in this test stand-in")

    def log_single_rank(logger, level, msg, *a, **k) -> None:
        logger.log(level, msg)

    module("megatron", __path__=[])
    module("megatron.core", __path__=[])
    module("megatron.core.datasets", __path__=[])
    module("megatron.core.datasets.object_storage_utils", S3Config=_Off, ObjectStorageConfig=_Off,
           cache_index_file=_Off, dataset_exists=_Off, get_index_cache_path=_Off, get_object_storage_access=_Off,
           is_object_storage_path=_not_object_storage, parse_s3_path=_Off)
    module("megatron.core.msc_utils", MultiStorageClientFeature=_Feature, maybe_msc=_MaybeMsc)
    module("megatron.core.utils", log_single_rank=log_single_rank)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def write_corpus(prefix: str | os.PathLike, documents, dtype) -> None:
    """``documents``: lists of token-id sequences (a document of several sequences, as sentence splitting makes),
    written with Megatron-Core's ``IndexedDatasetBuilder``."""
    import torch

    m = load()
    prefix = os.fspath(prefix)
    b = m.IndexedDatasetBuilder(m.get_bin_path(prefix), dtype=dtype)
    for doc in documents:
        for seq in doc:
            b.add_item(torch.tensor(seq, dtype=torch.int64))
        b.end_document()
    b.finalize(m.get_idx_path(prefix))


if __name__ == "__main__":
    print(fetch())
