"""``python -m balancer compare``: plan a workload with several strategies and print a table of
their figures (:mod:`balancer.report.compare`)."""
from __future__ import annotations

from . import args as cli_args
from .commands import command
from .progress import stages
from .. import workloads
from ..planning.warmup import warmup
from ..report.compare import compare, format_table
from ..samples import SampleTable


def _compare_args(p):
    cli_args.add_workload_args(p, default_workload="wlbllm")


def _compare_run(args) -> int:
    names = cli_args.parse_strategies(args.strategies)
    cost, layout, config = cli_args.build(args)
    lengths = workloads.load(args.lengths, n=args.samples, seed=args.seed)
    bar = stages(len(names) + 1, "compare")
    try:
        bar("compile kernels")
        warmup(["fixed"])
        res, _ = compare(SampleTable(lengths), cost, layout, config, names, progress=bar)
    finally:
        bar.close()
    print(format_table(res))
    return 0


command("compare", "plan a workload with several strategies and print their figures")(
    (_compare_args, _compare_run))
