"""Hybrid DP x CP over a stream of global batches: which step every *tall* document trains in
(the movement of :func:`balancer.strategies.hybrid_stream.plan_hybrid_stream`).

A tall document is slower on any group than a round of short documents filling a rank's memory;
several sharing one tall round ("shelf") cost less than each its own. Tall document ``zi`` (rows
``tall[zi]`` of the epoch's cost table, sorted by stream position, so ``home`` is non-decreasing)
may train in any step of ``[home - max_advance, home + max_delay]`` (steps >= 0). The score of a
set of tall documents sharing a step is :func:`packing.hybrid_shelf._shelf_cost_kernel` (the
planner's phase 2a estimate with unlimited short documents), always called on the set in
increasing ``zi`` order, so the score is a function of the set.

The rule (:func:`_move_tall`), deterministic, ties to the lower index / the earlier step:

1. Start A: every document in its home step. Start B: consecutive clusters (at most 8, spanning
   at most the window), the partition of least summed score by dynamic programming, each at its
   members' mean home step (rounded half to even) clamped into all its members' windows. B is
   kept if its summed score is lower by more than 1e-9.
2. Two passes over the documents in stream order: a document of a step holding at most 4 tall
   documents moves to the step of its window (holding fewer than 8) where the score of the step
   it leaves plus the step it joins drops most, if it drops by more than 1e-9.

Scores are cached per step (and per document and step of its window) and recomputed only when
that step's set changed: the same values as a cache keyed by the set, without building keys.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel
from .hybrid_cp import _check_table
from .hybrid_groups import batch
from .hybrid_shelf import _shelf_cost_kernel

#: a cluster of start B, and the largest step a document moves into, hold at most this many
_MAX_SHELF = 8
#: documents of steps holding more than this many tall ones stay where they are
_MAX_LEAVE = 4


@kernel
def _set_cost(bt, rho, tall, emit, z0, z1, s, drop, add, buf):
    """Score of the tall documents ``zi`` in ``[z0, z1)`` with ``emit[zi] == s``, without
    ``drop`` (-1: none) and with ``add`` (-1: none), in increasing ``zi`` order; 0 if empty."""
    m = np.int64(0)
    for z in range(z0, z1):
        if (emit[z] == s and z != drop) or z == add:
            buf[m] = tall[z]
            m += 1
    if m == 0:
        return 0.0
    return _shelf_cost_kernel(bt, buf[:m], rho)


@kernel
def _round_half_even(total, count):
    """round(total / count) with Python's rule (half to even), total >= 0, count >= 1."""
    q = total // count
    rem = total - q * count
    if 2 * rem > count or (2 * rem == count and q % 2 == 1):
        q += 1
    return q


@kernel
def _summed_cost(bt, rho, tall, emit, n_steps, zlo, zhi, buf, seen):
    """Summed score over the steps of ``emit``, in the order the steps first appear."""
    m = tall.shape[0]
    for s in range(n_steps):
        seen[s] = False
    total = 0.0
    for zi in range(m):
        s = emit[zi]
        if seen[s]:
            continue
        seen[s] = True
        total += _set_cost(bt, rho, tall, emit, zlo[s], zhi[s], s, np.int64(-1), np.int64(-1), buf)
    return total


