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


def min_bins_exact(sizes, capacity):
    """The fewest bins of ``capacity`` that hold ``sizes``, by exhaustive search: every item in
    turn (largest first) goes into each open bin it fits or into a new one. Exponential: a
    dozen items at most."""
    order = sorted(sizes, reverse=True)
    best = [len(order)]

    def place(k, loads):
        if len(loads) >= best[0]:
            return
        if k == len(order):
            best[0] = len(loads)
            return
        tried = set()
        for b in range(len(loads)):
            if loads[b] + order[k] <= capacity and loads[b] not in tried:
                tried.add(loads[b])   # bins with the same load are interchangeable
                loads[b] += order[k]
                place(k + 1, loads)
                loads[b] -= order[k]
        loads.append(order[k])
        place(k + 1, loads)
        loads.pop()

    place(0, [])
    return best[0]


def bins_lower_bound_l2(sizes, capacity):
    """Martello-Toth L2 from its definition, every integer threshold a in 0..capacity // 2."""
    best = 0
    for a in range(capacity // 2 + 1):
        j1 = [s for s in sizes if s > capacity - a]
        j2 = [s for s in sizes if 2 * s > capacity and s <= capacity - a]
        j3 = [s for s in sizes if a <= s and 2 * s <= capacity]
        rest = sum(j3) - (len(j2) * capacity - sum(j2))
        best = max(best, len(j1) + len(j2) + max(0, -(-rest // capacity)))
    return best


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
    by the n_units - 1 heaviest later lumps that could join it (summed as differences of the
    step's prefix sums, from 0 at each step, as the kernel does, so the two agree to the last
    bit)."""
    def imb(level, total):
        return (tc + level) * n_units / (n_units * tc + total)

    K = len(exc)
    order = sorted(range(K), key=lambda j: (-exc[j], j))
    feas = {t: [q for q in range(K) if lo[order[q]] <= t <= hi[order[q]]] for t in range(horizon)}
    cum = {t: np.concatenate([[0.0], np.cumsum([exc[order[q]] for q in feas[t]])])
           for t in range(horizon)}
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
                pm = cum[t][later[-1] + 1] - cum[t][later[0]] if later else 0.0
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


def kk_equal(costs, m):
    """Balanced Karmarkar-Karp differencing, written plainly (verl's equal_size formulation).

    Items sorted ascending are dealt m at a time into partial partitions (largest of the m in
    set 0). Repeatedly the two partitions of largest spread (max set sum - min set sum; ties: the
    partition made of later, larger items first) are merged, pairing the heaviest set of one with
    the lightest of the other, and the merged sets are re-sorted by sum, descending (stable).
    Sums are accumulated in merge order, as the kernel does, so equal sums tie the same way."""
    import heapq
    n = len(costs)
    asc = sorted(range(n), key=lambda i: (costs[i], i))
    n_states = n // m
    parts = {}   # state -> list of [sum, members], sorted by sum descending
    heap = []
    for s in range(n_states):
        chunk = asc[s * m:(s + 1) * m]
        parts[s] = [[float(costs[i]), [i]] for i in reversed(chunk)]
        heapq.heappush(heap, (-(parts[s][0][0] - parts[s][-1][0]), n_states - 1 - s))
    while len(heap) > 1:
        a = n_states - 1 - heapq.heappop(heap)[1]
        b = n_states - 1 - heapq.heappop(heap)[1]
        for x, y in zip(parts[a], reversed(parts.pop(b))):
            x[0] += y[0]
            x[1].extend(y[1])
        parts[a].sort(key=lambda st: -st[0])  # list.sort is stable
        heapq.heappush(heap, (-(parts[a][0][0] - parts[a][-1][0]), n_states - 1 - a))
    (final,) = parts.values()
    out = [0] * n
    for g, (_, members) in enumerate(final):
        for i in members:
            out[i] = g
    return np.array(out, dtype=np.int64)


def refine_swaps(costs, group_of, m, max_rounds=None):
    """Pairwise swaps out of the heaviest group, written plainly.

    A round takes the heaviest group g (lowest id on ties) and the others from the lightest up
    (stable), stopping at the first whose load is not below g's. For each member i of g (by id)
    the partners tried are the two members of h whose cost is nearest ``c_i - gap / 2`` (the
    last one below it and the first one at or above it, in (cost, id) order); a swap must move a
    positive amount less than the gap and lower the larger of the two loads by more than a
    relative 1e-12. The best swap with the first h that has one is made; no swap, no more rounds."""
    import bisect
    group_of = [int(g) for g in group_of]
    rounds = 4 * m + 16 if max_rounds is None else max_rounds
    loads = [0.0] * m
    for i, g in enumerate(group_of):
        loads[g] += costs[i]
    for _ in range(rounds):
        g = max(range(m), key=lambda h: (loads[h], -h))
        members = [i for i, x in enumerate(group_of) if x == g]
        swap = None
        for h in [h for h in sorted(range(m), key=lambda h: (loads[h], h)) if h != g]:
            gap = loads[g] - loads[h]
            if gap <= 0.0:
                break
            partners = sorted((costs[j], j) for j, x in enumerate(group_of) if x == h)
            keys = [c for c, _ in partners]
            best = loads[g]
            for i in members:
                at = bisect.bisect_left(keys, costs[i] - gap / 2.0)
                for c, j in partners[max(at - 1, 0):at + 1]:
                    d = costs[i] - c
                    if 0.0 < d < gap:
                        worse = max(loads[g] - d, loads[h] + d)
                        if worse < best - 1e-12 * abs(best):
                            best, swap = worse, (i, j, h)
            if swap:
                break
        if swap is None:
            break
        i, j, h = swap
        d = costs[i] - costs[j]
        group_of[i], group_of[j] = h, g
        loads[g] -= d
        loads[h] += d
    return np.array(group_of, dtype=np.int64)


def balanced_equal(costs, m):
    """LPT and KK equal-count partitions, each refined by swaps; KK only when its largest group
    load is strictly lower."""
    def largest(groups):
        loads = [0.0] * m
        for i, g in enumerate(groups):
            loads[g] += costs[i]
        return max(loads)
    a = refine_swaps(costs, lpt_equal(costs, m), m)
    b = refine_swaps(costs, kk_equal(costs, m), m)
    return b if largest(b) < largest(a) else a


def pipeline_order(cost, pp, swap_limit=8):
    """Run order of one rank's microbatches under 1F1B, written plainly: the "mountain"
    (ascending costs at even ranks going up, odd ranks coming down), replaced by ascending, then
    descending order when one simulates more than a relative 1e-12 shorter (forward 1, backward
    2 per unit of cost); then, for at most ``swap_limit`` microbatches, pairwise swaps kept while
    they shorten the schedule. Returns the microbatch index at each position."""
    m = len(cost)
    asc = sorted(range(m), key=lambda i: (cost[i], i))
    order = asc[0::2] + asc[1::2][::-1]
    if pp <= 1 or m < 3:
        return np.array(order, dtype=np.int64)

    def span(o):
        return simulate_1f1b([cost[j] for j in o], [2.0 * cost[j] for j in o], pp)

    best = span(order)
    for alt in (asc, asc[::-1]):
        v = span(alt)
        if v < best * (1.0 - 1e-12):
            best, order = v, list(alt)
    if m <= swap_limit:
        improved = True
        while improved:
            improved = False
            for i, j in itertools.combinations(range(m), 2):
                order[i], order[j] = order[j], order[i]
                v = span(order)
                if v < best * (1.0 - 1e-12):
                    best, improved = v, True
                else:
                    order[i], order[j] = order[j], order[i]
    return np.array(order, dtype=np.int64)
