"""The hybrid demo trainer against fixed CP on CPU/gloo, side by side in one run, measured vs
the CP cost model's estimate (the target: the measured hybrid / fixed ratio agrees with the
estimated one within 20%).

    ./dev python tools/bench_train_cp.py [--world 2] [--cp 2] [--rank-capacity 512]
        [--samples 800] [--steps 10] [--repeats 2] [--json PATH]

Runs ``tools/train_cp.py`` alternately with ``--cp-mode hybrid`` and ``--cp-mode fixed`` (the
fixed degree ``--cp`` that cuts nothing: the long-tail documents fit ``cp x rank_capacity``),
``--repeats`` times each, on the same data, seed and steps. Per run, the steps after the first
(warm-up) give: measured step time (slowest rank, data and gradient all-reduce included) and
compute (slowest rank's forward + backward, the in-group K/V exchange included), and the
estimate of the same steps. Ratios are medians over repeats of hybrid over fixed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from tools import train_cp


def summarize(log: dict) -> dict:
    steps = log["steps"][1:]
    return {"step_s": float(sum(max(e["step_s"]) for e in steps)),
            "compute_s": float(sum(max(e["compute_s"]) for e in steps)),
            "est_s": float(sum(e["est_step_s"] for e in steps)), "steps": len(steps),
            "est_s_per_document_exchange": float(sum(e["est_step_s_per_document_exchange"]
                                                     for e in steps)),
            "exposed_comm_fraction": log["estimate"]["exposed_comm_fraction"],
            "documents_cut": log["estimate"]["documents_cut"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args, rest = p.parse_known_args(argv)
    runs = {"hybrid": [], "fixed": []}
    for _ in range(args.repeats):
        for mode in ("hybrid", "fixed"):
            a = train_cp.parse_args(rest + ["--cp-mode", mode])
            runs[mode].append(summarize(train_cp.run(a)))
            r = runs[mode][-1]
            print(f"{mode:6s} measured step {r['step_s']:.3f} s, compute {r['compute_s']:.3f} s, "
                  f"estimated {r['est_s']:.3f} s over {r['steps']} steps", flush=True)
    ratio = {k: float(np.median([h[k] / f[k] for h, f in zip(runs["hybrid"], runs["fixed"])]))
             for k in ("step_s", "compute_s", "est_s", "est_s_per_document_exchange")}
    out = {"config": vars(train_cp.parse_args(rest)), "runs": runs,
           "hybrid_over_fixed": ratio,
           "measured_over_estimated_ratio": {"step": ratio["step_s"] / ratio["est_s"],
                                             "compute": ratio["compute_s"] / ratio["est_s"]}}
    print(f"hybrid / fixed: measured step {ratio['step_s']:.3f}, measured compute "
          f"{ratio['compute_s']:.3f}, estimated {ratio['est_s']:.3f}; measured / estimated "
          f"ratio: step {out['measured_over_estimated_ratio']['step']:.3f}, compute "
          f"{out['measured_over_estimated_ratio']['compute']:.3f} (per-document exchange "
          f"estimate: {ratio['est_s_per_document_exchange']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
