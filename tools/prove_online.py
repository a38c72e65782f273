"""The closed loop's proof (issue 26): two runs of the demo trainer on 2 gloo ranks, the same
data, windows and clock:

* **online**: started with a wrong cost model (``quadratic-64k``, token units, attention
  weighted for 64k contexts) and ``--calibrate-online``: refit every ``--refit-every`` steps;
* **offline**: planned with the offline-calibrated preset (``tiny-lm-cpu``, tools/calibrate.py),
  measured the same way but never refit (``--online-measure-only``).

    ./dev python tools/prove_online.py --steps 50 --online-clock cpu --out out/prove_online.json

It prints and writes the online run's ``prediction_error_first`` / ``_last``, the step by which
the error was <= 10% and under half its first value (the target: within 40 steps), whether the
ranks agreed, and both runs' measured DP imbalance (slowest rank / mean) over the last 10
steps, on the loop's clock and on the trainer's wall-clock compute time. Nothing here is a
pass/fail threshold of the test suite: the figures depend on the machine (on a shared,
overloaded one, ``--online-clock cpu`` measures each rank's own work).

Measured imbalances of two runs differ by the clock's noise, so the comparison is also made
free of it (``true_model`` in the output): one model fitted on every microbatch both runs
measured (the measured-true model) predicts each run's per-step DP imbalance from the
documents each rank trained, over the last 10 steps and from the online run's first
re-planned step on; and the whole epoch is planned with each model (the offline preset, the
refit models that planned the last steps, the measured-true model) and scored under it, which
also removes the luck of which documents fall in a 10-step slice (its spread is printed).
``--repeats N`` runs N pairs in alternating order and compares them pair by pair (``paired``:
online - offline per pair, mean, spread, how many pairs had the online plan no worse)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from tools import train


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--refit-every", type=int, default=5)
    p.add_argument("--online-clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--wrong-model", default="quadratic-64k")
    p.add_argument("--offline-model", default="tiny-lm-cpu")
    p.add_argument("--out", default="out/prove_online.json")
    p.add_argument("--workload", default=None, help="tools/train.py --workload (both runs)")
    p.add_argument("--scale", type=float, default=None, help="tools/train.py --scale (both runs)")
    p.add_argument("--seed", type=int, default=None, help="tools/train.py --seed (both runs)")
    p.add_argument("--train-args", default="", help="more tools/train.py flags, one string")
    p.add_argument("--repeats", type=int, default=1,
                   help="pairs of runs (online, offline), in alternating order; the imbalance "
                        "figures are compared pair by pair, with their spread")
    return p.parse_args(argv)


def _run(args, model: str, online: bool, tag: str) -> dict:
    out = Path(args.out).parent
    flags = ["--world", "2", "--steps", str(args.steps), "--cost-model", model,
             "--calibrate-online", "--refit-every", str(args.refit_every),
             "--online-clock", args.online_clock, "--log", str(out / f"{tag}.json"),
             "--measured", str(out / f"{tag}.jsonl")] + args.train_args.split()
    for flag in ("workload", "scale", "seed"):
        if getattr(args, flag) is not None:
            flags += [f"--{flag}", str(getattr(args, flag))]
    if not online:
        flags.append("--online-measure-only")
    jl = out / f"{tag}.jsonl"
    if jl.exists():
        jl.unlink()
    return train.run(train.parse_args(flags))


def _csr(lengths: list) -> tuple[np.ndarray, np.ndarray]:
    off = np.concatenate([[0], np.cumsum([len(x) for x in lengths])]).astype(np.int64)
    flat = np.concatenate([np.asarray(x, np.int64) for x in lengths]) if lengths else \
        np.zeros(0, np.int64)
    return flat, off


def _per_step_imbalance(obs: dict, seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(steps, slowest rank / mean per step) of per-microbatch ``seconds``."""
    step, rank = np.asarray(obs["step"], np.int64), np.asarray(obs["rank"], np.int64)
    steps = np.unique(step)
    ranks = int(rank.max()) + 1
    imb = np.empty(steps.size)
    for i, s in enumerate(steps):
        m = step == s
        per = np.bincount(rank[m], weights=seconds[m], minlength=ranks)
        imb[i] = per.max() / per.mean()
    return steps, imb


