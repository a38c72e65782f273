"""Benchmark every packing strategy side by side, in one process, on real and synthetic
workloads and a few layouts. Prints tables; ``--json PATH`` writes the same figures.

    python tools/bench.py                        # the built-in suite (the planner's targets)
    python tools/bench.py --lengths wlbllm --capacity 131072 --microbatches 4 --pp 4
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc

import numpy as np

from balancer.cli import args as cli_args
from balancer.cli import hybrid as cli_hybrid
from balancer.report import hybrid as hybrid_report
from balancer import workloads  # noqa: E402
from balancer.report.hybrid import add_fixed_mode_figures  # noqa: E402
from balancer.planning.warmup import warmup  # noqa: E402
from balancer.report.compare import compare, format_table  # noqa: E402
from balancer.config import Layout, PlannerConfig  # noqa: E402
from balancer.cost.model import load_cost_model  # noqa: E402
from balancer.planning.planner import epoch_order, plan_epoch  # noqa: E402
from balancer.report.metrics import capacity_lower_bound_ratio, step_metrics  # noqa: E402
from balancer.samples import SampleTable  # noqa: E402
from balancer.stats import summarize  # noqa: E402
from packing.binpack import bins_lower_bound_l2  # noqa: E402

# (title, workload, samples, layout kwargs, config kwargs)
SUITE = [
    ("wlbllm 128K, 4 microbatches (WLB-LLM PP4 setting)", "wlbllm", None,
     dict(dp=1, pp=4, microbatches=4, capacity=131072), dict(max_delay=4)),
    ("wikipedia, 8 DP x 4 microbatches, 32K, chunked", "wikipedia", None,
     dict(dp=8, pp=1, microbatches=4, capacity=32768), dict(over_length="chunk")),
    ("prolong, 4 DP x 2 PP x 2 CP, 64K", "prolong", None,
     dict(dp=4, pp=2, cp=2, microbatches=4, capacity=65536), dict(over_length="chunk")),
    ("bimodal SFT (synthetic), 16 DP x 8 microbatches, 16K", "bimodal-sft", 500_000,
     dict(dp=16, pp=1, microbatches=8, capacity=16384), dict(over_length="chunk")),
    ("pareto heavy tail (synthetic, to 4x capacity), 8 DP x 5 microbatches, 128K, chunked",
     "pareto", None, dict(dp=8, pp=1, microbatches=5, capacity=131072),
     dict(over_length="chunk")),
    ("lognormal-4k (synthetic), 8 DP x 4 microbatches, 128K, chunked", "lognormal-4k", None,
     dict(dp=8, pp=1, microbatches=4, capacity=131072), dict(over_length="chunk")),
    ("uniform 1..32K (synthetic), 8 DP x 4 microbatches, 32K", "uniform-32k", None,
     dict(dp=8, pp=1, microbatches=4, capacity=32768), dict(over_length="chunk")),
]


def add_efficiency_limit(res: dict, plans: dict) -> None:
    """Per strategy: ``efficiency_hard_limit`` (tokens over the fewest microbatches that can hold
    them: ceil(tokens / capacity) rounded up to a multiple of dp, times the capacity) and
    ``efficiency_gap_points`` (100 x (hard limit - packing efficiency)); and the same under
    Martello and Toth's L2 bound on the microbatches of the plan's entries (the documents and
    chunks as the planner packs them, packing.bins_lower_bound_l2: two entries above half the
    capacity never share a microbatch), rounded up to a multiple of dp:
    ``efficiency_l2_limit`` (never above the hard limit; no plan of these entries packs better)
    and ``efficiency_l2_gap_points``; ``microbatches_hard_bound`` and ``microbatches_l2_bound``
    are the two microbatch counts."""
    for s, plan in plans.items():
        lay = plan.layout
        tokens = int(plan.entry_length.sum())
        fewest = -(-(-(-tokens // lay.capacity)) // lay.dp) * lay.dp
        limit = tokens / (fewest * lay.capacity) if fewest else 1.0
        l2 = -(-bins_lower_bound_l2(plan.entry_length, lay.capacity) // lay.dp) * lay.dp
        l2_limit = tokens / (l2 * lay.capacity) if l2 else 1.0
        row = res["strategies"][s]
        row["efficiency_hard_limit"] = limit
        row["efficiency_gap_points"] = 100 * (limit - row["packing_efficiency"])
        row["microbatches_hard_bound"] = fewest
        row["microbatches_l2_bound"] = l2
        row["efficiency_l2_limit"] = l2_limit
        row["efficiency_l2_gap_points"] = 100 * (l2_limit - row["packing_efficiency"])


def add_lower_bound_gap(res: dict, plans: dict, cost) -> None:
    """Per strategy, the gap of the costliest DP rank to the step's lower bound:
    ``capacity_lower_bound_ratio`` (summary over steps of the ratio to the capacity-aware bound,
    metrics.step_capacity_bound: no plan of the step's documents does better) beside the
    simple ``lower_bound_ratio`` (max(total / dp, costliest document)), and the steps more than
    1% above each (``steps_over_1pct_lower_bound``, ``steps_over_1pct_capacity_bound``)."""
    for s, plan in plans.items():
        simple = step_metrics(plan, cost)["lower_bound_ratio"]
        tight = capacity_lower_bound_ratio(plan, cost)
        row = res["strategies"][s]
        row["capacity_lower_bound_ratio"] = summarize(tight)
        row["steps_over_1pct_lower_bound"] = int((simple > 1.01).sum())
        row["steps_over_1pct_capacity_bound"] = int((tight > 1.01).sum())


def format_efficiency(res: dict) -> str:
    out = "efficiency / hard limit (gap, points): " + ", ".join(
        f"{s} {v['packing_efficiency']:.4f} / {v['efficiency_hard_limit']:.4f} "
        f"({v['efficiency_gap_points']:.2f})" for s, v in res["strategies"].items())
    out += "\nefficiency / L2 limit (gap, points; Martello-Toth bound on the microbatches): " + \
        ", ".join(f"{s} {v['packing_efficiency']:.4f} / {v['efficiency_l2_limit']:.4f} "
                  f"({v['efficiency_l2_gap_points']:.2f})" for s, v in res["strategies"].items())
    if all("capacity_lower_bound_ratio" in v for v in res["strategies"].values()):
        out += "\nDP-rank cost over the step's lower bound, mean (steps > 1%), simple / " \
               "capacity-aware: " + ", ".join(
                   f"{s} {v['lower_bound_ratio']['mean']:.4f} "
                   f"({v['steps_over_1pct_lower_bound']}) / "
                   f"{v['capacity_lower_bound_ratio']['mean']:.4f} "
                   f"({v['steps_over_1pct_capacity_bound']})"
                   for s, v in res["strategies"].items())
    return out


def speed(n: int, dp: int, m: int, capacity: int, repeats: int,
          cost_model: str = "quadratic-64k") -> dict:
    """Plan time of every strategy for n resampled wikipedia samples next to numpy's default
    ``np.argsort`` of the same int64 array (introsort, SIMD-accelerated where the CPU allows: the
    fastest floor for any sort-based packer). The cost model changes the time (more samples are
    heavy under a steeper quadratic term), so it is named in the output."""
    lengths = np.ascontiguousarray(workloads.load("wikipedia", n=n, seed=1), dtype=np.int64)
    samples = SampleTable(lengths)
    cost = load_cost_model(cost_model)
    layout = Layout(dp=dp, microbatches=m, capacity=capacity)
    config = PlannerConfig(over_length="chunk")
    names = cli_args.DEFAULT_STRATEGIES
    warmup(["fixed"])
    # interleave: every repeat times the argsort right before each strategy, and the ratio is
    # the median of those paired ratios (this machine's speed drifts between seconds)
    ratios = {s: [] for s in names}
    cpu_ratios = {s: [] for s in names}
    times = {s: [] for s in names}
    sorts = []
    for _ in range(repeats):
        for s in names:
            cfg = config.model_copy(update={"strategy": s})
            c0 = time.process_time()
            t_sort = _timed(lambda: np.argsort(lengths))
            c1 = time.process_time()
            t = _timed(lambda: plan_epoch(samples, cost, layout, cfg))
            c2 = time.process_time()
            sorts.append(t_sort)
            times[s].append(t)
            ratios[s].append(t / t_sort)
            # CPU time of this process: what other jobs on a shared machine do not inflate
            cpu_ratios[s].append((c2 - c1) / max(c1 - c0, 1e-9))
    out = {"samples": n, "layout": layout.model_dump(), "cost_model": cost_model,
           "argsort": "np.argsort(int64 lengths), numpy default kind",
           "numpy": np.__version__, "argsort_seconds": float(np.median(sorts)),
           "argsort_seconds_min": float(min(sorts)), "strategies": {}}
    for s in names:
        out["strategies"][s] = {"plan_seconds": float(np.median(times[s])),
                                "plan_seconds_min": float(min(times[s])),
                                "ratio_to_argsort": float(np.median(ratios[s])),
                                "cpu_ratio_to_argsort": float(np.median(cpu_ratios[s])),
                                # best plan over best sort: each at the machine's best moment,
                                # which a burst of load on a shared machine moves least
                                "ratio_of_minima": float(min(times[s]) / max(min(sorts), 1e-9))}
    return out


def memory_per_sample(n: int, dp: int, m: int, capacity: int) -> dict:
    """Peak extra memory (tracemalloc: numpy allocations) of planning n samples with
    ``balanced``, per sample."""
    lengths = workloads.load("wikipedia", n=n, seed=2)
    samples = SampleTable(lengths)
    cost = load_cost_model("quadratic-64k")
    layout = Layout(dp=dp, microbatches=m, capacity=capacity)
    config = PlannerConfig(over_length="chunk")
    warmup(["fixed"])
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    plan = plan_epoch(samples, cost, layout, config)
    dt = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    del plan
    return {"samples": n, "peak_bytes": peak, "bytes_per_sample": peak / n, "plan_seconds": dt}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli_args.add_workload_args(p)
    cli_args.add_cp_args(p)
    p.add_argument("--json", help="write the figures to this JSON file")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats (best is kept)")
    p.add_argument("--no-suite", action="store_true",
                   help="skip the built-in workload suite (run only the speed/memory sections)")
    p.add_argument("--speed-samples", type=int, default=1_000_000,
                   help="samples for the speed comparison (0 skips it)")
    p.add_argument("--speed-cost-model", default="quadratic-64k",
                   help="cost model of the speed comparison (preset name or YAML; named in the "
                        "output: the ratio depends on it)")
    p.add_argument("--memory-samples", type=int, default=0,
                   help="samples for the peak-memory measurement (0 skips it; try 10000000)")
    args = p.parse_args(argv)
    try:
        return _main(args)
    except ValueError as e:  # bad input: one line naming the flag / sample
        print("error: " + " ".join(str(e).split("\n")), file=sys.stderr)
        return 2


def _main(args) -> int:
    if args.cp_mode == "hybrid":
        return _hybrid(args)
    names = cli_args.parse_strategies(args.strategies)
    results = []
    if args.lengths:
        cost, layout, config = cli_args.build(args)
        cp_model = cli_args.build_cp(args)[0]
        lengths = workloads.load(args.lengths, n=args.samples, seed=args.seed)
        warmup(["fixed"])
        res, plans = compare(SampleTable(lengths), cost, layout, config, names,
                             repeats=args.repeats)
        add_fixed_mode_figures(res, plans, lengths, cp_model)
        add_efficiency_limit(res, plans)
        add_lower_bound_gap(res, plans, cost)
        res["title"] = args.lengths
        print(format_table(res) + "\n" + format_efficiency(res), flush=True)
        results.append(res)
    else:
        cost = load_cost_model(args.cost_model)
        for title, wl, n, lay, cfg in ([] if args.no_suite else SUITE):
            try:
                lengths = workloads.load(wl, n=n, seed=args.seed)
            except ValueError as e:
                print(f"skipping {title}: {e}")
                continue
            layout = Layout(**lay)
            config = PlannerConfig(seed=args.seed, **cfg)
            warmup(["fixed"])
            res, plans = compare(SampleTable(lengths), cost, layout, config, names,
                                 repeats=args.repeats)
            add_efficiency_limit(res, plans)
            add_lower_bound_gap(res, plans, cost)
            res["title"] = title
            print(f"\n== {title}\n" + format_table(res) + "\n" + format_efficiency(res),
                  flush=True)
            results.append(res)
        if args.speed_samples:
            sp = speed(args.speed_samples, 64, 4, 32768, args.repeats, args.speed_cost_model)
            print(f"\n== speed: {sp['samples']:,} wikipedia samples, 64 DP x 4 microbatches, 32K, "
                  f"cost model {sp['cost_model']} (numpy {sp['numpy']} default np.argsort of the "
                  f"int64 lengths, median: {sp['argsort_seconds']:.3f} s; median of paired ratios)")
            for s, v in sp["strategies"].items():
                print(f"{s:<11} {v['plan_seconds']:7.3f} s  = {v['ratio_to_argsort']:5.2f} x argsort "
                      f"(CPU time: {v['cpu_ratio_to_argsort']:5.2f} x; best plan / best "
                      f"argsort: {v['ratio_of_minima']:5.2f} x)")
            results.append({"speed": sp})
    if args.memory_samples:
        mem = memory_per_sample(args.memory_samples, 64, 4, 32768)
        print(f"\n== memory: planning {mem['samples']:,} samples with balanced: peak extra "
              f"{mem['peak_bytes'] / 2**20:.0f} MiB = {mem['bytes_per_sample']:.1f} B/sample "
              f"({mem['plan_seconds']:.2f} s)")
        results.append({"memory": mem})
    if args.json:
        doc = results[0] if (args.lengths and len(results) == 1) else {"scenarios": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


def _hybrid(args) -> int:
    """``--cp-mode hybrid``: the pool of dp x cp ranks planned by every hybrid-mode strategy
    (the strategy registry's cp_mode hybrid ones, balancer.report.hybrid.compare_hybrid) on the
    same global batches; --max-delay defaults to the hybrid mode's 2."""
    if not args.lengths:
        raise ValueError("--cp-mode hybrid needs --lengths FILE.npy|NAME")
    model, P, budget = cli_args.build_cp(args)
    layout = cli_args.build(args)[1]   # validates the layout flags (cp_mode, rank_capacity)
    names = cli_hybrid.parse_strategies(
        None if args.strategies == ",".join(cli_args.DEFAULT_STRATEGIES) else args.strategies, P)
    lengths = workloads.load(args.lengths, n=args.samples, seed=args.seed)
    # the fixed mode's epoch order (seed, epoch 0): both modes train the same stream
    order = epoch_order(lengths.shape[0], args.seed, 0)
    warmup(["hybrid"])
    res, _, _ = hybrid_report.compare_hybrid(lengths, model, P, budget, names,
                                             max_delay=args.max_delay,
                                             order=order, over_length=args.over_length)
    res = {"title": args.lengths, "cp_mode": "hybrid",
           "workload": {"samples": int(lengths.shape[0]), "tokens": int(lengths.sum())},
           "layout": {**layout.model_dump(), "pool": P},
           "batch_tokens": budget, "cost_model": args.cost_model,
           "overlap": model.hardware.overlap, "gpus_per_node": model.hardware.gpus_per_node,
           "est_step_time_unit": "seconds per GPU (CP cost model, barrier per round)", **res}
    print(hybrid_report.format_table(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0 if all(b.get("valid") for b in res["strategies"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
