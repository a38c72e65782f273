"""Benchmark of opening a stored plan to train (issue 31 item 3): seconds and peak extra memory
of one process opening an epoch and reading its first microbatch, with ``verify=True`` (every
process hashes every array and checks the O(entries) invariants), ``verify="once"`` by the first
process (verifies, writes the stamp) and by every later one (trusts the stamp), and
``verify=False``. Side by side in one run, each in a fresh process; nothing is asserted.

    python tools/bench_verify.py                       # 10M wikipedia samples
    python tools/bench_verify.py --samples 50000000 --dir /big/scratch
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, workloads
from balancer.store import plan_store as store
from balancer.store import verified
from balancer.store.precompute import precompute

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_precompute import child_open, finish, run_child  # noqa: E402


def _child_open(out: str, verify: str) -> dict:
    v = {"true": True, "false": False}.get(verify, verify)
    return dict(child_open(out, v), verify=verify)


def _child(*args) -> dict:
    return run_child(__file__, ["--child", *args])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--window", type=int, default=1_000_000)
    p.add_argument("--dir", help="scratch directory (default: a temporary one)")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child_open(*args.child)))
        return 0
    tmp = args.dir or tempfile.mkdtemp(prefix="bench_verify_")
    os.makedirs(tmp, exist_ok=True)
    out = os.path.join(tmp, "plan")
    samples = SampleTable(workloads.load("wikipedia", n=args.samples, seed=1))
    precompute(samples, load_cost_model("quadratic-64k"),
               Layout(dp=64, microbatches=4, capacity=32768),
               PlannerConfig(over_length="chunk", window_samples=args.window), out,
               overwrite=True, workers=1)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    res = {"samples": args.samples, "plan_bytes": size, "load_average": os.getloadavg()}
    _child(out, "false")  # page cache warm for every row alike
    rows = [("verify=True (every process)", _child(out, "true"))]
    stamp = os.path.join(out, store.epoch_dirname(0), verified.STAMP)
    if os.path.exists(stamp):
        os.unlink(stamp)
    rows.append(('verify="once", first process', _child(out, "once")))
    rows += [('verify="once", later process', min((_child(out, "once") for _ in range(3)),
                                                  key=lambda r: r["seconds"]))]
    rows.append(("verify=False", _child(out, "false")))
    res["open"] = {k: v for k, v in rows}
    print(f"open a stored plan of {args.samples:,} wikipedia samples ({size / 2**20:.0f} MiB) "
          f"and read its first microbatch (load average {res['load_average'][0]:.1f})")
    for k, v in rows:
        print(f"  {k:<32} {v['seconds']:8.3f} s   peak extra RSS "
              f"{v['rss_peak_extra_bytes'] / 2**20:8.1f} MiB")
    return finish(args, res, tmp)


if __name__ == "__main__":
    raise SystemExit(main())