def true_model_check(runs: dict, template: str, skip: int, steady_from: int,
                     replanned_from: Optional[int] = None) -> dict:
    """The noise-free comparison of the runs' plans: one model fitted (robust, non-negative,
    the template's form) on every microbatch both runs measured (the first ``skip`` steps of
    each left out): the measured-true model. Each run's DP imbalance per step (slowest rank /
    mean) is then predicted under it from the documents each rank trained: what each plan's
    balance is worth under the same costs, free of the clock's noise. ``runs``: tag ->
    ``online_calibration["observations"]``."""
    from balancer import load_cost_model
    from balancer.cost.refit import predict_total, refit
    pooled = {"lengths": [], "seconds": [], "forward": [], "backward": []}
    for obs in runs.values():
        keep = [i for i, s in enumerate(obs["step"]) if s >= skip]
        for k in pooled:
            pooled[k] += [obs[k][i] for i in keep]
    lens, off = _csr(pooled["lengths"])
    tmpl = load_cost_model(template)
    if all(v is not None for v in pooled["forward"] + pooled["backward"]):
        model = refit(tmpl, lens, off, forward=np.asarray(pooled["forward"]),
                      backward=np.asarray(pooled["backward"]), name="measured-true")
    else:
        model = refit(tmpl, lens, off, total=np.asarray(pooled["seconds"]), name="measured-true")
    out = {"model": "pooled refit of every measured microbatch of both runs",
           "observations": len(pooled["seconds"]), "coefficients": _coefficients(model)}
    for tag, obs in runs.items():
        pred = predict_total(model, *_csr(obs["lengths"]))
        y = np.asarray(obs["seconds"])
        use = np.asarray(obs["step"]) >= skip
        steps, imb = _per_step_imbalance(obs, pred)
        _, meas = _per_step_imbalance(obs, y)
        rep = steps >= (replanned_from if replanned_from is not None else steps.size)
        out[tag] = {"fit_error": float(np.median(np.abs(pred[use] - y[use]) / y[use])),
                    "imbalance_last10": float(imb[-10:].mean()),
                    "imbalance_steady": float(imb[steps >= steady_from].mean())
                    if (steps >= steady_from).any() else None,
                    # from the online run's first re-planned step on: every step of the online
                    # run planned with a refit model (the steps before are the wrong model's)
                    "imbalance_replanned": float(imb[rep].mean()) if rep.any() else None,
                    "measured_imbalance_replanned": float(meas[rep].mean()) if rep.any()
                    else None,
                    "imbalance_per_step": [round(float(v), 5) for v in imb],
                    "measured_imbalance_per_step": [round(float(v), 5) for v in meas]}
    out["replanned_from_step"] = replanned_from
    return out, model


def _coefficients(model) -> dict:
    from balancer.cost.refit import coefficients
    f, b = coefficients(model)
    return {"forward": f.tolist(), "backward": b.tolist()}


def _step_times(plan, model) -> tuple[np.ndarray, np.ndarray]:
    """Per step of ``plan`` under ``model``: the slowest DP rank's predicted seconds and the
    mean over the ranks (rank r holds microbatches step_offsets[s] + r * step_mbs[s] ...)."""
    from balancer.cost.blocks import microbatch_costs
    f, b = microbatch_costs(model, plan.entry_length, plan.mb_offsets)
    c, so, m = f + b, plan.step_offsets, plan.step_mbs
    dp = plan.layout.dp
    slow, mean = np.empty(plan.n_steps), np.empty(plan.n_steps)
    for s in range(plan.n_steps):
        per = np.array([c[so[s] + r * m[s]: so[s] + (r + 1) * m[s]].sum() for r in range(dp)])
        slow[s], mean[s] = per.max(), per.mean()
    return slow, mean


def plan_check(online_log: dict, offline_model: str, true, last: int = 10) -> dict:
    """Free of the clock's noise and of the luck of a few steps: the online run's whole epoch
    (its data, layout and windows) planned with each model, every plan scored under the
    measured-true model ``true``: its mean per-step DP imbalance and the epoch's sum of
    slowest-rank step times over the sum of mean ones. The models: the measured-true one (the
    planner's best here), the offline preset, the online run's final refit and every refit
    model that planned one of the run's last ``last`` steps. ``slices``: the difference
    (final refit - offline preset) of the mean imbalance over consecutive ``last``-step slices
    of the epoch, the spread the last-steps criterion has from which documents a slice holds."""
    from balancer import SampleTable, load_cost_model
    from balancer.cost.refit import model_from_coefficients
    from balancer.planning.planner import plan_epoch
    cal = online_log["online_calibration"]
    cfg = argparse.Namespace(**online_log["config"])
    lengths = train.dataset_lengths(cfg.workload, cfg.samples, cfg.scale, cfg.seed)
    layout, config = train.plan_setup(cfg, cfg.world)
    template = load_cost_model(cfg.cost_model)
    refits = [(r["first_replanned_step"], model_from_coefficients(
        template, np.asarray(r["forward"]), np.asarray(r["backward"]), f"refit-s{r['step']}"))
        for r in cal["refits"]]
    n = len(online_log["steps"])
    planned_last = {}
    for s in range(max(0, n - last), n):
        used = [m for first, m in refits if first <= s]
        if used:
            planned_last[used[-1].name] = used[-1]
    models = {"measured-true": true, offline_model: load_cost_model(offline_model)}
    if refits:
        models[f"final ({refits[-1][1].name})"] = refits[-1][1]
    models.update(planned_last)
    samples = SampleTable(lengths)
    out, per_step = {}, {}
    for name, model in models.items():
        plan = plan_epoch(samples, model, layout, config)
        slow, mean = _step_times(plan, true)
        per_step[name] = imb = slow / mean
        out[name] = {"steps": int(plan.n_steps), "imbalance_mean": float(imb.mean()),
                     "epoch_slowest_over_mean": float(slow.sum() / mean.sum()),
                     "planned_last_steps": name in planned_last}
    res = {"scored_under": "measured-true", "epoch_samples": int(len(lengths)), "plans": out}
    if refits:
        a, b = per_step[f"final ({refits[-1][1].name})"], per_step[offline_model]
        k = min(a.size, b.size) // last
        d = np.array([a[i * last:(i + 1) * last].mean() - b[i * last:(i + 1) * last].mean()
                      for i in range(k)])
        res["slices"] = {"steps_per_slice": last, "count": int(k),
                         "difference_mean": float(d.mean()), "difference_std": float(d.std()),
                         "final_no_worse": int((d <= 0).sum())}
    return res


