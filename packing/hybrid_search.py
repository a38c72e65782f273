"""Hybrid DP x CP planning, step 4: local search on whole documents.

A document on the slowest rank of a round moves to the slot with the most room below its own
round's maximum, or swaps with a cheaper document on one of the four least-loaded ranks of the
same round, while that lowers the round's maximum without raising another's.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._jit import kernel
from .hybrid_groups import _TOL, _add_shard, _add_whole, _new_group, _new_rounds


class Links(NamedTuple):
    """The whole documents of every (round, rank) slot as doubly linked lists: ``head``
    int64[R * P] (first document of slot ``r * P + p``, -1: none), ``nxt``/``prv`` int64[n]."""

    head: np.ndarray
    nxt: np.ndarray
    prv: np.ndarray


@kernel
def _local_search(bt, rs, pl, nr, ng, iters, rmax, order_a, order_b):
    """Move or swap whole documents off the slowest rank of each of the ``nr`` rounds of
    ``rs`` (``rmax`` float64[nr] their maxima, kept up to date) while that lowers the round's
    maximum and raises no other round's, for at most ``iters`` sweeps; documents listed by
    ``order_b`` then ``order_a`` (decreasing time). Returns the group count."""
    time, tok, cap, P, whole_ok = bt.time, bt.tok, bt.cap, bt.P, bt.whole_ok
    load, rtok, gid, g_k = rs.load, rs.rtok, rs.gid, rs.g_k
    d_round, d_off, d_owner = pl.d_round, pl.d_off, pl.d_owner
    n = time.shape[0]
    head = np.full(nr * P, -1, dtype=np.int64)
    nxt = np.full(n, -1, dtype=np.int64)
    prv = np.full(n, -1, dtype=np.int64)
    lk = Links(head, nxt, prv)
    for src in range(2):
        order = order_b if src == 0 else order_a
        for q in range(order.shape[0] - 1, -1, -1):  # lists in decreasing time order
            d = order[q]
            if d_owner[d] < 0:
                continue
            _link(lk, d, d_round[d] * P + d_off[d] + d_owner[d])
    low = np.empty(4, dtype=np.int64)
    stuck = np.zeros(nr, dtype=np.bool_)  # no move found: skipped until a final full sweep
    final = False
    for it in range(iters):
        before = 0.0
        for r in range(nr):
            before += rmax[r]
        for r in range(nr):
            if stuck[r] and not final:
                continue
            p = np.int64(0)
            for pp in range(P):
                if load[r, pp] > load[r, p]:
                    p = pp
            mx = load[r, p]
            x = head[r * P + p]
            moved = False
            while x >= 0:
                t = time[x, 0]
                L = tok[x, 0]
                bid = np.int64(-1)
                bsl = _TOL * mx
                for s in range(nr):
                    lim = mx if s == r else rmax[s]
                    if lim - t <= bsl:
                        continue
                    for q in range(P):
                        if rtok[s, q] + L > cap or load[s, q] + t >= lim - bsl:
                            continue
                        if s == r and q == p:
                            continue
                        if not whole_ok and gid[s, q] >= 0 and g_k[gid[s, q]] > 0:
                            continue
                        bsl = lim - (load[s, q] + t)
                        bid = s * P + q
                if bid >= 0:
                    s = bid // P
                    q = bid % P
                    _unlink(lk, x, r * P + p)
                    _link(lk, x, bid)
                    load[r, p] -= t
                    rtok[r, p] -= L
                    if gid[s, q] < 0:
                        ng = _new_group(rs, ng, s, q, np.int64(0))
                    _add_whole(bt, rs, pl, x, s, q)
                    moved = True
                    break
                x = nxt[x]
            if not moved:
                # swap a document of the slowest rank with a cheaper one on one of the four
                # least-loaded ranks of the same round
                nl = np.int64(0)
                for q in range(P):
                    if q == p or (not whole_ok and gid[r, q] >= 0 and g_k[gid[r, q]] > 0):
                        continue
                    if nl < 4:
                        low[nl] = q
                        nl += 1
                    else:
                        w = np.int64(0)
                        for j in range(1, 4):
                            if load[r, low[j]] > load[r, low[w]]:
                                w = j
                        if load[r, q] < load[r, low[w]]:
                            low[w] = q
                bx = np.int64(-1)
                by = np.int64(-1)
                bq = np.int64(-1)
                bnew = mx * (1 - _TOL)
                x = head[r * P + p]
                while x >= 0:
                    for j in range(nl):
                        q = low[j]
                        y = head[r * P + q]
                        while y >= 0:
                            dlt = time[x, 0] - time[y, 0]
                            if dlt > 0:
                                a = mx - dlt
                                b = load[r, q] + dlt
                                nm = a if a > b else b
                                if (nm < bnew and rtok[r, q] - tok[y, 0] + tok[x, 0] <= cap
                                        and rtok[r, p] - tok[x, 0] + tok[y, 0] <= cap):
                                    bnew = nm
                                    bx = x
                                    by = y
                                    bq = q
                            y = nxt[y]
                    x = nxt[x]
                if bx >= 0:
                    _swap_whole(bt, rs, pl, lk, bx, by, r, p, bq)
                    moved = True
            if moved:
                m = 0.0
                for pp in range(P):
                    if load[r, pp] > m:
                        m = load[r, pp]
                rmax[r] = m
            else:
                stuck[r] = True
        after = 0.0
        for r in range(nr):
            after += rmax[r]
        if after >= before * (1 - 1e-9):
            if final:
                break
            final = True
            stuck[:] = False
        else:
            final = False
    return ng


@kernel
def _unlink(lk, x, s):
    """Document x out of slot s's list."""
    head, nxt, prv = lk.head, lk.nxt, lk.prv
    if prv[x] >= 0:
        nxt[prv[x]] = nxt[x]
    else:
        head[s] = nxt[x]
    if nxt[x] >= 0:
        prv[nxt[x]] = prv[x]
    prv[x] = -1
    nxt[x] = -1


