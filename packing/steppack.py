"""Pack one step's items into ``n_units x bins_per_unit`` bins of a token capacity, balancing cost.

A *unit* is what must finish at the same time: a DP rank (its bins are the rank's microbatches,
summed by gradient accumulation) or a single microbatch (``bins_per_unit == 1``, when pipeline
stages need every microbatch equal). Items are taken in the caller's priority order (forced
items first, then by cost, descending: LPT) and each goes to the cheapest unit that has a bin
with room; inside a unit an empty bin is taken first, then the fullest bin that still fits (best
fit), which keeps packing tight. Finding the cheapest feasible unit uses a segment tree over units
that stores the minimum cost and the maximum free room of each subtree, pruned on both, so a
placement is O(log units) in the common case instead of a scan over all units.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel


@kernel
def _cheapest_unit(tmin, tmax, p, s, stack):
    """Unit of minimum cost (lowest index on ties) having a bin with room >= s, or -1.
    ``stack`` is scratch space (int64[>= 2 * depth + 2])."""
    # fast path, the common case: the cheapest unit overall has room. The search below visits
    # the cheaper child first (the left one on ties), so its first leaf is this one, and every
    # subtree it set aside costs at least as much and is pruned: the same answer, without the
    # stack.
    node = 1
    while tmax[node] >= s:
        if node >= p:
            return node - p
        l = 2 * node
        node = l if tmin[l] <= tmin[l + 1] else l + 1
    top = 0
    stack[top] = 1
    top += 1
    best = np.inf
    bu = -1
    while top > 0:
        top -= 1
        node = stack[top]
        if tmax[node] < s or tmin[node] >= best:
            continue
        if node >= p:
            best = tmin[node]
            bu = node - p
            continue
        l = 2 * node
        r = l + 1
        if tmin[l] <= tmin[r]:  # visit the cheaper child first; the left one on ties
            stack[top] = r
            stack[top + 1] = l
        else:
            stack[top] = l
            stack[top + 1] = r
        top += 2
    return bu


@kernel
def _pack_step(order, sizes, costs, n_units, bins_per_unit, capacity, bin_of,
               bin_tokens, bin_cost, bin_count):
    """Place ``order`` (item ids into ``sizes``/``costs``) into bins; ``bin_of[k]`` gets the bin
    of ``order[k]`` (unit * bins_per_unit + j) or -1 when no bin has room. Bin arrays
    (length n_units * bins_per_unit) must be zeroed by the caller. Returns the number placed."""
    p = 1
    while p < n_units:
        p *= 2
    tmin = np.full(2 * p, np.inf)
    tmax = np.full(2 * p, -1, dtype=np.int64)
    for u in range(n_units):
        tmin[p + u] = 0.0
        tmax[p + u] = capacity
    for node in range(p - 1, 0, -1):
        l = 2 * node
        tmin[node] = min(tmin[l], tmin[l + 1])
        tmax[node] = max(tmax[l], tmax[l + 1])
    unit_cost = np.zeros(n_units)
    used = np.zeros(n_units, dtype=np.int64)  # bins of the unit holding an item: its first ones
    stack = np.empty(130, dtype=np.int64)
    placed = 0
    for k in range(order.shape[0]):
        i = order[k]
        s = sizes[i]
        # _cheapest_unit's fast path, inline (the common case: the cheapest unit has room)
        u = -1
        node = 1
        while tmax[node] >= s:
            if node >= p:
                u = node - p
                break
            l = 2 * node
            node = l if tmin[l] <= tmin[l + 1] else l + 1
        if u < 0:
            u = _cheapest_unit(tmin, tmax, p, s, stack)
        if u < 0:
            bin_of[k] = -1
            continue
        base = u * bins_per_unit
        chosen = -1
        # an empty bin first (every microbatch must get an item): bins are taken in order, so
        # the first empty one follows the used ones
        if used[u] < bins_per_unit:
            chosen = base + used[u]
            used[u] += 1
        else:
            best_room = capacity + 1
            for j in range(bins_per_unit):
                room = capacity - bin_tokens[base + j]
                if room >= s and room < best_room:
                    best_room = room
                    chosen = base + j
        bin_of[k] = chosen
        bin_tokens[chosen] += s
        bin_cost[chosen] += costs[i]
        bin_count[chosen] += 1
        unit_cost[u] += costs[i]
        if used[u] < bins_per_unit:
            mx = capacity  # an empty bin is left
        else:
            mx = 0
            for j in range(bins_per_unit):
                room = capacity - bin_tokens[base + j]
                if room > mx:
                    mx = room
        # the leaf's new values up to the root, carried in registers (each level reads only
        # the sibling, not the node just written). No early stop where an ancestor is left
        # unchanged: the unit placed is nearly always the cheapest, so its path changes to
        # the root, and the test cost more than it saved (1M items, 47.8 -> 46.2 ms)
        cmin = unit_cost[u]
        cmax = mx
        node = p + u
        tmin[node] = cmin
        tmax[node] = cmax
        while node > 1:
            sib = node ^ 1
            if tmin[sib] < cmin:
                cmin = tmin[sib]
            if tmax[sib] > cmax:
                cmax = tmax[sib]
            node >>= 1
            tmin[node] = cmin
            tmax[node] = cmax
        placed += 1
    return placed


def pack_step(order, sizes, costs, n_units: int, bins_per_unit: int, capacity: int):
    """Pack items ``order`` (int64[k], priority order) into ``n_units * bins_per_unit`` bins.

    ``sizes`` (int64) and ``costs`` (float64) are indexed by item id. Returns
    ``(bin_of int64[k] with -1 for items that did not fit, bin_tokens int64[B], bin_cost
    float64[B], bin_count int64[B])``."""
    n_bins = int(n_units) * int(bins_per_unit)
    order = np.ascontiguousarray(order, dtype=np.int64)
    bin_of = np.empty(order.shape[0], dtype=np.int64)
    bin_tokens = np.zeros(n_bins, dtype=np.int64)
    bin_cost = np.zeros(n_bins, dtype=np.float64)
    bin_count = np.zeros(n_bins, dtype=np.int64)
    _pack_step(order, sizes, costs, np.int64(n_units), np.int64(bins_per_unit), np.int64(capacity),
               bin_of, bin_tokens, bin_cost, bin_count)
    return bin_of, bin_tokens, bin_cost, bin_count


@kernel
def _priority_order(cls, cost, out):
    """Stable order by class ascending, then cost descending (ties keep input order): an LSD
    radix sort on one key, the class above the high 32 of the IEEE bits of the non-negative
    costs less their minimum (so a step's keys span only the bits its costs use, about 26: two
    or three passes of digits up to 13 bits wide, every digit's counts taken in one read),
    then runs equal in that key put in order of the full bits (rarely any work: costs of
    different lengths differ in their high bits). O(n), where a comparison sort per step was
    the planner's largest cost. ``cls`` int64[n] in 0..3, ``cost`` float64[n] >= 0; fills
    ``out`` (int64[n])."""
    n = cost.shape[0]
    if n == 0:
        return
    key = np.empty(n, dtype=np.uint64)  # descending cost = ascending complement of the bits
    ka = np.empty(n, dtype=np.uint64)
    kmin = np.uint64(0xFFFFFFFF)
    kmax = np.uint64(0)
    for i in range(n):
        key[i] = ~np.float64(cost[i]).view(np.uint64)
        h = key[i] >> np.uint64(32)
        ka[i] = h
        if h < kmin:
            kmin = h
        if h > kmax:
            kmax = h
    span = kmax - kmin
    bits = 0
    while span > np.uint64(0):
        bits += 1
        span >>= np.uint64(1)
    sh_cls = np.uint64(bits)
    for i in range(n):
        ka[i] = (np.uint64(cls[i]) << sh_cls) | (ka[i] - kmin)
    total = bits + 2
    # digits as wide as the counting arrays stay cheap next to n (zeroed and summed per pass)
    maxw = 13 if n >= 4096 else (11 if n >= 512 else 8)
    passes = (total + maxw - 1) // maxw
    width = (total + passes - 1) // passes
    nd = 1 << width
    mask = np.uint64(nd - 1)
    count = np.zeros((passes, nd + 1), dtype=np.int64)
    for i in range(n):  # every pass's digit counts in one read
        k = ka[i]
        for q in range(passes):
            count[q, ((k >> np.uint64(q * width)) & mask) + 1] += 1
    kb = np.empty(n, dtype=np.uint64)
    a = np.empty(n, dtype=np.int64)
    b = np.empty(n, dtype=np.int64)
    for i in range(n):
        a[i] = i
    for q in range(passes):
        sh = np.uint64(q * width)
        c = count[q]
        if c[((ka[0] >> sh) & mask) + 1] == n:
            continue  # every key has this digit: no reorder
        for d in range(nd):
            c[d + 1] += c[d]
        for i in range(n):
            d = (ka[i] >> sh) & mask
            p = c[d]
            b[p] = a[i]
            kb[p] = ka[i]
            c[d] = p + 1
        a, b = b, a
        ka, kb = kb, ka
    # runs equal in the sort key (one class, equal high bits; in input order: the sort is
    # stable) by their full bits: a stable insertion sort, which does nothing on a run already
    # in order (equal costs)
    lo = 0
    while lo < n:
        hi = lo + 1
        while hi < n and ka[hi] == ka[lo]:
            hi += 1
        for t in range(lo + 1, hi):
            j = a[t]
            kj = key[j]
            q = t
            while q > lo and key[a[q - 1]] > kj:
                a[q] = a[q - 1]
                q -= 1
            a[q] = j
        lo = hi
    for i in range(n):
        out[i] = a[i]
