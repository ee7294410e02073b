"""Pretraining data at two corpus sizes, side by side: `q38 prepare-data` throughput, trainer start-up time and
resident memory per rank when training from the prepared shards, from a Megatron indexed corpus (PREFIX.bin +
PREFIX.idx) holding the same tokens (read in place: opening validates the index and checks every token id), and,
for the small corpus, from the JSONL tokenized on the fly, for comparison.

    PYTHONPATH=$PWD python benchmarks/data.py                      # ~10 MB and ~1 GB synthetic corpora
    PYTHONPATH=$PWD python benchmarks/data.py --sizes-mb 10 200    # smaller large corpus on a slow machine
    PYTHONPATH=$PWD python benchmarks/data.py --nproc 2            # start-up / RSS of each of 2 torchrun ranks

Start-up = wall time from launching `q38 train`'s process (torch import, model init, data opening, first batch)
to the end of its first step; RSS = the process's peak resident set size at that moment (VmHWM of
/proc/self/status: ru_maxrss would include the parent's size at fork, which prepare-data with --workers 1 makes
large). The corpora
are synthetic English-like text records (byte tokenizer: 1 token per byte). Everything is written under --work
(default: a temporary directory, removed at the end unless --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WORDS = ("the of and to in is was for on that with as by at from his her this which are be or an had not but "
         "were they their one all been has have more its new first time after also two other into most over when "
         "model data train token layer expert router shard corpus memory batch step loss grad rank mesh").split()

CHILD = r"""
import json, os, resource, sys, time
def peak_mb():
    # this process's own high-water mark (VmHWM); ru_maxrss would also count the parent's RSS at fork time
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t_import = time.time()
from q38.train.run.trainer import RunConfig, train
cfg = RunConfig.from_dict(json.loads(sys.argv[1]), source="bench")
t0 = time.time()
from q38.train.data.tokenizer import load_tokenizer
from q38.train.data.sources import TrainData
data = TrainData(cfg.data.path, load_tokenizer("byte"), seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size)
it, _ = data.iterators(cfg.data.batch_size, dp_rank=0, dp_size=1, seed=0, shuffle=True)
next(it)
t_data = time.time() - t0
rss_data = peak_mb()
del data, it
done = {}
def hook(rec):
    if not done:
        done["t"] = time.time()
        done["rss"] = peak_mb()
train(cfg, on_step=hook)
print("BENCH " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "t_first_step": done["t"],
                             "rss_mb": done["rss"], "t_data_open": t_data, "rss_after_data_mb": rss_data}))
"""


def make_corpus(path: Path, mb: float, seed: int = 0) -> int:
    """JSONL text records of ~2 kB until ``mb`` megabytes; returns the byte count."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    # a pool of distinct sentences, combined per record: fast to write, and no two records are equal
    pool = [" ".join(rng.choice(words, size=int(rng.integers(8, 20)))) + "." for _ in range(4096)]
    target = int(mb * 1e6)
    n = 0
    with open(path, "w") as f:
        i = 0
        while n < target:
            picks = rng.integers(0, len(pool), size=(256, 16))
            lines = "".join(json.dumps({"text": f"doc {i + k}: " + " ".join(pool[j] for j in row)}) + "\n"
                            for k, row in enumerate(picks))
            f.write(lines)
            n += len(lines.encode())
            i += 256
    return path.stat().st_size


def write_megatron(shards: Path, prefix: Path) -> None:
    """A Megatron indexed corpus (one sequence per document, uint16 tokens) of a prepared directory's documents,
    written by hand in Megatron's index format (see q38/train/data/megatron.py), streaming shard by shard."""
    import struct

    import numpy as np

    man = json.loads((shards / "manifest.json").read_text())
    assert man["token_dtype"] == "uint16"
    lengths = []
    with open(prefix.with_suffix(".bin"), "wb") as out:
        for s in man["shards"]:
            with open(shards / f"{s['name']}.tokens", "rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
            docs = np.fromfile(shards / f"{s['name']}.docs", dtype=np.int64)
            lengths.append(np.diff(docs).astype(np.int32))
    lengths = np.concatenate(lengths)
    n = len(lengths)
    pointers = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * 2, out=pointers[1:])
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(n + 1, dtype=np.int64).tobytes())


