"""Capacity bin packing: next-fit (arrival order), first-fit-decreasing and best-fit-decreasing.

All kernels take ``sizes`` (int64[n], every size in ``1..capacity``) and fill ``bin_of``
(int64[n]) with the bin index of each item; they return the number of bins. FFD and BFD run in
O(n log n): FFD keeps a max segment tree over bins (leftmost bin with enough room), BFD keeps a
count tree over remaining-capacity values (smallest remaining capacity that still fits).
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel
from .validate import as_sizes, check_capacity

#: Largest capacity best-fit-decreasing accepts: its index is over capacity values, so memory is
#: 16 bytes per unit of capacity (64 MiB at this limit).
BFD_MAX_CAPACITY = 1 << 22


@kernel
def _next_fit(sizes, capacity, bin_of):
    n = sizes.shape[0]
    b = 0
    used = 0
    for i in range(n):
        if used + sizes[i] > capacity:
            b += 1
            used = 0
        bin_of[i] = b
        used += sizes[i]
    return b + 1 if n > 0 else 0


@kernel
def _next_fit_steps(sizes, capacity, per_step, budget, max_items, bin_of, step_end, step_bins):
    """Next fit in arrival order, cut into steps of at most ``per_step`` bins: a step takes the
    next item while it fits its bins, its tokens stay within ``budget`` and its item count
    below ``max_items`` -- but always at least ``per_step`` items, one per bin (an item never
    exceeds the capacity, so ``per_step`` items always fit ``per_step`` bins). ``bin_of[i]``
    is item i's bin inside its step; ``step_end[s]`` (exclusive) and ``step_bins[s]`` (bins
    used, at most ``per_step``) describe step s. Returns the number of steps. With the default
    budget ``per_step x capacity`` (and no item limit) the budget never binds, and the steps are
    the runs of ``per_step`` bins of one next fit over the whole stream."""
    n = sizes.shape[0]
    pos = 0
    ns = 0
    while pos < n:
        bins = 0
        used = 0
        tok = 0
        cnt = 0
        while pos < n:
            sz = sizes[pos]
            if cnt >= per_step and (tok + sz > budget or cnt >= max_items):
                break
            if cnt == 0 or used + sz > capacity:
                if bins == per_step:
                    break
                bins += 1
                used = 0
            bin_of[pos] = bins - 1
            used += sz
            tok += sz
            cnt += 1
            pos += 1
        step_end[ns] = pos
        step_bins[ns] = bins
        ns += 1
    return ns


@kernel
def _split_runs(sizes, lo, hi, bin_of, n_bins, target, counts):
    """Split the ``n_bins`` consecutive runs (bins) of items ``lo:hi`` (``bin_of`` their run,
    ascending) into ``target`` runs, keeping arrival order: repeatedly cut the run holding the
    most tokens among those with two items or more where its first part reaches half of its
    tokens. Needs ``hi - lo >= target``; fills ``counts`` (int64[target], items per run)."""
    start = np.empty(target + 1, dtype=np.int64)
    tok = np.zeros(target, dtype=np.int64)
    b = -1
    for i in range(lo, hi):
        if bin_of[i] != b:
            b = bin_of[i]
            start[b] = i
        tok[b] += sizes[i]
    start[n_bins] = hi
    for t in range(n_bins, target):
        best = -1
        for q in range(t):
            if start[q + 1] - start[q] >= 2 and (best < 0 or tok[q] > tok[best]):
                best = q
        a = start[best]
        e = start[best + 1]
        acc = 0
        c = e - 1
        for i in range(a, e - 1):
            acc += sizes[i]
            if 2 * acc >= tok[best]:
                c = i + 1
                break
        if c == e - 1:
            acc = tok[best] - sizes[e - 1]
        for q in range(t, best, -1):  # make room for the new run after ``best``
            start[q + 1] = start[q]
            tok[q] = tok[q - 1]
        start[best + 1] = c
        tok[best + 1] = tok[best] - acc
        tok[best] = acc
    for q in range(target):
        counts[q] = start[q + 1] - start[q]


@kernel
def _decreasing_order(sizes):
    # stable: equal sizes keep their input order, so results do not depend on the sort algorithm
    return np.argsort(-sizes, kind="mergesort")


@kernel
def _ffd(sizes, capacity, bin_of):
    n = sizes.shape[0]
    if n == 0:
        return 0
    order = _decreasing_order(sizes)
    p = 1
    while p < n:
        p *= 2
    tree = np.empty(2 * p, dtype=np.int64)  # max remaining capacity in each subtree of bins
    tree[:] = capacity
    n_bins = 0
    for k in range(n):
        i = order[k]
        s = sizes[i]
        node = 1
        while node < p:  # leftmost bin with remaining >= s; an unopened bin always qualifies
            node = 2 * node if tree[2 * node] >= s else 2 * node + 1
        b = node - p
        bin_of[i] = b
        if b + 1 > n_bins:
            n_bins = b + 1
        tree[node] -= s
        node //= 2
        while node >= 1:
            left = tree[2 * node]
            right = tree[2 * node + 1]
            tree[node] = left if left > right else right
            node //= 2
    return n_bins


@kernel
def _first_at_or_after(tree, p, s):
    """Smallest value index >= s whose count is positive, or -1 (count tree of size 2p)."""
    i = s + p
    if tree[i] > 0:
        return s
    found = False
    while i > 1:
        if i % 2 == 0 and tree[i + 1] > 0:
            i = i + 1
            found = True
            break
        i //= 2
    if not found:
        return -1
    while i < p:
        i = 2 * i if tree[2 * i] > 0 else 2 * i + 1
    return i - p


@kernel
def _tree_add(tree, p, v, delta):
    i = v + p
    while i >= 1:
        tree[i] += delta
        i //= 2


@kernel
def _bfd(sizes, capacity, bin_of):
    n = sizes.shape[0]
    if n == 0:
        return 0
    order = _decreasing_order(sizes)
    p = 1
    while p < capacity + 1:
        p *= 2
    tree = np.zeros(2 * p, dtype=np.int32)  # number of open bins with each remaining capacity
    head = np.full(capacity + 1, -1, dtype=np.int64)  # bucket of bins per remaining capacity
    nxt = np.empty(n, dtype=np.int64)
    n_bins = 0
    for k in range(n):
        i = order[k]
        s = sizes[i]
        r = _first_at_or_after(tree, p, s)
        if r < 0:
            b = n_bins
            n_bins += 1
            r_new = capacity - s
        else:
            b = head[r]
            head[r] = nxt[b]
            _tree_add(tree, p, r, np.int64(-1))
            r_new = r - s
        bin_of[i] = b
        if r_new > 0:
            nxt[b] = head[r_new]
            head[r_new] = b
            _tree_add(tree, p, r_new, np.int64(1))
    return n_bins


def _run(kern, sizes, capacity):
    sizes = as_sizes(sizes)
    capacity = check_capacity(sizes, capacity)
    bin_of = np.empty(sizes.shape[0], dtype=np.int64)
    n_bins = int(kern(sizes, np.int64(capacity), bin_of))
    return bin_of, n_bins


def next_fit(sizes, capacity):
    """Fill bins in arrival order, opening a new bin whenever the next item does not fit.

    Returns ``(bin_of int64[n], n_bins)``."""
    return _run(_next_fit, sizes, capacity)


def first_fit_decreasing(sizes, capacity):
    """First-fit-decreasing in O(n log n). Returns ``(bin_of int64[n], n_bins)``."""
    return _run(_ffd, sizes, capacity)


def best_fit_decreasing(sizes, capacity):
    """Best-fit-decreasing in O(n log capacity). Returns ``(bin_of int64[n], n_bins)``.

    Raises ValueError when ``capacity`` exceeds :data:`BFD_MAX_CAPACITY`."""
    if int(capacity) > BFD_MAX_CAPACITY:
        raise ValueError(
            f"best_fit_decreasing: capacity {int(capacity)} exceeds the limit {BFD_MAX_CAPACITY}; "
            "use first_fit_decreasing for larger capacities"
        )
    return _run(_bfd, sizes, capacity)


def bins_lower_bound(sizes, capacity) -> int:
    """``ceil(sum(sizes) / capacity)``: no packing uses fewer bins."""
    sizes = as_sizes(sizes)
    return int(-(-int(sizes.sum()) // int(capacity)))


def bins_lower_bound_l2(sizes, capacity) -> int:
    """Martello and Toth's L2 lower bound on the number of bins of ``capacity`` that hold
    ``sizes`` (every size in ``1..capacity``; numpy in, an int out). O(n log n).

    For a threshold ``a`` in ``[0, capacity / 2]``: items larger than ``capacity - a`` (J1) and
    items in ``(capacity / 2, capacity - a]`` (J2) each need a bin of their own (no two items
    above half the capacity share one), and items in ``[a, capacity / 2]`` (J3) fit only in the
    room J2's bins leave or in new bins (J1's bins have less than ``a`` left)::

        L(a) = |J1| + |J2| + max(0, ceil((sum(J3) - (|J2| capacity - sum(J2))) / capacity))

    L2 is the largest L(a) over a = 0 and the sizes up to half the capacity (L(a) only changes
    there). L(0) >= ceil(sum / capacity) (:func:`bins_lower_bound`), so L2 is never below it;
    with items above half the capacity it can be far above (two such items never share a bin).
    Martello & Toth, "Lower bounds and reduction procedures for the bin packing problem",
    Discrete Applied Mathematics 28 (1990)."""
    sizes = as_sizes(sizes)
    capacity = check_capacity(sizes, capacity)
    if sizes.size == 0:
        return 0
    s = np.sort(sizes)
    prefix = np.concatenate(([0], np.cumsum(s)))      # prefix[k] = sum of the k smallest
    n = s.shape[0]
    # items > capacity / 2 (2 s > C) are the big ones: J1 u J2, whatever a is
    first_big = int(np.searchsorted(s, capacity // 2, side="right"))  # first s > floor(C/2)
    n_big = n - first_big
    small = s[:first_big]                              # s <= floor(C/2), i.e. 2 s <= C
    alphas = np.concatenate(([0], np.unique(small))).astype(np.int64)
    # J3 = {a <= s <= C/2}: indices [lo3, first_big)
    lo3 = np.searchsorted(s, alphas, side="left")
    sum3 = prefix[first_big] - prefix[lo3]
    # J2 = {C/2 < s <= C - a}: indices [first_big, hi2)
    hi2 = np.maximum(np.searchsorted(s, capacity - alphas, side="right"), first_big)
    # room J2's bins leave: sum of (capacity - s) over J2 (summed per item: no n x capacity
    # product to overflow int64; each term is below its item, so the sum stays below the total)
    room = np.concatenate(([0], np.cumsum(capacity - s[first_big:])))
    rest = sum3 - room[hi2 - first_big]
    extra = np.maximum(0, -(-rest // capacity))
    return int(n_big + extra.max())
