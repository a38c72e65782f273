"""Benchmark of the offline path: precompute time on one core, peak extra memory per sample,
speedup from 1 to 2 worker processes, and the time to open a stored plan and read its first
microbatch. Figures are printed (and written with ``--json``); nothing is asserted.

    python tools/bench_precompute.py                       # 10M wikipedia samples
    python tools/bench_precompute.py --samples 1000000 --window 100000

Memory is measured in a fresh subprocess per configuration, both with tracemalloc (numpy's
allocations) and as the growth of ru_maxrss over the process's baseline after loading the
lengths and compiling the kernels; the lengths themselves (8 B/sample) are not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np


from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epoch  # noqa: E402
from balancer import workloads  # noqa: E402
from balancer.store import plan_store as store
from balancer.planning.warmup import warmup  # noqa: E402
from balancer.store.precompute import precompute  # noqa: E402

LAYOUT = dict(dp=64, microbatches=4, capacity=32768)


class PeakRSS:
    """Peak resident memory above the resident memory at ``start``: Linux resets the peak
    (VmHWM) when 5 is written to /proc/self/clear_refs; elsewhere ru_maxrss growth (which
    misses a peak that stays below an earlier one)."""

    def start(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.proc = True
            self.base = self._status("VmRSS")
        except OSError:
            self.proc = False
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def extra(self) -> int:
        if self.proc:
            return self._status("VmHWM") - self.base
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(key)


def _setup(window):
    cost = load_cost_model("quadratic-64k")
    layout = Layout(**LAYOUT)
    config = PlannerConfig(over_length="chunk", window_samples=window)
    return cost, layout, config


def _warm(cost, layout, config, tmp):
    warmup(["fixed"])
    small = SampleTable(workloads.load("wikipedia", n=50_000, seed=9))
    precompute(small, cost, layout, config.model_copy(update={"window_samples": 20_000}),
               os.path.join(tmp, "warm"), workers=1, overwrite=True)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def child_memory(npy: str, window, out: str) -> dict:
    """Run in a fresh process: peak extra memory of one precompute (workers=1)."""
    cost, layout, config = _setup(window)
    lengths = np.load(npy)
    samples = SampleTable(lengths)
    samples.fingerprint()
    _warm(cost, layout, config, os.path.dirname(out))
    rss = PeakRSS()
    rss.start()
    dt, _ = _timed(lambda: precompute(samples, cost, layout, config, out, overwrite=True))
    rss = rss.extra()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    precompute(samples, cost, layout, config, out, overwrite=True)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    n = len(samples)
    return {"samples": n, "window": window, "tracemalloc_peak_bytes": peak,
            "tracemalloc_bytes_per_sample": peak / n, "rss_peak_extra_bytes": rss,
            "rss_bytes_per_sample": rss / n, "seconds": dt}


def child_plan_epoch_memory(npy: str, window) -> dict:
    """Reference: peak extra memory of the in-memory planner (plan_epoch) in a fresh process."""
    cost, layout, config = _setup(window)
    samples = SampleTable(np.load(npy))
    warmup(["fixed"])
    rss = PeakRSS()
    rss.start()
    plan = plan_epoch(samples, cost, layout, config)
    rss = rss.extra()
    del plan
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    plan = plan_epoch(samples, cost, layout, config)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    del plan
    n = len(samples)
    return {"samples": n, "window": window, "tracemalloc_bytes_per_sample": peak / n,
            "rss_bytes_per_sample": rss / n}


def child_open(out: str, verify) -> dict:
    """Run in a fresh process (imports done first): open a plan, read its first microbatch;
    seconds and peak extra resident memory (``tools/bench_verify.py`` too)."""
    rss = PeakRSS()
    rss.start()
    t0 = time.perf_counter()
    plan, _ = store.load_plan(out, 0, verify=verify)
    first = plan.microbatch_samples(int(plan.microbatch_ids(0, 0)[0]))
    return {"verify": verify, "seconds": time.perf_counter() - t0,
            "rss_peak_extra_bytes": rss.extra(), "first_microbatch_samples": len(first)}


def run_child(script: str, args: list[str]) -> dict:
    """The JSON document the last line of ``python script *args`` prints."""
    r = subprocess.run([sys.executable, os.path.abspath(script), *args], capture_output=True,
                       text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _run_child(args: list[str]) -> dict:
    return run_child(__file__, args)


def finish(args, res: dict, tmp: str) -> int:
    """The figures to ``--json`` (when given); the scratch directory removed unless ``--dir``
    named it."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if not args.dir:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--window", type=int, default=1_000_000,
                   help="window_samples of the parallel runs (the plan depends on it)")
    p.add_argument("--repeats", type=int, default=2, help="timing repeats (best is kept)")
    p.add_argument("--dir", help="scratch directory (default: a temporary one)")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        if kind == "memory":
            w = None if rest[1] == "none" else int(rest[1])
            print(json.dumps(child_memory(rest[0], w, rest[2])))
        elif kind == "plan_epoch_memory":
            w = None if rest[1] == "none" else int(rest[1])
            print(json.dumps(child_plan_epoch_memory(rest[0], w)))
        else:
            print(json.dumps(child_open(rest[0], rest[1] == "1")))
        return 0

    tmp = args.dir or tempfile.mkdtemp(prefix="bench_precompute_")
    os.makedirs(tmp, exist_ok=True)
    res = {"samples": args.samples, "layout": LAYOUT, "window": args.window,
           "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    lengths = workloads.load("wikipedia", n=args.samples, seed=1)
    npy = os.path.join(tmp, "lengths.npy")
    np.save(npy, lengths)
    samples = SampleTable(lengths)
    cost, layout, config = _setup(args.window)
    _warm(cost, layout, config, tmp)
    out = os.path.join(tmp, "plan")

    def best(fn):
        return min(_timed(fn)[0] for _ in range(args.repeats))

    t_plan = best(lambda: plan_epoch(samples, cost, layout, config))
    t1 = t2 = float("inf")
    for _ in range(args.repeats):  # alternate, so load from other processes hits both alike
        t1 = min(t1, _timed(lambda: precompute(samples, cost, layout, config, out, workers=1,
                                               overwrite=True))[0])
        t2 = min(t2, _timed(lambda: precompute(samples, cost, layout, config, out, workers=2,
                                               overwrite=True))[0])
    cfg_whole = config.model_copy(update={"window_samples": None})
    t_whole = best(lambda: precompute(samples, cost, layout, cfg_whole, out + "-whole",
                                      overwrite=True))
    res["time"] = {"plan_epoch_in_memory_s": t_plan, "precompute_1_worker_s": t1,
                   "precompute_2_workers_s": t2, "speedup_1_to_2": t1 / t2,
                   "precompute_whole_epoch_window_s": t_whole}
    print(f"precompute {args.samples:,} wikipedia samples, dp=64 x 4 microbatches x 32K, "
          f"balanced, window {args.window:,} (load average {res['load_average'][0]:.1f} on "
          f"{res['cpus']} CPUs)")
    print(f"  plan_epoch in memory (no store)     {t_plan:7.2f} s")
    print(f"  precompute, 1 worker                {t1:7.2f} s")
    print(f"  precompute, 2 workers               {t2:7.2f} s   speedup {t1 / t2:.2f}x")
    print(f"  precompute, one whole-epoch window  {t_whole:7.2f} s")

    mem = {}
    for w in (args.window, None):
        tag = "none" if w is None else str(w)
        mem[f"precompute_window_{tag}"] = _run_child(["--child", "memory", npy, tag,
                                                      os.path.join(tmp, "memplan")])
        mem[f"plan_epoch_window_{tag}"] = _run_child(["--child", "plan_epoch_memory", npy, tag])
    res["memory"] = mem
    for k, v in mem.items():
        print(f"  peak extra memory, {k:<30} tracemalloc {v['tracemalloc_bytes_per_sample']:6.1f}"
              f" B/sample, peak RSS {v['rss_bytes_per_sample']:6.1f} B/sample")

    opened = [_run_child(["--child", "open", out, "0"]) for _ in range(3)]
    verified = _run_child(["--child", "open", out, "1"])
    res["open"] = {"no_verify_s": min(o["seconds"] for o in opened),
                   "verify_s": verified["seconds"]}
    print(f"  open plan + first microbatch        {res['open']['no_verify_s']:7.3f} s "
          f"(SHA-256 of every array: {res['open']['verify_s']:.3f} s; page cache warm)")
    m = store.load_manifest(out)
    res["plan"] = m["epochs"][0]["summary"]
    size = sum(os.path.getsize(os.path.join(dp_, f)) for dp_, _, fs in os.walk(out) for f in fs)
    res["plan_bytes"] = size
    print(f"  plan: {res['plan']['steps']:,} steps, {res['plan']['microbatches']:,} microbatches, "
          f"{size / 2**20:.0f} MiB on disk")
    return finish(args, res, tmp)


if __name__ == "__main__":
    raise SystemExit(main())
