"""Command line: ``python -m balancer <command>``.

Commands register themselves in :data:`COMMANDS` with :func:`command` (name -> (help,
add_arguments, run)), so each capability keeps its own module; :func:`main` imports the optional
command modules listed in :data:`COMMAND_MODULES`."""
from __future__ import annotations

import argparse
import sys
import time

from . import cli_args, workloads
from .compare import compare, format_table, warmup
from .samples import SampleTable

COMMANDS: dict = {}
#: modules that register more commands when imported (missing ones are skipped)
COMMAND_MODULES = ("report", "store_cli", "calibration_cli")


def command(name: str, help: str):
    def deco(fn_pair):
        COMMANDS[name] = (help, *fn_pair)
        return fn_pair
    return deco


def _compare_args(p):
    cli_args.add_workload_args(p, default_workload="wlbllm")


def _compare_run(args) -> int:
    names = cli_args.parse_strategies(args.strategies)
    cost, layout, config = cli_args.build(args)
    lengths = workloads.load(args.lengths, n=args.samples, seed=args.seed)
    warmup(names, cost, layout, config)
    res, _ = compare(SampleTable(lengths), cost, layout, config, names)
    print(format_table(res))
    return 0


command("compare", "plan a workload with several strategies and print their figures")(
    (_compare_args, _compare_run))


def _demo_args(p):
    p.add_argument("--out", default="out/demo", help="where the report files go")


def _demo_run(args) -> int:
    t0 = time.perf_counter()
    ns = argparse.Namespace(lengths="wlbllm", samples=None, capacity=None, dp=8, pp=4, cp=2,
                            microbatches=4, global_batch_tokens=None, global_batch_samples=None,
                            cost_model="llama-7b", over_length="chunk", max_delay=4,
                            tail="partial", strategies=",".join(cli_args.DEFAULT_STRATEGIES),
                            seed=0)
    try:
        workloads.load(ns.lengths)
    except ValueError:
        ns.lengths = "bimodal-sft"
    cost, layout, config = cli_args.build(ns)
    print(f"demo: {ns.lengths} workload, {cost.name} cost model, dp={layout.dp} pp={layout.pp} "
          f"cp={layout.cp}, {layout.microbatches} microbatches/rank, capacity {layout.capacity:,}")
    names = cli_args.parse_strategies(ns.strategies)
    warmup(names, cost, layout, config)
    res, _ = compare(SampleTable(workloads.load(ns.lengths)), cost, layout, config, names)
    print(format_table(res))
    base = res["strategies"]["sequential"]["est_step_time_total"]
    ours = res["strategies"]["balanced"]["est_step_time_total"]
    print(f"\nestimated speedup of balanced over sequential: {base / ours:.3f}x "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


command("demo", "compare every strategy on a built-in workload and layout")((_demo_args, _demo_run))


def main(argv=None) -> int:
    # importing these registers their commands
    for mod in COMMAND_MODULES:
        try:
            __import__(f"balancer.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"balancer.{mod}":
                raise
    p = argparse.ArgumentParser(prog="python -m balancer", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (help_, add, run) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        add(sp)
        sp.set_defaults(_run=run)
    args = p.parse_args(argv)
    try:
        return args._run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

