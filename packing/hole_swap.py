"""The holes a token-first step leaves after its fill, narrowed by exchanges with the stream
ahead: a microbatch with room gives one of its items back to the pool for an item read ahead
that is larger by at most the room.

Why exchanges and not more items: the fill (``packing.balanced_fill._ahead``) already put every
item ahead that fits a hole; what is left are holes smaller than the light items around. An
item a little larger than one already in the microbatch fits where no new item does, and the
item given back waits in the pool for the next step, so the stream's mix of short and long
items is kept (reading more short items early would leave the last steps with long items and
no partners). Measured on uniform 1..32K documents (8 DP x 4 x 32K): efficiency 0.9919 ->
0.9935 of an L2 limit of 0.9983 (benchmarks/planner_2026-12.md).

Whole-rank units only. With microbatch units a step must leave no more waiting tokens behind
than LPT's (``balanced_fill._keep_microbatches``) and the items given back count against that:
with any item allowed back, uniform 1..32K on 4 DP x 2 PP x 8 x 32K fell below 0.94 (the
token-first step was kept less often); with only documents read this step, prolong (4 DP x 2 PP
x 2 CP x 64K) fell 0.9959 -> 0.9948.

Rules, the same in ``tests/naive/balanced.py``: items ahead are read from ``pos`` as the fill
reads them (taken items skipped; ``est = 1 + light weight before // budget``, at most
``max_advance``; at most ``wmax`` looked at), heavy items ("lumps") included (they add no light
weight), the fill's own items left out, by size ascending (stream order on ties). Each
microbatch with room, in bin order, makes at most one exchange: of its candidates not at their
deadline (given back, an item's delay grows by a step: one at its deadline would pass the
bound), the one whose best partner (the largest unused item ahead with ``size < z <= size +
room``) gains the most tokens, the first on ties.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel
from .argsort import _argsort_int


@kernel
def _hole_swaps(items, stay, bo, sizes, costs, w, taken, cpt, thr, pos, budget, max_advance,
                capacity, bt, fi, fe, fb, na):
    """Exchanges for the holes of the bins (``bt`` int64[bins], their tokens, updated). The
    candidates ``items`` (int64[nc]) sit in bins ``bo`` (int64[nc], -1: not placed; an item
    given back gets -1); ``stay`` (bool[nc]) marks those that may not be given back (at their
    deadline). ``fi``/``fe``/``fb`` (int64[wmax]) hold the ``na`` items the fill read ahead,
    their steps early and bins; the items read by an exchange are appended. Returns the new
    count."""
    n = sizes.shape[0]
    nb = bt.shape[0]
    nc = items.shape[0]
    wmax = fi.shape[0]
    cand = np.empty(wmax, dtype=np.int64)
    cest = np.empty(wmax, dtype=np.int64)
    m = 0
    ahead = 0
    q = pos
    while q < n and m < wmax:
        if taken[q]:
            q += 1
            continue
        est = 1 + ahead // budget
        if est > max_advance:
            break
        cand[m] = q
        cest[m] = est
        m += 1
        if not (costs[q] - sizes[q] * cpt > thr):
            ahead += w[q]
        q += 1
    used = np.zeros(m, dtype=np.bool_)
    for a in range(na):  # the fill's items: cand is in stream order, a binary search each
        lo = np.searchsorted(cand[:m], fi[a])
        if lo < m and cand[lo] == fi[a]:
            used[lo] = True
    cs = np.empty(m, dtype=np.int64)
    for t in range(m):
        cs[t] = sizes[cand[t]]
    o = np.empty(m, dtype=np.int64)
    _argsort_int(cs, o)  # np.argsort(cs, kind="mergesort"), in linear time
    ss = np.empty(m, dtype=np.int64)  # sizes ascending
    for t in range(m):
        ss[t] = cs[o[t]]
    # each bin's candidates, in candidate order (CSR)
    boff = np.zeros(nb + 1, dtype=np.int64)
    for t in range(nc):
        if bo[t] >= 0:
            boff[bo[t] + 1] += 1
    for b in range(nb):
        boff[b + 1] += boff[b]
    fill = boff[:nb].copy()
    bitem = np.empty(boff[nb], dtype=np.int64)
    for t in range(nc):
        if bo[t] >= 0:
            bitem[fill[bo[t]]] = t
            fill[bo[t]] += 1
    for b in range(nb):
        r = capacity - bt[b]
        if na >= wmax:
            break
        if r <= 0:
            continue
        gain = 0
        bt_ = -1
        bk = -1
        for e in range(boff[b], boff[b + 1]):
            t = bitem[e]
            if stay[t]:
                continue
            y = sizes[items[t]]
            k = np.searchsorted(ss, y + r, side="right") - 1
            while k >= 0 and ss[k] > y and used[o[k]]:
                k -= 1
            if k >= 0 and ss[k] - y > gain:
                gain = ss[k] - y
                bt_ = t
                bk = k
        if bt_ < 0:
            continue
        c = o[bk]
        used[c] = True
        bo[bt_] = -1
        bt[b] += gain
        fi[na] = cand[c]
        fe[na] = cest[c]
        fb[na] = b
        na += 1
    return na
