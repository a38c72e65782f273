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
overloaded one, ``--online-clock cpu`` measures each rank's own work)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    on = _run(args, args.wrong_model, True, "online")
    off = _run(args, args.offline_model, False, "offline")
    a, b = on["online_calibration"], off["online_calibration"]
    res = {"steps": args.steps, "refit_every": args.refit_every, "clock": args.online_clock,
           "online": {k: a[k] for k in ("prediction_error_first", "prediction_error_last",
                                        "target_met_at_step", "ranks_agree", "first_window",
                                        "imbalance_measured_last10", "imbalance_measured_steady",
                                        "compute_imbalance_last10",
                                        "prediction_error_by_window")},
           "offline": {k: b[k] for k in ("prediction_error_first", "prediction_error_last",
                                         "imbalance_measured_last10",
                                         "imbalance_measured_steady",
                                         "compute_imbalance_last10")}}
    first, last = a["prediction_error_first"], a["prediction_error_last"]
    met = a["target_met_at_step"]
    res["verdict"] = {
        "error_last_at_most_10pct": last <= 0.10,
        "target_within_40_steps": met is not None and met <= 40,
        "ranks_agree": a["ranks_agree"],
        "imbalance_no_worse_than_offline_loop_clock":
            a["imbalance_measured_last10"] <= b["imbalance_measured_last10"],
        "steady_imbalance_no_worse_than_offline_loop_clock":
            a["imbalance_measured_steady"] <= b["imbalance_measured_steady"],
        "imbalance_no_worse_than_offline_wall_clock":
            a["compute_imbalance_last10"] <= b["compute_imbalance_last10"]}
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"online ({args.wrong_model} -> refit every {args.refit_every}, {args.online_clock} "
          f"clock): prediction error {100 * first:.1f}% -> {100 * last:.1f}%, target met at "
          f"step {met}, ranks agree {a['ranks_agree']}")
    print(f"DP imbalance, last 10 steps: online {a['imbalance_measured_last10']:.4f} vs offline "
          f"{args.offline_model} {b['imbalance_measured_last10']:.4f} ({args.online_clock} "
          f"clock); wall-clock compute {a['compute_imbalance_last10']:.4f} vs "
          f"{b['compute_imbalance_last10']:.4f}; from step {2 * args.refit_every} on "
          f"({args.online_clock} clock) {a['imbalance_measured_steady']:.4f} vs "
          f"{b['imbalance_measured_steady']:.4f}")
    print(json.dumps(res["verdict"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
