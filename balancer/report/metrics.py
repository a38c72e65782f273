"""Imbalance metrics of a plan, recomputed from its entries and a cost model (never from the
planner's own bookkeeping), per step and summarised over the epoch.

Definitions (the JSON keys of ``tools/bench.py`` and ``python -m balancer report``):

* ``microbatch_imbalance``: per step, max microbatch cost x number of microbatches / total;
* ``dp_imbalance``: per step, max / mean of per-DP-rank time (1F1B-simulated when pp > 1);
* ``cp_imbalance``: per microbatch, max / mean of per-CP-rank causal attention work under
  per-document zigzag sharding (documents padded to a multiple of 2 cp);
* ``pp_bubble_fraction``: per step, the idle fraction of the slowest rank's pipeline;
* ``lower_bound_ratio``: per step, max per-rank cost over max(total / dp, largest document);
* ``capacity_lower_bound_ratio``: the same over a bound that counts token capacity
  (:func:`step_capacity_bound`: ranks hold at most their microbatches' tokens, documents are
  indivisible), so at most ``lower_bound_ratio`` and never below 1;
* ``packing_efficiency``: tokens / (microbatches x capacity);
* ``outlier_delay_steps``: delay of the documents that waited at all (mean) and the maximum.
"""
from __future__ import annotations

import numpy as np

from packing.pipeline import rank_step_times

from ..cost import blocks
from ..cost.model import CostModel
from ..planning.planner import Plan
from ..stats import QUANTILES, summarize  # noqa: F401 (metrics.summarize, metrics.QUANTILES)
from ..zigzag import cp_pad_unit, zigzag_attention  # noqa: F401 (metrics.zigzag_attention kept)


def check_coverage(plan: Plan, lengths: np.ndarray) -> dict:
    """Every token of every sample must be in the plan exactly once, or explicitly left over.
    Returns counts of samples planned, lost (tokens missing) and duplicated (tokens twice)."""
    n = lengths.shape[0]
    samp = np.concatenate([plan.entry_sample, plan.leftover.sample])
    start = np.concatenate([plan.entry_start, plan.leftover.start])
    length = np.concatenate([plan.entry_length, plan.leftover.length])
    covered = np.bincount(samp, weights=length, minlength=n)[:n]
    # pieces can only overlap pieces of the same sample: sort just the samples cut in pieces
    # (most samples are whole, and a lexsort of every entry dominates the report's time)
    multi = np.flatnonzero(np.bincount(samp, minlength=n)[samp] > 1)
    o = multi[np.lexsort((start[multi], samp[multi]))]
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


def cp_imbalance(plan: Plan, cost: CostModel | None = None) -> np.ndarray:
    """max / mean of per-CP-rank attention work for every microbatch (float64[M]): causal
    query-key pairs, or, when ``cost`` has attention terms per layer type (a model from a
    Hugging Face config), the attention cost of each rank's zigzag shards summed over its
    layer types (a sliding window changes which rank is busiest)."""
    cp = plan.layout.cp
    if cp == 1 or plan.n_microbatches == 0:
        return np.ones(plan.n_microbatches)
    if cost is not None and getattr(cost, "attention", ()):
        work = _layered_shard_attention(plan.entry_length, cp, cost)
    else:
        work = zigzag_attention(plan.entry_length, cp)
    per_mb = np.add.reduceat(work, plan.mb_offsets[:-1], axis=0)
    mean = per_mb.mean(axis=1)
    return np.where(mean > 0, per_mb.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)


def _layered_shard_attention(lengths: np.ndarray, cp: int, cost: CostModel) -> np.ndarray:
    """float64[n, cp]: attention cost (forward + backward, recompute included) of every zigzag
    shard, over the cost model's ``a L^2`` part and its attention terms."""
    f, b = cost.forward, cost.backward
    rc = cost.recompute
    work = 2.0 * (f.a + b.a + (f.a if rc else 0.0)) * zigzag_attention(lengths, cp)
    for t in cost.attention:
        work += (t.forward + t.backward + (t.forward if rc else 0.0)) * t.shard_pairs(lengths, cp)
    return work


