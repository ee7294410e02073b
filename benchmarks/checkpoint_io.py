"""Per-rank peak memory of every path that moves state into or out of a run, over the rank's shard.

    python benchmarks/checkpoint_io.py [--worlds 1,2,4] [--dir DIR] [--keep]
    python benchmarks/checkpoint_io.py --hash-cost 3     # save/load seconds with the integrity hashes off and on

A 164M-parameter member of the family (hidden 512, 8 layers, 32 experts, MTP: 624 MiB of fp32 parameters, 1.83 GiB
with the AdamW moments; largest tensor 64 MiB) on 1, 2 and 4 gloo ranks, layout ``fsdp``. Every path runs in fresh
processes (one per rank, started like torchrun would, rendezvous through a file): each rank reads its resident set
after imports and the process group (the baseline) and its high-water mark (``VmHWM``) after the path; the table
prints ``(peak - baseline) / the rank's shard`` and, for the conversions, over the largest tensor. Seconds are the
slowest rank's; MB/s the bytes on disk read or written over those seconds.

Paths: ``fresh`` (sharded init of params + moments), ``save`` (a DCP checkpoint of that state), ``resume`` (sharded
template + DCP load of the checkpoint saved by the same world size), ``init_from q38`` (parameters only, + fresh
moments), ``init_from hf`` (this rank's slices of a HF directory, + fresh moments), ``convert --to-hf`` (every rank
writes its share of the files) and ``convert --from-hf`` (every rank writes a share of the tensors).

What it assumes: RSS is what the OS charges the process (file pages of the safetensors map that a rank touches
count too). The workers run with ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`` so that memory a path
frees is returned at once and the high-water mark is the live peak; ``--glibc-default`` measures glibc as it is (it
keeps freed heap blocks, which then count too). The machine is shared, so seconds are indicative.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GLIBC_DEFAULT = False
PATHS = ("fresh", "save", "resume", "init_from_q38", "init_from_hf", "to_hf", "from_hf")


def model_config():
    from q38 import ModelConfig  # (registers the layer kinds a ModelConfig checks)

    gdn3 = ("linear_attention",) * 3 + ("full_attention",)
    return ModelConfig.preset("tiny").replace(
        hidden_size=512, num_hidden_layers=8, layer_types=gdn3 * 2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=32, moe_intermediate_size=256, shared_expert_intermediate_size=512,
        vocab_size=32768, mtp_num_layers=1)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())


def worker(path: str, rank: int, world: int, work: Path) -> dict:
    import torch
    import torch.distributed as dist

    from q38.parallel.layout import Layout
    from q38.parallel.mesh import init_sharded, make_mesh
    from q38.pytree import tree_leaves
    from q38.train.io.checkpoint import empty_params, load_checkpoint, load_params, write_checkpoint
    from q38.train.core.step_config import TrainConfig
    from q38.train.io.hf_io import export_checkpoint, import_hf, load_hf_sharded
    from q38.train.core.state import state_from_params

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=rank, world_size=world)
    cfg, tc = model_config(), TrainConfig()
    mesh = make_mesh(Layout.preset("fsdp"), world) if world > 1 else None
    ck, hf = work / f"ck_{world}", work / "hf"
    base = _status("VmRSS")
    t0 = time.perf_counter()
    moved = 0
    if path in ("fresh", "save"):
        if mesh is None:
            from q38.model import init_params

            params = init_params(cfg, seed=0)
        else:
            params = init_sharded(cfg, mesh, seed=0)
        state = state_from_params(params, cfg, tc)
        if path == "save":
            base, t0 = _status("VmRSS"), time.perf_counter()
            write_checkpoint(ck, state, {"step": 0, "model_config": cfg.to_dict(), "train_config": tc.to_dict()})
            moved = _dir_bytes(ck)
    elif path == "resume":
        state, _ = load_checkpoint(ck, state_from_params(empty_params(cfg, mesh=mesh), cfg, tc))
        moved = _dir_bytes(ck)
    elif path == "init_from_q38":
        state = state_from_params(load_params(ck, mesh=mesh)[1], cfg, tc)
        moved = _dir_bytes(ck) // 3
    elif path == "init_from_hf":
        if mesh is None:
            from q38.hf import load_hf

            params = load_hf(hf)[1]
        else:
            params = load_hf_sharded(hf, mesh)[1]
        state = state_from_params(params, cfg, tc)
        moved = _dir_bytes(hf)
    elif path == "to_hf":
        out = work / f"export_{world}"
        export_checkpoint(ck, out)
        moved = _dir_bytes(out)
        state = None
    elif path == "from_hf":
        out = work / f"import_{world}"
        import_hf(hf, out)
        moved = _dir_bytes(out)
        state = None
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    shard = 0
    if state is not None:
        for t in tree_leaves(state):
            t = getattr(t, "_local_tensor", t)
            shard += t.numel() * t.element_size()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return {"rank": rank, "peak_over_base": peak - base, "shard": shard, "seconds": seconds, "moved": moved}


def hash_cost(work: Path, repeats: int) -> None:
    """Save and load time of the model's parameters (one process) with the integrity hashes switched off and on,
    alternating in one run; loads also through DCP's own reader (no checks at all) for reference."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from q38.model import init_params
    from q38.pytree import named_leaves
    from q38.train.io import checkpoint as ck
    from q38.train.io import untrusted

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    sd = {f"params.{n}": t for n, t in named_leaves(init_params(model_config(), seed=0))}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    target = {k: torch.empty_like(t) for k, t in sd.items()}
    times: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    for r in range(repeats):  # each save and load starts with the page cache written back (os.sync)
        dirs = {}
        for on in ((False, True) if r % 2 == 0 else (True, False)):  # alternating which save goes first
            untrusted.HASHING = on
            dirs[on] = d = work / f"hash_{int(on)}_{r}"
            os.sync()
            timed(f"save, hashes {'on' if on else 'off'}", lambda: ck.write_checkpoint(d, sd, {"step": 0}))
        for name in ("load, hashes off", "load, hashes on", "load, DCP's own reader (no checks)"):
            untrusted.HASHING = name != "load, hashes off"  # the same checkpoint, its chunk hashes checked or not
            os.sync()
            if name.startswith("load, DCP"):
                timed(name, lambda: dcp.load(target, checkpoint_id=str(dirs[True]), no_dist=True))
            else:
                timed(name, lambda: ck._dcp_load(target, dirs[True]))
            assert all(torch.equal(target[k], v) for k, v in sd.items())
            for t in target.values():
                t.zero_()
        for d in dirs.values():
            shutil.rmtree(d)
    untrusted.HASHING = True
    print(f"parameters: {nbytes / 2**20:.0f} MiB fp32 ({len(sd)} tensors), one process, {repeats} repeats (median)")
    med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    base = {"save": med["save, hashes off"], "load": med["load, DCP's own reader (no checks)"]}
    print("\n| | s (median) | MiB/s | / unchecked save or DCP's load | every run (s) |\n|---|---:|---:|---:|---|")
    for name, ts in times.items():
        m = med[name]
        print(f"| {name} | {m:.2f} | {nbytes / 2**20 / m:.0f} | {m / base[name[:4]]:.2f} | "
              f"{', '.join(f'{t:.2f}' for t in ts)} |")


