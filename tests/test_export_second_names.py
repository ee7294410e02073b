"""Hostile inputs of an export (issue 47): a run's base known under a second name (a bind mount, a symlinked parent,
a hard-linked file) is still the base, so ``q38 convert --to-hf RUN BASE --overwrite`` never replaces it
(``q38.train.io.dirs.same_or_inside`` compares device and inode, not names); a ``meta.json`` whose ``peft.base`` is
not a table, or whose per-tensor or whole-base digest was edited, is one line. Each case: exit 2, one line, and the
bytes of every directory involved unchanged (hashed here before and after).

The model differs from the ``tiny`` preset in every dimension (``tests.test_lora_base.OTHER``).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from q38.cli import main
from tests.test_lora_base import OTHER, PEFT, _lora_run, _tree_digest
from tests.test_peft_export import _lora_params, _refused, _write_lora_checkpoint

REPO = Path(__file__).resolve().parents[1]


def _edit_meta(run: Path, edit) -> None:
    """Change a LoRA checkpoint's ``meta.json`` with ``edit(meta)`` and rewrite its manifest (as someone editing the
    file by hand and re-signing it would: the manifest is a consistency check, not a signature)."""
    from q38.train.io.checkpoint import write_manifest

    ck = run / "checkpoints" / "step_000003"
    meta = json.loads((ck / "meta.json").read_text())
    edit(meta)
    (ck / "meta.json").write_text(json.dumps(meta))
    write_manifest(ck)


def test_a_second_name_of_the_base_is_the_base(tmp_path, capsys):
    """The run recorded its base through a symlinked parent; OUT is the base by its real name, by the alias, or a
    directory holding a hard link of the base's weights (refused before this change: exit 0): each one line, and
    nothing changed. A directory that only looks alike (a copy) is written."""
    base, _ = _lora_run(tmp_path)
    (tmp_path / "alias").symlink_to(tmp_path / "bases")
    from q38.model import init_params

    run = tmp_path / "run_alias"
    _write_lora_checkpoint(run, _lora_params(init_params(OTHER, seed=0), PEFT), PEFT,
                           init_from=tmp_path / "alias" / "base", cfg=OTHER)
    linked = tmp_path / "linked"
    linked.mkdir()
    os.link(base / "model.safetensors", linked / "weights.safetensors")
    before = _tree_digest(tmp_path / "bases"), _tree_digest(linked)
    for out, needle in ((base, "is the run's base (init_from)"), (tmp_path / "alias" / "base", "is the run's base"),
                        (linked, "second name (hard link)")):
        _refused(capsys, ["convert", "--to-hf", str(run), str(out), "--overwrite"], needle,
                 "--overwrite does not change this")
        assert (_tree_digest(tmp_path / "bases"), _tree_digest(linked)) == before, out
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    assert main(["convert", "--to-hf", str(run), str(copy), "--overwrite"]) == 0, capsys.readouterr().err


_IN_NAMESPACE = r"""
import subprocess, sys
from pathlib import Path
tmp = Path(sys.argv[1])
subprocess.run(["mount", "--bind", str(tmp / "bases" / "base"), str(tmp / "mnt")], check=True)
from q38.cli import main
from q38.model import init_params
from tests.test_lora_base import OTHER, PEFT
from tests.test_peft_export import _lora_params, _write_lora_checkpoint
_write_lora_checkpoint(tmp / "run_mnt", _lora_params(init_params(OTHER, seed=0), PEFT), PEFT, init_from=tmp / "mnt",
                       cfg=OTHER)
rcs = [main(["convert", "--to-hf", str(tmp / "run_mnt"), str(tmp / "bases" / "base"), "--overwrite"]),
       main(["convert", "--to-hf", str(tmp / "run"), str(tmp / "mnt"), "--overwrite"])]
print("RCS", rcs)
"""


@pytest.mark.slow
def test_a_bind_mount_of_the_base_is_the_base(tmp_path):
    """In a private mount namespace (``unshare -rm``): a run that recorded its base as a bind mount of BASE, exported
    over BASE, and a run that recorded BASE, exported over the mount: both one line, exit 2, BASE unchanged (the
    first exited 0 and replaced BASE/model.safetensors before this change; the second failed on the mount point
    with "Device or resource busy")."""
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mkdir -p {tmp_path}/p && mount --bind {tmp_path} "
                            f"{tmp_path}/p"], capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("cannot bind-mount here (unshare -rm with mount --bind needs user namespaces or root): "
                    f"{probe.stderr.strip() if probe else 'no unshare'}")
    base, run = _lora_run(tmp_path)
    (tmp_path / "mnt").mkdir()
    before = _tree_digest(tmp_path / "bases")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(["unshare", "-rm", sys.executable, "-c", _IN_NAMESPACE, str(tmp_path)], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=300)
    assert "RCS [2, 2]" in r.stdout, (r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if "q38 convert" in x]
    assert len(lines) == 2 and all(": error: " in x and "is the run's base" in x for x in lines), r.stderr
    assert "Traceback" not in r.stderr and "busy" not in r.stderr
    assert _tree_digest(tmp_path / "bases") == before
    assert not list(tmp_path.glob("bases/.base.tmp-*")) and not list(tmp_path.glob(".mnt.tmp-*"))


def test_a_base_record_that_is_not_a_table_is_one_line(tmp_path, capsys):
    """``peft.base`` a string (an AttributeError in the export guard before this change), a list, and ``peft`` a
    string: one line each, for both exports, nothing written."""
    base, run = _lora_run(tmp_path)
    for bad in ({"base": str(base)}, {"base": [str(base)]}, None):
        def edit(meta, bad=bad):
            if bad is None:
                meta["peft"] = "lora"
            else:
                meta["peft"].update(bad)

        _edit_meta(run, edit)
        for kind in ("--to-hf", "--to-peft"):
            _refused(capsys, ["convert", kind, str(run), str(tmp_path / "out")], "meta.json")
            assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("which", ["tensor", "whole"])
def test_an_edited_base_digest_is_refused(tmp_path, capsys, which):
    """The base is unchanged but ``meta.json``'s record of it was edited: one per-tensor digest (went unnoticed
    before this change: the whole-base digest decided), or the whole-base digest (every per-tensor one still
    matching). Both exports refuse, naming what was edited."""
    base, run = _lora_run(tmp_path)
    key = sorted(json.loads((run / "checkpoints" / "step_000003" / "meta.json").read_text())["peft"]["base"]
                 ["tensors"])[0]

    def edit(meta):
        rec = meta["peft"]["base"]
        if which == "tensor":
            rec["tensors"][key] = "0" * len(rec["tensors"][key])
        else:
            rec["sha256"] = "0" * 64

    assert main(["convert", "--to-peft", str(run), str(tmp_path / "ok")]) == 0
    capsys.readouterr()
    _edit_meta(run, edit)
    needle = f"recorded digest of tensor {key}" if which == "tensor" else "whole-base digest does not"
    for kind in ("--to-hf", "--to-peft"):
        _refused(capsys, ["convert", kind, str(run), str(tmp_path / "out")], needle, "meta.json edited?")
        assert not (tmp_path / "out").exists()