def step_metrics(plan: Plan, cost: CostModel) -> dict:
    """Per-step arrays (float64[S]) of every metric, recomputed from entries and ``cost``.
    ``step_time``: the slowest rank's time (1F1B simulated with pp > 1), or in lockstep
    (``Layout.lockstep``) the sum over microbatch positions of the costliest microbatch there;
    ``dp_imbalance`` is the step time over the mean rank's; ``rank_time`` the ranks' own
    (busy) times."""
    lay = plan.layout
    fwd, bwd = cost.doc_costs(plan.entry_length)
    cf, cb = cost.microbatch_constant
    mb_f, mb_b = microbatch_costs(plan, cost)
    mb_c = mb_f + mb_b
    doc_c = fwd + bwd
    so = plan.step_offsets
    steps = plan.n_steps
    mb_step, mb_rank = plan.mb_step, plan.mb_rank
    step_total = np.bincount(mb_step, weights=mb_c, minlength=steps)
    step_max_mb = np.maximum.reduceat(mb_c, so[:-1]) if steps else np.zeros(0)
    n_mb = plan.step_mbs * lay.dp
    mb_imb = step_max_mb * n_mb / step_total
    # per-rank sums and pipeline times
    rank_sum = np.zeros((steps, lay.dp))
    np.add.at(rank_sum, (mb_step, mb_rank), mb_c)
    if lay.pp > 1:
        times, bubble = rank_step_times(mb_f, mb_b, plan.step_mbs, lay.dp, lay.pp)
    else:
        times, bubble = rank_sum, np.zeros_like(rank_sum)
    slowest = times.argmax(axis=1)
    step_time = plan.lockstep_times(mb_c) if lay.lockstep else times.max(axis=1)
    dp_imb = step_time / times.mean(axis=1)
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
        "step_time": step_time,
        "idle_time": (step_time[:, None] - times).sum(axis=1),
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
        "cp_imbalance": summarize(cp_imbalance(plan, cost)),
        "pp_bubble_fraction": summarize(sm["pp_bubble_fraction"]),
        "lower_bound_ratio": summarize(sm["lower_bound_ratio"]),
        "outlier_delay_steps": {
            "mean": float(delayed.mean()) if delayed.size else 0.0,
            "max": float(d.max()) if d.size else 0.0,
            "mean_all": float(np.maximum(d, 0).mean()) if d.size else 0.0,
            "delayed_fraction": float(delayed.size / d.size) if d.size else 0.0,
            "bound_exceeded": int((d > plan.config.max_delay).sum()),
        },
        # heavy documents read ahead of their turn (negative entry_delay), by how many steps
        "outlier_advance_steps": {
            "mean": float(-d[d < 0].mean()) if (d < 0).any() else 0.0,
            "max": float(-d.min()) if d.size and d.min() < 0 else 0.0,
            "advanced_fraction": float((d < 0).mean()) if d.size else 0.0,
        },
        "est_step_time_total": float(sm["step_time"].sum()),
        "est_idle_time_total": float(sm["idle_time"].sum()),
        "samples_chunked": int(plan.stats.get("samples_chunked", 0)),
        "samples_dropped": int(plan.stats.get("dropped", 0)),
        "samples_carried_out": int(plan.stats.get("carried_out", 0)),
        "cost_unit": cost.unit,
    }
    return out


# ---- report metrics ------------------------------------------------------------------------
# Everything below feeds ``python -m balancer report``; like the block above it recomputes
# from the plan's entries and the cost model, never from ``plan.mb_fwd``/``plan.mb_bwd``.

