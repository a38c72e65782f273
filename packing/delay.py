"""Outlier scheduling for bounded delay: decide in which of the next few steps each heavy item
("lump") is emitted, so that lumps of similar weight share a step instead of leaving one unit far
above the others.

Model. A step has ``U`` units of ``unit_cap`` tokens. Light items ("fluid") fill whatever room is
left at about ``cpt`` cost per token, so a unit's cost is ``Tc + sum(excess)`` with
``Tc = unit_cap * cpt`` and ``excess_i = cost_i - size_i * cpt`` of the lumps in it. The step's
imbalance is ``I = (Tc + max unit excess) * U / (U * Tc + total excess)``. Lumps are taken heaviest
first; each goes to the step in its window (arrival .. arrival + max_delay, clipped to the horizon)
and the unit there that raises ``I`` least (filling the gap under the step's heaviest unit lowers
it). A lump that would open an empty step is valued by the best partners still unplaced that could
join it, so a heavy item waits for a partner that the look-ahead shows is coming, and does not
wait when none is.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel
from .steppack import _priority_order


@kernel
def _imbalance(tc, level, total, n_units):
    return (tc + level) * n_units / (n_units * tc + total)


@kernel
def _schedule_lumps(exc, size, lo, hi, horizon, n_units, unit_cap, tc, delay_penalty, out_t):
    """``exc`` float64[K], ``size`` int64[K], window ``lo..hi`` (int64[K], steps relative to now,
    within ``0..horizon-1``). Fills ``out_t`` (int64[K]) with the chosen relative step, or -1 when
    no step in the window has room."""
    k_total = exc.shape[0]
    positive = True
    for q in range(k_total):
        if not exc[q] > 0.0:
            positive = False
            break
    if positive:  # lumps' excess is: the linear-time sort (the same stable order)
        order = np.empty(k_total, dtype=np.int64)
        _priority_order(np.zeros(k_total, dtype=np.int64), exc, order)
    else:
        order = np.argsort(-exc, kind="mergesort")
    ex = np.zeros((horizon, n_units))
    tk = np.zeros((horizon, n_units), dtype=np.int64)
    used = np.zeros(horizon, dtype=np.int64)  # slots holding a lump (filled left to right)
    level = np.zeros(horizon)
    total = np.zeros(horizon)
    kmin = np.zeros(horizon, dtype=np.int64)  # least loaded slot once every slot is used
    # each step's imbalance as it stands, kept up to date (one division per evaluation, not two)
    imb = np.empty(horizon)
    for t in range(horizon):
        imb[t] = _imbalance(tc, 0.0, 0.0, n_units)
    # lumps feasible at each step, heaviest first, with prefix sums of their excess (from 0 at
    # each step), made lazily: only as far as the partner masses of steps still empty read
    # them. Once every step holds a lump none is read again, so where the look-ahead shows far
    # more lumps than the horizon holds, the lists stay short.
    f_pos = np.empty((horizon, k_total), dtype=np.int64)
    f_cum = np.empty((horizon, k_total + 1))
    f_len = np.zeros(horizon, dtype=np.int64)  # entries listed for step t
    f_scan = np.zeros(horizon, dtype=np.int64)  # next order position to examine for step t
    f_ptr = np.zeros(horizon, dtype=np.int64)  # first entry after the lump being placed
    f_cum[:, 0] = 0.0
    # the smallest lump from each position of the order on, and each step's largest room: once
    # no step has room for the smallest lump left, every lump left gets -1 (where the look-ahead
    # shows far more lumps than the horizon holds, most of them) without its window's scan
    smin = np.empty(k_total + 1, dtype=np.int64)
    smin[k_total] = unit_cap + 1
    for q in range(k_total - 1, -1, -1):
        sq = size[order[q]]
        smin[q] = sq if sq < smin[q + 1] else smin[q + 1]
    # the largest room of a unit of step t (kept once every unit holds a lump): a lump larger
    # skips the step without a scan of its units (long documents, one a unit: most lumps)
    room = np.full(horizon, unit_cap, dtype=np.int64)
    for idx in range(k_total):
        j = order[idx]
        e = exc[j]
        best = np.inf
        bt = -1
        bk = -1
        for t in range(lo[j], hi[j] + 1):
            if used[t] == 0:
                # partner mass: the next n_units - 1 heaviest lumps (after this one) that could
                # join step t, from prefix sums over the lumps feasible at t
                # (entries listed up to the n_units - 1 after this lump, or the order's end)
                while True:
                    while f_ptr[t] < f_len[t] and f_pos[t, f_ptr[t]] <= idx:
                        f_ptr[t] += 1
                    if f_len[t] >= f_ptr[t] + n_units - 1 or f_scan[t] >= k_total:
                        break
                    q = f_scan[t]
                    f_scan[t] += 1
                    jq = order[q]
                    if lo[jq] <= t and t <= hi[jq]:
                        x = f_len[t]
                        f_pos[t, x] = q
                        f_cum[t, x + 1] = f_cum[t, x] + exc[jq]
                        f_len[t] = x + 1
                p0 = f_ptr[t]
                p1 = p0 + n_units - 1
                if p1 > f_len[t]:
                    p1 = f_len[t]
                pm = f_cum[t, p1] - f_cum[t, p0] if p1 > p0 else 0.0
                val = _imbalance(tc, e, e + pm, n_units) - 1.0 + delay_penalty * t
                k = 0
            else:
                k = -1
                if used[t] < n_units:
                    k = used[t]
                elif room[t] < size[j]:
                    continue  # no unit of the full step has room (not scanned for each lump)
                elif tk[t, kmin[t]] + size[j] <= unit_cap:
                    k = kmin[t]  # the least loaded slot (ties: lowest index) has room
                else:
                    kv = np.inf  # ex[t, k], kept in a register: no load through k per slot
                    for kk in range(n_units):
                        if tk[t, kk] + size[j] <= unit_cap and (k < 0 or ex[t, kk] < kv):
                            k = kk
                            kv = ex[t, kk]
                if k < 0:
                    continue
                ne = ex[t, k] + e
                nl = level[t] if level[t] > ne else ne
                val = (_imbalance(tc, nl, total[t] + e, n_units) - imb[t]
                       + delay_penalty * t)
            if val < best:
                best = val
                bt = t
                bk = k
        out_t[j] = bt
        if bt >= 0:
            if bk == used[bt]:
                used[bt] += 1
            ex[bt, bk] += e
            tk[bt, bk] += size[j]
            total[bt] += e
            if ex[bt, bk] > level[bt]:
                level[bt] = ex[bt, bk]
            imb[bt] = _imbalance(tc, level[bt], total[bt], n_units)
            if used[bt] == n_units and (bk == kmin[bt] or used[bt] - 1 == bk):
                # keep the least loaded slot of a full step at hand: one scan per placement
                # instead of one per evaluation
                km = 0
                kv = ex[bt, 0]  # ex[bt, km], kept in a register
                for kk in range(1, n_units):
                    if ex[bt, kk] < kv:
                        km = kk
                        kv = ex[bt, kk]
                kmin[bt] = km
            if used[bt] == n_units:
                r = unit_cap - tk[bt, 0]
                for kk in range(1, n_units):
                    if unit_cap - tk[bt, kk] > r:
                        r = unit_cap - tk[bt, kk]
                room[bt] = r
                full = True
                for t in range(horizon):
                    if room[t] >= smin[idx + 1]:
                        full = False
                        break
                if full:
                    for q in range(idx + 1, k_total):
                        out_t[order[q]] = -1
                    return


def schedule_lumps(exc, size, lo, hi, horizon: int, n_units: int, unit_cap: int, tc: float,
                   delay_penalty: float = 0.002) -> np.ndarray:
    """Return the chosen step (relative, int64[K]; -1 = no room) for every lump."""
    exc = np.ascontiguousarray(exc, dtype=np.float64)
    out = np.empty(exc.shape[0], dtype=np.int64)
    if exc.shape[0]:
        _schedule_lumps(exc, np.ascontiguousarray(size, dtype=np.int64),
                        np.ascontiguousarray(lo, dtype=np.int64),
                        np.ascontiguousarray(hi, dtype=np.int64), np.int64(horizon),
                        np.int64(n_units), np.int64(unit_cap), np.float64(tc),
                        np.float64(delay_penalty), out)
    return out
