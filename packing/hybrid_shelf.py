"""Hybrid DP x CP planning, step 2a: tall documents share tall rounds ("shelves").

A shelf's documents each take the smallest aligned group reaching the shelf's height (groups
packed largest first from rank 0); the height minimises ``height - (work whole short documents
can still do in the free room) / P`` (:func:`_best_shelf`). Shelves are formed greedily and by
dynamic programming over documents sorted by their fastest time (:func:`_shelf_dp`), the
better kept, then repaired by moves and swaps (:func:`_place_tall`). See
:mod:`packing.hybrid_cp` for the whole algorithm.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel
from .hybrid_groups import _TOL, _add_shard, _add_whole, _new_group


@kernel
def _size_for(bt, d, h):
    """Smallest group size exponent (0: whole on one rank) at which document d fits memory and
    takes at most h seconds; -1 if none."""
    time, tok, cap = bt.time, bt.tok, bt.cap
    ka_lo, ka_hi = bt.ka_lo, bt.ka_hi
    if tok[d, 0] <= cap and time[d, 0] <= h * (1 + _TOL):
        return 0
    for k in range(ka_lo, ka_hi + 1):
        if tok[d, k] <= cap and time[d, k] <= h * (1 + _TOL):
            return k
    return -1


@kernel
def _fastest(bt, d):
    """Least per-rank time of document d over the group sizes it fits (0 and ka_lo..ka_hi);
    inf if none."""
    time, tok, cap = bt.time, bt.tok, bt.cap
    ka_lo, ka_hi = bt.ka_lo, bt.ka_hi
    f = np.inf
    if tok[d, 0] <= cap:
        f = time[d, 0]
    for k in range(ka_lo, ka_hi + 1):
        if tok[d, k] <= cap and time[d, k] < f:
            f = time[d, k]
    return f


@kernel
def _best_shelf(bt, mem, m, rho, budget, out_k):
    """Best height of a round holding exactly the documents mem[:m] (each on the smallest group
    reaching the height; groups packed largest first, so any set with total size <= P fits):
    the height minus the whole-document work its free room absorbs (at most ``budget``) over P.
    Writes the sizes to out_k[:m]; returns (score, height), score inf when none fits."""
    time, tok, cap, P = bt.time, bt.tok, bt.cap, bt.P
    ka_lo, ka_hi = bt.ka_lo, bt.ka_hi
    best = np.inf
    best_h = 0.0
    lo = 0.0
    for i in range(m):  # no height below the slowest document's fastest time
        d = mem[i]
        f = _fastest(bt, d)
        if f > lo:
            lo = f
    kk = np.empty(m, dtype=np.int64)
    for i in range(m):
        for k in range(0, ka_hi + 1):
            if k > 0 and k < ka_lo:
                continue
            h = time[mem[i], k]
            if tok[mem[i], k] > cap or h < lo * (1 - _TOL):
                continue
            used = np.int64(0)
            absorb = 0.0
            ok = True
            for j in range(m):
                kj = _size_for(bt, mem[j], h)
                if kj < 0:
                    ok = False
                    break
                kk[j] = kj
                used += 1 << kj
                a = h - time[mem[j], kj]
                b = rho * (cap - tok[mem[j], kj])
                if b < a:
                    a = b
                if a > 0:
                    absorb += a * (1 << kj)
            if not ok or used > P:
                continue
            f = h if h < rho * cap else rho * cap
            absorb += (P - used) * f
            if absorb > budget:
                absorb = budget
            sc = h - absorb / P
            if sc < best - 1e-12 or (abs(sc - best) <= 1e-12 and h < best_h):
                best = sc
                best_h = h
                out_k[:m] = kk
    return best, best_h


@kernel
def _shelf_dp(bt, zs, nz, rho, fluid, out_shelf):
    """Shelves of consecutive documents (by decreasing fastest time, at most 8 a shelf): the
    partition with the smallest summed shelf score, by dynamic programming. Writes each
    document's shelf to out_shelf[:nz]; returns the number of shelves (its score summed is
    :func:`shelf_cost`)."""
    fast = np.empty(nz)
    for zi in range(nz):
        d = zs[zi]
        f = _fastest(bt, d)
        fast[zi] = -f
    zo = np.argsort(fast, kind="mergesort")
    zsorted = zs[:nz][zo]
    dp = np.full(nz + 1, np.inf)
    dp[0] = 0.0
    prev = np.zeros(nz + 1, dtype=np.int64)
    mem = np.empty(8, dtype=np.int64)
    kk = np.empty(8, dtype=np.int64)
    for i in range(1, nz + 1):
        for j in range(max(0, i - 8), i):
            if dp[j] == np.inf:
                continue
            for q in range(j, i):
                mem[q - j] = zsorted[q]
            sc, h = _best_shelf(bt, mem, i - j, rho, fluid, kk)
            if dp[j] + sc < dp[i] - 1e-12:
                dp[i] = dp[j] + sc
                prev[i] = j
    alt = np.empty(nz, dtype=np.int64)
    i = nz
    ns = np.int64(0)
    while i > 0:
        j = prev[i]
        for q in range(j, i):
            alt[q] = ns
        i = j
        ns += 1
    for q in range(nz):
        out_shelf[zo[q]] = alt[q]
    return ns


@kernel
def _members(shelf, zs, n, s, drop, mem):
    """Gather into ``mem`` the documents ``zs[zj]`` (``zj < n``, ``zj != drop``) on shelf
    ``s``, in order; returns how many."""
    m = np.int64(0)
    for zj in range(n):
        if shelf[zj] == s and zj != drop:
            mem[m] = zs[zj]
            m += 1
    return m


@kernel
def _shelf_cost_kernel(bt, docs, rho):
    nz = docs.shape[0]
    shelf = np.empty(nz, dtype=np.int64)
    ns = _shelf_dp(bt, docs, nz, rho, np.inf, shelf)
    mem = np.empty(nz, dtype=np.int64)
    kk = np.empty(nz, dtype=np.int64)
    total = 0.0
    for s_ in range(ns):
        m = _members(shelf, docs, nz, s_, np.int64(-1), mem)
        sc, h = _best_shelf(bt, mem, m, rho, np.inf, kk)
        total += sc
    return total


@kernel
def _shelf_eval(bt, zs, shelf, nz, s, drop, add, rho, budget, mem, kk):
    """Score and absorbed work of shelf s without document index ``drop`` (-1: none) and with
    document ``add`` (-1: none); (0, 0) for an empty shelf."""
    m = _members(shelf, zs, nz, s, drop, mem)
    if add >= 0:
        mem[m] = add
        m += 1
    if m == 0:
        return 0.0, 0.0
    sc, h = _best_shelf(bt, mem, m, rho, budget, kk)
    return sc, (h - sc) * bt.P


@kernel
def _place_tall(bt, rs, pl, H, order_a, s_area, rho, R_cap, nr, ng, placed):
    """Step 2a: documents of ``order_a`` that no group size brings under ``H`` (at most 32)
    into shelves, one new round each, marked in ``placed``. Returns (status, rounds, groups);
    status 1: ``R_cap`` rounds were too few."""
    time, P, ka_hi = bt.time, bt.P, bt.ka_hi
    load, T = rs.load, rs.T
    na_ = order_a.shape[0]
    zs = np.empty(na_, dtype=np.int64)
    nz = np.int64(0)
    fluid = s_area
    for q in range(na_):
        d = order_a[q]
        f = _fastest(bt, d)
        if f > H * (1 + _TOL) and nz < 32:
            zs[nz] = d
            nz += 1
        else:
            fluid += time[d, 0]
    if nz > 0:
        shelf = np.empty(nz, dtype=np.int64)
        sh_sc = np.empty(nz)
        sh_h = np.empty(nz)
        sh_ab = np.empty(nz)  # the budget each shelf's score used
        ns = np.int64(0)
        mem = np.empty(nz, dtype=np.int64)
        kk = np.empty(nz, dtype=np.int64)
        used_ab = 0.0
        for zi in range(nz):
            d = zs[zi]
            mem[0] = d
            sc, h = _best_shelf(bt, mem, np.int64(1), rho, fluid - used_ab, kk)
            best = sc
            b_s = np.int64(-1)
            b_h = h
            for s_ in range(ns):
                m = _members(shelf, zs, zi, s_, np.int64(-1), mem)
                mem[m] = d
                m += 1
                sc2, h2 = _best_shelf(bt, mem, m, rho, fluid - used_ab + sh_ab[s_], kk)
                if sc2 - sh_sc[s_] < best - 1e-12:
                    best = sc2 - sh_sc[s_]
                    b_s = s_
                    b_h = h2
            if b_s < 0:
                b_s = ns
                ns += 1
                sh_sc[b_s] = 0.0
                sh_ab[b_s] = 0.0
            shelf[zi] = b_s
            used_ab -= sh_ab[b_s]
            sh_sc[b_s] += best
            sh_h[b_s] = b_h
            sh_ab[b_s] = b_h - sh_sc[b_s]  # absorbed / P
            sh_ab[b_s] *= P
            used_ab += sh_ab[b_s]
        # the alternative: shelves of consecutive documents by decreasing fastest time,
        # the best such partition by dynamic programming; keep the better of the two
        used_ab = 0.0
        tot_g = 0.0
        for s_ in range(ns):
            sh_sc[s_], sh_ab[s_] = _shelf_eval(bt, zs, shelf, nz, s_, np.int64(-1), np.int64(-1),
                                               rho, fluid - used_ab, mem, kk)
            used_ab += sh_ab[s_]
            tot_g += sh_sc[s_]
        alt_shelf = np.empty(nz, dtype=np.int64)
        na_s = _shelf_dp(bt, zs, nz, rho, fluid, alt_shelf)
        used2 = 0.0
        tot_a = 0.0
        a_sc = np.empty(nz)
        a_ab = np.empty(nz)
        for s_ in range(na_s):
            a_sc[s_], a_ab[s_] = _shelf_eval(bt, zs, alt_shelf, nz, s_, np.int64(-1),
                                             np.int64(-1), rho, fluid - used2, mem, kk)
            used2 += a_ab[s_]
            tot_a += a_sc[s_]
        if tot_a < tot_g - 1e-12:
            shelf[:nz] = alt_shelf
            ns = na_s
            sh_sc[:ns] = a_sc[:ns]
            sh_ab[:ns] = a_ab[:ns]
            used_ab = used2
        # repair the shelves: move a document to another (or a new) shelf, or swap two
        # documents of different shelves, while the summed score drops
        for it in range(4 * nz):
            bd = -1e-9
            b_z = np.int64(-1)
            b_z2 = np.int64(-1)
            b_s1 = np.int64(-1)
            for zi in range(nz):
                s0 = shelf[zi]
                cnt0 = np.int64(0)
                for zj in range(nz):
                    if shelf[zj] == s0:
                        cnt0 += 1
                others = used_ab - sh_ab[s0]
                sc0m, ab0m = _shelf_eval(bt, zs, shelf, nz, s0, zi, np.int64(-1), rho,
                                         fluid - others, mem, kk)
                for s1 in range(ns + 1):
                    if s1 == s0 or (s1 == ns and cnt0 == 1):
                        continue
                    old1 = sh_sc[s1] if s1 < ns else 0.0
                    oab1 = sh_ab[s1] if s1 < ns else 0.0
                    sc1p, ab1p = _shelf_eval(bt, zs, shelf, nz, s1, np.int64(-1), zs[zi], rho,
                                             fluid - (others - oab1) - ab0m, mem, kk)
                    dl = sc0m + sc1p - sh_sc[s0] - old1
                    if dl < bd:
                        bd = dl
                        b_z = zi
                        b_z2 = np.int64(-1)
                        b_s1 = s1
                for zj in range(zi + 1, nz):
                    s1 = shelf[zj]
                    if s1 == s0:
                        continue
                    rest = used_ab - sh_ab[s0] - sh_ab[s1]
                    # zi leaves s0 for s1, zj leaves s1 for s0
                    shelf[zj] = -2
                    sc0, ab0 = _shelf_eval(bt, zs, shelf, nz, s0, zi, zs[zj], rho,
                                           fluid - rest, mem, kk)
                    shelf[zj] = s1
                    shelf[zi] = -2
                    sc1, ab1 = _shelf_eval(bt, zs, shelf, nz, s1, zj, zs[zi], rho,
                                           fluid - rest - ab0, mem, kk)
                    shelf[zi] = s0
                    dl = sc0 + sc1 - sh_sc[s0] - sh_sc[s1]
                    if dl < bd:
                        bd = dl
                        b_z = zi
                        b_z2 = zj
                        b_s1 = s1
            if b_z < 0:
                break
            s0 = shelf[b_z]
            if b_z2 >= 0:
                shelf[b_z2] = s0
                shelf[b_z] = b_s1
            else:
                if b_s1 == ns:
                    sh_sc[ns] = 0.0
                    sh_ab[ns] = 0.0
                    ns += 1
                shelf[b_z] = b_s1
                empty = True
                for zj in range(nz):
                    if shelf[zj] == s0:
                        empty = False
                if empty:  # the last shelf takes the empty one's number
                    ns -= 1
                    for zj in range(nz):
                        if shelf[zj] == ns:
                            shelf[zj] = s0
                    if b_s1 == ns:
                        b_s1 = s0
            used_ab = 0.0
            for s_ in range(ns):
                sh_sc[s_], sh_ab[s_] = _shelf_eval(bt, zs, shelf, nz, s_, np.int64(-1),
                                                   np.int64(-1), rho, fluid - used_ab, mem, kk)
                used_ab += sh_ab[s_]
        # materialise: one round per shelf, groups largest first from rank 0
        for s_ in range(ns):
            m = np.int64(0)
            for zj in range(nz):
                if shelf[zj] == s_:
                    mem[m] = zs[zj]
                    m += 1
            _best_shelf(bt, mem, m, rho, np.inf, kk)
            if nr == R_cap:
                return 1, nr, ng
            r = nr
            nr += 1
            o = np.int64(0)
            for kq in range(ka_hi, -1, -1):
                for i in range(m):
                    if kk[i] != kq:
                        continue
                    ng = _new_group(rs, ng, r, o, kq)
                    if kq == 0:
                        _add_whole(bt, rs, pl, mem[i], r, o)
                    else:
                        _add_shard(bt, rs, pl, mem[i], ng - 1, kq)
                    placed[mem[i]] = True
                    o += 1 << kq
            mx = 0.0
            for p in range(P):
                if load[r, p] > mx:
                    mx = load[r, p]
            T[r] = mx
    return 0, nr, ng
