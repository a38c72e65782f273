"""``report.md``: the report dict of :mod:`balancer.report` as tables a person reads."""
from __future__ import annotations

DISTRIBUTIONS = [
    ("microbatch_imbalance", "Microbatch imbalance (max microbatch cost x n / total, per step)"),
    ("dp_imbalance", "DP imbalance (slowest / mean DP rank time, per step)"),
    ("cp_imbalance", "CP imbalance (slowest / mean CP rank attention, per microbatch)"),
    ("pp_bubble_fraction", "Pipeline bubble fraction (slowest rank, per step)"),
    ("lower_bound_ratio", "Cost lower-bound ratio (max rank cost / max(total / dp, largest "
                          "document), per step)"),
    ("token_lower_bound_ratio", "Token lower-bound ratio (max rank tokens / max(tokens / dp, "
                                "largest document), per step)"),
    ("est_step_time", "Estimated step time (cost units of a stage, per step)"),
    ("est_step_seconds", "Estimated step time (seconds, per step)"),
    ("samples_per_step", "Samples per step"),
    ("tokens_per_step", "Tokens per step"),
]


def _f(x, spec=".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and x != x:
        return "nan"
    return format(x, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out + [""]


def render(report: dict) -> str:
    w, lay = report["workload"], report["layout"]
    strategies = report["strategies"]
    valid = {n: s for n, s in strategies.items() if s.get("valid")}
    base = report.get("baseline")
    L = ["# Imbalance report", ""]
    L.append(f"- **Workload**: {w.get('name') or '?'}, {w['samples']:,} samples, "
             f"{w['tokens']:,} tokens" + (f"; length mean {w['length']['mean']:.0f}, p50 "
                                          f"{w['length']['p50']:.0f}, p99 {w['length']['p99']:.0f}, "
                                          f"max {w['length']['max']:,}" if "length" in w else ""))
    L.append(f"- **Layout**: dp={lay['dp']} x pp={lay['pp']} x cp={lay['cp']} "
             f"({lay['dp'] * lay['pp'] * lay['cp']} GPUs), {lay['microbatches']} microbatches per "
             f"DP rank per step, capacity {lay['capacity']:,} tokens per microbatch")
    L.append(f"- **Cost model**: {report['cost_model']} (unit: {report.get('cost_unit', '?')})"
             + (f"; {report['seconds_basis']}" if report.get("seconds_basis") else "")
             + "; a loss-masked token costs the same compute as a trained one")
    if "trained_tokens" in w:
        L.append(f"- **Trained tokens** (loss mask): {w['trained_tokens']:,} of {w['tokens']:,} "
                 f"({100 * w['trained_fraction']:.2f}%), "
                 f"{w['samples_without_trained_tokens']:,} samples with none")
    if base:
        L.append(f"- **Baseline for speedups**: {base}")
    if "report_seconds" in report:
        L.append(f"- Report computed in {report['report_seconds']:.1f} s")
    L.append("")

    invalid = {n: s for n, s in strategies.items() if not s.get("valid")}
    if invalid:
        L += ["## Invalid plans (not summarised)", ""]
        L += _table(["strategy", "samples planned", "lost", "duplicated", "problems"],
                    [[n, str(s["samples_planned"]), str(s["samples_lost"]),
                      str(s["samples_duplicated"]), "; ".join(s["problems"])]
                     for n, s in invalid.items()])
    if not valid:
        return "\n".join(L)

    secs = all(s["gpu_time"]["est_epoch_seconds"] is not None for s in valid.values())
    L += ["## Summary", ""]
    L += _table(
        ["strategy", "steps", "packing eff.", "mb imb.", "DP imb.", "CP imb.", "bubble",
         "LB ratio", "GPU idle", "epoch time" + (" (s)" if secs else " (cost)"),
         f"speedup vs {base}", "plan s"],
        [[n, str(s["steps"]), _f(s["packing_efficiency"], ".4f"),
          _f(s["microbatch_imbalance"]["mean"], ".3f"), _f(s["dp_imbalance"]["mean"], ".3f"),
          _f(s["cp_imbalance"]["mean"], ".4f"), _f(s["pp_bubble_fraction"]["mean"], ".3f"),
          _f(s["lower_bound_ratio"]["mean"], ".3f"),
          f"{100 * (s['gpu_time']['dp_idle_fraction'] + s['gpu_time']['pp_bubble_fraction']):.1f}%",
          _f(s["gpu_time"]["est_epoch_seconds"] if secs else s["est_step_time_total"]),
          f"{s['speedup_vs_baseline']:.3f}x", _f(s["plan_seconds"], ".3f")]
         for n, s in valid.items()])
    L.append("Means over steps (CP: over microbatches). Speedup: estimated epoch time of the "
             "baseline over the strategy's (the same samples in every plan). GPU idle: share of "
             "GPU time in pipeline bubbles and DP waits.")
    L.append("")

    L += ["## Distributions", ""]
    for key, title in DISTRIBUTIONS:
        if not all(isinstance(s.get(key), dict) for s in valid.values()):
            continue
        L += [f"### {title}", ""]
        L += _table(["strategy", "mean", "p50", "p90", "p99", "max"],
                    [[n] + [_f(s[key][q]) for q in ("mean", "p50", "p90", "p99", "max")]
                     for n, s in valid.items()])

    g0 = next(iter(valid.values()))["gpu_time"]
    L += [f"## Where the GPU time goes ({g0['unit']})", ""]
    L += _table(["strategy", "total", "useful", "pipeline bubbles", "DP waits", "idle share"],
                [[n, _f(g["total"]), _f(g["useful"]),
                  f"{_f(g['pp_bubble'])} ({100 * g['pp_bubble_fraction']:.1f}%)",
                  f"{_f(g['dp_idle'])} ({100 * g['dp_idle_fraction']:.1f}%)",
                  f"{100 * (g['pp_bubble_fraction'] + g['dp_idle_fraction']):.1f}%"]
                 for n, s in valid.items() for g in [s["gpu_time"]]])
    L.append("GPU time = dp x pp x cp GPUs x step time; CP imbalance inside a microbatch is not "
             "in it (see the CP table).")
    L.append("")

    L += ["## Packing, padding and lower bounds", ""]
    L += _table(["strategy", "steps", "steps lower bound", "token slots used", "CP padding",
                 "unused capacity", "epoch time / zero-bubble bound", "chunked samples",
                 "left over"],
                [[n, str(s["steps"]), str(s["steps_lower_bound"]),
                  f"{100 * s['packing_efficiency']:.2f}%",
                  f"{100 * s['padding']['cp_padding_fraction']:.3f}%",
                  f"{100 * s['padding']['unused_fraction']:.2f}%",
                  _f(s["time_lower_bound_ratio"], ".3f"), str(s["samples_chunked"]),
                  str(s["samples_left_over"])]
                 for n, s in valid.items()])
    L.append("The zero-bubble bound is the total cost spread evenly over every GPU with no "
             "pipeline fill or drain; 1F1B with m equal microbatches per step takes "
             "(m + pp - 1) / m times it.")
    L.append("")

    if lay["pp"] > 1:
        L += ["## Effect of microbatch order (1F1B)", ""]
        L += _table(["strategy", "planned order", "heaviest first", "lightest first",
                     "planned / best, mean", "planned / best, max"],
                    [[n, _f(o["planned_total"]), _f(o["descending_total"]),
                      _f(o["ascending_total"]), _f(o["planned_over_best"]["mean"], ".4f"),
                      _f(o["planned_over_best"]["max"], ".4f")]
                     for n, s in valid.items() for o in [s["pp_order"]]])
        L.append("Epoch time (cost units of a stage) with each rank's microbatches in the "
                 "planned order or re-ordered by cost; best = the fastest of the three per step.")
        L.append("")

    lt = {n: s["loss_tokens"] for n, s in valid.items() if "loss_tokens" in s}
    if lt:
        L += ["## Trained tokens per step (loss mask)", ""]
        L += _table(["strategy", "trained / tokens", "mean", "min", "p50", "p90", "max",
                     "steps with none", "pieces apportioned"],
                    [[n, f"{t['trained_tokens']:,} / {t['tokens']:,}"]
                     + [f"{100 * f[q]:.2f}%" for q in ("mean", "min", "p50", "p90", "max")]
                     + [str(t["steps_without_trained_tokens"]), str(t["pieces_apportioned"])]
                     for n, t in lt.items() for f in [t["trained_fraction_per_step"]]])
        L.append("Trained fraction of each step's tokens. " + next(iter(lt.values()))["cost_note"]
                 + " A document cut into pieces has its count shared among its pieces in "
                 "proportion to their lengths.")
        L.append("")

    L += ["## Outlier delay", ""]
    L += _table(["strategy", "delayed documents", "mean delay of delayed (steps)", "max",
                 "documents by delay (steps: count)"],
                [[n, f"{100 * d['delayed_fraction']:.2f}%", _f(d["mean"], ".2f"),
                  _f(d["max"], ".0f"),
                  ", ".join(f"{k}: {c}" for k, c in s["outlier_delay_histogram"].items())]
                 for n, s in valid.items() for d in [s["outlier_delay_steps"]]])

    L += ["## Checks", ""]
    L += _table(["strategy", "samples planned", "lost", "duplicated",
                 "recomputed vs predicted microbatch cost (max rel. error)"],
                [[n, str(s["samples_planned"]), str(s["samples_lost"]),
                  str(s["samples_duplicated"]), _f(s["prediction_max_rel_error"], ".2e")]
                 for n, s in valid.items()])

    files = report.get("files", {})
    plots = [(k, v) for k, v in files.items() if k.startswith("plot_")]
    if plots:
        L += ["## Plots", ""]
        captions = {"plot_steps": "Imbalance and step time per step",
                    "plot_ranks": "Per-rank time and microbatch cost distributions",
                    "plot_gantt": "1F1B timeline of each strategy's worst step",
                    "plot_lengths": "Length histogram with cumulative token and cost shares"}
        for k, v in plots:
            L += [f"### {captions.get(k, k)}", "", f"![{captions.get(k, k)}]({v})", ""]
    return "\n".join(L)