def microbatch_costs(plan: Plan, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Recomputed ``(forward, backward)`` cost of every microbatch, float64[M] each."""
    return blocks.microbatch_costs(cost, plan.entry_length, plan.mb_offsets)


def prediction_error(plan: Plan, cost: CostModel, costs=None) -> float:
    """Largest relative difference between the recomputed microbatch costs (``costs``, as
    :func:`microbatch_costs` returns, computed when None) and the planner's own predictions
    (``plan.mb_fwd``/``plan.mb_bwd``): ~1e-16 unless they disagree."""
    f, b = microbatch_costs(plan, cost) if costs is None else costs
    if f.size == 0:
        return 0.0
    pred = np.concatenate([plan.mb_fwd, plan.mb_bwd])
    ours = np.concatenate([f, b])
    if pred.shape != ours.shape:
        return float("inf")
    return float((np.abs(pred - ours) / np.maximum(np.abs(ours), 1e-300)).max())


def validate_plan(plan: Plan, lengths: np.ndarray | None = None) -> dict:
    """Structural checks and token coverage of a plan. ``lengths`` (int64[n]) are the samples'
    lengths; without them each sample's length is taken as the end of its last piece, so a
    missing middle piece or a missing sample is still found, a missing final piece is not.

    Returns ``{"valid", "problems": [str], "samples_planned", "samples_lost",
    "samples_duplicated", "samples_left_over"}``; ``valid`` is False on any problem."""
    problems = []
    n = int(plan.n_samples if lengths is None else len(lengths))
    if lengths is not None and plan.n_samples != n:
        problems.append(f"plan is for {plan.n_samples} samples, the lengths have {n}")
    off = plan.mb_offsets
    E = plan.entry_sample.shape[0]
    if off.shape[0] == 0 or off[0] != 0 or off[-1] != E or (np.diff(off) < 0).any():
        problems.append(f"mb_offsets do not partition the {E} entries")
    elif (np.diff(off) == 0).any():
        problems.append(f"{int((np.diff(off) == 0).sum())} microbatches are empty")
    if int((plan.step_mbs * plan.layout.dp).sum()) != plan.n_microbatches:
        problems.append(f"step_mbs x dp = {int((plan.step_mbs * plan.layout.dp).sum())} "
                        f"microbatches, the plan has {plan.n_microbatches}")
    samp = np.concatenate([plan.entry_sample, plan.leftover.sample])
    start = np.concatenate([plan.entry_start, plan.leftover.start])
    length = np.concatenate([plan.entry_length, plan.leftover.length])
    bad = (samp < 0) | (samp >= n) | (length <= 0) | (start < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        problems.append(f"{int(bad.sum())} entries are out of range (first: sample {int(samp[i])}, "
                        f"start {int(start[i])}, length {int(length[i])}, {n} samples)")
    if not problems and plan.n_microbatches:
        unit = cp_pad_unit(plan.layout.cp)
        padded = -(-plan.entry_length // unit) * unit
        over = np.add.reduceat(padded, off[:-1]) > plan.layout.capacity
        if over.any():
            problems.append(f"{int(over.sum())} microbatches exceed the capacity "
                            f"{plan.layout.capacity} (first: microbatch {int(np.flatnonzero(over)[0])})")
    cov = {"samples_planned": 0, "samples_lost": 0, "samples_duplicated": 0,
           "samples_left_over": 0}
    if not bad.any():
        if lengths is None:
            ends = np.zeros(n, np.int64)
            np.maximum.at(ends, samp, start + length)
            cov = check_coverage(plan, ends)
            absent = int((ends == 0).sum())  # never seen: lost
            cov["samples_lost"] += absent
            cov["samples_planned"] -= absent
        else:
            cov = check_coverage(plan, np.asarray(lengths, dtype=np.int64))
    if cov["samples_lost"] or cov["samples_duplicated"]:
        problems.append(f"{cov['samples_lost']} samples lost, {cov['samples_duplicated']} "
                        f"duplicated")
    return {"valid": not problems, "problems": problems, **cov}


def pipeline_timeline(fwd, bwd, pp: int) -> dict:
    """Every op of one DP rank's non-interleaved 1F1B schedule (the order and dependencies of
    ``packing.pipeline``), for Gantt charts. ``fwd``/``bwd``: per-stage durations float64[m].

    Returns arrays of length ``2 m pp``: ``stage`` int64, ``kind`` int64 (0 forward,
    1 backward), ``mb`` int64, ``start``/``end`` float64."""
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    m = fwd.shape[0]
    orders = []
    for s in range(pp):
        warm = min(pp - 1 - s, m)
        seq = [(0, j) for j in range(warm)]
        f = warm
        for b in range(m):
            if f < m:
                seq.append((0, f))
                f += 1
            seq.append((1, b))
        orders.append(seq)
    end = {}
    nxt = [0] * pp
    clock = [0.0] * pp
    rows = []
    while len(rows) < 2 * m * pp:
        progressed = False
        for s in range(pp):
            while nxt[s] < len(orders[s]):
                k, j = orders[s][nxt[s]]
                if k == 0:
                    dep = 0.0 if s == 0 else end.get((0, s - 1, j))
                else:
                    dep = end.get((0, s, j)) if s == pp - 1 else end.get((1, s + 1, j))
                if dep is None:
                    break
                t0 = max(clock[s], dep)
                t1 = t0 + (fwd[j] if k == 0 else bwd[j])
                end[(k, s, j)] = clock[s] = t1
                rows.append((s, k, j, t0, t1))
                nxt[s] += 1
                progressed = True
        if not progressed:  # pragma: no cover - a 1F1B order never deadlocks
            raise RuntimeError("1F1B schedule deadlocked")
    a = np.array(rows, dtype=np.float64).reshape(-1, 5)
    return {"stage": a[:, 0].astype(np.int64), "kind": a[:, 1].astype(np.int64),
            "mb": a[:, 2].astype(np.int64), "start": a[:, 3], "end": a[:, 4]}


def _rank_groups(plan: Plan) -> np.ndarray:
    """Group id (step * dp + rank) of every microbatch, int64[M]."""
    return plan.mb_step * plan.layout.dp + plan.mb_rank


def pipeline_times(plan: Plan, cost: CostModel, order: str = "planned",
                   costs=None) -> tuple[np.ndarray, np.ndarray]:
    """``(times float64[S, dp], bubble float64[S, dp])``: every DP rank's step time (1F1B
    simulated over ``pp`` stages; the plain cost sum when pp == 1) and bubble fraction, with the
    microbatches of each rank run in the ``planned`` order or re-ordered by total cost
    (``descending``/``ascending``) to show what the order is worth. ``costs``: the
    microbatch costs of :func:`microbatch_costs` when already computed."""
    if order not in ("planned", "descending", "ascending"):
        raise ValueError(f"order {order!r} is not one of planned, descending, ascending")
    lay = plan.layout
    f, b = microbatch_costs(plan, cost) if costs is None else costs
    if order != "planned" and lay.pp > 1:
        c = f + b
        key = -c if order == "descending" else c
        o = np.lexsort((key, _rank_groups(plan)))
        f, b = f[o], b[o]
    if lay.pp > 1:
        return rank_step_times(f, b, plan.step_mbs, lay.dp, lay.pp)
    g = _rank_groups(plan)
    times = np.bincount(g, weights=f + b, minlength=plan.n_steps * lay.dp)
    times = times.reshape(plan.n_steps, lay.dp)
    return times, np.zeros_like(times)


def seconds_per_cost(cost: CostModel) -> float | None:
    """Seconds per cost unit on one GPU, or None when the model's unit has no clock time."""
    if cost.unit == "seconds":
        return 1.0
    if cost.unit == "flops" and cost.flops_per_second:
        return 1.0 / cost.flops_per_second
    return None


