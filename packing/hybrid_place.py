"""Hybrid DP x CP planning, steps 2b and 3: the other group documents, then the whole ones.
See :mod:`packing.hybrid_cp` for the whole algorithm and
:mod:`packing.hybrid_groups` for the round state.
"""
from __future__ import annotations

import numpy as np

from ._heap import heap_pop, heap_push
from ._jit import kernel
from .hybrid_groups import (_add_shard, _add_whole, _free_block, _new_group, _round_room,
                            _slot_room)


@kernel
def _place_group_docs(bt, rs, pl, H, order_a, s_area, rho, R_cap, nr, ng, placed):
    """Step 2b: every document of ``order_a`` not yet ``placed``, by decreasing area, at the
    placement that raises the estimated step time least (LPT on the fixed groups with
    ``fixed_k >= 0``), into ``rs`` (``nr`` rounds, ``ng`` groups so far) and ``pl``; ``s_area``
    the whole documents' work, ``rho`` their seconds per token. Returns (status, rounds,
    groups); status 1: ``R_cap`` rounds were too few."""
    time, tok, cap, P = bt.time, bt.tok, bt.cap, bt.P
    whole_ok, fixed_k = bt.whole_ok, bt.fixed_k
    fsize = 1 << fixed_k if fixed_k >= 0 else 0
    ka_lo, ka_hi = bt.ka_lo, bt.ka_hi
    load, rtok, gid, T = rs.load, rs.rtok, rs.gid, rs.T
    g_off, g_k, g_round, g_load, g_tok = rs.g_off, rs.g_k, rs.g_round, rs.g_load, rs.g_tok
    room = rs.room
    s_room = 0.0  # sum of room[r]
    for r in range(nr):
        te = T[r] if T[r] > H else H
        room[r] = _round_room(bt, rs, r, te, rho, np.int64(0), np.int64(0))
        s_room += room[r]
    for q in range(order_a.shape[0]):
        d = order_a[q]
        if placed[d]:
            continue
        if fixed_k >= 0:
            # fixed groups: LPT, the group whose load grows least with memory room
            k = fixed_k
            bg = np.int64(-1)
            bl = np.inf
            for gi in range(ng):
                if g_tok[gi] + tok[d, k] <= cap and g_load[gi] + time[d, k] < bl:
                    bl = g_load[gi] + time[d, k]
                    bg = gi
            if bg < 0:
                if nr == R_cap:
                    return 1, nr, ng
                for o in range(0, P - fsize + 1, fsize):
                    ng = _new_group(rs, ng, nr, o, k)
                nr += 1
                bg = ng - P // fsize
            _add_shard(bt, rs, pl, d, bg, k)
            r = g_round[bg]
            if g_load[bg] > T[r]:
                T[r] = g_load[bg]
            continue
        # hybrid: the placement that raises the estimated step time least, where the estimate
        # is sum over rounds of max(height, H) plus the whole-document work that the rounds'
        # free slots cannot absorb (by height and by memory), spread over the pool
        rem = s_area - s_room
        base_rem = rem if rem > 0 else 0.0
        best = np.inf
        b_r = np.int64(-1)
        b_k = np.int64(-1)
        b_kind = np.int64(-1)   # 0 whole on slot, 1 existing group, 2 new block, 3 new round
        b_t = np.int64(-1)      # slot / group / block offset
        whole_fits = tok[d, 0] <= cap
        # sizes worth trying: up to one above the smallest that reaches H
        k_top = ka_hi
        for k in range(ka_lo, ka_hi + 1):
            if tok[d, k] <= cap and time[d, k] <= H:
                k_top = k + 1 if k + 1 < ka_hi else ka_hi
                break
        for r in range(nr):
            te_old = T[r] if T[r] > H else H
            for k in range(0, k_top + 1):
                if k == 0:
                    if not whole_fits:
                        continue
                    t = time[d, 0]
                    # least-loaded slot with memory room
                    sp = np.int64(-1)
                    for p in range(P):
                        if not whole_ok and gid[r, p] >= 0 and g_k[gid[r, p]] > 0:
                            continue
                        if rtok[r, p] + tok[d, 0] <= cap and (sp < 0 or load[r, p] < load[r, sp]):
                            sp = p
                    if sp < 0:
                        continue
                    nt = load[r, sp] + t
                    newT = T[r] if T[r] > nt else nt
                    te = newT if newT > H else H
                    old_s = _slot_room(rs, r, sp, te_old, rho, cap)
                    load[r, sp] += t
                    rtok[r, sp] += tok[d, 0]
                    if te != te_old:
                        nroom = _round_room(bt, rs, r, te, rho, np.int64(0), np.int64(0))
                    else:
                        nroom = room[r] - old_s + _slot_room(rs, r, sp, te, rho, cap)
                    load[r, sp] -= t
                    rtok[r, sp] -= tok[d, 0]
                    rem2 = rem - (nroom - room[r])
                    df = (te - te_old) + ((rem2 if rem2 > 0 else 0.0) - base_rem) / P
                    if df < best - 1e-12:
                        best = df
                        b_r = r
                        b_k = np.int64(0)
                        b_kind = np.int64(0)
                        b_t = sp
                    continue
                if k < ka_lo or tok[d, k] > cap:
                    continue
                t = time[d, k]
                size = 1 << k
                # an existing group of this size with memory room (least loaded), and a free block
                for kind in range(1, 3):
                    tgt = np.int64(-1)
                    if kind == 1:
                        for gi in range(ng):
                            if g_round[gi] == r and g_k[gi] == k and g_tok[gi] + tok[d, k] <= cap:
                                if tgt < 0 or g_load[gi] < g_load[tgt]:
                                    tgt = gi
                        if tgt < 0:
                            continue
                        o = g_off[tgt]
                    else:
                        o = _free_block(gid, r, k, P)
                        if o < 0:
                            continue
                        tgt = o
                    mx = 0.0
                    for p in range(o, o + size):
                        if load[r, p] > mx:
                            mx = load[r, p]
                    nt = mx + t
                    newT = T[r] if T[r] > nt else nt
                    te = newT if newT > H else H
                    old_s = 0.0
                    if te == te_old:
                        for p in range(o, o + size):
                            if whole_ok or gid[r, p] < 0 or g_k[gid[r, p]] == 0:
                                old_s += _slot_room(rs, r, p, te_old, rho, cap)
                    for p in range(o, o + size):
                        load[r, p] += t
                        rtok[r, p] += tok[d, k]
                    if te == te_old:
                        nroom = room[r] - old_s
                        if whole_ok:
                            for p in range(o, o + size):
                                nroom += _slot_room(rs, r, p, te, rho, cap)
                    else:
                        nroom = _round_room(bt, rs, r, te, rho, o, size if kind == 2 else 0)
                    for p in range(o, o + size):
                        load[r, p] -= t
                        rtok[r, p] -= tok[d, k]
                    rem2 = rem - (nroom - room[r])
                    df = (te - te_old) + ((rem2 if rem2 > 0 else 0.0) - base_rem) / P
                    if df < best - 1e-12:
                        best = df
                        b_r = r
                        b_k = k
                        b_kind = kind
                        b_t = tgt
        # a new round of this document's height
        for k in range(0, k_top + 1):
            if k == 0:
                if not whole_fits:
                    continue
            elif k < ka_lo or tok[d, k] > cap:
                continue
            t = time[d, k]
            size = 1 << k
            te = t if t > H else H
            a = te - t
            m = rho * (cap - tok[d, k])
            if m < a:
                a = m
            nroom = size * (a if a > 0 else 0.0)
            if k > 0 and not whole_ok:
                nroom = 0.0
            free = te if te < rho * cap else rho * cap
            nroom += (P - size) * free
            rem2 = rem - nroom
            df = te + ((rem2 if rem2 > 0 else 0.0) - base_rem) / P
            if df < best - 1e-12:
                best = df
                b_r = np.int64(-1)
                b_k = k
                b_kind = np.int64(3)
                b_t = np.int64(0)
        # apply
        if b_kind == 3:
            if nr == R_cap:
                return 1, nr, ng
            r = nr
            nr += 1
            ng = _new_group(rs, ng, r, np.int64(0), b_k)
            if b_k == 0:
                _add_whole(bt, rs, pl, d, r, np.int64(0))
            else:
                _add_shard(bt, rs, pl, d, ng - 1, b_k)
        else:
            r = b_r
            if b_kind == 0:
                if gid[r, b_t] < 0:
                    ng = _new_group(rs, ng, r, b_t, np.int64(0))
                _add_whole(bt, rs, pl, d, r, b_t)
            elif b_kind == 1:
                _add_shard(bt, rs, pl, d, b_t, b_k)
            else:
                ng = _new_group(rs, ng, r, b_t, b_k)
                _add_shard(bt, rs, pl, d, ng - 1, b_k)
        m = 0.0
        for p in range(P):
            if load[r, p] > m:
                m = load[r, p]
        T[r] = m
        te = m if m > H else H
        s_room -= room[r]
        room[r] = _round_room(bt, rs, r, te, rho, np.int64(0), np.int64(0))
        s_room += room[r]
    return 0, nr, ng


