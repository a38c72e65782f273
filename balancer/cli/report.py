"""``python -m balancer report``: the imbalance report (:mod:`balancer.report.build`) of a
workload given on the command line or of a stored plan (``--plan DIR``)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from . import args as cli_args
from .args import manifest_lengths as _manifest_lengths, read_lengths as _read_lengths
from .. import workloads
from .commands import command
from .progress import stages
from ..samples import DEFAULT_LENGTH_COLUMN
from ..cost.model import CostModel, load_cost_model
from ..planning.planner import Plan
from ..report.build import add_speedups, analyze, build_report, cost_block, format_summary, \
    layout_block, write_report
from ..samples import SampleTable


# ---- command -------------------------------------------------------------------------------
def _load_stored_plan(path: str, epoch: int = 0):
    try:
        from ..store import plan_store as store
    except ModuleNotFoundError as e:
        if e.name != "balancer.store":
            raise
        raise ValueError(f"--plan {path}: reading stored plans needs balancer.store (the "
                         f"precompute module), which this installation does not have yet; "
                         f"report the workload with --lengths instead") from None
    # the report diagnoses coverage and capacity itself: load a broken plan to show it
    return store.load_plan(path, epoch or 0, check_plan=False)


def _plan_cost_model(name: str | None, manifest: dict, plan: Plan) -> CostModel:
    """``--cost-model`` when given, else the stored plan's: its full spec when the manifest
    carries one (``{"name", "spec"}``), else a preset of that name."""
    if name:
        return load_cost_model(name)
    cm = manifest.get("cost_model") if isinstance(manifest, dict) else None
    if isinstance(cm, dict):
        if cm.get("spec"):
            return CostModel.model_validate(cm["spec"])
        cm = cm.get("name")
    cm = cm or plan.cost_model
    try:
        return load_cost_model(cm)
    except ValueError as e:
        raise ValueError(f"{e}; the plan's cost model {cm!r} is not a known preset, give "
                         f"--cost-model NAME|FILE.yaml|config.json") from None


def _read_loss_tokens(args) -> np.ndarray | None:
    """``--loss-tokens FILE.npy`` (integer trained tokens per sample), or with ``--dataset`` the
    per-row sum of ``--loss-mask-column`` (0/1 per token); None when neither is given. The
    counts are checked against the lengths by the report (balancer.report.loss_tokens)."""
    path, col = getattr(args, "loss_tokens", None), getattr(args, "loss_mask_column", None)
    if path and col:
        raise ValueError("give --loss-tokens FILE.npy or --loss-mask-column NAME, not both")
    if path:
        if not str(path).endswith(".npy") or not Path(path).is_file():
            raise ValueError(f"--loss-tokens {path}: expected an existing .npy file of integer "
                             f"trained-token counts, one per sample")
        return np.load(path, allow_pickle=False)
    if col:
        if not getattr(args, "dataset", None):
            raise ValueError("--loss-mask-column reads a column of --dataset DIR; with --lengths "
                             "give --loss-tokens FILE.npy")
        ds = cli_args.open_dataset(args.dataset, args.split)
        if col not in ds.column_names:
            raise ValueError(f"--loss-mask-column {col!r}: the dataset has no such column "
                             f"(columns: {ds.column_names})")
        counts = np.zeros(len(ds), np.int64)
        for i, row in enumerate(ds.with_format("numpy")[col]):
            row = np.asarray(row)
            if row.size and (row.min() < 0 or row.max() > 1):
                raise ValueError(f"--loss-mask-column {col!r}: sample {i} holds "
                                 f"{row[(row < 0) | (row > 1)][0]}, a loss mask is 0/1")
            counts[i] = int(row.sum())
        return counts
    return None


def run_report(args, *, out: str, plots: bool = True, quiet: bool = False) -> dict:
    """Everything ``python -m balancer report`` does; returns the report dict (with
    ``report_seconds`` and ``files``)."""
    from ..planning.warmup import warmup
    _refuse_unused(args)
    given = {k: getattr(args, k, None) is not None for k in ("dp", "microbatches")}
    args = _with_layout_default(args)
    if getattr(args, "plan", None):
        from .hybrid import is_hybrid
        if is_hybrid(Path(args.plan)):   # precompute --cp-mode hybrid wrote it
            args = argparse.Namespace(**{**vars(args), "cp_mode": "hybrid"})
    if getattr(args, "cp_mode", "fixed") == "hybrid":
        if getattr(args, "loss_tokens", None) or getattr(args, "loss_mask_column", None):
            why = (f"--plan {args.plan} is a hybrid DP x CP plan" if getattr(args, "plan", None)
                   else "leave out --cp-mode hybrid")
            raise ValueError(f"--loss-tokens / --loss-mask-column: the trained fraction per "
                             f"step is in the fixed-mode report only ({why}); masks do not "
                             f"change the cost of either mode")
        from .hybrid import run_hybrid_report
        return run_hybrid_report(args, out=out, plots=plots, quiet=quiet)
    t0 = time.perf_counter()
    lengths, wname = _read_lengths(args)
    loss_tokens = _read_loss_tokens(args)
    explicit_strategies = args.strategies is not None
    names = cli_args.parse_strategies(",".join(cli_args.DEFAULT_STRATEGIES)
                                      if args.strategies is None else args.strategies)
    plans = None
    if args.plan:
        plan, manifest = _load_stored_plan(args.plan, getattr(args, "epoch", 0))
        if lengths is None:
            lengths = _manifest_lengths(manifest, Path(args.plan))
            wname = wname or Path(args.plan).name
            if lengths is not None and \
                    SampleTable(lengths).fingerprint() != plan.dataset_fingerprint:
                lengths = None   # the file changed since: report the plan alone
        if lengths is not None and SampleTable(lengths).fingerprint() != plan.dataset_fingerprint:
            raise ValueError(f"--plan {args.plan}: the plan was made for dataset "
                             f"{plan.dataset_fingerprint}, the lengths given are "
                             f"{SampleTable(lengths).fingerprint()}")
        cost = _plan_cost_model(args.cost_model, manifest, plan)
        layout, config = plan.layout, plan.config
        plans = {f"{plan.config.strategy} (stored)": plan}
        names = names if explicit_strategies and lengths is not None else []
        if lengths is None:
            # nothing to re-plan or to check lengths against: report the plan alone
            report = {"workload": {"samples": plan.n_samples,
                                   "tokens": int(plan.entry_length.sum() + plan.leftover.length.sum()),
                                   "name": wname, "lengths_known": False},
                      "layout": layout_block(layout), **cost_block(cost),
                      "config": config.model_dump(), "strategies": {}}
            details = {}
            for name, p in plans.items():
                report["strategies"][name], details[name] = analyze(p, cost, None, loss_tokens)
            add_speedups(report)
            lengths = np.zeros(0, np.int64)
            return _finish(report, details, lengths, cost, out, plots, quiet, t0)
    else:
        if lengths is None:
            raise ValueError("give --lengths FILE.npy|NAME, --dataset DIR or --plan DIR")
        if not any(given.values()):
            # the defaults (one rank, one microbatch) make every step one microbatch: every
            # strategy would be the same plan at imbalance 1.000
            raise ValueError("give the layout to report on: --dp N (data-parallel ranks) and "
                             "--microbatches N (per rank per step), with --pp and --cp where "
                             "they apply; e.g. --dp 8 --pp 4 --cp 2 --microbatches 4")
        cost, layout, config = cli_args.build(_with_cost_default(args))
    bar = stages(len(names) + len(plans or {}) + 2, "report", quiet=quiet)
    try:
        if names:
            bar("compile kernels")
            warmup(["fixed"])
        report, details = build_report(lengths, cost, layout, config, names, workload=wname,
                                       plans=plans, progress=bar, loss_tokens=loss_tokens)
        bar("write report" + (" and plots" if plots else ""))
        files = _write(report, details, lengths, cost, out, plots, t0)
    finally:
        bar.close()
    return _finish(report, details, lengths, cost, out, plots, quiet, t0, files)


def _refuse_unused(args) -> None:
    """A flag the input does not read is an error, not ignored: ``--epoch`` reads ``--plan``,
    ``--split`` / ``--length-column`` / ``--tokens-column`` read ``--dataset``."""
    unused = []
    if not getattr(args, "plan", None) and getattr(args, "epoch", 0) not in (0, None):
        unused.append(f"--epoch {args.epoch} (it picks an epoch of --plan PLAN_DIR)")
    if not getattr(args, "dataset", None):
        for flag, key, default in (("--split", "split", "train"),
                                   ("--length-column", "length_column", "length"),
                                   ("--tokens-column", "tokens_column", None)):
            v = getattr(args, key, default)
            if v != default:
                unused.append(f"{flag} {v} (it reads --dataset DIR)")
    if unused:
        raise ValueError("not used by this input: " + "; ".join(unused) + "; leave it out")


def _with_layout_default(args):
    """``--dp`` and ``--microbatches`` left out (None) take the Layout's defaults."""
    ns = argparse.Namespace(**vars(args))
    for k in ("dp", "microbatches"):
        if getattr(ns, k, None) is None:
            setattr(ns, k, 1)
    return ns