def gpu_time(times: np.ndarray, bubble: np.ndarray, layout, cost: CostModel,
             step_time: np.ndarray | None = None) -> dict:
    """Where the GPU time of an epoch goes, from per-step per-rank pipeline ``times`` and
    ``bubble`` fractions (float64[S, dp], as :func:`pipeline_times` returns). ``step_time``
    (float64[S]): how long each step lasts when that is not its slowest rank's time (in
    lockstep, ``Plan.lockstep_times``); the ranks wait the rest (``dp_idle``).

    A DP rank holds ``pp x cp`` GPUs; a step lasts as long as its slowest rank. GPU time splits
    exactly into ``useful`` (the ranks' microbatch costs), ``pp_bubble`` (1F1B fill and drain
    and waits inside a rank's pipeline) and ``dp_idle`` (ranks waiting for the slowest one).
    Values are GPU-seconds when the cost model has a clock (``unit``), else cost units x GPUs.
    CP imbalance inside a microbatch is not included (see ``cp_imbalance``)."""
    pp = layout.pp
    spc = seconds_per_cost(cost)
    scale = spc if spc is not None else 1.0
    if step_time is not None:
        tmax = np.asarray(step_time, dtype=np.float64)[:, None]
    else:
        tmax = times.max(axis=1, keepdims=True) if times.size else np.zeros((0, 1))
    total = float(pp * tmax.sum() * times.shape[1]) * scale
    dp_idle = float(pp * (tmax - times).sum()) * scale
    pp_bub = float(pp * (bubble * times).sum()) * scale
    out = {"unit": "GPU-seconds" if spc is not None else f"{cost.unit} x GPUs",
           "total": total, "useful": total - dp_idle - pp_bub, "dp_idle": dp_idle,
           "pp_bubble": pp_bub,
           "dp_idle_fraction": dp_idle / total if total > 0 else 0.0,
           "pp_bubble_fraction": pp_bub / total if total > 0 else 0.0}
    # wall-clock of the epoch: a stage's cost is spread over cp GPUs
    out["est_epoch_seconds"] = (float(tmax.sum()) / layout.cp * spc) if spc is not None else None
    return out