@kernel
def _place_whole(bt, rs, pl, H, order_b, min_len_b, s_area, s_tok, rho, R_cap, nr, ng):
    """Step 3: whole documents (``order_b``, by decreasing time; ``min_len_b[q]`` the shortest
    of ``order_b[q:]``) by LPT over the (round, rank) slots keyed by load minus the round's
    effective height, rounds added for what the existing ones cannot absorb (``s_area``
    seconds, ``s_tok`` tokens of them). Returns (status, rounds, groups); status 1: ``R_cap``
    rounds were too few."""
    time, tok, cap, P = bt.time, bt.tok, bt.cap, bt.P
    whole_ok, fixed_k = bt.whole_ok, bt.fixed_k
    fsize = 1 << fixed_k if fixed_k >= 0 else 0
    load, rtok, gid, T, g_k = rs.load, rs.rtok, rs.gid, rs.T, rs.g_k
    nb = order_b.shape[0]
    if nb > 0:
        absorb = 0.0
        free_tok = np.int64(0)
        for r in range(nr):
            te = T[r] if T[r] > H else H
            absorb += _round_room(bt, rs, r, te, rho, np.int64(0), np.int64(0))
            for p in range(P):
                if not whole_ok and gid[r, p] >= 0 and g_k[gid[r, p]] > 0:
                    continue
                free_tok += cap - rtok[r, p]
        level = H if H < rho * cap else rho * cap
        extra = np.int64(0)
        if s_area > absorb * (1 + 1e-9):
            extra = int(np.ceil((s_area - absorb) / (P * level) - 1e-9))
        if s_tok > free_tok:
            e2 = int(np.ceil((s_tok - free_tok) / (P * cap)))
            if e2 > extra:
                extra = e2
        if nr + extra > R_cap:
            return 1, nr, ng
        for e in range(extra):
            if fixed_k >= 0:
                for o in range(0, P - fsize + 1, fsize):
                    ng = _new_group(rs, ng, nr, o, fixed_k)
            nr += 1
        Te = np.empty(R_cap)
        for r in range(R_cap):
            Te[r] = T[r] if T[r] > H else H
        keys = np.empty(R_cap * P)
        ids = np.empty(R_cap * P, dtype=np.int64)
        pkeys = np.empty(R_cap * P)  # slots set aside for memory: max-heap on free tokens
        pids = np.empty(R_cap * P, dtype=np.int64)
        hs = np.int64(0)
        ps = np.int64(0)
        for r in range(nr):
            for p in range(P):
                if not whole_ok and gid[r, p] >= 0 and g_k[gid[r, p]] > 0:
                    continue
                hs = heap_push(keys, ids, hs, load[r, p] - Te[r], r * P + p)
        for q in range(nb):
            d = order_b[q]
            t = time[d, 0]
            L = tok[d, 0]
            while ps > 0 and -pkeys[0] >= L:  # set-aside slots that fit again
                ps = heap_pop(pkeys, pids, ps)
                j = pids[ps]
                hs = heap_push(keys, ids, hs, load[j // P, j % P] - Te[j // P], j)
            while True:
                if hs == 0:
                    if nr == R_cap:
                        return 1, nr, ng
                    if fixed_k >= 0:
                        for o in range(0, P - fsize + 1, fsize):
                            ng = _new_group(rs, ng, nr, o, fixed_k)
                    for p in range(P):
                        hs = heap_push(keys, ids, hs, -Te[nr], nr * P + p)
                    nr += 1
                hs = heap_pop(keys, ids, hs)
                ident = ids[hs]
                r = ident // P
                p = ident % P
                if rtok[r, p] + L <= cap:
                    break
                if cap - rtok[r, p] >= min_len_b[q + 1]:  # may still take a later document
                    ps = heap_push(pkeys, pids, ps, -float(cap - rtok[r, p]), ident)
            if gid[r, p] < 0:
                ng = _new_group(rs, ng, r, p, np.int64(0))
            _add_whole(bt, rs, pl, d, r, p)
            if cap - rtok[r, p] >= min_len_b[q + 1]:
                hs = heap_push(keys, ids, hs, load[r, p] - Te[r], ident)
    return 0, nr, ng
