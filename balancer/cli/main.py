"""Command line: ``python -m balancer <command>``.

Commands register themselves in :data:`COMMANDS` with :func:`command` (name -> (help,
add_arguments, run)), so each capability keeps its own module; :func:`main` imports the optional
command modules listed in :data:`COMMAND_MODULES`."""
from __future__ import annotations

import argparse
import sys
import time

from . import args as cli_args
from .. import workloads
from ..report.compare import compare, format_table, warmup
from ..samples import SampleTable

COMMANDS: dict = {}
#: modules that register more commands when imported (missing ones are skipped)
COMMAND_MODULES = ("report.build", "cli.store", "cli.calibrate")


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
    """The imbalance report (balancer.report) on a built-in default: the wlbllm workload (the
    synthetic bimodal-sft one when the shared workloads are absent), a 7B preset on
    8 DP x 4 PP x 2 CP with 4 microbatches per rank, over-long samples chunked."""
    from ..report.build import run_report
    t0 = time.perf_counter()
    ns = argparse.Namespace(lengths="wlbllm", samples=None, capacity=None, dp=8, pp=4, cp=2,
                            microbatches=4, global_batch_tokens=None, global_batch_samples=None,
                            cost_model="llama-7b", over_length="chunk", max_delay=4,
                            tail="partial", strategies=None, seed=0, plan=None, dataset=None)
    try:
        workloads.load(ns.lengths)
    except ValueError:
        ns.lengths = "bimodal-sft"
    print(f"demo: {ns.lengths} workload, {ns.cost_model} cost model, dp={ns.dp} pp={ns.pp} "
          f"cp={ns.cp}, {ns.microbatches} microbatches/rank, over-long samples chunked\n")
    report = run_report(ns, out=args.out)
    sp = report.get("speedup", {})
    if "balanced" in sp and report.get("baseline") and report["baseline"] != "balanced":
        print(f"estimated end-to-end speedup of balanced over {report['baseline']}: "
              f"{sp['balanced']:.3f}x; open {args.out}/report.md for the tables and plots "
              f"({time.perf_counter() - t0:.1f} s)")
    return 0 if all(s.get("valid") for s in report["strategies"].values()) else 1


command("demo", "imbalance report of every strategy on a built-in workload and layout")(
    (_demo_args, _demo_run))


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
    except (ValueError, OSError) as e:  # bad input: one line naming the file / flag / sample
        msg = " ".join(str(e).split("\n"))
        print(f"error: {msg}", file=sys.stderr)
        return 2

