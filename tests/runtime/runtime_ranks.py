"""Spawning gloo process groups for the run-time balancing tests (the pattern of
tests/test_distributed.py): ``file://`` rendezvous in the test's tmp dir, a timeout that kills
the ranks, results written by the ranks as JSON and checked in the parent."""
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420  # generous: CI machines are shared; a hang still fails


def run_ranks(fn, world: int, tmp_path, *args):
    """Spawn ``world`` processes running ``fn(rank, world, out_dir, *args)`` in one gloo group;
    fail (killing them) after TIMEOUT_S."""
    warm_numba_cache()
    init = f"file://{tmp_path / 'rendezvous'}"
    ctx = mp.start_processes(_entry, args=(fn, world, init, str(tmp_path)) + args,
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish in {TIMEOUT_S}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def warm_numba_cache():
    """Compile (or load) the planner's kernels once in the parent so the ranks load them from
    the disk cache instead of compiling concurrently."""
    from balancer import CostModel, Layout, PlannerConfig, SampleTable, plan_epoch
    for tail in ("partial", "carry"):
        for la in (True, False):
            plan_epoch(SampleTable(np.arange(1, 65)), CostModel.quadratic(65536),
                       Layout(dp=2, microbatches=2, capacity=128),
                       PlannerConfig(shuffle=False, tail=tail, lookahead=la))


def _entry(rank, fn, world, init, out, *args):
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S // 2))
    try:
        fn(rank, world, out, *args)
    finally:
        dist.destroy_process_group()


def write(out, name, obj):
    with open(Path(out) / name, "w") as f:
        json.dump(obj, f)


def read(tmp_path, name):
    return json.loads((Path(tmp_path) / name).read_text())
