"""The ``balanced`` planner's exchange pass for whole-rank units (``rank_units``: only per-rank
cost sums matter). LPT under a token capacity fills every rank to its token capacity, and then
ranks holding the same tokens differ in cost: under a superlinear cost a rank holding one long
document costs more than a rank holding the same tokens in two shorter ones, and LPT has no way
back. This pass takes a packed step and, while its costliest rank is more than ``tol`` above the
step's lower bound (max(total / dp, the costliest item)), moves cost from the costliest rank U to
a cheaper rank V by the best of:

* a move: an item a of U into a bin of V with room for it (a's bin keeps an item);
* a swap: a of U for b of V, each bin keeping within its token capacity;
* a two-for-one: a of U for b and c of one bin of V (b, c in the same bin, a into it), under the
  same capacities: a long document of U for a shorter one of V plus a short one that makes up
  the tokens, which under a superlinear cost moves cost at equal tokens.

"Best" is the exchange whose new max(cost U, cost V) is smallest (the first found on ties, in
item order), applied only when it is below U's cost; V is the cheapest rank that has such an
exchange among the ``_V_TRIES`` cheapest (tried from the cheapest up: in a token-full step the
cheapest rank often has none where a slightly costlier one does; more tries cost plan time at
64 ranks for little). The pass stops when no rank has one, or after ``rounds``
exchanges. Items stay in their step (the delay bound is untouched), every bin keeps
an item and its capacity. Plain version, step for step the same: ``tests/naive/steps.py``
``rank_swaps``.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel
from .rank_views import TOP as _TOP
from .rank_views import _new_views, _rank_view

_V_TRIES = 8  # U exchanges with the first of its 8 cheapest ranks that has an exchange
#: a size window of at most this many of V's items is scanned as it is, without the binary
#: searches of the cost window (the same exchange either way: they were most of the pass)
_SIZE_SCAN = 16
#: relative margin of the check on bin costs that ends a step's pass before it starts
_MARGIN = 1e-9
SWAP_TOL = 5e-3  # exchanges stop once the costliest rank is within this fraction of the bound


@kernel
def _rank_swaps(items, sizes, costs, bin_of, bin_tokens, bin_count, dp, m, capacity, tol,
                rounds, bin_cost):
    """Exchange items between the ranks of one packed step (``bin_of[t]``: bin of ``items[t]``,
    ``-1`` not placed; rank r holds bins ``r*m..r*m+m-1``), updating ``bin_of``, ``bin_tokens``
    and ``bin_count``. ``bin_cost`` (float64[dp * m]) holds the bins' costs as packed (in any
    order of summation: only a check with a margin reads them) and, when an exchange is made,
    gets them summed afresh in item order. Returns the number of exchanges made."""
    nc = items.shape[0]
    # a step within the tolerance by its bin costs (sums in another order, so with a margin far
    # above their rounding) is left as it is before its items are read: most steps are
    rank_sum = np.zeros(dp)
    for b in range(dp * m):
        rank_sum[b // m] += bin_cost[b]
    est_total = 0.0
    for u in range(dp):
        est_total += rank_sum[u]
    if rank_sum.max() <= est_total / dp * (1.0 + tol) * (1.0 - _MARGIN):
        return np.int64(0)
    # the items' sizes and costs in step order: every exchange looks at them many times, and
    # reading them through ``items`` from the epoch-long arrays missed the cache each time
    isz = np.empty(nc, dtype=np.int64)
    ics = np.empty(nc)
    # ... with each item's rank (-1 not placed), from a table: an integer division per item
    # was a visible part of the pass
    rank_of_bin = np.empty(dp * m, dtype=np.int64)
    for b in range(dp * m):
        rank_of_bin[b] = b // m
    rk = np.empty(nc, dtype=np.int64)
    uc = np.zeros(dp)
    cnt = np.zeros(dp, dtype=np.int64)
    top = 0.0
    for t in range(nc):
        i = items[t]
        isz[t] = sizes[i]
        c = costs[i]
        ics[t] = c
        b = bin_of[t]
        u = -1
        if b >= 0:
            u = rank_of_bin[b]
            uc[u] += c
            cnt[u] += 1
            if c > top:
                top = c
        rk[t] = u
    total = 0.0
    for u in range(dp):
        total += uc[u]
    lb = total / dp
    if top > lb:
        lb = top
    # every rank's items (unordered, with room for what exchanges bring in)
    off = np.zeros(dp + 1, dtype=np.int64)
    for u in range(dp):
        off[u + 1] = off[u] + cnt[u] + rounds + 1
    ul = np.empty(off[dp], dtype=np.int64)
    fill = np.zeros(dp, dtype=np.int64)
    for t in range(nc):
        u = rk[t]
        if u >= 0:
            ul[off[u] + fill[u]] = t
            fill[u] += 1
    made = np.int64(0)
    # every rank's items in the orders an exchange search reads them (_rank_view), kept from
    # round to round: an exchange changes the items of its two ranks only, and the cheapest
    # ranks are searched again in most rounds
    views = _new_views(off, dp, m)
    for _ in range(rounds):
        U = np.int64(0)  # typed: _list_move compiles once, for int64 ranks
        for u in range(1, dp):
            if uc[u] > uc[U]:
                U = u
        cu = uc[U]
        if cu <= lb * (1.0 + tol):
            break
        # V: the cheapest rank with an exchange that lowers max(cost U, cost V) below cost U
        by_cost = np.argsort(uc, kind="mergesort")        # ranks by (cost, index)
        _rank_view(U, ul, off, fill, isz, ics, bin_of, m, views)
        ua = views.item[off[U]:off[U] + fill[U]]           # U's items in item order
        ta_top = views.top[U, :views.ntop[U]]  # its _TOP costliest, then item order
        kind = np.int64(-1)
        ba = np.int64(-1)
        bb = np.int64(-1)
        bcx = np.int64(-1)
        bbin = np.int64(-1)
        bd = 0.0
        V = np.int64(0)
        cv = 0.0
        for q in range(min(dp, _V_TRIES)):
            V = by_cost[q]
            cv = uc[V]
            if cv >= cu:
                break
            _rank_view(V, ul, off, fill, isz, ics, bin_of, m, views)
            kind, ba, bb, bcx, bbin, bd = _best_exchange(isz, ics, bin_of, bin_tokens,
                                                         bin_count, m, capacity, off, fill,
                                                         views, ua, ta_top, V, cu, cv)
            if kind >= 0:
                break
        if kind < 0:
            break
        A = bin_of[ba]
        sa = isz[ba]
        if kind == 0:
            B = bbin
            bin_of[ba] = B
            bin_tokens[A] -= sa
            bin_count[A] -= 1
            bin_tokens[B] += sa
            bin_count[B] += 1
        else:
            B = bin_of[bb]
            sb = isz[bb]
            bin_of[ba] = B
            bin_of[bb] = A
            bin_tokens[A] += sb - sa
            bin_tokens[B] += sa - sb
            if kind == 2:
                sc = isz[bcx]
                bin_of[bcx] = A
                bin_tokens[A] += sc
                bin_tokens[B] -= sc
                bin_count[A] += 1
                bin_count[B] -= 1
        # the rank lists: a leaves U for V, b (and c) leave V for U
        _list_move(ul, off, fill, U, V, ba)
        if kind > 0:
            _list_move(ul, off, fill, V, U, bb)
        if kind == 2:
            _list_move(ul, off, fill, V, U, bcx)
        uc[U] = cu - bd
        uc[V] = cv + bd
        views.valid[U] = False
        views.valid[V] = False
        made += 1
    if made > 0:
        bin_cost[:] = 0.0
        for t in range(nc):
            if bin_of[t] >= 0:
                bin_cost[bin_of[t]] += ics[t]
    return made


@kernel
def _best_exchange(isz, ics, bin_of, bin_tokens, bin_count, m, capacity, off, fill, views, ua,
                   ta_top, V, cu, cv):
    """The best exchange between rank U (cost ``cu``; ``ua`` its items in item order, ``ta_top``
    its ``_TOP`` costliest by (cost descending, item order)) and rank V (``cv``; its views up to
    date in ``views``), items t of the step sized ``isz[t]`` and costing ``ics[t]``: returns
    (kind: -1 none, 0 move, 1 swap, 2 two-for-one; a, b, c, the bin a moves to, the cost
    moved)."""
    gap = cu - cv
    a0 = off[V]
    nv = fill[V]
    vt = views.by_cost[a0:a0 + nv]                     # V's items by (cost, item order)
    vc = views.cost[a0:a0 + nv]
    best = cu
    kind = np.int64(-1)
    ba = np.int64(-1)
    bb = np.int64(-1)
    bcx = np.int64(-1)
    bbin = np.int64(-1)
    bd = 0.0
    # moves: a of U into a bin of V with room (a's bin keeps an item)
    for ta in ua:
        A = bin_of[ta]
        sa = isz[ta]
        ca = ics[ta]
        if bin_count[A] < 2 or ca >= gap:
            continue
        for B in range(V * m, V * m + m):
            if capacity - bin_tokens[B] >= sa:
                nm = _new_max(cu, cv, ca)
                if nm < best:
                    best = nm
                    kind = 0
                    ba = ta
                    bbin = B
                    bd = ca
    # swaps: a of U for b of V, ca - gap < cb < ca, and sb within the rooms: sa - (B's room)
    # <= sb <= (A's room once a leaves). In a token-full step the cost window holds most of V's
    # items and the size window few, so each a scans the smaller of the two: the size window
    # through V's items by (size, cost order), keeping the least new max cost and, on ties,
    # the first b in cost order, as the scan in cost order would
    rv = 0
    for B in range(V * m, V * m + m):
        if capacity - bin_tokens[B] > rv:
            rv = capacity - bin_tokens[B]
    so = views.by_size[a0:a0 + nv]  # V's items (positions in vt) by (size, cost order)
    ss = views.size[a0:a0 + nv]     # their sizes, as float64 (exact below 2**53)
    for ta in ua:
        A = bin_of[ta]
        sa = isz[ta]
        ca = ics[ta]
        room_a = capacity - bin_tokens[A] + sa  # A's room once a leaves
        s_lo = _first_at_least(ss, np.int64(0), nv, np.float64(sa - rv))
        s_hi = _first_above(ss, s_lo, nv, np.float64(room_a))
        # this a's best b: the least new max below the best so far, the first in cost order
        # on ties (the cost window is scanned in that order; the size window is not). A
        # short size window is scanned without the cost window's two searches, b's cost
        # checked against its bounds instead (q in lo..hi-1 is ca - gap < cb < ca)
        a_best = best
        a_q = nv
        lo = np.int64(0)
        hi = np.int64(0)
        by_cost = s_hi - s_lo > _SIZE_SCAN
        if by_cost:
            lo = _first_above(vc, np.int64(0), nv, ca - gap)  # first b with cb > ca - gap
            hi = _first_at_least(vc, lo, nv, ca)    # first b with cb >= ca
            by_cost = hi - lo <= s_hi - s_lo
        if by_cost:
            for q in range(lo, hi):
                tb = vt[q]
                sb = isz[tb]
                if sb <= room_a and sa <= capacity - bin_tokens[bin_of[tb]] + sb:
                    nm = _new_max(cu, cv, ca - vc[q])
                    if nm < a_best:
                        a_best = nm
                        a_q = q
        else:
            for r in range(s_lo, s_hi):
                q = so[r]
                if not (vc[q] > ca - gap and vc[q] < ca):
                    continue
                tb = vt[q]
                sb = isz[tb]  # <= room_a: the window's bound
                if sa <= capacity - bin_tokens[bin_of[tb]] + sb:
                    nm = _new_max(cu, cv, ca - vc[q])
                    if nm < a_best or (nm == a_best and a_q < nv and q < a_q):
                        a_best = nm
                        a_q = q
        if a_q < nv:
            best = a_best
            kind = 1
            ba = ta
            bb = vt[a_q]
            bd = ca - vc[a_q]
    # two-for-one: one of U's _TOP costliest items a for one of V's _TOP costliest b (cb <
    # ca) and c of b's bin (a into that bin)
    tb_top = views.top[V, :views.ntop[V]]
    # V's items by bin, each bin's in (cost, item order): c comes from b's bin
    boff = views.bin_off[V]
    bl = views.by_bin[a0:a0 + nv]
    for ta in ta_top:
        A = bin_of[ta]
        sa = isz[ta]
        ca = ics[ta]
        room_a = capacity - bin_tokens[A] + sa
        for tb in tb_top:
            cb = ics[tb]
            if cb >= ca or ca - cb <= cu - best:
                # (no c can make this the best: d <= ca - cb, costs are not negative)
                continue
            B = bin_of[tb]
            sb = isz[tb]
            lo_c = sa - (capacity - bin_tokens[B] + sb)
            if lo_c < 1:
                lo_c = 1
            hi_c = room_a - sb
            if hi_c < lo_c:
                continue
            jb = B - V * m
            for qq in range(boff[jb], boff[jb + 1]):  # c of bin B by (cost, item order)
                tc = bl[qq]
                if tc == tb:
                    continue
                d = (ca - cb) - ics[tc]
                # d falls as c's cost rises: once it is 0, or U alone stays at best, no later
                # c makes a better exchange
                if d <= 0.0 or cu - d >= best:
                    break
                sc = isz[tc]
                if sc < lo_c or sc > hi_c:
                    continue
                nm = _new_max(cu, cv, d)
                if nm < best:
                    best = nm
                    kind = 2
                    ba = ta
                    bb = tb
                    bcx = tc
                    bd = d
    return kind, ba, bb, bcx, bbin, bd


@kernel
def _new_max(cu, cv, d):
    """The larger of the two ranks' costs once cost ``d`` moves from U (``cu``) to V (``cv``)."""
    nm = cu - d
    if cv + d > nm:
        nm = cv + d
    return nm