@kernel
def _link(lk, x, s):
    """Document x first in slot s's list."""
    head, nxt, prv = lk.head, lk.nxt, lk.prv
    nxt[x] = head[s]
    prv[x] = -1
    if head[s] >= 0:
        prv[head[s]] = x
    head[s] = x


@kernel
def _swap_whole(bt, rs, pl, lk, x, y, r, p, q):
    """Exchange whole document x (on rank p of round r) with y (rank q of round r)."""
    time, tok, P = bt.time, bt.tok, bt.P
    load, rtok, gid, g_off, g_k = rs.load, rs.rtok, rs.gid, rs.g_off, rs.g_k
    d_off, d_k, d_owner = pl.d_off, pl.d_k, pl.d_owner
    _unlink(lk, x, r * P + p)
    _unlink(lk, y, r * P + q)
    _link(lk, x, r * P + q)
    _link(lk, y, r * P + p)
    dt = time[x, 0] - time[y, 0]
    dl = tok[x, 0] - tok[y, 0]
    load[r, p] -= dt
    load[r, q] += dt
    rtok[r, p] -= dl
    rtok[r, q] += dl
    gp = gid[r, p]
    gq = gid[r, q]
    d_off[x] = g_off[gq]
    d_k[x] = g_k[gq]
    d_owner[x] = q - g_off[gq]
    d_off[y] = g_off[gp]
    d_k[y] = g_k[gp]
    d_owner[y] = p - g_off[gp]


@kernel
def _repair(bt, nr, iters, ob, pl):
    """Local search (step 4) on a finished plan of ``nr`` rounds, rebuilt from its per-item
    arrays ``pl``, which are updated in place; returns the objective."""
    time, tok, P, fixed_k = bt.time, bt.tok, bt.P, bt.fixed_k
    d_round, d_off, d_k, d_owner = pl.d_round, pl.d_off, pl.d_k, pl.d_owner
    n = time.shape[0]
    rs = _new_rounds(nr, P)
    load, rtok, gid = rs.load, rs.rtok, rs.gid
    ng = np.int64(0)
    if fixed_k >= 0:
        fs = 1 << fixed_k
        for r in range(nr):
            for o in range(0, P - fs + 1, fs):
                ng = _new_group(rs, ng, r, o, fixed_k)
    for d in range(n):
        r = d_round[d]
        o = d_off[d]
        if gid[r, o] < 0:
            ng = _new_group(rs, ng, r, o, d_k[d])
        if d_owner[d] < 0:
            _add_shard(bt, rs, pl, d, gid[r, o], d_k[d])
        else:
            load[r, o + d_owner[d]] += time[d, 0]
            rtok[r, o + d_owner[d]] += tok[d, 0]
    rmax = np.zeros(nr)
    for r in range(nr):
        for p in range(P):
            if load[r, p] > rmax[r]:
                rmax[r] = load[r, p]
    none = np.empty(0, dtype=np.int64)
    _local_search(bt, rs, pl, nr, ng, iters, rmax, none, ob)
    obj = 0.0
    for r in range(nr):
        obj += rmax[r]
    return obj
