"""What the right cost model of a current architecture is worth (issue #25, item 4): plan with
the model's own cost model (per-layer attention from its config) and with the wrong ones a
user had before, and score every plan under the right one.

For each model preset with an ``hf_config:`` (sliding-window, mixed sliding/full, MoE) and each
real workload, plans the same samples, layout and strategy with

* ``right``: the preset (sliding / chunked / linear layers, active experts);
* ``full-attention twin``: the same config with every layer full causal attention (what a
  Llama-style ``a L^2 + b L`` preset of the same shape gives);
* ``dense twin`` (MoE only): every expert active (a dense model of the same weights);
* ``quadratic-64k``: the package default;

and reports, under the right model, the estimated epoch time (sum of step times, seconds at
the preset's FLOP/s) and the DP and microbatch imbalance (mean over steps).

    ./dev python tools/bench_modelcost.py --samples 40000 --json out/modelcost.json
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings

import numpy as np

from balancer import workloads
from balancer.config import Layout, PlannerConfig
from balancer.cost.model import cost_model_from_config, load_cost_model, preset_path, read_yaml
from balancer.planning.planner import plan_epoch
from balancer.planning.warmup import warmup
from balancer.report.metrics import step_metrics
from balancer.samples import SampleTable

MODELS = ["mistral-7b-v0.1", "gemma3-27b", "gpt-oss-20b", "qwen3-30b-a3b"]
#: workload -> layout: wlbllm (documents up to 128K) and prolong (long-context mix)
WORKLOADS = {"wlbllm": dict(dp=8, microbatches=4, capacity=131072),
             "prolong": dict(dp=8, microbatches=4, capacity=65536)}


def _preset_config(name: str) -> tuple[dict, dict]:
    """``(hf_config, options)`` of a preset."""
    doc = read_yaml(preset_path(name, "models"), "cost preset")
    opts = {k: v for k, v in doc.items() if k not in ("hf_config", "description", "source")}
    return doc["hf_config"], opts


def twins(name: str) -> dict:
    """The planning cost models of one preset: right, its full-attention twin, its dense twin
    (MoE), quadratic-64k."""
    cfg, opts = _preset_config(name)
    out = {"right": load_cost_model(name)}
    full = copy.deepcopy(cfg)
    n = full["num_hidden_layers"]
    full["layer_types"] = ["full_attention"] * n
    full.pop("sliding_window", None)
    out["full-attention twin"] = cost_model_from_config(full, name=f"{name}-full", **opts)
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):
        if k in cfg:
            dense = copy.deepcopy(cfg)
            dense["num_experts_per_tok"] = cfg[k]
            out["dense twin"] = cost_model_from_config(dense, name=f"{name}-dense", **opts)
    out["quadratic-64k"] = load_cost_model("quadratic-64k")
    return out


def score(plan, right, planned_with=None) -> dict:
    """The plan under the right model; ``own_estimate_seconds``: the epoch time the planning
    model itself predicts for the same plan (what a report made with it would say; None
    without a clock)."""
    sm = step_metrics(plan, right)
    own = None
    if planned_with is not None and planned_with.unit == "flops" \
            and planned_with.flops_per_second:
        own = float(planned_with.seconds(step_metrics(plan, planned_with)["step_time"].sum()))
    return {"epoch_seconds": float(right.seconds(sm["step_time"].sum())),
            "own_estimate_seconds": own,
            "dp_imbalance": float(sm["dp_imbalance"].mean()),
            "microbatch_imbalance": float(sm["microbatch_imbalance"].mean()),
            "steps": int(plan.n_steps)}


def run(samples: int, seed: int, strategy: str, models=MODELS) -> list[dict]:
    warmup(["fixed"])
    rows = []
    for wl, lay in WORKLOADS.items():
        lengths = workloads.load(wl, n=samples, seed=seed)
        st = SampleTable(lengths)
        layout = Layout(**lay)
        config = PlannerConfig(seed=seed, strategy=strategy, over_length="chunk")
        for name in models:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cms = twins(name)
            right = cms["right"]
            base = None
            for label, cm in cms.items():
                t0 = time.perf_counter()
                plan = plan_epoch(st, cm, layout, config)
                s = score(plan, right, cm)
                s.update(workload=wl, model=name, planned_with=label,
                         plan_seconds=time.perf_counter() - t0)
                if base is None:
                    base = s
                s["epoch_vs_right"] = s["epoch_seconds"] / base["epoch_seconds"] - 1.0
                rows.append(s)
                own = s["own_estimate_seconds"]
                s["own_estimate_error"] = None if own is None else own / s["epoch_seconds"] - 1
                est = "" if own is None else f"  its own estimate {s['own_estimate_error']:+7.2%}"
                print(f"{wl:8s} {name:16s} {label:20s} epoch {s['epoch_seconds']:12.1f} s "
                      f"({s['epoch_vs_right']:+7.2%})  dp_imb {s['dp_imbalance']:.4f}  "
                      f"mb_imb {s['microbatch_imbalance']:.4f}{est}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=40000, help="samples resampled per workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", default="balanced")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated presets")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args(argv)
    rows = run(args.samples, args.seed, args.strategy, args.models.split(","))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": args.samples, "seed": args.seed, "strategy": args.strategy,
                       "workloads": WORKLOADS, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
