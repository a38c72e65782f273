"""Run strategies side by side on one workload and layout: the engine behind ``tools/bench.py``
and the report command. Returns the stable JSON shape documented in docs/report.md."""
from __future__ import annotations

import time

from ..config import Layout, PlannerConfig
from ..cost.model import CostModel
from .metrics import plan_summary
from ..planning.planner import Plan, plan_epoch
from ..samples import SampleTable


def compare(samples: SampleTable, cost: CostModel, layout: Layout, config: PlannerConfig,
            strategies_: list[str], *, repeats: int = 1,
            progress=None) -> tuple[dict, dict[str, Plan]]:
    """Plan with every strategy (best of ``repeats`` timings) and summarise each plan;
    ``progress(label)``, when given, is called as each strategy starts."""
    out = {"workload": {"samples": len(samples), "tokens": samples.total_tokens},
           "layout": {"dp": layout.dp, "pp": layout.pp, "cp": layout.cp,
                      "microbatches": layout.microbatches, "capacity": layout.capacity},
           "cost_model": cost.name, "strategies": {}}
    plans = {}
    for s in strategies_:
        if progress is not None:
            progress(f"plan {s}")
        cfg = config.model_copy(update={"strategy": s})
        best = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan = plan_epoch(samples, cost, layout, cfg)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        plan.stats["plan_seconds"] = best
        summary = plan_summary(plan, cost, samples.lengths)
        summary["plan_seconds_per_step"] = best / max(plan.n_steps, 1)
        out["strategies"][s] = summary
        plans[s] = plan
    return out, plans


def format_table(result: dict) -> str:
    """A fixed-width table of the headline figures of every strategy."""
    w = result["workload"]
    lay = result["layout"]
    lines = [f"workload: {w['samples']:,} samples, {w['tokens']:,} tokens | layout dp={lay['dp']} "
             f"pp={lay['pp']} cp={lay['cp']} microbatches={lay['microbatches']} "
             f"capacity={lay['capacity']:,} | cost {result.get('cost_model', '?')}"]
    hdr = (f"{'strategy':<11} {'plan s':>7} {'ms/step':>7} {'steps':>6} {'eff':>6} "
           f"{'mb imb':>7} {'mb p90':>7} {'dp imb':>7} {'LB ratio':>8} {'cp imb':>7} "
           f"{'bubble':>6} {'delay':>5} {'dmax':>4} {'lost':>4} {'dup':>4} {'est time':>10}")
    lines += [hdr, "-" * len(hdr)]
    for name, s in result["strategies"].items():
        lines.append(
            f"{name:<11} {s['plan_seconds']:7.3f} {1e3 * s['plan_seconds_per_step']:7.3f} "
            f"{s['steps']:6d} {s['packing_efficiency']:6.4f} "
            f"{s['microbatch_imbalance']['mean']:7.4f} {s['microbatch_imbalance']['p90']:7.4f} "
            f"{s['dp_imbalance']['mean']:7.4f} {s['lower_bound_ratio']['mean']:8.4f} "
            f"{s['cp_imbalance']['mean']:7.4f} {s['pp_bubble_fraction']['mean']:6.3f} "
            f"{s['outlier_delay_steps']['mean']:5.2f} {s['outlier_delay_steps']['max']:4.0f} "
            f"{s['samples_lost']:4d} {s['samples_duplicated']:4d} {s['est_step_time_total']:10.4g}")
    return "\n".join(lines)