@kernel
def _first_above(a, lo, hi, x):
    """The first index in ``lo..hi-1`` of ascending ``a`` whose value is above ``x``, else hi."""
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@kernel
def _first_at_least(a, lo, hi, x):
    """The first index in ``lo..hi-1`` of ascending ``a`` whose value is ``x`` or more, else hi."""
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@kernel
def _list_move(ul, off, fill, src, dst, t):
    """Move item ``t`` from rank ``src``'s list to rank ``dst``'s (both unordered)."""
    for q in range(off[src], off[src] + fill[src]):
        if ul[q] == t:
            ul[q] = ul[off[src] + fill[src] - 1]
            fill[src] -= 1
            break
    ul[off[dst] + fill[dst]] = t
    fill[dst] += 1


def rank_swaps(items, sizes, costs, bin_of, bin_tokens, bin_count, dp: int, m: int,
               capacity: int, tol: float = SWAP_TOL, rounds: int | None = None,
               bin_cost=None) -> int:
    """:func:`_rank_swaps` on arrays of any integer/float dtype (``bin_of``, ``bin_tokens``,
    ``bin_count`` int64, changed in place; ``bin_cost``, float64[dp * m], the bins' costs,
    changed in place too when given, else summed here from the items). Returns the number of
    exchanges."""
    items = np.ascontiguousarray(items, dtype=np.int64)
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    if bin_cost is None:
        placed = bin_of >= 0
        bin_cost = np.bincount(bin_of[placed], weights=costs[items[placed]],
                               minlength=int(dp) * int(m)).astype(np.float64)
    return int(_rank_swaps(items, np.ascontiguousarray(sizes, dtype=np.int64), costs, bin_of,
                           bin_tokens, bin_count, np.int64(dp), np.int64(m), np.int64(capacity),
                           float(tol), np.int64(2 * dp + 8 if rounds is None else rounds),
                           bin_cost))