def _with_cost_default(args):
    ns = argparse.Namespace(**vars(args))
    ns.cost_model = ns.cost_model or "quadratic-64k"
    return ns


def _write(report, details, lengths, cost, out, plots, t0) -> dict:
    return write_report(report, details, out, lengths, cost, plots=plots, t0=t0)


def _finish(report, details, lengths, cost, out, plots, quiet, t0, files=None) -> dict:
    if files is None:
        files = _write(report, details, lengths, cost, out, plots, t0)
    if not quiet:
        print(format_summary(report))
        print(f"\nreport written to {Path(out)}/: " + ", ".join(Path(p).name for p in files.values())
              + f" ({report['report_seconds']:.1f} s)")
    return report


def _report_args(p: argparse.ArgumentParser) -> None:
    cli_args.add_workload_args(p)
    cli_args.add_cp_args(p)
    # None = "not given": a stored plan brings its own cost model and strategy; a report of
    # lengths needs --dp or --microbatches (run_report)
    p.set_defaults(cost_model=None, strategies=None, dp=None, microbatches=None)
    g = p.add_argument_group("report")
    g.add_argument("--plan", default=None, help="a plan directory written by precompute "
                   "(balancer.store); its layout and config are used")
    g.add_argument("--epoch", type=int, default=0, help="epoch of the stored plan to report")
    g.add_argument("--dataset", default=None, help="a datasets.save_to_disk directory, or "
                   "jsonl / parquet file(s) (comma-separated, or a directory of them), to read "
                   "lengths from instead of --lengths")
    g.add_argument("--split", default="train", help="split of a DatasetDict")
    g.add_argument("--length-column", default=DEFAULT_LENGTH_COLUMN,
                   help="integer length column (default 'length', else a token column)")
    g.add_argument("--tokens-column", default=None, help="token-id column when there is no "
                   "length column")
    g.add_argument("--loss-tokens", default=None, metavar="FILE.npy", help="trained tokens "
                   "of every sample (integer, 0..length; e.g. the sum of its loss mask): the "
                   "report adds the fraction of trained tokens per step (plans and costs are "
                   "the same: a masked token costs the same compute)")
    g.add_argument("--loss-mask-column", default=None, help="with --dataset: a 0/1 per-token "
                   "loss-mask column (TRL's completion_mask, assistant_masks) whose row sums "
                   "are the trained tokens, as --loss-tokens")
    g.add_argument("--out", default="out/report", help="directory for report.json, report.md "
                   "and the PNG plots")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--measured", default=None, metavar="FILE.jsonl",
                   help="draw a training run's predicted vs measured step times, DP imbalance "
                        "and refit coefficients over time from the JSON lines of the closed "
                        "loop (balancer.loader.online; tools/train.py --measured) instead")


