"""Balancing a streamed dataset at run time on CPU: 2 gloo processes (spawned by this script),
each reading its own part of a Hugging Face streaming dataset (``load_dataset(...,
streaming=True)`` + ``split_dataset_by_node``) through ``StreamingPackedDataset`` and a
``StatefulDataLoader``.

Every step, each rank reads about its share of a global batch, the ranks all-gather the lengths,
plan the same cost-balanced step, swap documents with one all-to-all and each gets its packed
microbatches (at most ``--capacity`` tokens each). Halfway through, the loader's
``state_dict()`` is saved, the loader and dataset are thrown away and a fresh pair resumes from
the saved state (source position plus the documents carried into the step). At the end rank 0
checks that every document of the corpus was trained exactly once over both halves, and prints
the per-step balance (slowest rank's cost over the mean) of the steps; the last line is
``RESULT {json}``.

The corpus is generated here (JSON lines in a temporary folder, one file per shard, documents
of log-normal lengths with a few long ones) and tokenized with a byte tokenizer in ``.map``,
so the example needs no network and no model.

  ./dev python examples/stream_balance.py [--world 2] [--docs 600] [--capacity 2048]

Tested with torch 2.13.0+cpu, datasets 5.2.0, torchdata 0.11.0, numba 0.68.1, numpy 2.4.6
(Python 3.11, 2 CPU cores): about 20 s, most of it process start-up.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import tempfile
from pathlib import Path

import numpy as np

import balancer
from _common import at_least

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: nothing to fetch


def write_corpus(folder: Path, docs: int, shards: int, capacity: int, seed: int) -> list:
    """``docs`` JSON-lines documents {"id", "text"} over ``shards`` files; lengths log-normal
    (median ~capacity / 8), clipped to the capacity, so some documents are cost-heavy."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(capacity / 8), 1.0, docs), 1, capacity).astype(int)
    files = []
    for s in range(shards):
        p = folder / f"shard-{s:02d}.jsonl"
        with open(p, "w") as f:
            for i in range(s, docs, shards):
                text = "".join(chr(97 + int(c)) for c in rng.integers(0, 26, lengths[i]))
                f.write(json.dumps({"id": i, "text": text}) + "\n")
        files.append(str(p))
    return files


def make_loader(files, rank, world, args):
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader

    from balancer import Layout, load_cost_model
    from balancer.runtime import StreamingPackedDataset

    ds = load_dataset("json", data_files=files, split="train", streaming=True)
    ds = split_dataset_by_node(ds, rank=rank, world_size=world)  # this rank's shards
    ds = ds.map(lambda row: {"input_ids": list(row["text"].encode())}, remove_columns=["text"])
    cost = load_cost_model(args.cost_model)
    layout = Layout(dp=world, microbatches=args.microbatches, capacity=args.capacity)
    packed = StreamingPackedDataset(ds, cost, layout, id_column="id")
    # the step's collectives run in the loading process: num_workers=0 for this loader
    return packed, StatefulDataLoader(packed, batch_size=None, num_workers=0), cost


def worker(rank: int, world: int, init: str, files: list, args) -> None:
    import torch
    import torch.distributed as dist
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        packed, loader, cost = make_loader(files, rank, world, args)
        trained, step_cost, state = [], {}, None
        for i, mb in enumerate(loader):
            assert int(mb["cu_seqlens"][-1]) <= args.capacity
            trained += mb["sample_ids"].tolist()
            lens = np.diff(mb["cu_seqlens"].numpy())
            step_cost[mb["step"]] = step_cost.get(mb["step"], 0.0) + float(cost.doc_total(lens).sum())
            if i + 1 == args.stop_after:
                state = loader.state_dict()  # what a checkpoint would save
                break
        first = len(trained)
        # a restart: new dataset, new loader, the saved state
        packed, loader, cost = make_loader(files, rank, world, args)
        loader.load_state_dict(state)
        for mb in loader:
            assert int(mb["cu_seqlens"][-1]) <= args.capacity
            trained += mb["sample_ids"].tolist()
            lens = np.diff(mb["cu_seqlens"].numpy())
            step_cost[mb["step"]] = step_cost.get(mb["step"], 0.0) + float(cost.doc_total(lens).sum())
        everyone = [None] * world
        dist.all_gather_object(everyone, (trained, first, step_cost, packed.stats,
                                          packed.last_step))
        if rank == 0:
            report(everyone, args)
    finally:
        gc.collect()  # finished collective work released before the group goes (gloo)
        dist.destroy_process_group()


def report(everyone, args) -> None:
    ids = [i for t, *_ in everyone for i in t]
    stats = everyone[0][3]
    unplanned = stats["unplanned_ids"]
    print(f"{len(everyone)} ranks, {args.docs} documents, capacity {args.capacity}, "
          f"{args.microbatches} microbatches per rank per step")
    for r, (t, first, _, st, _) in enumerate(everyone):
        print(f"rank {r}: read {st['read']} rows, trained {len(t)} documents ({first} before the "
              f"restart, {len(t) - first} after)")
    steps = sorted(set().union(*[set(c) for _, _, c, _, _ in everyone]))
    ratios = []
    for s in steps:
        costs = np.array([c.get(s, 0.0) for _, _, c, _, _ in everyone])
        ratios.append(costs.max() / costs.mean())
    print(f"{len(steps)} steps; slowest rank / mean cost per step: median "
          f"{np.median(ratios):.4f}, max {np.max(ratios):.4f} (the last steps flush the carry)")
    last = everyone[0][4]
    print(f"last step: gather {last['gather']['bytes_sent']} B sent per rank, all-to-all "
          f"{last['exchange']['bytes_sent']} B sent by rank 0, plan "
          f"{1e3 * last['plan_seconds']:.2f} ms; carried at most {stats['max_age']} step(s)")
    dup = len(ids) - len(set(ids))
    missing = set(range(args.docs)) - set(ids) - set(unplanned)
    print(f"every document once: {dup == 0 and not missing} (duplicates {dup}, missing "
          f"{len(missing)}, left unplanned and reported {len(unplanned)})")
    print("RESULT " + json.dumps({
        "processes": len(everyone), "documents": args.docs, "trained": len(ids),
        "duplicates": dup, "missing": len(missing), "unplanned": len(unplanned),
        "before_restart": [first for _, first, _, _, _ in everyone], "steps": len(steps),
        "imbalance_median": round(float(np.median(ratios)), 4),
        "imbalance_max": round(float(np.max(ratios)), 4)}))
    if dup or missing:
        raise SystemExit("a document was lost or trained twice")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=at_least(1), default=2)
    ap.add_argument("--docs", type=at_least(1), default=600)
    ap.add_argument("--shards", type=at_least(1), default=4, help="files (split_dataset_by_node gives "
                    "each rank whole shards when shards %% world == 0)")
    ap.add_argument("--capacity", type=at_least(1), default=2048)
    ap.add_argument("--microbatches", type=at_least(1), default=2)
    ap.add_argument("--stop-after", type=at_least(0), default=10, help="microbatches before the restart")
    ap.add_argument("--cost-model", default="llama-7b")
    ap.add_argument("--seed", type=at_least(0), default=0)
    args = ap.parse_args(argv)
    balancer.warmup(["fixed"])  # compiled once here: the spawned ranks load the kernels
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        files = write_corpus(Path(tmp), args.docs, args.shards, args.capacity, args.seed)
        init = f"file://{Path(tmp) / 'rendezvous'}"
        mp.start_processes(worker, args=(args.world, init, files, args), nprocs=args.world,
                           join=True, start_method="spawn")


if __name__ == "__main__":
    main()