def run(path: str, world: int, work: Path) -> list[dict]:
    (work / "pg").unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    if not GLIBC_DEFAULT:  # freed memory goes back to the OS at once, so the high-water mark is live memory
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", path, "--rank", str(r), "--world", str(world),
                               "--dir", str(work)], env=env, stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"{path} on {world} ranks: rank exited {p.returncode}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--paths", default=",".join(PATHS), help="a subset of " + ",".join(PATHS))
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed after)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--glibc-default", action="store_true",
                    help="leave glibc malloc as it is (it keeps freed heap memory: the high-water mark then includes it)")
    ap.add_argument("--hash-cost", type=int, default=0, metavar="REPEATS",
                    help="instead: save/load time of the parameters with the integrity hashes off and on")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.rank, a.world, Path(a.dir))))
        return
    if a.hash_cost:
        work = Path(a.dir or tempfile.mkdtemp(prefix="q38_ckhash_"))
        work.mkdir(parents=True, exist_ok=True)
        hash_cost(work, a.hash_cost)
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)
        return
    global GLIBC_DEFAULT
    GLIBC_DEFAULT = a.glibc_default
    import torch

    from q38.hf import save_hf
    from q38.model import abstract_params, init_params, is_param_info
    from q38.pytree import named_leaves

    work = Path(a.dir or tempfile.mkdtemp(prefix="q38_ckio_"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = model_config()
    sizes = [math.prod(i.shape) * 4 for _, i in named_leaves(abstract_params(cfg), is_leaf=is_param_info) if i is not None]
    largest, total = max(sizes), sum(sizes)
    print(f"model: {total / 4 / 1e6:.1f}M parameters, {total / 2**20:.0f} MiB fp32, with moments "
          f"{3 * total / 2**30:.2f} GiB; largest tensor {largest / 2**20:.0f} MiB")
    if not (work / "hf").exists():
        save_hf(work / "hf", cfg, init_params(cfg, seed=1), max_shard_bytes=200_000_000)
    del torch
    rows = []
    for world in [int(w) for w in a.worlds.split(",")]:
        for path in a.paths.split(","):
            if path in ("resume", "init_from_q38", "to_hf") and not (work / f"ck_{world}").exists():
                run("save", world, work)
            outs = run(path, world, work)
            peak = max(o["peak_over_base"] for o in outs)
            shard = max(o["shard"] for o in outs)
            secs = max(o["seconds"] for o in outs)
            moved = sum(o["moved"] for o in outs) // world  # each rank counts the whole directory
            ratio = f"{peak / shard:5.2f}" if shard else "    -"
            rows.append((path, world, peak, shard, ratio, peak / largest, secs, moved / 2**20 / secs if secs else 0))
            print(f"{path:14s} {world} ranks  peak-over-baseline {peak / 2**20:7.0f} MiB  shard {shard / 2**20:6.0f} "
                  f"MiB  peak/shard {ratio}  peak/largest {peak / largest:5.2f}  {secs:6.1f} s  "
                  f"{moved / 2**20 / max(secs, 1e-9):6.0f} MB/s", flush=True)
    print("\n| path | ranks | peak over baseline (MiB, max rank) | rank's shard (MiB) | peak / shard | "
          "peak / largest tensor | s (slowest rank) | MiB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for path, world, peak, shard, ratio, pl, secs, mbs in rows:
        print(f"| {path} | {world} | {peak / 2**20:.0f} | {shard / 2**20:.0f} | {ratio.strip()} | {pl:.2f} | "
              f"{secs:.1f} | {mbs:.0f} |")
    if not a.keep and not a.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
