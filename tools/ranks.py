"""Spawned gloo ranks for the tools' trainers (``tools/train.py``, ``tools/train_cp.py``):
start ``args.world`` processes in one group with a ``file://`` rendezvous, run a per-rank
function, gather its records; the gradient sum over ranks; the tokenized dataset they read
(:func:`write_documents` makes it, :func:`load_dataset` reads it)."""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def write_documents(folder, lengths, vocab: int, seed: int = 0) -> Path:
    """Write ``folder/tokens.parquet`` (``input_ids`` list<int32>, ``length`` int64): one
    learnable document per length, an arithmetic progression modulo ``vocab`` with its own
    start and stride (seeded)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.shape[0]
    rng = np.random.default_rng(seed)
    start = np.repeat(rng.integers(0, vocab, n), lengths)
    stride = np.repeat(rng.integers(1, 8, n), lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    pos = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lengths)
    values = ((start + stride * pos) % vocab).astype(np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                                            pa.array(values)),
                      "length": pa.array(lengths)})
    path = Path(folder) / "tokens.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def load_dataset(path: Path):
    import datasets
    return datasets.Dataset.from_parquet(str(path), cache_dir=str(Path(path).parent / "hf_cache"))


def sum_grads(params) -> None:
    """Sum every parameter's gradient over the ranks in one all-reduce (a parameter without a
    gradient counts as zeros and gets the sum)."""
    flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else
                      torch.zeros(p.numel(), dtype=p.dtype) for p in params])
    dist.all_reduce(flat)
    off = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            p.grad = flat[off:off + n].view_as(p).clone()
        else:
            p.grad.copy_(flat[off:off + n].view_as(p))
        off += n


def _rank_entry(rank: int, train_rank, world: int, args: argparse.Namespace, init: str,
                out: str):
    """One spawned rank: ``train_rank(rank, world, args)`` in the gloo group; rank 0 writes every
    rank's records to ``out`` once all have finished."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        records = train_rank(rank, world, args)
        gathered = [None] * world
        dist.all_gather_object(gathered, records)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
        dist.barrier()
    finally:
        # drop DDP's reducer and any finished work before the group goes: gloo aborts the
        # process when its threads release Python objects during interpreter shutdown
        gc.collect()
        dist.destroy_process_group()


def _read_records(path: str):
    """The gathered per-rank records, or None when the file is missing or incomplete."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def spawn_ranks(train_rank, args: argparse.Namespace, tmp: str) -> list[list[dict]]:
    """Run ``train_rank(rank, world, args)`` on ``args.world`` spawned ranks in one gloo group
    (``file://`` rendezvous in ``tmp``, ``args.timeout``); returns the per-rank records.
    ``train_rank`` must be importable (module level), as for any spawned process."""
    out = os.path.join(tmp, "records.json")
    init = f"file://{tmp}/rendezvous"
    crash = None
    try:
        mp.start_processes(_rank_entry, args=(train_rank, args.world, args, init, out),
                           nprocs=args.world, join=True, start_method="spawn")
    except mp.ProcessExitedException as exc:
        crash = exc
    # gloo has been seen (about once in 40 runs here) to abort a rank with "terminate called
    # without an active exception" while the process group is torn down. Rank 0 writes the
    # records only after every rank finished training, so a complete file means the run is
    # whole; anything less is a real failure
    per_rank = _read_records(out)
    if per_rank is None:
        if crash is not None:
            raise crash
        raise RuntimeError("the ranks exited without writing their records")
    if crash is not None:
        print(f"train: a rank died after the run completed ({crash}); its records are "
              "complete", file=sys.stderr, flush=True)
    return per_rank
