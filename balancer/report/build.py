"""The imbalance report: how much time a layout wastes on a workload, level by level, and what
each packing strategy buys.

``python -m balancer report --lengths X.npy --capacity N ...`` (:mod:`balancer.cli.report`) plans
the workload with every strategy asked for (default: the baselines and ``balanced``); ``--plan
DIR`` reports a stored plan (``balancer.store``). Either way it writes, under ``--out``:

* ``report.json``: the stable per-strategy block of ``tools/bench.py``
  (:func:`balancer.report.metrics.plan_summary`) plus every extra figure (padding, lower bounds,
  GPU-time breakdown, microbatch order effect, delay histogram, speedups, per-step series);
* ``report.md``: the same as tables a person reads;
* ``*.png``: imbalance per step, per-rank cost distribution, the 1F1B timeline of the worst
  step, the length histogram;

and prints a summary table. A plan that loses or duplicates a sample (or breaks its own
structure) is marked ``"valid": false`` with the counts and is not summarised.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from . import loss_tokens as LT
from . import metrics
from ..strategies import registry as strategies
from ..config import Layout, PlannerConfig
from ..cost.model import CostModel
from ..planning.planner import Plan, plan_epoch
from ..samples import SampleTable

#: strategies tried as the reference for speedups, first present wins
BASELINES = tuple(strategies.baselines())
#: per-step series are kept in report.json up to this many steps
MAX_SERIES_STEPS = 100_000


# ---- analysis ------------------------------------------------------------------------------
def analyze(plan: Plan, cost: CostModel, lengths: np.ndarray | None,
            loss_tokens: np.ndarray | None = None) -> tuple[dict, dict | None]:
    """The report block of one plan and the arrays the plots need (None for an invalid plan).

    ``lengths`` int64[n] are the samples' lengths (None: inferred from the plan, see
    :func:`balancer.report.metrics.validate_plan`); ``loss_tokens`` int64[n], when given, the
    trained tokens of every sample (a loss mask's sum): the block then has ``loss_tokens``
    (:func:`balancer.report.loss_tokens.loss_token_figures`, the trained fraction per step)."""
    check = metrics.validate_plan(plan, lengths)
    if not check["valid"]:
        return {"valid": False, "problems": check["problems"], "steps": plan.n_steps,
                "plan_seconds": float(plan.stats.get("plan_seconds", float("nan"))),
                **{k: v for k, v in check.items() if k.startswith("samples_")}}, None
    if lengths is None:  # plan_summary's coverage needs lengths: those the check inferred
        lengths = np.zeros(plan.n_samples, np.int64)
        np.maximum.at(lengths, np.concatenate([plan.entry_sample, plan.leftover.sample]),
                      np.concatenate([plan.entry_start + plan.entry_length,
                                      plan.leftover.start + plan.leftover.length]))
    block = metrics.plan_summary(plan, cost, lengths)
    block["problems"] = []
    if loss_tokens is not None:
        # masks change what is learnt, not the compute: the cost figures above stay as they are
        block["loss_tokens"] = LT.loss_token_figures(
            plan, LT.check_loss_tokens(loss_tokens, lengths), lengths,
            series=plan.n_steps <= MAX_SERIES_STEPS)
    # the hybrid interface's keys; the exchange is modelled only by --cp-mode hybrid
    # and tools/bench.py --rank-capacity (balancer.report.hybrid.add_fixed_mode_figures)
    block["documents_cut"] = int(block.get("samples_chunked", 0))
    block["exposed_comm_fraction"] = 0.0 if plan.layout.cp == 1 else None
    block["plan_seconds_per_step"] = block["plan_seconds"] / max(plan.n_steps, 1)
    mb_f, mb_b = mbc = metrics.microbatch_costs(plan, cost)
    block["prediction_max_rel_error"] = metrics.prediction_error(plan, cost, mbc)
    sm = metrics.step_metrics(plan, cost)
    times, bubble = metrics.pipeline_times(plan, cost, costs=mbc)
    step_time = sm["step_time"]  # the slowest rank's time, or the lockstep time (FSDP, ZeRO-3)
    spc = metrics.seconds_per_cost(cost)
    # a stage's cost is shared by cp GPUs: seconds of a step = cost / cp * seconds per cost
    to_s = (lambda x: np.asarray(x) / plan.layout.cp * spc) if spc is not None else None
    block["est_step_time"] = metrics.summarize(step_time)
    block["est_step_seconds"] = metrics.summarize(to_s(step_time)) if to_s else None
    block["gpu_time"] = metrics.gpu_time(times, bubble, plan.layout, cost, step_time)
    block["dp_idle_time_per_step"] = metrics.summarize(sm["idle_time"])
    order = {"planned_total": float(step_time.sum())}
    if plan.layout.pp > 1:
        per = {"planned": step_time}
        for o in ("descending", "ascending"):
            per[o] = metrics.pipeline_times(plan, cost, o, costs=mbc)[0].max(axis=1)
            order[f"{o}_total"] = float(per[o].sum())
        best = np.minimum.reduce(list(per.values()))
        order["planned_over_best"] = metrics.summarize(step_time / best)
    block["pp_order"] = order
    spstep = metrics.samples_per_step(plan)
    block["samples_per_step"] = metrics.summarize(spstep)
    block["documents_per_step"] = metrics.summarize(sm["samples"])
    block["tokens_per_step"] = metrics.summarize(sm["tokens"])
    block["token_lower_bound_ratio"] = metrics.summarize(metrics.token_lower_bound_ratio(plan))
    lb = metrics.epoch_lower_bounds(plan, cost)
    block.update(lb)
    block["time_lower_bound_ratio"] = (block["est_step_time_total"] / lb["time_lower_bound"]
                                       if lb["time_lower_bound"] > 0 else float("nan"))
    block["padding"] = metrics.padding_waste(plan)
    block["outlier_delay_histogram"] = metrics.delay_histogram(plan)
    if plan.n_steps <= MAX_SERIES_STEPS:
        block["per_step"] = {"microbatch_imbalance": sm["microbatch_imbalance"].tolist(),
                             "dp_imbalance": sm["dp_imbalance"].tolist(),
                             "pp_bubble_fraction": sm["pp_bubble_fraction"].tolist(),
                             "est_step_time": step_time.tolist(),
                             "samples": spstep.tolist()}
    # the step whose slowest rank is furthest above a perfectly shared, bubble-free step
    # (full steps only, a short final step is all bubble by construction)
    step_total = np.bincount(plan.mb_step, weights=mb_f + mb_b, minlength=plan.n_steps)
    inflation = step_time / np.maximum(step_total / (plan.layout.dp * plan.layout.pp), 1e-300)
    full = plan.step_mbs == plan.layout.microbatches
    worst = int(np.argmax(np.where(full, inflation, -np.inf) if full.any() else inflation))
    block["worst_step"] = {"step": worst, "inflation": float(inflation[worst]),
                           "dp_imbalance": float(sm["dp_imbalance"][worst])}
    ids = [plan.microbatch_ids(worst, r) for r in range(plan.layout.dp)]
    detail = {"step_mb_imbalance": sm["microbatch_imbalance"], "step_dp_imbalance":
              sm["dp_imbalance"], "step_time": step_time, "rank_time": times,
              "microbatch_cost": sm["microbatch_cost"], "to_seconds": to_s,
              "worst_step": worst, "worst_fwd": [mb_f[i] / plan.layout.pp for i in ids],
              "worst_bwd": [mb_b[i] / plan.layout.pp for i in ids]}
    return block, detail


def workload_block(lengths: np.ndarray, cost: CostModel, name: str | None,
                   loss_tokens: np.ndarray | None = None) -> dict:
    """The workload's keys; with ``loss_tokens`` (int64[n], checked here) also its trained
    tokens (:func:`balancer.report.loss_tokens.workload_loss_tokens`)."""
    f, b = cost.doc_costs(lengths)
    extra = ({} if loss_tokens is None else
             LT.workload_loss_tokens(LT.check_loss_tokens(loss_tokens, lengths), lengths))
    return {**extra, "samples": int(lengths.shape[0]), "tokens": int(lengths.sum()), "name": name,
            "length": {"mean": float(lengths.mean()), "p50": float(np.percentile(lengths, 50)),
                       "p90": float(np.percentile(lengths, 90)),
                       "p99": float(np.percentile(lengths, 99)), "max": int(lengths.max())},
            "total_cost": float(f.sum() + b.sum())}


def layout_block(layout: Layout) -> dict:
    return {"dp": layout.dp, "pp": layout.pp, "cp": layout.cp,
            "microbatches": layout.microbatches, "capacity": layout.capacity}


def add_speedups(report: dict) -> None:
    """``report["baseline"]`` and every valid strategy's ``speedup_vs_baseline`` (epoch time of
    the baseline over its own)."""
    valid = {k: v for k, v in report["strategies"].items() if v.get("valid")}
    base = next((b for b in BASELINES if b in valid), next(iter(valid), None))
    report["baseline"] = base
    report["speedup"] = {}
    for name, s in valid.items():
        x = metrics.speedup(valid[base]["est_step_time_total"], s["est_step_time_total"])
        s["speedup_vs_baseline"] = x
        report["speedup"][name] = x


def cost_block(cost: CostModel) -> dict:
    """The report's cost-model keys: name, unit, and what its seconds rest on
    (``flops_per_second``: the cost model's achieved FLOP/s per GPU, None without one;
    ``seconds_basis``: the same in words, stated in report.md and the summary)."""
    fps = cost.flops_per_second if cost.unit == "flops" else None
    if cost.unit == "seconds":
        basis = f"seconds measured by calibration (cost model {cost.name})"
    elif fps:
        basis = (f"seconds = FLOPs / {fps / 1e12:g} TFLOP/s per GPU (flops_per_second of cost "
                 f"model {cost.name})")
    else:
        basis = (f"no clock: cost model {cost.name} counts {cost.unit} with no flops_per_second, "
                 f"so times are in cost units")
    return {"cost_model": cost.name, "cost_unit": cost.unit, "flops_per_second": fps,
            "seconds_basis": basis}


def build_report(lengths: np.ndarray, cost: CostModel, layout: Layout, config: PlannerConfig,
                 names: list[str], *, workload: str | None = None,
                 plans: dict[str, Plan] | None = None,
                 progress=None, loss_tokens=None) -> tuple[dict, dict]:
    """Plan ``lengths`` with every strategy in ``names`` (after any given ``plans``, reported
    as they are) and analyse each. Returns ``(report dict, plot details by strategy)``.
    ``progress(label)``, when given, is called as each strategy starts. ``loss_tokens``
    (int64[n], the trained tokens of every sample) adds the trained fraction per step to every
    strategy; the plans and their costs are the same with or without it."""
    samples = SampleTable(lengths)
    if loss_tokens is not None:  # refuse bad counts before planning anything
        loss_tokens = LT.check_loss_tokens(loss_tokens, samples.lengths)
    report = {"workload": workload_block(samples.lengths, cost, workload, loss_tokens),
              "layout": layout_block(layout), **cost_block(cost),
              "config": config.model_dump(), "strategies": {}}
    details = {}
    items = list((plans or {}).items())
    for name, plan in items:
        if progress is not None:
            progress(f"analyse {name}")
        report["strategies"][name], details[name] = analyze(plan, cost, samples.lengths,
                                                            loss_tokens)
    for name in names:
        if name in report["strategies"]:
            continue
        if progress is not None:
            progress(f"plan {name}")
        plan = plan_epoch(samples, cost, layout, config.model_copy(update={"strategy": name}))
        t0 = time.perf_counter()
        report["strategies"][name], details[name] = analyze(plan, cost, samples.lengths,
                                                            loss_tokens)
        report["strategies"][name]["analyze_seconds"] = time.perf_counter() - t0
    add_speedups(report)
    return report, details


# ---- output --------------------------------------------------------------------------------
def _jsonable(x):
    """NaN/inf become null: report.json stays strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return _jsonable(x.item())
    return x


