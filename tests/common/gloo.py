"""The one multi-process harness of the tests: ``world`` spawned processes in a torch.distributed
gloo group (``file://`` rendezvous in the test's tmp_path), each running
``fn(rank, world, out_dir, *args)``; a hang fails after :data:`TIMEOUT_S` and kills the ranks.
With ``torchrun_env`` every rank also gets the environment torchrun gives it (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR), which accelerate and the HF Trainer read."""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 420  # generous: CI machines are shared; a hang still fails


def run_ranks(fn, world: int, tmp_path, *args, timeout_s: float = TIMEOUT_S,
              torchrun_env: bool = False):
    """Spawn ``world`` processes running ``fn(rank, world, out_dir, *args)`` in one gloo
    group; fail (killing them) after ``timeout_s``. ``fn`` must be importable (module level).
    ``torchrun_env``: set the variables torchrun sets in each rank before the group starts."""
    init = f"file://{tmp_path / 'rendezvous'}"
    ctx = mp.start_processes(
        _entry, args=(fn, world, init, str(tmp_path), timeout_s, torchrun_env) + args,
        nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish in {timeout_s}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def _entry(rank, fn, world, init, out, timeout_s, torchrun_env, *args):
    # the spawned rank inherits the parent's sys.path (pytest's pythonpath = ["."] and the test
    # file's folder), so ``fn`` and the helpers next to it import as in the parent
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if torchrun_env:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s // 2))
    try:
        fn(rank, world, out, *args)
    finally:
        dist.destroy_process_group()
