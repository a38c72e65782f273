"""Proof on real compute: train the same model on the same data with the same seed on gloo DP
ranks once per strategy (``sequential`` baseline, ``balanced``), measure every rank's compute
time per step, and put the measured DP imbalance and speedup next to what the simulator
predicts from the calibrated cost model for the very same plan.

    ./dev python tools/calibrate.py --name tiny-lm-cpu --capacity 2048
    ./dev python tools/prove.py --cost-model tiny-lm-cpu --worlds 2 --out out/prove

Training is tools/train.py (``run(parse_args(...))``, explicit gradient all-reduce, so a rank's
``compute_s`` is pure forward + backward). Per step, the *step time* is the slowest rank's
compute time (what every rank waits for at the all-reduce) and the *DP imbalance* is max / mean
of the ranks' compute times. The prediction is :func:`balancer.report.metrics.step_metrics` of the plan
the trainer's sampler builds (same dataset, cost model, layout and config), in the cost model's
unit (seconds for a calibrated preset). By default the whole epoch is trained, so both strategies
see exactly the same documents and the speedup is a ratio of training times for the same work;
``--skip-steps`` leaves the first steps (lazy initialisation, allocator warm-up) out of the
timing, from both the measurement and the prediction.

Outputs ``<out>/prove.json`` (and the trainer logs) and ``<out>/prove.md``. JSON keys:
``{"config", "cost_model", "worlds": {"<world>": {"strategies": {"<name>": {"steps",
"measured": {...}, "predicted": {...}, "loss": [...], "log"}}, "speedup": {"<name>":
{"measured", "predicted", "relative_gap"}}, "loss_agreement": {...}}}}``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np


from balancer import load_cost_model  # noqa: E402
from balancer.report.metrics import step_metrics, summarize  # noqa: E402
from tools import train  # noqa: E402
from tools.tiny_lm import add_model_args  # noqa: E402

BASELINE = "sequential"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cost-model", default="tiny-lm-cpu",
                   help="calibrated preset (name or YAML; tools/calibrate.py writes it)")
    p.add_argument("--strategies", default="sequential,balanced", help="comma-separated")
    p.add_argument("--worlds", default="2", help="comma-separated DP world sizes, e.g. 2,4")
    p.add_argument("--workload", default="wlbllm")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--scale", type=float, default=0.05,
                   help="length multiplier: long documents stay attention-bound at the capacity")
    p.add_argument("--capacity", type=int, default=2048)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--max-delay", type=int, default=4)
    p.add_argument("--steps", type=int, default=0, help="steps to train (0: the whole epoch)")
    p.add_argument("--skip-steps", type=int, default=1, help="first steps left out of timing")
    add_model_args(p)  # as calibrated
    p.add_argument("--eval-every", type=int, default=4,
                   help="evaluate a fixed held-out set every this many steps and at the end")
    p.add_argument("--order-seeds", type=int, default=2,
                   help="train every strategy in this many more shuffle orders (held-out loss "
                        "only): the loss comparison is over orders, mean and standard error")
    p.add_argument("--repeats", type=int, default=1,
                   help="train every strategy this many times, interleaved (baseline, ours, "
                        "baseline, ...); the measured speedup is the median of paired ratios")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=int, default=600, help="collective timeout, seconds")
    p.add_argument("--out", default="out/prove", help="folder for the report and logs")
    return p.parse_args(argv)


def train_args(args, strategy: str, world: int, data: Path, log: Path,
               shuffle_seed: int | None = None) -> argparse.Namespace:
    """tools/train.py arguments of one run; DataLoader workers off (fetching is cheap here and
    extra processes would compete with the ranks for the cores being measured)."""
    return train.parse_args([
        "--workload", args.workload, "--samples", str(args.samples), "--scale", str(args.scale),
        "--data", str(data), "--vocab", str(args.vocab), "--world", str(world),
        "--microbatches", str(args.microbatches), "--capacity", str(args.capacity),
        "--strategy", strategy, "--cost-model", str(args.cost_model),
        "--max-delay", str(args.max_delay), "--seed", str(args.seed), "--dim", str(args.dim),
        "--layers", str(args.layers), "--heads", str(args.heads), "--lr", str(args.lr),
        "--attention", args.attention,
        "--steps", str(args.steps), "--num-workers", "0", "--threads", str(args.threads),
        "--timeout", str(args.timeout), "--log", str(log), "--eval-every", str(args.eval_every),
        *(["--shuffle-seed", str(shuffle_seed)] if shuffle_seed is not None else [])])


def trainer_plan(targs: argparse.Namespace, world: int):
    """The epoch-0 plan the trainer's sampler builds (same dataset, cost, layout, config)."""
    ds = train.load_dataset(Path(targs.data) / "tokens.parquet")
    sampler, _ = train.build_loader(targs, ds, 0, world)
    sampler.set_epoch(0)
    return sampler.plan


