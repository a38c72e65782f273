"""Multimodal benchmark: per-phase DP imbalance (encoder, LLM) of the placement modes side by
side, and planning time against the text-only planner on the same samples.

    ./dev python tools/bench_multimodal.py                      # the built-in scenarios
    ./dev python tools/bench_multimodal.py --workload multimodal-omni --model omni-7b \
        --dp 8 --cp 2 --microbatches 2 --samples 50000 --json out.json

Rows: ``sequential/home`` (what a plain packer does), ``balanced/home`` (LLM-balanced, images
encoded where their sample runs), ``balanced/joint`` (balanced on LLM + encoder cost per sample),
``balanced/post`` (LLM-balanced, then the encoder inputs of every step re-partitioned over DP
ranks). Figures per phase: ``dp_imbalance`` (max / mean over ranks per step) and
``lower_bound_ratio`` (max / max(total / dp, largest item) per step), mean and max over the
steps; ``step``: two-phase step time over its lower bound; ``moved``: share of media tokens
whose embeddings travel. ``plan_s`` is the best of ``--repeat`` runs after a warm-up;
``text_s`` the text-only ``plan_epoch`` (same strategy, same lengths).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


from balancer import Layout, PlannerConfig, plan_epoch  # noqa: E402
from balancer.multimodal.cost import load_mm_cost_model  # noqa: E402
from balancer.multimodal.plan import MMConfig, mm_summary, plan_multimodal  # noqa: E402
from balancer.multimodal.workloads import generate  # noqa: E402

ROWS = [("sequential", "home"), ("balanced", "home"), ("balanced", "joint"),
        ("balanced", "post")]
SCENARIOS = [
    dict(workload="multimodal-mix", model="qwen2-vl-7b", dp=16, cp=1, microbatches=1),
    dict(workload="multimodal-mix", model="qwen2-vl-7b", dp=8, cp=1, microbatches=2),
    dict(workload="multimodal-long", model="qwen2-vl-7b", dp=8, cp=4, microbatches=2),
    dict(workload="multimodal-omni", model="omni-7b", dp=8, cp=1, microbatches=2),
]


def best_time(fn, repeat):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(sc: dict, samples: int, seed: int, repeat: int, shuffle: bool) -> dict:
    cost = load_mm_cost_model(sc["model"])
    table = generate(sc["workload"], cost.rules, n=samples, seed=seed)
    layout = Layout(dp=sc["dp"], cp=sc["cp"], microbatches=sc["microbatches"],
                    capacity=cost.capacity(cp=sc["cp"]))
    mm_base = MMConfig(over_capacity="downscale")
    out = {"scenario": sc, "samples": samples, "media": table.n_media,
           "layout": layout.model_dump(), "rows": {}}
    fitted = None
    for strat, mode in ROWS:
        cfg = PlannerConfig(strategy=strat, shuffle=shuffle, seed=seed)
        mm = mm_base.model_copy(update={"mode": mode})
        plan_multimodal(table, cost, layout, cfg, mm)  # warm-up (numba compile / cache load)
        t, mp = best_time(lambda: plan_multimodal(table, cost, layout, cfg, mm), repeat)
        fitted = mp.table
        samp = fitted.to_sample_table()
        plan_epoch(samp, cost.llm, layout, cfg)
        tt, _ = best_time(lambda: plan_epoch(samp, cost.llm, layout, cfg), repeat)
        s = mm_summary(mp, cost)
        s["plan_seconds"], s["text_plan_seconds"] = t, tt
        out["rows"][f"{strat}/{mode}"] = s
    out["media_downscaled"] = int(mp.stats.get("media_downscaled", 0))
    return out


def fmt(res: dict) -> str:
    sc = res["scenario"]
    lines = [f"\n{sc['workload']} on {sc['model']}: dp={sc['dp']} cp={sc['cp']} "
             f"microbatches={sc['microbatches']} capacity={res['layout']['capacity']}, "
             f"{res['samples']} samples, {res['media']} media items "
             f"({res['media_downscaled']} downscaled to the encoder capacity)",
             f"{'row':18} {'enc imb':>13} {'enc LB':>13} {'llm imb':>13} {'llm LB':>13} "
             f"{'step LB':>8} {'moved':>6} {'plan_s':>7} {'text_s':>7} {'ratio':>5}"]
    for name, r in res["rows"].items():
        e, m = r["encoder"], r["llm"]

        def mm(d):
            return f"{d['mean']:.3f}/{d['max']:.2f}"
        lines.append(
            f"{name:18} {mm(e['dp_imbalance']):>13} {mm(e['lower_bound_ratio']):>13} "
            f"{mm(m['dp_imbalance']):>13} {mm(m['lower_bound_ratio']):>13} "
            f"{r['step']['lower_bound_ratio']['mean']:>8.3f} "
            f"{r['traffic']['moved_token_fraction']:>6.2f} {r['plan_seconds']:>7.3f} "
            f"{r['text_plan_seconds']:>7.3f} "
            f"{r['plan_seconds'] / max(r['text_plan_seconds'], 1e-9):>5.2f}")
    lines.append("(imbalance and LB columns: mean/max over steps)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload")
    ap.add_argument("--model", default="qwen2-vl-7b")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--samples", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shuffle", action="store_true",
                    help="shuffle samples per epoch (default: stream order, so the generator's "
                         "batch-to-batch modality variation reaches the planner)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    scs = SCENARIOS if a.workload is None else [dict(
        workload=a.workload, model=a.model, dp=a.dp, cp=a.cp, microbatches=a.microbatches)]
    results = []
    for sc in scs:
        res = run(sc, a.samples, a.seed, a.repeat, a.shuffle)
        print(fmt(res), flush=True)
        results.append(res)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