def write_report(report: dict, details: dict, out: str | Path, lengths: np.ndarray,
                 cost: CostModel, *, plots: bool = True, t0: float | None = None) -> dict:
    """Write report.json, report.md and (unless ``plots`` is False) the PNGs under ``out``.
    Returns ``{kind: path}`` of the files written (also stored in ``report["files"]``);
    ``t0`` (a ``time.perf_counter()`` reading) sets ``report["report_seconds"]``."""
    from . import markdown as report_md
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    if plots:
        from . import plots as P
        t1 = time.perf_counter()
        files.update(P.write_all(report, details, lengths, cost, out))
        report["plot_seconds"] = time.perf_counter() - t1
    return write_md_json(report, files, out, report_md.render, t0)


def write_md_json(report: dict, files: dict, out: Path, render, t0: float | None) -> dict:
    """The last part of writing a report (this one and the hybrid one): ``report.md`` (by
    ``render(report)``) and ``report.json`` under ``out``, after ``report["files"]`` (the names
    of ``files`` plus these two) and, given ``t0``, ``report["report_seconds"]``. Returns
    ``files`` with the two added."""
    files["markdown"] = str(out / "report.md")
    files["json"] = str(out / "report.json")
    report["files"] = {k: Path(v).name for k, v in files.items()}
    if t0 is not None:
        report["report_seconds"] = time.perf_counter() - t0
    Path(files["markdown"]).write_text(render(report))
    with open(files["json"], "w") as f:
        json.dump(_jsonable(report), f, indent=1)
    return files