def startup(data_path: str, out: Path, nproc: int, seq_len: int, batch: int) -> list[dict]:
    cfg = {
        "model": "tiny", "layout": "single" if nproc == 1 else "fsdp",
        "data": {"path": data_path, "tokenizer": "byte", "seq_len": seq_len, "batch_size": batch},
        "train": {"lr": 1e-3, "total_steps": 10, "loss_chunk_size": 256},
        "run": {"steps": 1, "out_dir": str(out), "progress": False, "log_every": 1},
    }
    shutil.rmtree(out, ignore_errors=True)  # a fresh run (not a resume)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if nproc == 1:
        cmd = [sys.executable, "-c", CHILD, json.dumps(cfg)]
    else:
        script = out.parent / f"child_{out.name}.py"
        script.write_text(CHILD)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), json.dumps(cfg)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(f"train start-up run failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    recs = [json.loads(line.split("BENCH ", 1)[1]) for line in p.stdout.splitlines() if "BENCH " in line]
    for r in recs:
        r["startup_s"] = r.pop("t_first_step") - t0
    return sorted(recs, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", type=float, nargs=2, default=[10, 1000], metavar=("SMALL", "LARGE"))
    ap.add_argument("--workers", type=int, default=None, help="prepare-data workers (default: CPU count)")
    ap.add_argument("--nproc", type=int, default=1, help="trainer ranks (torchrun) for the start-up measurement")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the corpora and shards")
    ap.add_argument("--reuse", action="store_true", help="reuse corpora already in --work (prepare-data then has "
                    "nothing to do and the prepare rows repeat nothing)")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from q38.train.data.prepare import prepare_data

    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="q38_bench_data_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for label, mb in zip(("small", "large"), a.sizes_mb):
            corpus = work / f"{label}.jsonl"
            t0 = time.time()
            size = corpus.stat().st_size if a.reuse and corpus.is_file() else make_corpus(corpus, mb)
            gen_s = time.time() - t0
            t0 = time.time()
            man = prepare_data([str(corpus)], work / f"{label}_shards", workers=a.workers, progress=False,
                               log=lambda s: None)
            prep_s = time.time() - t0
            if man.get("skipped"):  # --reuse: the time the preparation took when it ran
                prep_s = man.get("prepare_seconds", float("nan"))
            t0 = time.time()
            again = prepare_data([str(corpus)], work / f"{label}_shards", progress=False, log=lambda s: None)
            rerun_s = time.time() - t0
            assert again.get("skipped")
            st = startup(str(work / f"{label}_shards"), work / f"{label}_run", a.nproc, a.seq_len, a.batch_size)
            prefix = work / f"{label}_megatron"
            if not (a.reuse and prefix.with_suffix(".idx").is_file()):
                write_megatron(work / f"{label}_shards", prefix)
            mg = startup(str(prefix), work / f"{label}_run_megatron", a.nproc, a.seq_len, a.batch_size)
            row = {"corpus": label, "MB": size / 1e6, "tokens": man["num_tokens"], "gen_s": gen_s, "prep_s": prep_s,
                   "tok_per_s": man["num_tokens"] / prep_s, "rerun_s": rerun_s, "ranks": st, "megatron": mg}
            if label == "small":
                row["jsonl"] = startup(str(corpus), work / f"{label}_run_jsonl", a.nproc, a.seq_len, a.batch_size)
            rows.append(row)
            print(f"# {label}: {size / 1e6:,.1f} MB, {man['num_tokens']:,} tokens; generated in {gen_s:.1f}s, "
                  f"prepared in {prep_s:.1f}s, re-run {rerun_s:.2f}s", flush=True)
    finally:
        if not a.keep and not a.work:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\nmachine: {os.cpu_count()} CPUs (shared: timings are noisy; read the ratios), prepare-data workers "
          f"{a.workers or os.cpu_count()}, trainer ranks {a.nproc}, tiny model, seq_len {a.seq_len}, "
          f"batch {a.batch_size}")
    heads = [f"{r['corpus']} ({r['MB']:,.0f} MB)" for r in rows]
    print(f"{'':28s}" + "".join(f"{h:>22s}" for h in heads) + f"{'large/small':>14s}")

    def line(name, vals, fmt):
        ratio = vals[1] / vals[0] if vals[0] else float("nan")
        print(f"{name:28s}" + "".join(f"{fmt.format(v):>22s}" for v in vals) + f"{ratio:>14.2f}")

    line("tokens", [r["tokens"] for r in rows], "{:,}")
    line("prepare tokens/s", [r["tok_per_s"] for r in rows], "{:,.0f}")
    line("prepare re-run s (no-op)", [r["rerun_s"] for r in rows], "{:.2f}")
    for k in range(len(rows[0]["ranks"])):
        line(f"rank {k} start-up s (shards)", [r["ranks"][k]["startup_s"] for r in rows], "{:.2f}")
        line(f"rank {k} data open s (shards)", [r["ranks"][k]["t_data_open"] for r in rows], "{:.3f}")
        line(f"rank {k} peak RSS MB (shards)", [r["ranks"][k]["rss_mb"] for r in rows], "{:,.0f}")
        line(f"rank {k} start-up s (megatron)", [r["megatron"][k]["startup_s"] for r in rows], "{:.2f}")
        line(f"rank {k} data open s (megatron)", [r["megatron"][k]["t_data_open"] for r in rows], "{:.3f}")
        line(f"rank {k} RSS after open MB (megatron)", [r["megatron"][k]["rss_after_data_mb"] for r in rows],
             "{:,.0f}")
        line(f"rank {k} peak RSS MB (megatron)", [r["megatron"][k]["rss_mb"] for r in rows], "{:,.0f}")
    j = rows[0]["jsonl"][0]
    print(f"{'small corpus as JSONL, rank 0':28s}  start-up {j['startup_s']:.2f}s, data open {j['t_data_open']:.3f}s, "
          f"peak RSS {j['rss_mb']:,.0f} MB (tokenized on the fly; grows with the corpus)")


if __name__ == "__main__":
    main()
