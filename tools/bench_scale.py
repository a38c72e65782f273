"""Peak memory per process of ``python -m balancer precompute`` over length shards, at growing
corpus sizes (issue 31 item 2): the growth per sample is what a bigger corpus costs each
process. Shards of wikipedia-like lengths are written block by block (the generator never holds
the corpus), then precompute runs in a fresh process (or ``--ranks`` torchrun ranks) and its
peak RSS (ru_maxrss: anonymous and file-backed pages mapped, so a memory map's touched pages
count; under torchrun each rank's own, the largest reported) is read. ``--order blocks`` (the default here) plans with
``PlannerConfig.order='blocks'``, the order computed per window, and the lengths read on demand;
``--order permutation`` is the default order of plans (one permutation held per process).
The kernels are compiled into numba's disk cache first (not measured). The plan written is
removed after each size unless ``--keep-plans``. Nothing is asserted.

    python tools/bench_scale.py --samples 10000000 100000000 1000000000 --dir /big/scratch
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np

from balancer import workloads

SHARD = 10_000_000
RUN = ("import resource, runpy, sys; sys.argv = ['balancer'] + sys.argv[1:]\n"
       "try:\n    runpy.run_module('balancer', run_name='__main__')\n"
       "except SystemExit as e:\n    rc = e.code\n"
       "finally:\n    print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
       " file=sys.stderr)\n")


def write_shards(d: str, n: int, seed: int = 1) -> None:
    os.makedirs(d, exist_ok=True)
    pool = workloads.load("wikipedia")
    rng = np.random.default_rng(seed)
    for i, lo in enumerate(range(0, n, SHARD)):
        np.save(os.path.join(d, f"part-{i:05d}.npy"), rng.choice(pool, min(SHARD, n - lo)))


def run(d: str, out: str, window: int, ranks: int, order: str = "blocks") -> dict:
    flags = ["precompute", "--lengths", d, "--order", order, "--dp", "64", "--microbatches", "4",
             "--capacity", "32768", "--over-length", "chunk", "--window-samples", str(window),
             "--out", out, "--overwrite", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    if ranks == 1:
        p = subprocess.run([sys.executable, "-c", RUN, *flags], capture_output=True, text=True,
                           env=env)
        peak = int([x for x in p.stderr.splitlines() if x.startswith("MAXRSS_KB")][-1].split()[1])
    else:  # every rank runs the same wrapper and reports its own peak; the largest counts
        script = os.path.join(os.path.dirname(out), "bench_scale_rank.py")
        with open(script, "w") as f:
            f.write(RUN)
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", str(ranks), script, *flags],
                           capture_output=True, text=True, env=env)
        peaks = [int(x.split()[-1]) for x in p.stderr.splitlines() if "MAXRSS_KB" in x]
        peak = max(peaks) if len(peaks) == ranks else -1
    if p.returncode != 0:
        raise SystemExit(p.stderr[-3000:])
    return {"seconds": time.perf_counter() - t0, "peak_rss_bytes": peak * 1024}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--window", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=1, help="torchrun ranks (1: one process)")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--order", choices=["blocks", "permutation"], default="blocks")
    ap.add_argument("--keep-plans", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    # kernels compiled into the disk cache first: a compile's memory is not the corpus's
    subprocess.run([sys.executable, "-m", "balancer", "compile", "--quiet"], check=True)
    rows = []
    for n in args.samples:
        d = os.path.join(args.dir, f"shards-{n}")
        if not os.path.isdir(d):
            write_shards(d, n)
        out = os.path.join(args.dir, f"plan-{n}")
        r = run(d, out, args.window, args.ranks, args.order)
        if not args.keep_plans:
            shutil.rmtree(out, ignore_errors=True)
        r["samples"] = n
        rows.append(r)
        print(f"{n:>13,} samples: {r['seconds']:8.1f} s, peak RSS per process "
              f"{r['peak_rss_bytes'] / 2**20:9.1f} MiB ({r['peak_rss_bytes'] / n:6.1f} B/sample)",
              flush=True)
    for a, b in zip(rows, rows[1:]):
        g = (b["peak_rss_bytes"] - a["peak_rss_bytes"]) / (b["samples"] - a["samples"])
        print(f"growth {a['samples']:,} -> {b['samples']:,}: {g:.1f} B/sample per process")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"window": args.window, "ranks": args.ranks, "order": args.order,
                       "rows": rows,
                       "load_average": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
