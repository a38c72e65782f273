"""``python -m balancer report --cp-mode hybrid --dp D --cp C --rank-capacity TOKENS
--cost-model llama-7b --lengths X ...``: reads the flags, plans and writes the hybrid DP x CP
report of :mod:`balancer.report.hybrid` (what it holds is described there) and prints its
table. A plan that loses or duplicates a token of a document is reported ``"valid": false``
(exit status 1).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from . import args as cli_args
from ..planning.hybrid_eval import format_table, parse_strategies
from ..planning.warmup import warmup
# the report's names, importable from here as before the move
from ..report.hybrid import build_hybrid_report, render_md, write_hybrid_report, write_plots


def run_hybrid_report(args, *, out: str, plots: bool = True, quiet: bool = False) -> dict:
    """Everything ``python -m balancer report --cp-mode hybrid`` does; returns the report."""
    t0 = time.perf_counter()
    if getattr(args, "plan", None):
        raise ValueError("--plan: stored plans are fixed-mode plans; --cp-mode hybrid plans "
                         "the workload itself (give --lengths or --dataset)")
    lengths, wname = cli_args.read_lengths(args)
    if lengths is None:
        raise ValueError("give --lengths FILE.npy|NAME or --dataset DIR")
    # the CP cost model needs a preset with a model: mapping; llama-7b unless told
    args = argparse.Namespace(**{**vars(args), "cost_model": args.cost_model or "llama-7b"})
    model, P, budget = cli_args.build_cp(args)
    layout = cli_args.build(args)[1]   # validates the layout flags (cp_mode, rank_capacity)
    names = parse_strategies(args.strategies, P)
    warmup(["hybrid"])
    report, _, _ = build_hybrid_report(
        lengths, model, P, budget, names, seed=args.seed, max_delay=args.max_delay,
        layout=layout.model_dump(), workload=wname, over_limit=args.over_length)
    files = write_hybrid_report(report, out, plots=plots, t0=t0)
    if not quiet:
        print(format_table({**report, "title": wname, "longest": report["workload"]["longest"],
                            "overlap": report["cp_cost_model"]["overlap"]}))
        written = ", ".join(Path(p).name for p in files.values())
        print(f"\nreport written to {Path(out)}/: {written} ({report['report_seconds']:.1f} s)")
    return report


__all__ = ["build_hybrid_report", "render_md", "run_hybrid_report", "write_hybrid_report",
           "write_plots"]