def _pair(args, i: int) -> dict:
    """One online and one offline run, in alternating order (pair 0: online first), so drift
    in the machine's load falls on both alike over the pairs."""
    tags = {"online": f"online-{i}" if args.repeats > 1 else "online",
            "offline": f"offline-{i}" if args.repeats > 1 else "offline"}
    order = ["online", "offline"] if i % 2 == 0 else ["offline", "online"]
    logs = {}
    for kind in order:
        t0 = time.time()
        logs[kind] = _run(args, args.wrong_model if kind == "online" else args.offline_model,
                          kind == "online", tags[kind])
        logs[kind]["online_calibration"]["run_s"] = round(time.time() - t0, 1)
    a, b = logs["online"]["online_calibration"], logs["offline"]["online_calibration"]
    first = a["refits"][0]["first_replanned_step"] if a["refits"] else None
    true, model = true_model_check({"online": a["observations"],
                                    "offline": b["observations"]},
                                   args.wrong_model, a["skip_steps"], 2 * args.refit_every,
                                   first)
    true["plans"] = plan_check(logs["online"], args.offline_model, model)
    pair = {"order": order, "load_average": os.getloadavg()[0],
            "offline_model": args.offline_model,
            "online": {k: a[k] for k in ONLINE_KEYS},
            "offline": {k: b[k] for k in OFFLINE_KEYS},
            "true_model": true}
    return pair


ONLINE_KEYS = ("prediction_error_first", "prediction_error_last", "target_met_at_step",
               "ranks_agree", "first_window", "imbalance_measured_last10",
               "imbalance_measured_steady", "compute_imbalance_last10",
               "prediction_error_by_window", "run_s")
OFFLINE_KEYS = ("prediction_error_first", "prediction_error_last", "imbalance_measured_last10",
                "imbalance_measured_steady", "compute_imbalance_last10", "run_s")
#: the imbalance figures compared pair by pair (online minus offline): measured on the loop's
#: clock, on the wall clock, and predicted under the measured-true model (noise-free)
COMPARED = {"loop_clock_last10": ("imbalance_measured_last10",),
            "loop_clock_steady": ("imbalance_measured_steady",),
            "loop_clock_replanned": ("true_model", "measured_imbalance_replanned"),
            "wall_clock_last10": ("compute_imbalance_last10",),
            "true_model_last10": ("true_model", "imbalance_last10"),
            "true_model_steady": ("true_model", "imbalance_steady"),
            "true_model_replanned": ("true_model", "imbalance_replanned"),
            # the whole epoch planned with the models that planned the last 10 steps (their
            # mean) vs with the offline preset, scored under the measured-true model
            "whole_epoch_last_models": ("plans", "epoch_slowest_over_mean")}


def _figure(pair: dict, kind: str, path: tuple):
    if path[0] == "plans":
        plans = pair["true_model"]["plans"]["plans"]
        if kind == "offline":
            return plans[pair["offline_model"]][path[1]]
        last = [v[path[1]] for v in plans.values() if v["planned_last_steps"]]
        return float(np.mean(last)) if last else None
    if path[0] == "true_model":
        return pair["true_model"][kind][path[1]]
    return pair[kind][path[0]]