def format_summary(report: dict) -> str:
    """The terminal table: one line per strategy, invalid plans marked with their counts."""
    w, lay = report["workload"], report["layout"]
    lines = [f"workload: {w.get('name') or '?'} {w['samples']:,} samples, {w['tokens']:,} tokens "
             f"| dp={lay['dp']} pp={lay['pp']} cp={lay['cp']} microbatches={lay['microbatches']} "
             f"capacity={lay['capacity']:,} | cost {report['cost_model']}"]
    if report.get("seconds_basis"):
        lines.append(report["seconds_basis"])
    secs = any((s.get("gpu_time") or {}).get("est_epoch_seconds") is not None
               for s in report["strategies"].values())
    tcol = "epoch s" if secs else "est time"
    nw = max([12] + [len(n) for n in report["strategies"]])
    hdr = (f"{'strategy':<{nw}} {'steps':>6} {'eff':>6} {'mb imb':>7} {'dp imb':>7} {'cp imb':>7} "
           f"{'bubble':>6} {'LB ratio':>8} {'delay':>5} {'dmax':>4} {'idle %':>6} {tcol:>10} "
           f"{'speedup':>7} {'plan s':>6}")
    lines += [hdr, "-" * len(hdr)]
    for name, s in report["strategies"].items():
        if not s.get("valid"):
            lines.append(f"{name:<{nw}} INVALID: {s['samples_lost']} samples lost, "
                         f"{s['samples_duplicated']} duplicated; " + "; ".join(s["problems"]))
            continue
        g = s["gpu_time"]
        t = g["est_epoch_seconds"] if secs else s["est_step_time_total"]
        lines.append(
            f"{name:<{nw}} {s['steps']:6d} {s['packing_efficiency']:6.4f} "
            f"{s['microbatch_imbalance']['mean']:7.4f} {s['dp_imbalance']['mean']:7.4f} "
            f"{s['cp_imbalance']['mean']:7.4f} {s['pp_bubble_fraction']['mean']:6.3f} "
            f"{s['lower_bound_ratio']['mean']:8.4f} {s['outlier_delay_steps']['mean']:5.2f} "
            f"{s['outlier_delay_steps']['max']:4.0f} "
            f"{100 * (g['dp_idle_fraction'] + g['pp_bubble_fraction']):6.1f} {t:10.4g} "
            f"{s['speedup_vs_baseline']:6.3f}x {s['plan_seconds']:6.3f}")
    if "trained_tokens" in w:
        per = [f"{n} mean {100 * f['mean']:.1f}% min {100 * f['min']:.1f}%"
               for n, s in report["strategies"].items() if s.get("valid") and "loss_tokens" in s
               for f in [s["loss_tokens"]["trained_fraction_per_step"]]]
        lines.append(f"trained tokens (loss mask): {w['trained_tokens']:,} of {w['tokens']:,} "
                     f"({100 * w['trained_fraction']:.1f}%); per step: " + "; ".join(per)
                     + "; costs and times are the same with or without the mask")
    base = report.get("baseline")
    if base:
        lines.append(f"speedup: estimated epoch time of {base} over each strategy's; idle %: GPU "
                     f"time in pipeline bubbles and DP waits")
    return "\n".join(lines)
