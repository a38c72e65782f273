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

_TOP = 8  # the two-for-one looks at this many of the costliest items of each of the two ranks
_V_TRIES = 8  # U exchanges with the first of its 8 cheapest ranks that has an exchange
SWAP_TOL = 5e-3  # exchanges stop once the costliest rank is within this fraction of the bound


@kernel
def _rank_swaps(items, sizes, costs, bin_of, bin_tokens, bin_count, dp, m, capacity, tol,
                rounds, bin_cost):
    """Exchange items between the ranks of one packed step (``bin_of[t]``: bin of ``items[t]``,
    ``-1`` not placed; rank r holds bins ``r*m..r*m+m-1``), updating ``bin_of``, ``bin_tokens``
    and ``bin_count``, and, when it makes an exchange, ``bin_cost`` (float64[dp * m], summed
    afresh in item order). Returns the number of exchanges made."""
    nc = items.shape[0]
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
        ua = np.sort(ul[off[U]:off[U] + fill[U]])          # U's items in item order
        ka = ua.shape[0] if ua.shape[0] < _TOP else _TOP
        ta_top = np.empty(ka, dtype=np.int64)
        uac = np.empty(ua.shape[0])
        for q in range(ua.shape[0]):
            uac[q] = -ics[ua[q]]
        oa = np.argsort(uac, kind="mergesort")  # by cost descending, then item order
        for q in range(ka):
            ta_top[q] = ua[oa[q]]
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
            kind, ba, bb, bcx, bbin, bd = _best_exchange(isz, ics, bin_of, bin_tokens,
                                                         bin_count, m, capacity, ul, off, fill,
                                                         ua, ta_top, V, cu, cv)
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
        made += 1
    if made > 0:
        bin_cost[:] = 0.0
        for t in range(nc):
            if bin_of[t] >= 0:
                bin_cost[bin_of[t]] += ics[t]
    return made


@kernel
def _best_exchange(isz, ics, bin_of, bin_tokens, bin_count, m, capacity, ul, off, fill, ua,
                   ta_top, V, cu, cv):
    """The best exchange between rank U (cost ``cu``; ``ua`` its items in item order, ``ta_top``
    its ``_TOP`` costliest by (cost descending, item order)) and rank V (``cv``), items t of
    the step sized ``isz[t]`` and costing ``ics[t]``: returns
    (kind: -1 none, 0 move, 1 swap, 2 two-for-one; a, b, c, the bin a moves to, the cost
    moved)."""
    gap = cu - cv
    vt_t = np.sort(ul[off[V]:off[V] + fill[V]])        # V's items in item order
    nv = vt_t.shape[0]
    vc_t = np.empty(nv)
    for q in range(nv):
        vc_t[q] = ics[vt_t[q]]
    o = np.argsort(vc_t, kind="mergesort")             # V's items by (cost, item order)
    vt = vt_t[o]
    vc = vc_t[o]
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
    # sizes as float64 (exact below 2**53): the searches below take one array type
    vs = np.empty(nv)
    for q in range(nv):
        vs[q] = isz[vt[q]]
    so = np.argsort(vs, kind="mergesort")  # V's items (positions in vt) by (size, cost order)
    ss = vs[so]
    for ta in ua:
        A = bin_of[ta]
        sa = isz[ta]
        ca = ics[ta]
        room_a = capacity - bin_tokens[A] + sa  # A's room once a leaves
        lo = _first_above(vc, np.int64(0), nv, ca - gap)  # first b with cb > ca - gap
        hi = _first_at_least(vc, lo, nv, ca)    # first b with cb >= ca
        s_lo = _first_at_least(ss, np.int64(0), nv, np.float64(sa - rv))
        s_hi = _first_above(ss, s_lo, nv, np.float64(room_a))
        # this a's best b: the least new max below the best so far, the first in cost order
        # on ties (the cost window is scanned in that order; the size window is not)
        a_best = best
        a_q = nv
        if hi - lo <= s_hi - s_lo:
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
                if q < lo or q >= hi:
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
    kb = nv if nv < _TOP else _TOP
    tb_top = np.empty(kb, dtype=np.int64)
    for q in range(nv):
        vc_t[q] = -ics[vt_t[q]]
    ob = np.argsort(vc_t, kind="mergesort")
    for q in range(kb):
        tb_top[q] = vt_t[ob[q]]
    # V's items by bin, each bin's in (cost, item order): c comes from b's bin
    boff = np.zeros(m + 1, dtype=np.int64)
    for q in range(nv):
        boff[bin_of[vt[q]] - V * m + 1] += 1
    for j in range(m):
        boff[j + 1] += boff[j]
    bl = np.empty(nv, dtype=np.int64)
    bfill = boff[:m].copy()
    for q in range(nv):
        j = bin_of[vt[q]] - V * m
        bl[bfill[j]] = vt[q]
        bfill[j] += 1
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
    ``bin_count`` int64, changed in place; ``bin_cost``, float64, too when given). Returns the
    number of exchanges."""
    if bin_cost is None:
        bin_cost = np.zeros(int(dp) * int(m))
    return int(_rank_swaps(np.ascontiguousarray(items, dtype=np.int64),
                           np.ascontiguousarray(sizes, dtype=np.int64),
                           np.ascontiguousarray(costs, dtype=np.float64), bin_of, bin_tokens,
                           bin_count, np.int64(dp), np.int64(m), np.int64(capacity), float(tol),
                           np.int64(2 * dp + 8 if rounds is None else rounds), bin_cost))
