"""The figures of hybrid DP x CP plans: per strategy (:func:`summarize`: coverage, estimated
step time under the CP cost model, lower bounds, exposed exchange, group sizes, planning time),
every hybrid-mode strategy side by side on one workload (:func:`compare_hybrid`, with ours'
ratios to the baselines; :func:`format_table`, what ``tools/bench.py --cp-mode hybrid`` and
``report --cp-mode hybrid`` print), and the hybrid-interface figures of fixed-mode plans
(:func:`add_fixed_mode_figures`).

Every strategy sees the same global batches (consecutive documents of the shuffled stream, a
batch closing with the document that reaches ``batch_tokens``), so their ``est_step_time_total``
(seconds per GPU, summed over steps, a barrier ending every microbatch round, from
:func:`balancer.planning.hybrid.estimate`) compare directly; a fixed-mode
:class:`~balancer.planning.plan.Plan` converted by
:func:`balancer.planning.hybrid.fixed_to_rounds` is evaluated the same way. A plan that loses or
duplicates a token of a document is reported ``"valid": false`` (:func:`coverage`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from packing.hybrid_cp import HybridPlan, check_plan

from ...config import PlannerConfig, renamed
from ...cost.cp import CPCostModel
from ...planning.hybrid import (HYBRID_DEFAULT_STRATEGY, HYBRID_STRATEGIES, check_pieces,
                                check_pool_limit,
                                estimate, fixed_degrees, fixed_to_rounds, hybrid_config,
                                plan_strategy)
from ...strategies import registry as strategies


def ours() -> list[str]:
    """The hybrid-mode strategies that are not baselines (``hybrid``, ``hybrid_stream``), in
    registry order: the ones the report measures against the others."""
    return [n for n in strategies.names("hybrid") if not strategies.is_baseline(n)]


def coverage(plan: HybridPlan, lengths: np.ndarray) -> dict:
    """Samples lost (a token of it in no item) and duplicated (a token in two items) by the
    plan's items, and whether the plan's structure holds (:func:`packing.hybrid_cp.check_plan`,
    alignment not required: Megatron's groups are consecutive, not aligned)."""
    lengths = np.asarray(lengths, np.int64)
    n = lengths.shape[0]
    problems = []
    try:
        check_plan(plan, aligned=False)
    except AssertionError as e:
        problems.append(f"malformed plan ({e})")
    doc, st, ln = plan.item_doc, plan.item_start, plan.item_length
    if not ln.any():
        ln = lengths[doc]
    used = np.bincount(doc, minlength=n)[:n] > 0 if doc.size else np.zeros(n, bool)
    # pieces of a sample must tile [0, L): sorted by start, each starts where the last ended
    o = np.lexsort((st, doc))
    d, s, e = doc[o], st[o], st[o] + ln[o]
    first = np.r_[True, d[1:] != d[:-1]] if d.size else np.zeros(0, bool)
    prev_end = np.where(first, 0, np.r_[0, e[:-1]])
    last = np.r_[d[1:] != d[:-1], True] if d.size else np.zeros(0, bool)
    lost_d = (s > prev_end) | (last & (e < lengths[d]))
    dup_d = (s < prev_end) | (last & (e > lengths[d]))
    lost = np.union1d(np.flatnonzero(~used), np.unique(d[lost_d]))
    dup = np.unique(d[dup_d])
    if lost.size:
        problems.append(f"{lost.size} samples lost (first: sample {int(lost[0])})")
    if dup.size:
        problems.append(f"{dup.size} samples duplicated (first: sample {int(dup[0])})")
    return {"valid": not problems, "samples_lost": int(lost.size),
            "samples_duplicated": int(dup.size), "problems": problems}


def group_size_histogram(plan: HybridPlan) -> dict:
    """``{group size: groups that ran something}`` over the epoch, sizes as strings (JSON)."""
    busy = np.diff(plan.group_entries) > 0
    sizes, counts = np.unique(plan.group_size[busy], return_counts=True)
    return {str(int(s)): int(c) for s, c in zip(sizes, counts)}


def sharded_documents_by_size(plan: HybridPlan) -> dict:
    """``{group size: items sharded over a group of that size}`` (size 1: items whole)."""
    g_of = plan.group_of_entry()
    size = np.where(plan.entry_owner < 0, plan.group_size[g_of], 1)
    sizes, counts = np.unique(size, return_counts=True)
    return {str(int(s)): int(c) for s, c in zip(sizes, counts)}


def summarize(plan: HybridPlan, model: CPCostModel, lengths: np.ndarray,
              plan_seconds: list, *, per_document: bool = False) -> tuple[dict, dict]:
    """The per-strategy block (JSON-ready) and the arrays the plots need. ``per_document``:
    the plan's sharded documents each run their own pass (Megatron's schedule), so the packed
    exchange figure equals the per-document one."""
    cov = coverage(plan, lengths)
    if not cov["valid"]:
        return {**cov, "steps": plan.n_steps}, {}
    e = estimate(plan, model, lengths)
    ms = np.asarray(plan_seconds, dtype=np.float64) * 1e3
    comp_rank, expo_rank = e.compute.sum(axis=0), e.exposed.sum(axis=0)
    busy = float(comp_rank.sum() + expo_rank.sum())
    block = {
        **cov,
        "documents_cut": e.documents_cut,
        # global batches planned by Megatron-LM's rule, estimated faster there (hybrid only)
        "megatron_steps": int(plan.megatron_steps),
        "attention_removed": e.attention_removed,
        "exposed_comm_fraction": e.exposed_comm_fraction,
        "est_step_time_total": e.step_time,
        "est_step_time_total_async": e.step_time_async,
        "lower_bound_total": e.lower_bound,
        "lower_bound_ratio": e.ratio,
        # each document at its least area on a group it fits (forced exposed exchange
        # included): what any planner can reach (balancer.planning.hybrid.tight_lower_bound)
        "tight_lower_bound_total": e.tight_lower_bound,
        "tight_lower_bound_ratio": e.tight_ratio,
        "steps": plan.n_steps,
        "rounds": plan.n_rounds,
        "rounds_per_step": {"min": int(np.diff(plan.step_rounds).min(initial=0)),
                            "max": int(np.diff(plan.step_rounds).max(initial=0))},
        "compute_seconds_total": float(comp_rank.sum()),
        "exposed_seconds_total": float(expo_rank.sum()),
        "per_rank": {"compute_seconds": comp_rank.tolist(),
                     "exposed_seconds": expo_rank.tolist(),
                     "max_over_mean": float((comp_rank + expo_rank).max()
                                            / max((comp_rank + expo_rank).mean(), 1e-300))
                     if busy > 0 else 1.0},
        "group_size_histogram": group_size_histogram(plan),
        "items_by_group_size": sharded_documents_by_size(plan),
        "plan_ms_per_batch": {"median": float(np.median(ms)) if ms.size else 0.0,
                              "p90": float(np.percentile(ms, 90)) if ms.size else 0.0,
                              "max": float(ms.max(initial=0.0))},
    }
    # one exchange per group microbatch (ring / all-gather over the packed group microbatch),
    # for the plans that run a group's documents together; Megatron's documents each run their
    # own pass, so its figure stays the per-document one
    eg = e if per_document else estimate(plan, model, lengths, exchange="group")
    block["est_step_time_total_packed_exchange"] = eg.step_time
    block["exposed_comm_fraction_packed_exchange"] = eg.exposed_comm_fraction
    block["lower_bound_ratio_packed_exchange"] = eg.ratio
    detail = {"round_time": e.round_time, "compute": e.compute, "exposed": e.exposed,
              "step_times": e.step_times, "step_lower_bounds": e.step_lower_bounds}
    return block, detail


@renamed(over_limit="over_length", model="cost")
def compare_hybrid(lengths: np.ndarray, cost: CPCostModel, n_ranks: int, batch_tokens: int,
                   names: list[str], *, config: Optional[PlannerConfig] = None,
                   max_delay: Optional[int] = None, order: Optional[np.ndarray] = None,
                   over_length: Optional[str] = None) -> tuple[dict, dict, dict]:
    """Plan ``lengths`` (int64[n]) in the stream order ``order`` (a permutation, default the
    identity; :func:`balancer.planning.planner.epoch_order` gives the fixed mode's) with every hybrid-mode
    strategy of ``names``, with ``config`` and the keywords on top (:func:`~balancer.planning.
    hybrid.hybrid_config`: ``max_delay`` 2 and ``over_length="error"`` unless set), and summarise
    each: ``(result, plot details, plans)``; the plans' ``item_doc`` are sample ids. Adds to ours
    (the registry's hybrid-mode strategies that are not baselines: ``hybrid``, ``hybrid_stream``)
    their ratios to the named baselines (``megatron_hybrid``), to the fixed degree that cuts
    nothing and to the best fixed degree."""
    config = hybrid_config(config, max_delay=max_delay, over_length=over_length)
    lengths = np.asarray(lengths, np.int64)
    order = np.arange(lengths.shape[0], dtype=np.int64) if order is None else \
        np.asarray(order, np.int64)
    stream = lengths[order]
    P = int(n_ranks)
    if any("over_length" in strategies.knobs(n) for n in names):  # fixed_cp<c> cuts by design
        check_pool_limit(lengths, cost, P, config.over_length)
    for name in names:
        check_pieces(lengths, cost, P, name, config.over_length)
    blocks, details, plans = {}, {}, {}
    for name in names:
        plan, secs = plan_strategy(name, stream, cost, P, batch_tokens, config)
        plan = plan._replace(item_doc=order[plan.item_doc])
        # Megatron's schedule runs every document of a group as its own pass
        blocks[name], details[name] = summarize(plan, cost, lengths, secs,
                                                per_document=name == "megatron_hybrid")
        plans[name] = plan
    longest = int(lengths.max(initial=0))
    no_cut = next((c for c in fixed_degrees(P) if cost.doc_limit(c) >= longest), None)
    fixed = {n: b for n, b in blocks.items() if n.startswith("fixed_cp") and b.get("valid")}
    best = min(fixed, key=lambda n: fixed[n]["est_step_time_total"]) if fixed else None
    refs = {**{n: n for n in HYBRID_STRATEGIES if strategies.is_baseline(n)},
            "no_cut_fixed": f"fixed_cp{no_cut}" if no_cut else None, "best_fixed": best}
    for name in ours():
        b = blocks.get(name)
        if not b or not b.get("valid"):
            continue
        for key, ref in refs.items():
            if ref in blocks and blocks[ref].get("valid"):
                b[f"vs_{key}"] = b["est_step_time_total"] / blocks[ref]["est_step_time_total"]
                b[f"vs_{key}_packed_exchange"] = (b["est_step_time_total_packed_exchange"]
                                                  / blocks[ref][
                                                      "est_step_time_total_packed_exchange"])
    meta = {"no_cut_fixed": refs["no_cut_fixed"], "best_fixed": best, "longest": longest,
            "default_strategy": HYBRID_DEFAULT_STRATEGY}
    return {"strategies": blocks, **meta}, details, plans


def format_table(res: dict) -> str:
    """The terminal table of :func:`compare_hybrid`'s result."""
    lay = res.get("layout", {})
    lines = [f"workload {res.get('title', '?')}: {res['workload']['samples']:,} samples, "
             f"{res['workload']['tokens']:,} tokens | hybrid pool dp={lay.get('dp')} x "
             f"cp={lay.get('cp')} = {lay.get('pool')} ranks, rank capacity "
             f"{lay.get('rank_capacity'):,} | cost {res.get('cost_model')} overlap "
             f"{res.get('overlap')} | longest {res['longest']:,}; no-cut fixed "
             f"{res['no_cut_fixed']}, best fixed {res['best_fixed']}"]
    hdr = (f"{'strategy':<16} {'cut':>5} {'attn rm':>7} {'step s':>10} {'/ LB':>6} "
           f"{'async s':>10} {'exposed':>7} {'rounds':>6} {'ms/batch':>8} {'max ms':>7}")
    lines += [hdr, "-" * len(hdr)]
    for n, b in res["strategies"].items():
        if not b.get("valid"):
            lines.append(f"{n:<16} INVALID: " + "; ".join(b.get("problems", [])))
            continue
        pm = b["plan_ms_per_batch"]
        lines.append(f"{n:<16} {b['documents_cut']:5d} {b['attention_removed']:7.3f} "
                     f"{b['est_step_time_total']:10.4g} {b['lower_bound_ratio']:6.3f} "
                     f"{b['est_step_time_total_async']:10.4g} {b['exposed_comm_fraction']:7.3f} "
                     f"{b['rounds']:6d} {pm['median']:8.2f} {pm['max']:7.2f}")
    default = res.get("default_strategy", HYBRID_DEFAULT_STRATEGY)
    for n in ours():
        b = res["strategies"].get(n, {})
        r = {k: v for k, v in b.items() if k.startswith("vs_")}
        r = {k.replace("_packed_exchange", " (packed exchange)"): v for k, v in r.items()}
        if r:
            mark = " (the default planner)" if n == default else ""
            lines.append(f"{n}{mark}: " + ", ".join(f"{k[3:]} {v:.3f}x" for k, v in r.items()))
    return "\n".join(lines)


def add_fixed_mode_figures(result: dict, plans: dict, lengths: np.ndarray,
                           model: Optional[CPCostModel]) -> None:
    """The hybrid-interface keys on fixed-mode strategy blocks (``compare`` output), in place:
    ``documents_cut`` (samples cut into pieces) always; with a CP cost model (``--rank-capacity``)
    ``exposed_comm_fraction``, ``lower_bound_ratio_cp`` and ``est_step_time_total`` in seconds
    per GPU under it (the planner's own figure, in cost units of a whole CP group, kept as
    ``est_step_time_total_planner``), comparable with the hybrid mode's; without one,
    ``exposed_comm_fraction`` is 0 at cp == 1 and null otherwise (no exchange model)."""
    for name, block in result["strategies"].items():
        plan = plans[name]
        rounds = fixed_to_rounds(plan, lengths.shape[0])
        block["documents_cut"] = int(rounds.documents_cut)
        if model is None:
            block["exposed_comm_fraction"] = 0.0 if plan.layout.cp == 1 else None
            continue
        used = np.unique(plan.entry_sample)
        # the estimate indexes documents by sample id: evaluate on all lengths
        e = estimate(rounds, model, lengths)
        block["est_step_time_total_planner"] = block["est_step_time_total"]
        block["est_step_time_total"] = e.step_time
        block["est_step_time_total_async"] = e.step_time_async
        eg = estimate(rounds, model, lengths, exchange="group")
        block["est_step_time_total_packed_exchange"] = eg.step_time
        block["exposed_comm_fraction_packed_exchange"] = eg.exposed_comm_fraction
        block["exposed_comm_fraction"] = e.exposed_comm_fraction
        block["attention_removed"] = e.attention_removed
        block["lower_bound_total_cp"] = e.lower_bound
        block["lower_bound_ratio_cp"] = e.ratio
        block["samples_planned"] = int(used.shape[0])
    result["cp_mode"] = "fixed"
    if model is not None:
        result["rank_capacity"] = int(model.rank_capacity)
        result["est_step_time_unit"] = "seconds per GPU (CP cost model, barrier per round)"


__all__ = ["add_fixed_mode_figures", "compare_hybrid", "coverage", "format_table",
           "group_size_histogram", "ours", "sharded_documents_by_size", "summarize"]
