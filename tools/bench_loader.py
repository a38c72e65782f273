"""Benchmark of the DataLoader drop-in: collation throughput per worker and sampler start-up.

    ./dev python tools/bench_loader.py [--workload wikipedia] [--samples 10000000] [--json PATH]

* collation: tokens/s of ``PackedDataset.__getitems__`` + ``PackedCollator`` in one process
  (what one DataLoader worker does), on in-memory token arrays and on a Hugging Face dataset
  read through Arrow, for cp = 1 and for cp = 2 (zigzag and cost-chosen whole documents);
* sampler start-up for ``--samples`` samples: building the epoch plan in memory
  (``plan_epoch``), and from a plan in memory to the first microbatch (``__len__`` + the first
  ``MicrobatchRef``), after a warm-up run (numba compiled and cached).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


from balancer import CostModel, Layout, PlannerConfig, SampleTable, plan_epoch  # noqa: E402
from balancer import workloads  # noqa: E402
from balancer.loader.collate import FlatTokens, PackedCollator, PackedDataset  # noqa: E402
from balancer.loader.sampler import PackedBatchSampler  # noqa: E402


def collation(dataset, sampler, collator, seconds: float) -> dict:
    wrapped = PackedDataset(dataset)
    n = len(sampler)
    tokens, mbs = 0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b = collator(wrapped.__getitems__(sampler.ref(mbs % n)))
        tokens += int(b["input_ids"].shape[0])
        mbs += 1
    dt = time.perf_counter() - t0
    return {"tokens_per_s": tokens / dt, "microbatches_per_s": mbs / dt,
            "tokens_per_microbatch": tokens / mbs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="wikipedia")
    p.add_argument("--samples", type=int, default=10_000_000, help="samples for the start-up test")
    p.add_argument("--collate-samples", type=int, default=200_000)
    p.add_argument("--capacity", type=int, default=16384)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--strategies", default="sequential,balanced")
    p.add_argument("--seconds", type=float, default=3.0, help="per collation measurement")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    cost = CostModel.quadratic(65536)
    out = {"workload": a.workload, "collation": {}, "startup": {}}

    # ---- collation ------------------------------------------------------------------------
    L = workloads.load(a.workload, n=a.collate_samples, seed=0)
    flat = FlatTokens.from_lengths(L, vocab=32000)
    cfg = PlannerConfig(strategy="sequential", over_length="chunk")
    for cp, balance in ((1, "zigzag"), (2, "zigzag"), (2, "auto")):
        lay = Layout(dp=a.dp, cp=cp, microbatches=a.microbatches, capacity=a.capacity)
        s = PackedBatchSampler(SampleTable(L), cost, lay, cfg, dp_rank=0, cp_rank=0)
        r = collation(flat, s, PackedCollator(cp_balance=balance, cost=cost), a.seconds)
        out["collation"][f"memory_cp{cp}_{balance}"] = r
        print(f"collate in-memory cp={cp} {balance:6s}: {r['tokens_per_s'] / 1e6:7.1f} M tok/s "
              f"({r['microbatches_per_s']:.0f} microbatches/s of {r['tokens_per_microbatch']:.0f})")
    try:
        import datasets
        n_hf = min(len(L), 50_000)
        offs = flat.offsets[:n_hf + 1]
        import pyarrow as pa
        arr = pa.ListArray.from_arrays(pa.array(offs.astype(np.int32)),
                                       pa.array(flat.tokens[:offs[-1]].astype(np.int32)))
        hf = datasets.Dataset(pa.table({"input_ids": arr}))
        lay = Layout(dp=a.dp, microbatches=a.microbatches, capacity=a.capacity)
        s = PackedBatchSampler(SampleTable(L[:n_hf]), cost, lay, cfg, dp_rank=0)
        r = collation(hf, s, PackedCollator(), a.seconds)
        out["collation"]["hf_arrow_cp1"] = r
        print(f"collate HF/Arrow   cp=1 zigzag: {r['tokens_per_s'] / 1e6:7.1f} M tok/s")
    except ImportError:
        pass

    # ---- start-up for many samples --------------------------------------------------------
    big = SampleTable(workloads.load(a.workload, n=a.samples, seed=1))
    lay = Layout(dp=a.dp, microbatches=a.microbatches, capacity=a.capacity)
    warm = SampleTable(big.lengths[:20_000])
    for name in a.strategies.split(","):
        c = PlannerConfig(strategy=name, over_length="chunk")
        plan_epoch(warm, cost, lay, c)  # warm-up: numba compiled / loaded from cache
        t0 = time.perf_counter()
        plan = plan_epoch(big, cost, lay, c)
        t_plan = time.perf_counter() - t0
        t0 = time.perf_counter()
        s = PackedBatchSampler(plan=plan, dp_rank=a.dp - 1)
        n = len(s)
        first = next(iter(s))
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        s2 = PackedBatchSampler(big, cost, lay, c, dp_rank=a.dp - 1)
        len(s2)
        next(iter(s2))
        t_total = time.perf_counter() - t0
        out["startup"][name] = {"samples": len(big), "plan_seconds": t_plan,
                                "sampler_from_plan_seconds": t_first,
                                "sampler_cold_seconds": t_total, "microbatches_per_rank": n}
        print(f"start-up {name:10s} {len(big) / 1e6:.0f}M samples: plan {t_plan:6.2f} s, "
              f"sampler from plan to first batch {t_first * 1e3:7.1f} ms, sampler from lengths "
              f"to first batch {t_total:6.2f} s ({n} microbatches/rank, first has {len(first)} "
              f"docs)")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
