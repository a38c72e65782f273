"""Imbalance metrics of a plan, recomputed from its entries and a cost model (never from the
planner's own bookkeeping), per step and summarised over the epoch.

Definitions (the JSON keys of ``tools/bench.py`` and ``python -m balancer report``):

* ``microbatch_imbalance``: per step, max microbatch cost x number of microbatches / total;
* ``dp_imbalance``: per step, max / mean of per-DP-rank time (1F1B-simulated when pp > 1);
* ``cp_imbalance``: per microbatch, max / mean of per-CP-rank causal attention work under
  per-document zigzag sharding (documents padded to a multiple of 2 cp);
* ``pp_bubble_fraction``: per step, the idle fraction of the slowest rank's pipeline;
* ``lower_bound_ratio``: per step, max per-rank cost over max(total / dp, largest document);
* ``packing_efficiency``: tokens / (microbatches x capacity);
* ``outlier_delay_steps``: delay of the documents that waited at all (mean) and the maximum.
"""
from __future__ import annotations

import numpy as np

from packing.pipeline import rank_step_times

from .cost import CostModel
from .planner import Plan

QUANTILES = {"p50": 50, "p90": 90, "p99": 99}


def summarize(x) -> dict:
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"),
                "p99": float("nan"), "max": float("nan")}
    out = {"mean": float(x.mean())}
    for k, q in QUANTILES.items():
        out[k] = float(np.percentile(x, q))
    out["max"] = float(x.max())
    return out


def check_coverage(plan: Plan, lengths: np.ndarray) -> dict:
    """Every token of every sample must be in the plan exactly once, or explicitly left over.
    Returns counts of samples planned, lost (tokens missing) and duplicated (tokens twice)."""
    n = lengths.shape[0]
    samp = np.concatenate([plan.entry_sample, plan.leftover.sample])
    start = np.concatenate([plan.entry_start, plan.leftover.start])
    length = np.concatenate([plan.entry_length, plan.leftover.length])
    covered = np.bincount(samp, weights=length, minlength=n)[:n]
    o = np.lexsort((start, samp))
    s, st, ln = samp[o], start[o], length[o]
    same = s[1:] == s[:-1]
    overlap = np.zeros(n, dtype=bool)
    bad = same & (st[1:] < st[:-1] + ln[:-1])
    overlap[s[1:][bad]] = True
    dup = (covered > lengths) | overlap
    lost = covered < lengths
    left = np.zeros(n, dtype=bool)
    left[plan.leftover.sample] = True
    lost &= ~left
    return {"samples_planned": int(n - lost.sum() - dup.sum()),
            "samples_lost": int(lost.sum()), "samples_duplicated": int(dup.sum()),
            "samples_left_over": int(left.sum())}