def padding_waste(plan: Plan) -> dict:
    """Token slots of the epoch (microbatches x capacity) and where they go: real tokens, CP
    padding (every document padded to a multiple of 2 cp) and unused capacity."""
    cp = plan.layout.cp
    tokens = int(plan.entry_length.sum())
    unit = cp_pad_unit(cp)
    padded = int((-(-plan.entry_length // unit) * unit).sum())
    slots = plan.n_microbatches * plan.layout.capacity
    frac = (lambda x: x / slots) if slots else (lambda x: 0.0)
    return {"slots": slots, "tokens": tokens, "cp_padding_tokens": padded - tokens,
            "unused_tokens": slots - padded, "cp_padding_fraction": frac(padded - tokens),
            "unused_fraction": frac(slots - padded),
            "waste_fraction": frac(slots - tokens)}


def _entry_steps(plan: Plan) -> np.ndarray:
    return np.repeat(plan.mb_step, np.diff(plan.mb_offsets))


def samples_per_step(plan: Plan) -> np.ndarray:
    """Samples that start in each step (a chunked sample counts once, where its first piece
    is), int64[S]."""
    first = plan.entry_start == 0
    return np.bincount(_entry_steps(plan)[first], minlength=plan.n_steps)


def token_lower_bound_ratio(plan: Plan) -> np.ndarray:
    """Per step: the largest DP rank's tokens over max(step tokens / dp, largest document),
    float64[S] (1 = as even as tokens allow)."""
    lay = plan.layout
    if plan.n_steps == 0:
        return np.zeros(0)
    est = _entry_steps(plan)
    g = np.repeat(_rank_groups(plan), np.diff(plan.mb_offsets))
    rank_tok = np.bincount(g, weights=plan.entry_length,
                           minlength=plan.n_steps * lay.dp).reshape(plan.n_steps, lay.dp)
    biggest = np.zeros(plan.n_steps)
    np.maximum.at(biggest, est, plan.entry_length.astype(np.float64))
    lb = np.maximum(rank_tok.sum(axis=1) / lay.dp, biggest)
    return rank_tok.max(axis=1) / np.where(lb > 0, lb, 1.0)


def epoch_lower_bounds(plan: Plan, cost: CostModel) -> dict:
    """Bounds no plan of these pieces can beat: the fewest steps that hold the padded tokens at
    ``dp x microbatches`` full microbatches, and the epoch time of a perfectly balanced,
    bubble-free pipeline (every GPU busy: total cost / (dp pp), in the units of
    ``est_step_time_total``), plus the microbatch constants of the fewest microbatches."""
    lay = plan.layout
    unit = cp_pad_unit(lay.cp)
    padded = int((-(-plan.entry_length // unit) * unit).sum())
    per_step = lay.dp * lay.microbatches * lay.capacity
    fwd, bwd = cost.doc_costs(plan.entry_length)
    cf, cb = cost.microbatch_constant
    min_mbs = -(-padded // lay.capacity)
    total = float(fwd.sum() + bwd.sum()) + min_mbs * (cf + cb)
    return {"steps_lower_bound": int(-(-padded // per_step)),
            "time_lower_bound": total / (lay.dp * lay.pp)}


def delay_histogram(plan: Plan) -> dict[str, int]:
    """Documents by the steps they waited: ``{"d": count}`` for every delay d from the
    smallest to the largest in the plan (keys are strings, as in JSON; a negative delay, a
    document placed before the step that read it, is counted like any other)."""
    d = plan.entry_delay.astype(np.int64)
    if d.size == 0:
        return {}
    lo = int(d.min())
    return {str(lo + i): int(c) for i, c in enumerate(np.bincount(d - lo))}


def speedup(baseline_time: float, time: float) -> float:
    """Estimated end-to-end speedup of a plan taking ``time`` over one taking
    ``baseline_time`` (epoch totals in the same units); > 1 means faster."""
    return float(baseline_time / time) if time > 0 else float("nan")


def step_capacity_bound(lengths, costs, dp: int, rank_tokens: int, rank_constant: float = 0.0,
                        top: int | None = None) -> float:
    """A lower bound on the costliest of ``dp`` ranks' cost for one step's documents
    (``lengths`` int, ``costs`` float, indivisible) when a rank holds at most ``rank_tokens``
    tokens and carries ``rank_constant`` besides its documents (its microbatches' constants).

    The simple bound, max(total / dp, costliest document), ignores that the ranks are
    token-capped: the other dp - 1 ranks hold at most (dp - 1) x rank_tokens, so every rank
    holds at least ``need`` = tokens - (dp - 1) x rank_tokens of them, and under a
    superlinear cost the rank that holds a long document cannot make up those tokens for free.
    With ``fill(t)`` the least cost of t tokens taken fractionally from the cheapest tokens
    (documents by cost per token) of the documents not already counted, the bound is the
    largest of

    * total / dp and the costliest document (the simple bound);
    * for every k, the k + 1 cheapest of the k * dp + 1 costliest documents (some rank holds
      k + 1 of them);
    * for every document i: ``c_i + fill(need - L_i)`` (the rank holding i);
    * for the ``top`` (default dp + 1) costliest documents, of which some rank holds two:
      the least over their pairs of ``c_a + c_b + fill(need - L_a - L_b)``;

    plus ``rank_constant``. Every term relaxes a real rank (fractional documents, only the
    rank's token total constrained), so no plan beats it."""
    L = np.asarray(lengths, dtype=np.float64)
    c = np.asarray(costs, dtype=np.float64)
    n = L.shape[0]
    if n == 0:
        return float(rank_constant)
    best = max(c.sum() / dp, c.max())
    # pigeonhole: of the k * dp + 1 costliest documents some rank holds k + 1, so it costs at
    # least the k + 1 cheapest of them (k = 1 is the pair term below, without the fill); where
    # a step holds a few more large documents than ranks, this is what forces it above total / dp
    cs = np.concatenate([[0.0], np.cumsum(np.sort(c)[::-1])])
    ks = np.arange(1, (n - 1) // dp + 1)
    if ks.size:
        best = max(best, float((cs[ks * dp + 1] - cs[ks * dp - ks]).max()))
    need = L.sum() - (dp - 1) * float(rank_tokens)
    if need > 0:
        o = np.lexsort((np.arange(n), c / np.maximum(L, 1.0)))   # cheapest tokens first
        P = np.concatenate([[0.0], np.cumsum(L[o])])              # tokens of the first k
        Q = np.concatenate([[0.0], np.cumsum(c[o])])              # their cost
        rank = np.empty(n, dtype=np.int64)
        rank[o] = np.arange(n)

        def fill(t, skip_lo, skip_hi):
            # fill(t) without the docs at density ranks skip_lo <= skip_hi (arrays; -1: none):
            # tokens past a skipped doc's place shift by its length, and its cost comes off
            t = np.maximum(t, 0.0)
            shift = np.zeros_like(t)
            off = np.zeros_like(t)
            for s in (skip_lo, skip_hi):
                ok = s >= 0
                past = ok & (t + shift > P[np.maximum(s, 0)])
                shift = np.where(past, shift + L[o][np.maximum(s, 0)], shift)
                off = np.where(past, off + c[o][np.maximum(s, 0)], off)
            return np.interp(t + shift, P, Q) - off

        none = np.full(n, -1, dtype=np.int64)
        best = max(best, float((c + fill(need - L, rank, none)).max()))
        k = min(n, dp + 1 if top is None else top)
        if k > dp:
            t = np.argsort(-c, kind="stable")[:k]
            a, b = np.triu_indices(k, 1)
            a, b = t[a], t[b]
            lo = np.minimum(rank[a], rank[b])
            hi = np.maximum(rank[a], rank[b])
            pair = c[a] + c[b] + fill(need - L[a] - L[b], lo, hi)
            best = max(best, float(pair.min()))
    return float(best + rank_constant)


def capacity_lower_bound_ratio(plan: Plan, cost: CostModel) -> np.ndarray:
    """Per step: the costliest DP rank's cost (documents and microbatch constants, as
    ``lower_bound_ratio`` counts it) over :func:`step_capacity_bound` of the step's documents
    (a rank holds ``step_mbs x capacity`` tokens), float64[S]. At least 1 for every plan;
    ``lower_bound_ratio`` >= this ratio, the gap between them what token capacity forces."""
    lay = plan.layout
    S = plan.n_steps
    if S == 0:
        return np.zeros(0)
    fwd, bwd = cost.doc_costs(plan.entry_length)
    doc_c = fwd + bwd
    cf, cb = cost.microbatch_constant
    mb_f, mb_b = microbatch_costs(plan, cost)
    g = _rank_groups(plan)
    rank_sum = np.bincount(g, weights=mb_f + mb_b, minlength=S * lay.dp).reshape(S, lay.dp)
    rank_mbs = np.bincount(g, minlength=S * lay.dp).reshape(S, lay.dp)
    eo = plan.mb_offsets[plan.step_offsets]
    out = np.empty(S)
    for s in range(S):
        lo, hi = eo[s], eo[s + 1]
        lb = step_capacity_bound(plan.entry_length[lo:hi], doc_c[lo:hi], lay.dp,
                                 int(plan.step_mbs[s]) * lay.capacity,
                                 float(rank_mbs[s].min()) * (cf + cb))
        out[s] = rank_sum[s].max() / lb if lb > 0 else 1.0
    return out
