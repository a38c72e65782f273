"""Hybrid DP x CP planning: one candidate round height (steps 2-4 in order), and the choice
among candidates. See :mod:`packing.hybrid_cp` for the whole algorithm.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel
from .hybrid_groups import Placement, _new_group, _new_rounds
from .hybrid_place import _place_group_docs, _place_whole
from .hybrid_search import _local_search, _repair
from .hybrid_shelf import _place_tall


@kernel
def _kernel_candidate(bt, H, j_rounds, R_cap, order_a, order_b, min_len_b, ls_iters, pl):
    """Plan with round height ``H`` (``j_rounds`` rounds pre-created with a fixed partition)
    into ``pl``: group documents ``order_a``, whole ones ``order_b`` (``min_len_b`` the
    shortest of each suffix of it). Returns (status, rounds, objective); status 1: ``R_cap``
    rounds were too few (retry)."""
    time, tok, P, fixed_k = bt.time, bt.tok, bt.P, bt.fixed_k
    n = time.shape[0]
    rs = _new_rounds(R_cap, P)
    load = rs.load
    nr = np.int64(0)
    ng = np.int64(0)
    fsize = 1 << fixed_k if fixed_k >= 0 else 0
    nb = order_b.shape[0]
    # whole documents as a fluid: their work, tokens and work per token
    s_area = 0.0
    s_tok = np.int64(0)
    for q in range(nb):
        s_area += time[order_b[q], 0]
        s_tok += tok[order_b[q], 0]
    rho = s_area / s_tok if s_tok > 0 else 0.0
    if fixed_k >= 0:
        if j_rounds > R_cap:
            return 1, nr, 0.0
        for r in range(j_rounds):
            for o in range(0, P - fsize + 1, fsize):
                ng = _new_group(rs, ng, r, o, fixed_k)
        nr = j_rounds
    # ---- 2a. tall documents (no size reaches H) share rounds: each joins the round where the
    # re-optimised sizes raise the score least, or opens one ------------------------------------
    placed = np.zeros(n, dtype=np.bool_)
    if fixed_k < 0:
        st, nr, ng = _place_tall(bt, rs, pl, H, order_a, s_area, rho, R_cap, nr, ng, placed)
        if st:
            return 1, nr, 0.0
    # ---- 2b. other group documents ----------------------------------------------------------
    st, nr, ng = _place_group_docs(bt, rs, pl, H, order_a, s_area, rho, R_cap, nr, ng,
                                   placed)
    if st:
        return 1, nr, 0.0
    # ---- 3. whole documents -----------------------------------------------------------------
    st, nr, ng = _place_whole(bt, rs, pl, H, order_b, min_len_b, s_area, s_tok, rho, R_cap,
                              nr, ng)
    if st:
        return 1, nr, 0.0
    # ---- 4. repair: local search on whole documents ------------------------------------------
    rmax = np.zeros(nr)
    for r in range(nr):
        m = 0.0
        for p in range(P):
            if load[r, p] > m:
                m = load[r, p]
        rmax[r] = m
    if ls_iters > 0:
        ng = _local_search(bt, rs, pl, nr, ng, ls_iters, rmax, order_a, order_b)
    obj = 0.0
    for r in range(nr):
        obj += rmax[r]
    return 0, nr, obj


@kernel
def _run_candidate(bt, H, j_rounds, shard_all, oa, ob, ls_iters, pl):
    """Split documents into group and whole ones at height H and plan them into ``pl``;
    (rounds, obj)."""
    time, tok, cap, ka_lo, ka_hi = bt.time, bt.tok, bt.cap, bt.ka_lo, bt.ka_hi
    n = time.shape[0]
    shard_ok = ka_lo >= 1 and ka_hi >= ka_lo
    in_a = np.zeros(n, dtype=np.bool_)
    na = np.int64(0)
    for d in range(n):
        if shard_all or tok[d, 0] > cap or (shard_ok and time[d, 0] > H):
            in_a[d] = True
            na += 1
    order_a = np.empty(na, dtype=np.int64)
    order_b = np.empty(n - na, dtype=np.int64)
    ia = np.int64(0)
    for q in range(n):
        if in_a[oa[q]]:
            order_a[ia] = oa[q]
            ia += 1
    ib = np.int64(0)
    for q in range(n):
        if not in_a[ob[q]]:
            order_b[ib] = ob[q]
            ib += 1
    min_len_b = np.empty(n - na + 1, dtype=np.int64)
    min_len_b[n - na] = cap + 1
    for q in range(n - na - 1, -1, -1):
        L = tok[order_b[q], 0]
        min_len_b[q] = L if L < min_len_b[q + 1] else min_len_b[q + 1]
    R_cap = j_rounds + na + 4
    while True:
        st, nr, obj = _kernel_candidate(bt, H, j_rounds, R_cap, order_a, order_b, min_len_b,
                                        ls_iters, pl)
        if st == 0:
            return nr, obj
        R_cap *= 2


@kernel
def _plan_kernel(bt, n_cand, ls_iters, oa, ob, pl):
    """Plan one global batch: every candidate round height without repair, then the best one
    again with repair, written to ``pl`` (int64[n] each). ``oa``: documents by decreasing
    area at their smallest size, ``ob``: by decreasing whole time. Returns (rounds, objective,
    candidate index)."""
    time, tok, cap, P = bt.time, bt.tok, bt.cap, bt.P
    ka_lo, ka_hi, whole_ok, fixed_k = bt.ka_lo, bt.ka_hi, bt.whole_ok, bt.fixed_k
    d_round, d_off, d_k, d_owner = pl.d_round, pl.d_off, pl.d_k, pl.d_owner
    n = time.shape[0]
    K = time.shape[1]
    # fixed groups of two or more without whole documents: every document is sharded
    shard_all = fixed_k >= 1 and not whole_ok
    # the pool's work at each document's most area-efficient size, the memory minimum of
    # rounds, and the height a round of short documents reaches when its memory is full
    work = 0.0
    tokens = np.int64(0)
    st_ = 0.0
    sk_ = np.int64(0)
    for d in range(n):
        best = np.inf
        for k in range(K):
            if tok[d, k] > cap:
                continue
            if k > 0 and (k < ka_lo or k > ka_hi):
                continue
            if k == 0 and shard_all:
                continue
            a = time[d, k] * (1 << k)
            if a < best:
                best = a
        work += best
        tokens += tok[d, 0]
        if 2 * tok[d, 0] <= cap:
            st_ += time[d, 0]
            sk_ += tok[d, 0]
    j_lo = max(1, int(np.ceil(tokens / (P * cap) - 1e-12)))
    full = st_ / sk_ * cap if sk_ > 0 else np.inf
    best_obj = np.inf
    best_c = np.int64(-1)
    best_nr = np.int64(0)
    best_H = 0.0
    c_round = np.empty(n, dtype=np.int64)
    c_off = np.empty(n, dtype=np.int64)
    c_k = np.empty(n, dtype=np.int64)
    c_owner = np.empty(n, dtype=np.int64)
    cand = Placement(c_round, c_off, c_k, c_owner)
    for c in range(n_cand):
        H = work / (P * (j_lo + c))
        if H > full * (1 - 0.1 * c):
            H = full * (1 - 0.1 * c)
        nr, obj = _run_candidate(bt, H, j_lo + c, shard_all, oa, ob, np.int64(0), cand)
        if obj < best_obj * (1 - 1e-12):
            best_obj = obj
            best_c = c
            best_nr = nr
            best_H = H
            d_round[:] = c_round
            d_off[:] = c_off
            d_k[:] = c_k
            d_owner[:] = c_owner
    if ls_iters > 0 and best_nr > 0:
        best_obj = _repair(bt, best_nr, ls_iters, ob, pl)
    return best_nr, best_obj, best_c