def zigzag_attention(lengths: np.ndarray, cp: int) -> np.ndarray:
    """Causal attention work (query-key pairs) of every CP rank for documents of these lengths
    under zigzag sharding: float64[len(lengths), cp]. Padding tokens carry no work."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if cp == 1:
        lf = lengths.astype(np.float64)
        return (lf * (lf + 1) / 2)[:, None]
    c = -(-lengths // (2 * cp))  # chunk size per document
    out = np.zeros((lengths.shape[0], cp))

    def tri(x):  # sum_{p < x} (p + 1)
        x = x.astype(np.float64)
        return x * (x + 1) / 2

    for r in range(cp):
        for j in (r, 2 * cp - 1 - r):
            lo = np.minimum(j * c, lengths)
            hi = np.minimum((j + 1) * c, lengths)
            out[:, r] += tri(hi) - tri(lo)
    return out


def cp_imbalance(plan: Plan) -> np.ndarray:
    """max / mean of per-CP-rank attention work for every microbatch (float64[M])."""
    cp = plan.layout.cp
    if cp == 1 or plan.n_microbatches == 0:
        return np.ones(plan.n_microbatches)
    work = zigzag_attention(plan.entry_length, cp)
    per_mb = np.add.reduceat(work, plan.mb_offsets[:-1], axis=0)
    mean = per_mb.mean(axis=1)
    return np.where(mean > 0, per_mb.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)


def step_metrics(plan: Plan, cost: CostModel) -> dict:
    """Per-step arrays (float64[S]) of every metric, recomputed from entries and ``cost``."""
    lay = plan.layout
    fwd, bwd = cost.doc_costs(plan.entry_length)
    cf, cb = cost.microbatch_constant
    starts = plan.mb_offsets[:-1]
    mb_f = np.add.reduceat(fwd, starts) + cf
    mb_b = np.add.reduceat(bwd, starts) + cb
    mb_c = mb_f + mb_b
    doc_c = fwd + bwd
    so = plan.step_offsets
    steps = plan.n_steps
    mb_step = np.repeat(np.arange(steps), plan.step_mbs * lay.dp)
    step_total = np.bincount(mb_step, weights=mb_c, minlength=steps)
    step_max_mb = np.maximum.reduceat(mb_c, so[:-1]) if steps else np.zeros(0)
    n_mb = plan.step_mbs * lay.dp
    mb_imb = step_max_mb * n_mb / step_total
    # per-rank sums and pipeline times
    mb_rank = (np.arange(plan.n_microbatches) - so[mb_step]) // np.repeat(plan.step_mbs, n_mb)
    rank_sum = np.zeros((steps, lay.dp))
    np.add.at(rank_sum, (mb_step, mb_rank), mb_c)
    if lay.pp > 1:
        times, bubble = rank_step_times(mb_f, mb_b, plan.step_mbs, lay.dp, lay.pp)
    else:
        times, bubble = rank_sum, np.zeros_like(rank_sum)
    slowest = times.argmax(axis=1)
    dp_imb = times.max(axis=1) / times.mean(axis=1)
    ent_step = np.repeat(mb_step, np.diff(plan.mb_offsets))
    max_doc = np.zeros(steps)
    np.maximum.at(max_doc, ent_step, doc_c)
    lb = np.maximum(step_total / lay.dp, max_doc + cf + cb)
    tokens = np.bincount(ent_step, weights=plan.entry_length, minlength=steps)
    return {
        "microbatch_imbalance": mb_imb,
        "dp_imbalance": dp_imb,
        "pp_bubble_fraction": bubble[np.arange(steps), slowest],
        "lower_bound_ratio": rank_sum.max(axis=1) / lb,
        "step_time": times.max(axis=1),
        "idle_time": (times.max(axis=1, keepdims=True) - times).sum(axis=1),
        "tokens": tokens,
        "samples": np.bincount(ent_step, minlength=steps),
        "microbatch_cost": mb_c,
        "rank_cost": rank_sum,
        "rank_time": times,
    }


def plan_summary(plan: Plan, cost: CostModel, lengths: np.ndarray) -> dict:
    """The per-strategy JSON block of the stable interface (plus extra keys)."""
    cov = check_coverage(plan, lengths)
    sm = step_metrics(plan, cost)
    d = plan.entry_delay
    delayed = d[d > 0]
    cap = plan.layout.capacity
    eff = float(plan.entry_length.sum()) / (plan.n_microbatches * cap) if plan.n_microbatches else 0.0
    out = {
        "plan_seconds": float(plan.stats.get("plan_seconds", float("nan"))),
        "steps": plan.n_steps,
        **cov,
        "valid": cov["samples_lost"] == 0 and cov["samples_duplicated"] == 0,
        "packing_efficiency": eff,
        "microbatch_imbalance": summarize(sm["microbatch_imbalance"]),
        "dp_imbalance": summarize(sm["dp_imbalance"]),
        "cp_imbalance": summarize(cp_imbalance(plan)),
        "pp_bubble_fraction": summarize(sm["pp_bubble_fraction"]),
        "lower_bound_ratio": summarize(sm["lower_bound_ratio"]),
        "outlier_delay_steps": {
            "mean": float(delayed.mean()) if delayed.size else 0.0,
            "max": float(d.max()) if d.size else 0.0,
            "mean_all": float(d.mean()) if d.size else 0.0,
            "delayed_fraction": float(delayed.size / d.size) if d.size else 0.0,
        },
        "est_step_time_total": float(sm["step_time"].sum()),
        "est_idle_time_total": float(sm["idle_time"].sum()),
        "samples_chunked": int(plan.stats.get("samples_chunked", 0)),
        "samples_dropped": int(plan.stats.get("dropped", 0)),
        "samples_carried_out": int(plan.stats.get("carried_out", 0)),
        "cost_unit": cost.unit,
    }
    return out
