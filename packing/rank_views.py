"""A step's ranks' items in the orders the exchange pass (:mod:`packing.rank_swap`) searches
them: by item, by cost, by size, by bin, and the costliest few. The pass searches the cheapest
ranks again in most of its rounds and an exchange changes the items of its two ranks only, so
each rank's views are sorted once and kept until an exchange touches the rank (sorting them
for every search was most of the pass)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._jit import kernel

#: the costliest items kept per rank (the two-for-one looks at this many)
TOP = 8


class _RankViews(NamedTuple):
    """Every rank's items as the exchange search reads them, in the rank's slots
    ``off[r]..off[r] + fill[r]`` of the flat arrays (:func:`_rank_view`)."""
    item: np.ndarray      # int64: in item order
    by_cost: np.ndarray   # int64: by (cost, item order)
    cost: np.ndarray      # float64: the costs of by_cost
    size: np.ndarray      # float64: the sizes, ascending
    by_size: np.ndarray   # int64: positions in by_cost by (size, cost order)
    by_bin: np.ndarray    # int64: items by bin, each bin's by (cost, item order)
    bin_off: np.ndarray   # int64[dp, m + 1]: a bin's items in by_bin, from the rank's slot
    top: np.ndarray       # int64[dp, TOP]: the costliest items by (cost desc, item order)
    ntop: np.ndarray      # int64[dp]
    valid: np.ndarray     # bool[dp]: the rank's views are up to date


@kernel
def _new_views(off, dp, m):
    """Views of ``dp`` ranks whose slots end at ``off[dp]``, none up to date."""
    k = off[dp]
    return _RankViews(np.empty(k, dtype=np.int64), np.empty(k, dtype=np.int64), np.empty(k),
                      np.empty(k), np.empty(k, dtype=np.int64), np.empty(k, dtype=np.int64),
                      np.zeros((dp, m + 1), dtype=np.int64), np.empty((dp, TOP), dtype=np.int64),
                      np.zeros(dp, dtype=np.int64), np.zeros(dp, dtype=np.bool_))


@kernel
def _rank_view(r, ul, off, fill, isz, ics, bin_of, m, views):
    """Rank ``r``'s views from its item list (``ul[off[r]:off[r] + fill[r]]``, unordered),
    unless they are up to date."""
    if views.valid[r]:
        return
    a0 = off[r]
    nv = fill[r]
    vt_t = np.sort(ul[a0:a0 + nv])
    views.item[a0:a0 + nv] = vt_t
    vc_t = np.empty(nv)
    for q in range(nv):
        vc_t[q] = ics[vt_t[q]]
    o = np.argsort(vc_t, kind="mergesort")
    vs = np.empty(nv)
    for q in range(nv):
        views.by_cost[a0 + q] = vt_t[o[q]]
        views.cost[a0 + q] = vc_t[o[q]]
        vs[q] = isz[vt_t[o[q]]]
    so = np.argsort(vs, kind="mergesort")
    for q in range(nv):
        views.by_size[a0 + q] = so[q]
        views.size[a0 + q] = vs[so[q]]
    for q in range(nv):
        vc_t[q] = -vc_t[q]
    ob = np.argsort(vc_t, kind="mergesort")  # by cost descending, then item order
    kb = nv if nv < TOP else TOP
    for q in range(kb):
        views.top[r, q] = vt_t[ob[q]]
    views.ntop[r] = kb
    boff = views.bin_off[r]
    boff[:] = 0
    for q in range(nv):
        boff[bin_of[views.by_cost[a0 + q]] - r * m + 1] += 1
    for j in range(m):
        boff[j + 1] += boff[j]
    bfill = boff[:m].copy()
    for q in range(nv):
        t = views.by_cost[a0 + q]
        j = bin_of[t] - r * m
        views.by_bin[a0 + bfill[j]] = t
        bfill[j] += 1
    views.valid[r] = True