def paired(pairs: list[dict]) -> dict:
    """Per compared figure: online and offline per pair, their differences (online - offline;
    > 0: the online plan was the less balanced) with mean, spread and how many pairs had
    the online plan no worse."""
    out = {}
    for name, path in COMPARED.items():
        on = [_figure(p, "online", path) for p in pairs]
        off = [_figure(p, "offline", path) for p in pairs]
        if any(v is None for v in on + off):
            continue
        d = np.asarray(on) - np.asarray(off)
        out[name] = {"online": on, "offline": off, "difference": d.tolist(),
                     "difference_mean": float(d.mean()),
                     "difference_std": float(d.std(ddof=1)) if d.size > 1 else None,
                     "difference_min": float(d.min()), "difference_max": float(d.max()),
                     "online_no_worse": int((d <= 0).sum()), "pairs": int(d.size)}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pairs = [_pair(args, i) for i in range(args.repeats)]
    a, b = pairs[0]["online"], pairs[0]["offline"]
    res = {"steps": args.steps, "refit_every": args.refit_every, "clock": args.online_clock,
           "repeats": args.repeats, "online": a, "offline": b,
           "true_model": pairs[0]["true_model"], "pairs": pairs, "paired": paired(pairs)}
    cmp = res["paired"]
    res["verdict"] = {
        "error_last_at_most_10pct": all(p["online"]["prediction_error_last"] <= 0.10
                                        for p in pairs),
        "target_within_40_steps": all(p["online"]["target_met_at_step"] is not None
                                      and p["online"]["target_met_at_step"] <= 40
                                      for p in pairs),
        "ranks_agree": all(p["online"]["ranks_agree"] for p in pairs),
        # measured (noisy): the mean over the pairs of online - offline
        "imbalance_no_worse_than_offline_loop_clock":
            cmp["loop_clock_last10"]["difference_mean"] <= 0,
        "steady_imbalance_no_worse_than_offline_loop_clock":
            cmp["loop_clock_steady"]["difference_mean"] <= 0
            if "loop_clock_steady" in cmp else None,
        "imbalance_no_worse_than_offline_wall_clock":
            cmp["wall_clock_last10"]["difference_mean"] <= 0,
        # noise-free: both plans under the measured-true model (the mean over the pairs: the
        # online plans of different pairs differ with their refits)
        "imbalance_no_worse_than_offline_true_model":
            cmp["true_model_last10"]["difference_mean"] <= 0,
        "steady_imbalance_no_worse_than_offline_true_model":
            cmp["true_model_steady"]["difference_mean"] <= 0
            if "true_model_steady" in cmp else None,
        "replanned_imbalance_no_worse_than_offline_true_model":
            cmp["true_model_replanned"]["difference_mean"] <= 0
            if "true_model_replanned" in cmp else None,
        # noise-free and free of a 10-step slice's luck: the whole epoch planned with the
        # models that planned the last steps
        "whole_epoch_no_worse_than_offline_true_model":
            cmp["whole_epoch_last_models"]["difference_mean"] <= 0
            if "whole_epoch_last_models" in cmp else None}
    Path(args.out).write_text(json.dumps(res, indent=1))
    for i, p in enumerate(pairs):
        on, off, t = p["online"], p["offline"], p["true_model"]
        print(f"pair {i} ({' then '.join(p['order'])}, load {p['load_average']:.1f}): online "
              f"({args.wrong_model} -> refit every {args.refit_every}, {args.online_clock} "
              f"clock) prediction error {100 * on['prediction_error_first']:.1f}% -> "
              f"{100 * on['prediction_error_last']:.1f}%, target met at step "
              f"{on['target_met_at_step']}, ranks agree {on['ranks_agree']}")
        print(f"  DP imbalance, last 10 steps, online vs offline {args.offline_model}: "
              f"{args.online_clock} clock {on['imbalance_measured_last10']:.4f} vs "
              f"{off['imbalance_measured_last10']:.4f}; wall-clock compute "
              f"{on['compute_imbalance_last10']:.4f} vs {off['compute_imbalance_last10']:.4f}; "
              f"under the measured-true model {t['online']['imbalance_last10']:.4f} vs "
              f"{t['offline']['imbalance_last10']:.4f} (noise-free)")
        pl = t["plans"]
        print("  whole epoch planned with each model, under the measured-true model "
              "(mean step imbalance, epoch slowest/mean): " + "; ".join(
                  f"{k} {v['imbalance_mean']:.4f}, {v['epoch_slowest_over_mean']:.4f}"
                  for k, v in pl["plans"].items()))
        if "slices" in pl:
            sl = pl["slices"]
            print(f"  {sl['steps_per_slice']}-step slices of it, final refit - offline: "
                  f"{sl['difference_mean']:+.4f} +- {sl['difference_std']:.4f} over "
                  f"{sl['count']} (the luck of a slice)")
    for name, c in cmp.items():
        spread = "" if c["difference_std"] is None else f" +- {c['difference_std']:.4f}"
        print(f"{name}: online - offline {c['difference_mean']:+.4f}{spread} (min "
              f"{c['difference_min']:+.4f}, max {c['difference_max']:+.4f}), online no worse "
              f"in {c['online_no_worse']} of {c['pairs']}")
    print(json.dumps(res["verdict"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