def measured_block(log: dict, skip: int) -> dict:
    """Per-step figures of a trainer log: step time = slowest rank's compute, DP imbalance =
    max / mean compute over ranks; totals over the steps from ``skip`` on."""
    comp = np.array([e["compute_s"] for e in log["steps"]], dtype=np.float64)
    timed = comp[skip:]
    step = timed.max(axis=1)
    return {"compute_s": comp.tolist(), "step_time": comp.max(axis=1).tolist(),
            "step_time_total": float(step.sum()), "step_time_mean": float(step.mean()),
            "compute_total": float(timed.sum()),
            "dp_imbalance": summarize(timed.max(axis=1) / timed.mean(axis=1)),
            "tokens": int(sum(sum(e["tokens"]) for e in log["steps"][skip:]))}


def predicted_block(plan, cost, n_steps: int, skip: int) -> dict:
    """The simulator's figures (balancer.report.metrics.step_metrics) for the first ``n_steps`` steps
    of ``plan``, timed from ``skip`` on like :func:`measured_block`."""
    sm = step_metrics(plan, cost)
    rank = sm["rank_time"][:n_steps]
    timed = rank[skip:]
    return {"rank_time": rank.tolist(), "step_time": sm["step_time"][:n_steps].tolist(),
            "step_time_total": float(timed.max(axis=1).sum()),
            "step_time_mean": float(timed.max(axis=1).mean()),
            "compute_total": float(timed.sum()),
            "dp_imbalance": summarize(sm["dp_imbalance"][skip:n_steps]),
            "plan_steps": int(plan.n_steps), "unit": cost.unit}


def loss_agreement(curves: dict, tokens: dict, final_fraction: float = 0.25) -> dict:
    """How close the loss curves of the strategies are, on the same axis: tokens trained.

    Step contents differ between strategies (balancing moves documents between steps by up to
    max_delay and packs steps fuller, so the epoch has fewer steps), so per-step losses differ
    by batch composition. Each curve is summarised by the token-weighted mean loss of its steps
    in the last ``final_fraction`` of the epoch's tokens; ``noise`` is the standard error of
    that mean (standard deviation of those steps' losses / sqrt(steps)), and a strategy agrees
    with the baseline when the difference is within ~2 combined standard errors."""
    out = {"final_fraction": final_fraction, "strategies": {}}
    summary = {}
    for k, c in curves.items():
        c = np.asarray(c, dtype=np.float64)
        t = np.cumsum(np.asarray(tokens[k], dtype=np.float64))
        sel = t > (1 - final_fraction) * t[-1]
        sel[-1] = True
        w = np.diff(np.concatenate([[0.0], t]))[sel]
        mean = float((c[sel] * w).sum() / w.sum())
        se = float(c[sel].std(ddof=1) / np.sqrt(sel.sum())) if sel.sum() > 1 else 0.0
        summary[k] = (mean, se)
        out["strategies"][k] = {"first": float(c[0]), "last": float(c[-1]), "final_mean": mean,
                                "final_steps": int(sel.sum()), "noise": se}
    b_mean, b_se = summary[BASELINE]
    out["noise"] = b_se
    for k, (mean, se) in summary.items():
        comb = float(np.hypot(se, b_se))
        out["strategies"][k].update({
            "final_mean_rel_diff": abs(mean - b_mean) / b_mean,
            "final_mean_diff_over_noise": abs(mean - b_mean) / comb if comb > 0 else 0.0})
    return out


