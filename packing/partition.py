"""Multiway number partitioning: split items into ``m`` groups with balanced cost sums.

``lpt_equal`` and ``kk_equal`` give every group exactly ``n / m`` items (the constraint that
keeps every DP rank at the same microbatch count); ``kk`` is unconstrained (verl's micro-batch
split). ``refine_swaps`` improves an equal-count partition by pairwise swaps between the heaviest
group and the others. Kernels fill ``group_of`` (int64[n]).
"""
from __future__ import annotations

import numpy as np

from ._heap import heap_pop, heap_push
from ._jit import kernel
from .validate import as_costs, check_groups


@kernel
def _lpt_equal(costs, m, group_of):
    """Longest-processing-time first with a cardinality limit of n/m items per group."""
    n = costs.shape[0]
    k = n // m
    order = np.argsort(-costs, kind="mergesort")
    keys = np.empty(m, dtype=np.float64)
    ids = np.empty(m, dtype=np.int64)
    size = np.int64(0)  # typed: a literal start compiles the heap for Literal[int](0)
    for g in range(m):
        size = heap_push(keys, ids, size, 0.0, g)
    count = np.zeros(m, dtype=np.int64)
    for t in range(n):
        i = order[t]
        size = heap_pop(keys, ids, size)
        g = ids[size]
        load = keys[size]
        group_of[i] = g
        count[g] += 1
        if count[g] < k:
            size = heap_push(keys, ids, size, load + costs[i], g)


@kernel
def _group_loads(costs, group_of, m):
    loads = np.zeros(m, dtype=np.float64)
    for i in range(costs.shape[0]):
        loads[group_of[i]] += costs[i]
    return loads


@kernel
def _refine_swaps(costs, group_of, m, max_rounds):
    """Swap one item of the heaviest group with one of a lighter group while that lowers the
    larger of the two loads; stops when no swap helps. Counts per group never change."""
    n = costs.shape[0]
    loads = _group_loads(costs, group_of, m)
    members = np.empty(n, dtype=np.int64)
    hm = np.empty(n, dtype=np.int64)
    for _ in range(max_rounds):
        g = 0
        for h in range(1, m):
            if loads[h] > loads[g]:
                g = h
        order = np.argsort(loads, kind="mergesort")
        improved = False
        ng = 0
        for i in range(n):
            if group_of[i] == g:
                members[ng] = i
                ng += 1
        for oi in range(m):
            h = order[oi]
            if h == g:
                continue
            gap = loads[g] - loads[h]
            if gap <= 0.0:
                break
            # items of h sorted by cost, to binary-search the partner closest to c_i - gap/2
            nh = 0
            for j in range(n):
                if group_of[j] == h:
                    hm[nh] = j
                    nh += 1
            hc = np.empty(nh, dtype=np.float64)
            for t in range(nh):
                hc[t] = costs[hm[t]]
            so = np.argsort(hc, kind="mergesort")
            best_new = loads[g]
            best_i = -1
            best_j = -1
            for a in range(ng):
                i = members[a]
                target = costs[i] - gap / 2.0
                lo = 0
                hi = nh
                while lo < hi:
                    mid = (lo + hi) // 2
                    if hc[so[mid]] < target:
                        lo = mid + 1
                    else:
                        hi = mid
                for cand in (lo - 1, lo):
                    if cand < 0 or cand >= nh:
                        continue
                    j = hm[so[cand]]
                    d = costs[i] - costs[j]
                    if d <= 0.0 or d >= gap:
                        continue
                    new_max = max(loads[g] - d, loads[h] + d)
                    if new_max < best_new - 1e-12 * abs(best_new):
                        best_new = new_max
                        best_i = i
                        best_j = j
            if best_i >= 0:
                d = costs[best_i] - costs[best_j]
                group_of[best_i] = h
                group_of[best_j] = g
                loads[g] -= d
                loads[h] += d
                improved = True
                break
        if not improved:
            break


