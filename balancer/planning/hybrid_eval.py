"""Hybrid DP x CP in the product (issue #15): epochs of global batches planned by the hybrid
planner or its baselines, fixed-mode plans seen as CP rounds, and the per-strategy figures that
``tools/bench.py --cp-mode hybrid`` and ``python -m balancer report --cp-mode hybrid`` print.

Strategies of the hybrid mode (:data:`HYBRID_STRATEGIES`, plus ``fixed_cp<c>``):

* ``hybrid``: :func:`balancer.planning.hybrid.plan_hybrid` per global batch (per-document CP degree);
* ``hybrid_stream``: :func:`balancer.planning.hybrid.plan_hybrid_stream` (tall documents may move to a
  nearby step, at most ``max_delay`` steps late or early);
* ``megatron_hybrid``: Megatron-LM's hybrid CP rule (:func:`balancer.planning.hybrid.plan_megatron_hybrid`);
* ``fixed_cp<c>``: fixed CP of degree ``c`` (:func:`balancer.planning.hybrid.plan_fixed_cp`); documents
  longer than ``c x rank_capacity`` are cut (counted in ``documents_cut``).

Every strategy sees the same global batches (consecutive documents of the shuffled stream, a
batch closing with the document that reaches ``batch_tokens``), so their ``est_step_time_total``
(seconds per GPU, summed over steps, a barrier ending every microbatch round, from
:func:`balancer.planning.hybrid.estimate`) compare directly; a fixed-mode :class:`~balancer.planning.planner.Plan`
converted by :func:`fixed_to_rounds` is evaluated the same way.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from packing.hybrid_cp import HybridPlan, check_plan, concat_plans

from ..cost.cp import CPCostModel, CPHardware
from .hybrid import estimate, plan_fixed_cp, plan_hybrid, plan_hybrid_stream, plan_megatron_hybrid

#: named strategies of the hybrid mode (``fixed_cp<c>`` come on top, one per degree)
HYBRID_STRATEGIES = ("hybrid", "hybrid_stream", "megatron_hybrid")
#: the strategy that cp_mode hybrid plans with when none is named (the sampler, ``precompute``):
#: ``hybrid_stream`` meets the quality targets ``hybrid`` misses on prolong x llama-7b, is never
#: slower than ``hybrid`` by more than 0.5% on any cell of ``tools/bench_hybrid.py``, and plans
#: in a few ms per global batch (its movement compiled)
HYBRID_DEFAULT_STRATEGY = "hybrid_stream"


def fixed_degrees(n_ranks: int) -> list[int]:
    """Power-of-two CP degrees that tile a pool of ``n_ranks``: 1, 2, 4, ... dividing it."""
    return [c for c in (1 << np.arange(int(n_ranks).bit_length())).tolist() if n_ranks % c == 0]


def default_strategies(n_ranks: int) -> list[str]:
    return list(HYBRID_STRATEGIES) + [f"fixed_cp{c}" for c in fixed_degrees(n_ranks)]


def parse_strategies(text: Optional[str], n_ranks: int) -> list[str]:
    """``--strategies`` of the hybrid mode (None: :func:`default_strategies`); unknown names or
    degrees that do not tile the pool are one error naming them."""
    if not text:
        return default_strategies(n_ranks)
    names = [s.strip() for s in text.split(",") if s.strip()]
    ok = set(default_strategies(n_ranks))
    bad = [s for s in names if s not in ok]
    if bad or not names:
        raise ValueError(f"--strategies {text!r}: {', '.join(bad) or 'none given'} not a hybrid-"
                         f"mode strategy of a pool of {n_ranks} ranks (choose from "
                         f"{', '.join(sorted(ok))})")
    return names


def cp_cost_model(cost_model: str, rank_capacity: int, *, pp: int = 1, gpus_per_node: int = 8,
                  overlap: float = 1.0) -> CPCostModel:
    """The CP cost model of a preset with a ``model:`` mapping (llama-7b, llama-70b, ...)."""
    hw = CPHardware(gpus_per_node=gpus_per_node, overlap=overlap)
    return CPCostModel.from_preset(cost_model, int(rank_capacity), hardware=hw, pp=pp)


def global_batches(lengths: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Consecutive ``[a, b)`` document ranges: a batch closes with the document that reaches
    ``budget`` tokens (the last one holds what is left)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.shape[0] == 0:
        return []
    cs = np.cumsum(lengths)
    cuts = np.searchsorted(cs, np.arange(budget, int(cs[-1]) + 1, budget), side="left") + 1
    bounds = np.unique(np.concatenate([[0], np.minimum(cuts, lengths.shape[0]),
                                       [lengths.shape[0]]]))
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def check_pool_limit(lengths: np.ndarray, model: CPCostModel, n_ranks: int,
                     over_limit: str = "error") -> None:
    """Refuse (``over_limit="error"``) a document longer than the pool's largest aligned group
    holds, naming the sample by its id in ``lengths`` (planning sees shuffled batches, whose
    positions are not sample ids), its length and the limit."""
    if over_limit == "chunk":
        return
    g = 1 << (int(n_ranks).bit_length() - 1)
    limit = model.doc_limit(g)
    over = np.flatnonzero(np.asarray(lengths) > limit)
    if over.size:
        i = int(over[0])
        group = f"{g} ranks" if g == n_ranks else \
            f"its largest aligned group: {g} of the pool's {n_ranks} ranks"
        raise ValueError(f"sample {i}: length {int(lengths[i])} exceeds the pool's limit of "
                         f"{limit} tokens ({group} x rank_capacity {model.rank_capacity}, CP "
                         f"padding included); --over-length chunk (over_limit='chunk') cuts "
                         f"such documents into pieces (counted as documents_cut)")


def plan_strategy(name: str, lengths: np.ndarray, model: CPCostModel, n_ranks: int,
                  batch_tokens: int, *, max_delay: int = 2,
                  over_limit: str = "error") -> tuple[HybridPlan, list]:
    """``(plan of the epoch, planning seconds per global batch)`` of one hybrid-mode strategy.
    ``plan.item_doc`` indexes ``lengths``. A document longer than the pool holds is an error
    naming it, or cut (counted) with ``over_limit="chunk"`` (fixed degrees always cut what
    their groups cannot hold: that is the baseline)."""
    P = int(n_ranks)
    if name == "hybrid_stream":
        secs: list = []   # per step, the movement's share included; the cost table apart
        sr = plan_hybrid_stream(lengths, model, P, batch_tokens, max_delay=max_delay,
                                max_advance=max_delay, over_limit=over_limit,
                                step_seconds=secs)
        return sr.plan, secs
    plans, secs = [], []
    for a, b in global_batches(lengths, batch_tokens):
        docs = lengths[a:b]
        if name == "hybrid":
            limit = model.doc_limit(1 << (P.bit_length() - 1))
            tab = model.table(docs, P) if (docs <= limit).all() else None  # timed apart
            t0 = time.perf_counter()
            p = plan_hybrid(docs, model, P, table=tab, over_limit=over_limit)
        elif name == "megatron_hybrid":
            t0 = time.perf_counter()
            p = plan_megatron_hybrid(docs, P, model.rank_capacity, over_limit=over_limit)
        elif name.startswith("fixed_cp"):
            t0 = time.perf_counter()
            p = plan_fixed_cp(docs, model, P, int(name.removeprefix("fixed_cp")))
        else:
            raise ValueError(f"unknown hybrid-mode strategy {name!r}")
        secs.append(time.perf_counter() - t0)
        plans.append(p._replace(item_doc=p.item_doc + a))
    if not plans:
        raise ValueError("no documents to plan")
    return concat_plans(plans), secs


def fixed_to_rounds(plan, n_samples: Optional[int] = None) -> HybridPlan:
    """A fixed-mode :class:`~balancer.planning.planner.Plan` as CP rounds on the stage's pool of
    ``dp x cp`` ranks: microbatch ``j`` of DP rank ``d`` in a step is round ``j`` of that step
    on the group of ranks ``d cp .. d cp + cp - 1``, every document sharded over it (whole on
    its one rank when cp == 1). Items are the plan's entries (pieces of cut samples included);
    ``documents_cut`` counts the samples cut."""
    lay = plan.layout
    dp, cp = lay.dp, lay.cp
    P = dp * cp
    E = plan.entry_sample.shape[0]
    mb_of = np.repeat(np.arange(plan.n_microbatches, dtype=np.int64), np.diff(plan.mb_offsets))
    so = plan.step_offsets
    step_of_mb = np.repeat(np.arange(plan.n_steps, dtype=np.int64), plan.step_mbs * dp)
    m = plan.step_mbs[step_of_mb]
    local = np.arange(plan.n_microbatches, dtype=np.int64) - so[step_of_mb]
    rank_of_mb, slot_of_mb = local // m, local % m
    step_rounds = np.concatenate([[0], np.cumsum(plan.step_mbs)]).astype(np.int64)
    round_of_mb = step_rounds[step_of_mb] + slot_of_mb
    R = int(step_rounds[-1])
    # groups: round-major, then DP rank (rank offsets ascending); one group per microbatch
    g_of_mb = round_of_mb * dp + rank_of_mb
    order = np.argsort(g_of_mb[mb_of], kind="stable")
    counts = np.bincount(g_of_mb, weights=np.diff(plan.mb_offsets), minlength=R * dp)
    ge = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    go = np.tile(np.arange(dp, dtype=np.int64) * cp, R)
    gs = np.full(R * dp, cp, dtype=np.int64)
    rg = np.arange(R + 1, dtype=np.int64) * dp
    owner = np.full(E, -1 if cp > 1 else 0, dtype=np.int64)
    lengths = plan.entry_length
    cut = np.unique(plan.entry_sample[plan.entry_length < _sample_lengths(plan, n_samples)[
        plan.entry_sample]]).shape[0]
    return HybridPlan(step_rounds, rg, go, gs, ge, order.astype(np.int64), owner,
                      plan.entry_sample.astype(np.int64), plan.entry_start.astype(np.int64),
                      lengths.astype(np.int64), P, int(lay.capacity // cp), int(cut))


def _sample_lengths(plan, n_samples: Optional[int]) -> np.ndarray:
    n = plan.n_samples if n_samples is None else int(n_samples)
    out = np.zeros(n, np.int64)
    np.add.at(out, plan.entry_sample, plan.entry_length)
    if plan.leftover.sample.shape[0]:
        np.add.at(out, plan.leftover.sample, plan.leftover.length)
    return out


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


def compare_hybrid(lengths: np.ndarray, model: CPCostModel, n_ranks: int, batch_tokens: int,
                   names: list[str], *, max_delay: int = 2,
                   order: Optional[np.ndarray] = None,
                   over_limit: str = "error") -> tuple[dict, dict, dict]:
    """Plan ``lengths`` (int64[n]) in the stream order ``order`` (a permutation, default the
    identity; :func:`balancer.planning.planner.epoch_order` gives the fixed mode's) with every hybrid-mode
    strategy and summarise each: ``(result, plot details, plans)``; the plans' ``item_doc`` are
    sample ids. Adds to ``hybrid``/``hybrid_stream`` the ratios of the issue's targets (to
    ``megatron_hybrid``, to the fixed degree that cuts nothing and to the best fixed degree)."""
    lengths = np.asarray(lengths, np.int64)
    order = np.arange(lengths.shape[0], dtype=np.int64) if order is None else \
        np.asarray(order, np.int64)
    stream = lengths[order]
    P = int(n_ranks)
    if any(n in HYBRID_STRATEGIES for n in names):   # fixed degrees cut by design
        check_pool_limit(lengths, model, P, over_limit)
    blocks, details, plans = {}, {}, {}
    for name in names:
        plan, secs = plan_strategy(name, stream, model, P, batch_tokens, max_delay=max_delay,
                                   over_limit=over_limit)
        plan = plan._replace(item_doc=order[plan.item_doc])
        blocks[name], details[name] = summarize(plan, model, lengths, secs,
                                                per_document=name == "megatron_hybrid")
        plans[name] = plan
    longest = int(lengths.max(initial=0))
    no_cut = next((c for c in fixed_degrees(P) if model.doc_limit(c) >= longest), None)
    fixed = {n: b for n, b in blocks.items() if n.startswith("fixed_cp") and b.get("valid")}
    best = min(fixed, key=lambda n: fixed[n]["est_step_time_total"]) if fixed else None
    refs = {"megatron_hybrid": "megatron_hybrid",
            "no_cut_fixed": f"fixed_cp{no_cut}" if no_cut else None, "best_fixed": best}
    for name in ("hybrid", "hybrid_stream"):
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
    for n in ("hybrid", "hybrid_stream"):
        b = res["strategies"].get(n, {})
        r = {k: v for k, v in b.items() if k.startswith("vs_")}
        r = {k.replace("_packed_exchange", " (packed exchange)"): v for k, v in r.items()}
        if r:
            mark = " (the default planner)" if n == default else ""
            lines.append(f"{n}{mark}: " + ", ".join(f"{k[3:]} {v:.3f}x" for k, v in r.items()))
    return "\n".join(lines)


__all__ = ["HYBRID_DEFAULT_STRATEGY", "HYBRID_STRATEGIES", "add_fixed_mode_figures",
           "check_pool_limit", "compare_hybrid", "coverage", "cp_cost_model",
           "default_strategies", "fixed_degrees", "fixed_to_rounds", "format_table",
           "global_batches", "group_size_histogram", "parse_strategies",
           "plan_strategy", "summarize"]


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