def _report_run(args) -> int:
    if getattr(args, "measured", None):
        from ..report.measured import write_measured
        s = write_measured(args.measured, args.out, plots=not args.no_plots)
        print(f"{len(s['steps'])} steps, {len(s['refits'])} refits: prediction error "
              f"{100 * s['prediction_error_first']:.1f}% (first 10 steps) -> "
              f"{100 * s['prediction_error_last']:.1f}% (last 10), measured DP imbalance "
              f"{s['imbalance_measured_last']:.3f} (last 10); wrote {', '.join(s['files'])}")
        return 0
    report = run_report(args, out=args.out, plots=not args.no_plots)
    return 0 if all(s.get("valid") for s in report["strategies"].values()) else 1


def _demo_args(p):
    p.add_argument("--out", default="out/demo", help="where the report files go")


def _demo_run(args) -> int:
    """The imbalance report (balancer.report) on a built-in default: the wlbllm workload (the
    synthetic bimodal-sft one when the shared workloads are absent), a 7B preset on
    8 DP x 4 PP x 2 CP with 4 microbatches per rank, over-long samples chunked."""
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

# after demo: the --help order users know (compare, demo, report, ...)
command("report", "imbalance report of a workload or a stored plan: report.json, report.md, "
                  "PNG plots")((_report_args, _report_run))
