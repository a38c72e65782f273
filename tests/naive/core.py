"""Slow, obviously-correct reference implementations that the kernels are checked against."""
from __future__ import annotations

import itertools

import numpy as np


def next_fit(sizes, capacity):
    bins, used, out = 0, 0, []
    for s in sizes:
        if used + s > capacity:
            bins += 1
            used = 0
        out.append(bins)
        used += s
    return np.array(out, dtype=np.int64), (bins + 1 if len(sizes) else 0)


def _decreasing(sizes):
    return sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))


def ffd(sizes, capacity):
    rem, out = [], [0] * len(sizes)
    for i in _decreasing(sizes):
        for b, r in enumerate(rem):
            if r >= sizes[i]:
                rem[b] -= sizes[i]
                out[i] = b
                break
        else:
            rem.append(capacity - sizes[i])
            out[i] = len(rem) - 1
    return np.array(out, dtype=np.int64), len(rem)


def bfd_bin_count(sizes, capacity):
    """Number of bins of best-fit-decreasing (which bin wins a tie may differ, the count and the
    multiset of loads may not)."""
    rem = []
    for i in _decreasing(sizes):
        best = None
        for b, r in enumerate(rem):
            if r >= sizes[i] and (best is None or r < rem[best]):
                best = b
        if best is None:
            rem.append(capacity - sizes[i])
        else:
            rem[best] -= sizes[i]
    return len(rem), sorted(capacity - r for r in rem)


def lpt_equal(costs, m):
    k = len(costs) // m
    loads, counts, out = [0.0] * m, [0] * m, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        g = min((g for g in range(m) if counts[g] < k), key=lambda g: (loads[g], g))
        loads[g] += costs[i]
        counts[g] += 1
        out[i] = g
    return np.array(out, dtype=np.int64)


def best_equal_partition_max(costs, m):
    """Optimal max group load over all equal-count partitions (tiny inputs only)."""
    n = len(costs)
    k = n // m
    best = np.inf
    for labels in itertools.product(range(m), repeat=n):
        if labels[0] != 0:
            continue
        counts = np.bincount(labels, minlength=m)
        if (counts != k).any():
            continue
        best = min(best, np.bincount(labels, weights=costs, minlength=m).max())
    return best


def simulate_1f1b(fwd, bwd, pp):
    """Dependency-driven 1F1B with explicit per-stage op lists, by fixed-point iteration."""
    m = len(fwd)
    ops = []
    for s in range(pp):
        warm = min(pp - 1 - s, m)
        seq = [("F", j) for j in range(warm)]
        f = warm
        for b in range(m):
            if f < m:
                seq.append(("F", f))
                f += 1
            seq.append(("B", b))
        ops.append(seq)
    end = {}
    changed = True
    while changed:
        changed = False
        for s in range(pp):
            t = 0.0
            for kind, j in ops[s]:
                if kind == "F":
                    dep = 0.0 if s == 0 else end.get(("F", s - 1, j))
                    dur = fwd[j]
                else:
                    dep = end.get(("F", s, j)) if s == pp - 1 else end.get(("B", s + 1, j))
                    dur = bwd[j]
                if dep is None:
                    break
                t = max(t, dep) + dur
                if end.get((kind, s, j)) != t:
                    end[(kind, s, j)] = t
                    changed = True
    return max(end.values())


def schedule_lumps(exc, size, lo, hi, horizon, n_units, unit_cap, tc, delay_penalty=0.002):
    """The outlier scheduler of packing.delay, written plainly: heaviest first, each lump to the
    (step, slot) of its window that raises the step's imbalance least; an empty step is valued
    by the n_units - 1 heaviest later lumps that could join it (summed as differences of prefix
    sums, as the kernel does, so the two agree to the last bit)."""
    def imb(level, total):
        return (tc + level) * n_units / (n_units * tc + total)

    K = len(exc)
    order = sorted(range(K), key=lambda j: (-exc[j], j))
    feas = {t: [q for q in range(K) if lo[order[q]] <= t <= hi[order[q]]] for t in range(horizon)}
    flat = [q for t in range(horizon) for q in feas[t]]
    cum = np.concatenate([[0.0], np.cumsum([exc[order[q]] for q in flat])])
    start = {}
    x = 0
    for t in range(horizon):
        start[t] = x
        x += len(feas[t])
    ex = np.zeros((horizon, n_units))
    tk = np.zeros((horizon, n_units), dtype=np.int64)
    has = np.zeros(horizon, dtype=bool)
    out = np.full(K, -1, dtype=np.int64)
    for idx, j in enumerate(order):
        e = exc[j]
        best = (np.inf, -1, -1)
        for t in range(lo[j], hi[j] + 1):
            if not has[t]:
                later = [p for p in range(len(feas[t])) if feas[t][p] > idx][:n_units - 1]
                pm = cum[start[t] + later[-1] + 1] - cum[start[t] + later[0]] if later else 0.0
                val = imb(e, e + pm) - 1.0 + delay_penalty * t
                k = 0
            else:
                fits = [k for k in range(n_units) if tk[t, k] + size[j] <= unit_cap]
                if not fits:
                    continue
                k = min(fits, key=lambda k: (ex[t, k], k))
                level, total = ex[t].max(), ex[t].sum()
                val = imb(max(level, ex[t, k] + e), total + e) - imb(level, total) + delay_penalty * t
            if val < best[0]:
                best = (val, t, k)
        _, t, k = best
        out[j] = t
        if t >= 0:
            ex[t, k] += e
            tk[t, k] += size[j]
            has[t] = True
    return out