@kernel
def _kk(costs, m, equal, group_of):
    """Karmarkar-Karp largest differencing for m-way partitioning (verl's formulation).

    With ``equal`` the items, sorted ascending, are taken m at a time as partial partitions so
    every group ends with n/m items; otherwise every item starts as its own partial partition."""
    n = costs.shape[0]
    order = np.argsort(costs, kind="mergesort")
    if equal:
        n_states = n // m
    else:
        n_states = n
    # every set is a linked list of items; sets of a state are kept sorted by sum, descending
    set_head = np.full(n_states * m, -1, dtype=np.int64)
    set_tail = np.full(n_states * m, -1, dtype=np.int64)
    set_sum = np.zeros(n_states * m, dtype=np.float64)
    nxt = np.full(n, -1, dtype=np.int64)
    state_sets = np.empty((n_states, m), dtype=np.int64)
    keys = np.empty(n_states, dtype=np.float64)
    ids = np.empty(n_states, dtype=np.int64)
    size = np.int64(0)  # typed: a literal start compiles the heap for Literal[int](0)
    for s in range(n_states):
        for j in range(m):
            state_sets[s, j] = s * m + j
        if equal:
            # items order[s*m .. s*m+m-1] ascending; put the largest in set 0
            for j in range(m):
                it = order[s * m + (m - 1 - j)]
                sid = s * m + j
                set_head[sid] = it
                set_tail[sid] = it
                set_sum[sid] = costs[it]
            spread = set_sum[s * m] - set_sum[s * m + m - 1]
        else:
            it = order[s]
            sid = s * m
            set_head[sid] = it
            set_tail[sid] = it
            set_sum[sid] = costs[it]
            spread = costs[it]
        # max-heap on spread: negate; ties broken by state id (later = larger items first)
        size = heap_push(keys, ids, size, -spread, n_states - 1 - s)
    tmp = np.empty(m, dtype=np.int64)
    tsum = np.empty(m, dtype=np.float64)
    while size > 1:
        size = heap_pop(keys, ids, size)
        a = n_states - 1 - ids[size]
        size = heap_pop(keys, ids, size)
        b = n_states - 1 - ids[size]
        for j in range(m):
            sa = state_sets[a, j]
            sb = state_sets[b, m - 1 - j]
            if set_head[sb] >= 0:
                if set_head[sa] < 0:
                    set_head[sa] = set_head[sb]
                else:
                    nxt[set_tail[sa]] = set_head[sb]
                set_tail[sa] = set_tail[sb]
                set_sum[sa] += set_sum[sb]
        for j in range(m):
            tmp[j] = state_sets[a, j]
            tsum[j] = -set_sum[tmp[j]]
        so = np.argsort(tsum, kind="mergesort")
        for j in range(m):
            state_sets[a, j] = tmp[so[j]]
        spread = set_sum[state_sets[a, 0]] - set_sum[state_sets[a, m - 1]]
        size = heap_push(keys, ids, size, -spread, n_states - 1 - a)
    size = heap_pop(keys, ids, size)
    final = n_states - 1 - ids[size]
    for j in range(m):
        it = set_head[state_sets[final, j]]
        while it >= 0:
            group_of[it] = j
            it = nxt[it]


def _prepare(costs, m, equal):
    costs = as_costs(costs)
    m = int(m)
    if equal:
        check_groups(costs.shape[0], m)
    elif m <= 0:
        raise ValueError(f"number of groups {m} must be positive")
    return costs, m, np.empty(costs.shape[0], dtype=np.int64)


def lpt_equal(costs, m: int) -> np.ndarray:
    """LPT partition of ``costs`` (float64[n], n divisible by m) into m groups of n/m items.
    Returns ``group_of`` int64[n]."""
    costs, m, group_of = _prepare(costs, m, True)
    if costs.shape[0]:
        _lpt_equal(costs, np.int64(m), group_of)
    return group_of


def kk_equal(costs, m: int) -> np.ndarray:
    """Balanced Karmarkar-Karp differencing into m groups of n/m items (verl's equal_size=True)."""
    costs, m, group_of = _prepare(costs, m, True)
    if costs.shape[0]:
        _kk(costs, np.int64(m), np.bool_(True), group_of)
    return group_of


def kk(costs, m: int) -> np.ndarray:
    """Karmarkar-Karp differencing into m groups with no count constraint (a group may be empty
    when n < m)."""
    costs, m, group_of = _prepare(costs, m, False)
    if costs.shape[0]:
        _kk(costs, np.int64(m), np.bool_(False), group_of)
    return group_of


def refine_swaps(costs, group_of, m: int, max_rounds: int | None = None) -> np.ndarray:
    """Return a copy of ``group_of`` improved by pairwise swaps (counts per group unchanged)."""
    costs = as_costs(costs)
    group_of = np.array(group_of, dtype=np.int64, copy=True)
    if group_of.shape != costs.shape:
        raise ValueError(f"group_of has shape {group_of.shape}, costs {costs.shape}")
    m = int(m)
    if costs.shape[0] and m > 1:
        rounds = 4 * m + 16 if max_rounds is None else int(max_rounds)
        _refine_swaps(costs, group_of, np.int64(m), np.int64(rounds))
    return group_of


def balanced_equal(costs, m: int) -> np.ndarray:
    """The better of LPT and KK (equal counts), each polished by swaps: the DP placement used by
    the ``balanced`` strategy."""
    costs = as_costs(costs)
    best = None
    best_max = np.inf
    for g in (lpt_equal(costs, m), kk_equal(costs, m)):
        g = refine_swaps(costs, g, m)
        mx = float(np.bincount(g, weights=costs, minlength=m).max()) if costs.size else 0.0
        if mx < best_max:
            best, best_max = g, mx
    return best


def group_loads(costs, group_of, m: int) -> np.ndarray:
    """Sum of costs per group (float64[m])."""
    return np.bincount(np.asarray(group_of), weights=np.asarray(costs, dtype=np.float64), minlength=m)
