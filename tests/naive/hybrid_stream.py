"""Slow reference for the movement of tall documents in ``plan_hybrid_stream`` (issue #15): the
Python rule as it was before :mod:`packing.hybrid_move` compiled it (dicts of lists per step, a
dict cache keyed by the sorted set), kept verbatim so the kernel is compared with it. Imports
nothing from the production code: the score of a set of tall documents is passed in as ``cost``
(a function of a sorted tuple of indices into ``home``; the test hands it the production
``shelf_cost``, which other tests check).
"""
from __future__ import annotations

import numpy as np


def move_tall(home, cost, max_delay: int, max_advance: int) -> np.ndarray:
    """The step of every tall document (int64[m]): ``home`` int64[m] their steps without moving
    (stream order, non-decreasing); ``cost(key)`` the score of the documents ``key`` (a sorted
    tuple of indices into ``home``) sharing one step, 0 for the empty tuple."""
    home = np.asarray(home, dtype=np.int64)
    emit = home.copy()
    span = max_delay + max_advance
    m = home.shape[0]
    if m == 0 or span <= 0:
        return emit
    cache: dict[tuple, float] = {}

    def c(zis) -> float:
        key = tuple(sorted(zis))
        if key not in cache:
            cache[key] = cost(key) if key else 0.0
        return cache[key]

    def by_step(em):
        out: dict[int, list] = {}
        for zi, st_ in enumerate(em.tolist()):
            out.setdefault(st_, []).append(zi)
        return out

    # a second start: consecutive clusters (at most 8, spanning at most the window) chosen by
    # dynamic programming, each at its members' mean step clamped into their windows
    best = np.full(m + 1, np.inf)
    best[0] = 0.0
    prev = np.zeros(m + 1, dtype=np.int64)
    for i in range(1, m + 1):
        for j in range(i - 1, max(-1, i - 9), -1):
            if home[i - 1] - home[j] > span:
                break
            v = best[j] + c(list(range(j, i)))
            if v < best[i] - 1e-12:
                best[i], prev[i] = v, j
    alt = np.empty(m, dtype=np.int64)
    i = m
    while i > 0:
        j = prev[i]
        hs = home[j:i]
        e = int(round(float(hs.mean())))
        alt[j:i] = min(int(hs.min()) + max_delay, max(int(hs.max()) - max_advance, e))
        i = j
    if sum(c(v) for v in by_step(alt).values()) < \
            sum(c(v) for v in by_step(emit).values()) - 1e-9:
        emit = alt
    members = by_step(emit)
    for _ in range(2):
        for zi in range(m):
            s0 = int(emit[zi])
            here = members[s0]
            if len(here) > 4:
                continue
            h = int(home[zi])
            without = [z for z in here if z != zi]
            base = c(here) - c(without)
            gbest, best_s = -1e-9, s0
            for s1 in range(h - max_advance, h + max_delay + 1):
                there = members.get(s1, [])
                if s1 == s0 or s1 < 0 or len(there) >= 8:
                    continue
                gain = c(there + [zi]) - c(there) - base
                if gain < gbest:
                    gbest, best_s = gain, s1
            if best_s != s0:
                members[s0] = without
                members.setdefault(best_s, []).append(zi)
                emit[zi] = best_s
    return emit