def prove_world(args, world: int, strategies: list[str], out: Path, data: Path) -> dict:
    cost = load_cost_model(args.cost_model)
    res = {"strategies": {}}
    totals = {s: [] for s in strategies}  # measured step time total of every repeat
    for rep in range(max(1, args.repeats)):
        # interleaved, so a slow spell of the machine hits both strategies alike
        for s in strategies:
            log_path = out / f"train_w{world}_{s}{f'_r{rep}' if rep else ''}.json"
            targs = train_args(args, s, world, data, log_path)
            print(f"[prove] world {world}: training {s} (run {rep + 1}/{args.repeats}) ...",
                  file=sys.stderr, flush=True)
            log = train.run(targs)
            n = len(log["steps"])
            skip = min(args.skip_steps, n - 1)
            meas = measured_block(log, skip)
            totals[s].append(meas["step_time_total"])
            if rep:
                r = res["strategies"][s]
                # the same plan and seed: the loss curve must not depend on the run
                r["loss_repeatable"] &= [e["loss"] for e in log["steps"]] == r["loss"]
                r["runs"].append(meas)
                continue
            plan = trainer_plan(targs, world)
            pred = predicted_block(plan, cost, n, skip)
            # the trainer logs the planner's own cost of every rank's microbatches; it must be
            # the simulator's input exactly (same plan), or the comparison below is meaningless
            logged = np.array([e["predicted_cost"] for e in log["steps"]])
            gap = float(np.abs(logged - np.array(pred["rank_time"])).max() /
                        max(float(np.abs(logged).max()), 1e-300))
            res["strategies"][s] = {"steps": n, "skipped_steps": skip,
                                    "measured": meas, "predicted": pred,
                                    "plan_matches_trainer": gap < 1e-9,
                                    "loss": [e["loss"] for e in log["steps"]],
                                    "loss_repeatable": True, "runs": [meas],
                                    "step_tokens": [sum(e["tokens"]) for e in log["steps"]],
                                    "eval": eval_curve(log),
                                    "log": str(log_path)}
    for s, r in res["strategies"].items():
        # the run with the median total stands for the strategy (all runs are kept)
        runs = r.pop("runs")
        r["measured"] = runs[int(np.argsort(totals[s])[(len(runs) - 1) // 2])]
        r["measured"]["repeats"] = totals[s]
        if len(runs) > 1:
            r["measured_runs_dp_imbalance_mean"] = [x["dp_imbalance"]["mean"] for x in runs]
    base = res["strategies"].get(BASELINE)
    res["speedup"] = {}
    if base is not None:
        for s, r in res["strategies"].items():
            paired = np.array(totals[BASELINE]) / np.array(totals[s])
            m = float(np.median(paired))
            p = base["predicted"]["step_time_total"] / r["predicted"]["step_time_total"]
            # runs at different times on a shared machine get different CPU shares; the ratio
            # of measured to predicted total compute (all ranks, same documents) is the speed
            # of the machine during a run, and dividing it out gives a load-normalised speedup
            # (model-assisted: a diagnostic next to the raw measurement, not a replacement)
            speed = {k: x["measured"]["compute_total"] / x["predicted"]["compute_total"]
                     for k, x in ((BASELINE, base), (s, r))}
            res["speedup"][s] = {"measured": m, "predicted": p, "measured_runs": paired.tolist(),
                                 "relative_gap": (p - m) / m,
                                 "machine_slowdown": speed[s],
                                 "measured_load_normalised": m * speed[s] / speed[BASELINE]}
        res["loss_agreement"] = loss_agreement(
            {s: r["loss"] for s, r in res["strategies"].items()},
            {s: r["step_tokens"] for s, r in res["strategies"].items()})
        if args.eval_every:
            runs = {k: [r["eval"]] for k, r in res["strategies"].items()}
            for k in range(1, args.order_seeds + 1):
                for st in strategies:
                    print(f"[prove] world {world}: training {st} in shuffle order {k + 1} ...",
                          file=sys.stderr, flush=True)
                    log_path = out / f"train_w{world}_{st}_order{k + 1}.json"
                    runs[st].append(eval_curve(train.run(train_args(args, st, world, data,
                                                                 log_path, args.seed + k))))
            res["eval_agreement"] = eval_agreement(runs)
    return res


def eval_curve(log: dict) -> dict:
    """``{"steps": [...], "tokens": [...], "loss": [...]}``: held-out loss after the evaluated
    steps (counted from 1), with the tokens trained so far."""
    tok = np.cumsum([sum(e["tokens"]) for e in log["steps"]])
    ev = [(i + 1, int(t), e["eval_loss"])
          for i, (t, e) in enumerate(zip(tok, log["steps"])) if "eval_loss" in e]
    return {"steps": [x[0] for x in ev], "tokens": [x[1] for x in ev], "loss": [x[2] for x in ev]}


def eval_agreement(runs: dict) -> dict:
    """Held-out loss of every strategy over shuffle orders (``runs``: strategy -> list of
    :func:`eval_curve` s, one per order), compared with the baseline's at two points: after
    the same number of optimizer steps (the last step every run evaluated) and at the end
    of the run (the same documents trained). Balanced steps are fuller, so an epoch has fewer
    of them: at equal tokens a strategy with fewer steps trails while the loss still falls
    steeply. Each point gives the mean and standard deviation over orders and the difference
    from the baseline in standard errors of that difference."""
    curves = [c for cs in runs.values() for c in cs]
    step = max(set.intersection(*(set(c["steps"]) for c in curves)))

    def point(values):
        v = np.asarray(values, dtype=np.float64)
        return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
                "n": int(v.size), "values": v.tolist()}

    out = {"orders": len(runs[BASELINE]), "step": step, "curves": runs}
    at_step = lambda c: c["loss"][c["steps"].index(step)]  # noqa: E731
    for name, pick in (("equal_steps", at_step), ("end", lambda c: c["loss"][-1])):
        pts = {s: point([pick(c) for c in cs]) for s, cs in runs.items()}
        b = pts[BASELINE]
        for p in pts.values():
            se = float(np.hypot(p["std"] / np.sqrt(p["n"]), b["std"] / np.sqrt(b["n"])))
            p["diff"] = p["mean"] - b["mean"]
            p["diff_over_se"] = abs(p["diff"]) / se if se > 0 else None
        out[name] = pts
    return out


def format_markdown(rep: dict) -> str:
    cfg = rep["config"]
    lines = ["# Proof on real compute", "",
             f"Workload `{cfg['workload']}` x {cfg['scale']} ({cfg['samples']} samples), "
             f"capacity {cfg['capacity']} tokens, {cfg['microbatches']} microbatches per rank, "
             f"TinyLM dim {cfg['dim']} x {cfg['layers']} layers, cost model "
             f"`{rep['cost_model']['name']}` ({rep['cost_model']['unit']}).", ""]
    for w, r in rep["worlds"].items():
        lines += [f"## {w} DP ranks", "",
                  "| strategy | steps | measured step time total (s) | predicted (s) | "
                  "measured DP imbalance mean / max | predicted mean / max | measured speedup | "
                  "predicted speedup | gap |", "|---|---|---|---|---|---|---|---|---|"]
        for s, x in r["strategies"].items():
            m, p = x["measured"], x["predicted"]
            sp = r["speedup"].get(s, {})
            lines.append(
                f"| {s} | {x['steps']} | {m['step_time_total']:.2f} | {p['step_time_total']:.2f} "
                f"| {m['dp_imbalance']['mean']:.3f} / {m['dp_imbalance']['max']:.3f} "
                f"| {p['dp_imbalance']['mean']:.3f} / {p['dp_imbalance']['max']:.3f} "
                f"| {sp.get('measured', float('nan')):.3f}x | {sp.get('predicted', float('nan')):.3f}x "
                f"| {100 * sp.get('relative_gap', float('nan')):+.1f}% |")
        runs = {k: v["measured_runs"] for k, v in r["speedup"].items() if len(v["measured_runs"]) > 1}
        if runs:
            lines += ["", "Measured speedup of every interleaved run pair (the table gives their "
                          "median): " + "; ".join(f"{k} " + ", ".join(f"{x:.3f}x" for x in v)
                                                  for k, v in runs.items() if k != BASELINE)]
        ea = r.get("eval_agreement")
        if ea:
            lines += ["", f"Held-out loss (a fixed set of documents) over {ea['orders']} shuffle "
                          "orders, mean +- standard deviation; the difference from "
                          f"{BASELINE} in standard errors:", "",
                      f"| strategy | after step {ea['step']} (every run) | diff "
                      "| at the end of the run | diff |",
                      "|---|---|---|---|---|"]
            for s in ea["equal_steps"]:
                a, e = ea["equal_steps"][s], ea["end"][s]
                f = lambda p: f"{p['diff']:+.4f} ({p['diff_over_se']:.2f} SE)" \
                    if p["diff_over_se"] is not None else "-"  # noqa: E731
                lines.append(f"| {s} | {a['mean']:.4f} +- {a['std']:.4f} | {f(a)} "
                             f"| {e['mean']:.4f} +- {e['std']:.4f} | {f(e)} |")
        la = r.get("loss_agreement")
        if la:
            lines += ["", f"Loss curves (token-weighted mean over the last "
                          f"{100 * la['final_fraction']:.0f}% of the epoch's tokens, with its "
                          f"standard error):", ""]
            for s, x in la["strategies"].items():
                lines.append(f"- {s}: {x['first']:.4f} -> {x['last']:.4f}, final mean "
                             f"{x['final_mean']:.4f} +- {x['noise']:.4f} over {x['final_steps']} "
                             f"steps ({100 * x['final_mean_rel_diff']:.2f}% from {BASELINE}, "
                             f"{x['final_mean_diff_over_noise']:.2f} standard errors)")
            lines += ["", "| step | " + " | ".join(r["strategies"]) + " |",
                      "|---|" + "---|" * len(r["strategies"])]
            n = min(len(x["loss"]) for x in r["strategies"].values())
            for i in range(n):
                lines.append(f"| {i} | " + " | ".join(f"{x['loss'][i]:.4f}"
                                                       for x in r["strategies"].values()) + " |")
        lines.append("")
    return "\n".join(lines)


def run(args) -> dict:
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    cost = load_cost_model(args.cost_model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rep = {"config": {k: v for k, v in vars(args).items()},
           "cost_model": {"name": cost.name, "unit": cost.unit,
                          "forward": cost.forward.model_dump(),
                          "backward": cost.backward.model_dump()},
           "worlds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"  # one dataset for every run: same documents, same order
        for w in worlds:
            rep["worlds"][str(w)] = prove_world(args, w, strategies, out, data)
    (out / "prove.json").write_text(json.dumps(rep, indent=1))
    (out / "prove.md").write_text(format_markdown(rep))
    return rep


def main(argv=None) -> int:
    args = parse_args(argv)
    rep = run(args)
    for w, r in rep["worlds"].items():
        for s, sp in r["speedup"].items():
            x = r["strategies"][s]
            print(f"world {w} {s:11s}: measured {x['measured']['step_time_total']:.2f} s "
                  f"(DP imbalance {x['measured']['dp_imbalance']['mean']:.3f}), predicted "
                  f"{x['predicted']['step_time_total']:.2f} {x['predicted']['unit']} "
                  f"({x['predicted']['dp_imbalance']['mean']:.3f}); speedup measured "
                  f"{sp['measured']:.3f}x predicted {sp['predicted']:.3f}x "
                  f"(gap {100 * sp['relative_gap']:+.1f}%)")
        ea = r.get("eval_agreement")
        if ea:
            for s, a in ea["equal_steps"].items():
                e = ea["end"][s]
                print(f"world {w} {s:11s}: held-out loss after equal steps {a['mean']:.4f} +- "
                      f"{a['std']:.4f}, at the end {e['mean']:.4f} +- {e['std']:.4f} "
                      f"({ea['orders']} orders)")
        la = r.get("loss_agreement", {})
        for s, x in la.get("strategies", {}).items():
            print(f"world {w} {s:11s}: loss {x['first']:.4f} -> {x['last']:.4f}, final mean "
                  f"{x['final_mean']:.4f} +- {x['noise']:.4f} ({100 * x['final_mean_rel_diff']:.2f}% "
                  f"from {BASELINE}, {x['final_mean_diff_over_noise']:.2f} standard errors)")
    print(f"wrote {Path(args.out) / 'prove.json'} and {Path(args.out) / 'prove.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