@kernel
def _move_tall(bt, rho, tall, home, max_delay, max_advance, emit):
    """The step of every tall document into ``emit`` int64[m] (see the module docstring).

    ``bt``: the epoch's cost table (:class:`packing.hybrid_groups.Batch`, sharded sizes
    ``2^1 .. 2^(K-1)``); ``tall`` int64[m] its rows of the tall documents in stream order;
    ``home`` int64[m] their steps without moving (non-decreasing); ``rho`` the short
    documents' seconds per token."""
    m = tall.shape[0]
    span = max_delay + max_advance
    for zi in range(m):
        emit[zi] = home[zi]
    if m == 0 or span <= 0:
        return
    n_steps = home[m - 1] + max_delay + 1
    # the documents that may train in step s are zi in [zlo[s], zhi[s]): home in
    # [s - max_delay, s + max_advance]
    zlo = np.empty(n_steps, dtype=np.int64)
    zhi = np.empty(n_steps, dtype=np.int64)
    a = np.int64(0)
    b = np.int64(0)
    for s in range(n_steps):
        while a < m and home[a] < s - max_delay:
            a += 1
        while b < m and home[b] <= s + max_advance:
            b += 1
        zlo[s] = a
        zhi[s] = b
    buf = np.empty(m + 1, dtype=np.int64)
    seen = np.zeros(n_steps, dtype=np.bool_)
    # start B: clusters of consecutive documents by dynamic programming
    best = np.full(m + 1, np.inf)
    best[0] = 0.0
    prev = np.zeros(m + 1, dtype=np.int64)
    for i in range(1, m + 1):
        j = i - 1
        while j >= 0 and j >= i - (_MAX_SHELF + 1) + 1:
            if home[i - 1] - home[j] > span:
                break
            for q in range(j, i):
                buf[q - j] = tall[q]
            c = best[j] + _shelf_cost_kernel(bt, buf[:i - j], rho)
            if c < best[i] - 1e-12:
                best[i] = c
                prev[i] = j
            j -= 1
    alt = np.empty(m, dtype=np.int64)
    i = m
    while i > 0:
        j = prev[i]
        lo = home[j]
        hi = home[j]
        tot = np.int64(0)
        for q in range(j, i):
            if home[q] < lo:
                lo = home[q]
            if home[q] > hi:
                hi = home[q]
            tot += home[q]
        e = _round_half_even(tot, i - j)
        v = hi - max_advance
        if e > v:
            v = e
        if lo + max_delay < v:
            v = lo + max_delay
        for q in range(j, i):
            alt[q] = v
        i = j
    c_alt = _summed_cost(bt, rho, tall, alt, n_steps, zlo, zhi, buf, seen)
    c_home = _summed_cost(bt, rho, tall, emit, n_steps, zlo, zhi, buf, seen)
    if c_alt < c_home - 1e-9:
        for zi in range(m):
            emit[zi] = alt[zi]
    cnt = np.zeros(n_steps, dtype=np.int64)
    for zi in range(m):
        cnt[emit[zi]] += 1
    # score caches: of every step (valid while its version is unchanged), of a document's step
    # without it, and of every step of a document's window with it added
    ver = np.zeros(n_steps, dtype=np.int64)
    st_cost = np.zeros(n_steps)
    st_ver = np.full(n_steps, -1, dtype=np.int64)
    wo_cost = np.zeros(m)
    wo_step = np.full(m, -1, dtype=np.int64)
    wo_ver = np.full(m, -1, dtype=np.int64)
    ad_cost = np.zeros((m, span + 1))
    ad_ver = np.full((m, span + 1), -1, dtype=np.int64)
    for _ in range(2):
        for zi in range(m):
            s0 = emit[zi]
            if cnt[s0] > _MAX_LEAVE:
                continue
            h = home[zi]
            if st_ver[s0] != ver[s0]:
                st_cost[s0] = _set_cost(bt, rho, tall, emit, zlo[s0], zhi[s0], s0, np.int64(-1),
                                        np.int64(-1), buf)
                st_ver[s0] = ver[s0]
            if wo_step[zi] != s0 or wo_ver[zi] != ver[s0]:
                wo_cost[zi] = _set_cost(bt, rho, tall, emit, zlo[s0], zhi[s0], s0, zi,
                                        np.int64(-1), buf)
                wo_step[zi] = s0
                wo_ver[zi] = ver[s0]
            base = st_cost[s0] - wo_cost[zi]
            bst = -1e-9
            best_s = s0
            for s1 in range(h - max_advance, h + max_delay + 1):
                if s1 == s0 or s1 < 0 or cnt[s1] >= _MAX_SHELF:
                    continue
                w = s1 - (h - max_advance)
                if ad_ver[zi, w] != ver[s1]:
                    ad_cost[zi, w] = _set_cost(bt, rho, tall, emit, zlo[s1], zhi[s1], s1,
                                               np.int64(-1), zi, buf)
                    ad_ver[zi, w] = ver[s1]
                if st_ver[s1] != ver[s1]:
                    st_cost[s1] = _set_cost(bt, rho, tall, emit, zlo[s1], zhi[s1], s1,
                                            np.int64(-1), np.int64(-1), buf)
                    st_ver[s1] = ver[s1]
                gain = ad_cost[zi, w] - st_cost[s1] - base
                if gain < bst:
                    bst = gain
                    best_s = s1
            if best_s != s0:
                emit[zi] = best_s
                cnt[s0] -= 1
                cnt[best_s] += 1
                ver[s0] += 1
                ver[best_s] += 1


def move_tall(time, tokens, rank_capacity: int, n_ranks: int, tall, home, density: float,
              max_delay: int, max_advance: int) -> np.ndarray:
    """The step (int64[m]) of every tall document: ``tall`` int64[m] rows of the cost table
    (``time`` float64[n, K], ``tokens`` int64[n, K], ``K = n_ranks.bit_length()``) in stream
    order, ``home`` int64[m] their steps without moving (non-decreasing, >= 0), ``density`` the
    short documents' seconds per token; each ends within ``[home - max_advance, home +
    max_delay]`` and >= 0 (see the module docstring for the rule)."""
    time, tokens, cap, P = _check_table(time, tokens, rank_capacity, n_ranks)
    tall = np.ascontiguousarray(tall, dtype=np.int64)
    home = np.ascontiguousarray(home, dtype=np.int64)
    m = tall.shape[0]
    if tall.ndim != 1 or home.shape != tall.shape:
        raise ValueError(f"tall and home must be int64[m] of one length, got {tall.shape} and "
                         f"{home.shape}")
    if m and ((tall < 0).any() or (tall >= time.shape[0]).any()):
        raise ValueError(f"tall rows must lie in 0..{time.shape[0] - 1}")
    if m and ((home < 0).any() or (np.diff(home) < 0).any()):
        raise ValueError("home steps must be >= 0 and non-decreasing (stream order)")
    if int(max_delay) < 0 or int(max_advance) < 0:
        raise ValueError(f"max_delay {max_delay} and max_advance {max_advance} must be >= 0")
    emit = np.empty(m, dtype=np.int64)
    _move_tall(batch(time, tokens, cap, P, 1, time.shape[1] - 1, True, -1), np.float64(density),
               tall, home, np.int64(max_delay), np.int64(max_advance), emit)
    return emit


__all__ = ["move_tall"]
