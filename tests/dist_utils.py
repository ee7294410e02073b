"""Run a function on N gloo ranks forked from the pytest process (docs/testing.md: fork + pre-imported torch.distributed)."""

import io
import multiprocessing as mp
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  (pre-import in the parent: forked children start warm)
import torch.distributed._functional_collectives  # noqa: F401


def _child(rank, world, init_file, fn, args, q):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # bytes, not shared-memory tensor handles (those die with the child)
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world: int, *args, timeout: float = 240.0):
    """``fn(rank, world, *args)`` on ``world`` processes; returns the results in rank order, re-raising failures."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="q38_pg_")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_child, args=(r, world, init_file, fn, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, out = q.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(out), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{out}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    if errors:
        raise AssertionError("distributed run failed\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
