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


@kernel
def _imbalance(tc, level, total, n_units):
    return (tc + level) * n_units / (n_units * tc + total)


@kernel
def _schedule_lumps(exc, size, lo, hi, horizon, n_units, unit_cap, tc, delay_penalty, out_t):
    """``exc`` float64[K], ``size`` int64[K], window ``lo..hi`` (int64[K], steps relative to now,
    within ``0..horizon-1``). Fills ``out_t`` (int64[K]) with the chosen relative step, or -1 when
    no step in the window has room."""
    k_total = exc.shape[0]
    order = np.argsort(-exc, kind="mergesort")
    ex = np.zeros((horizon, n_units))
    tk = np.zeros((horizon, n_units), dtype=np.int64)
    used = np.zeros(horizon, dtype=np.int64)  # slots holding a lump (filled left to right)
    level = np.zeros(horizon)
    total = np.zeros(horizon)
    for idx in range(k_total):
        j = order[idx]
        e = exc[j]
        best = np.inf
        bt = -1
        bk = -1
        for t in range(lo[j], hi[j] + 1):
            if used[t] == 0:
                pm = 0.0
                cnt = 0
                for q in range(idx + 1, k_total):
                    jj = order[q]
                    if lo[jj] <= t and t <= hi[jj]:
                        pm += exc[jj]
                        cnt += 1
                        if cnt >= n_units - 1:
                            break
                val = _imbalance(tc, e, e + pm, n_units) - 1.0 + delay_penalty * t
                k = 0
            else:
                k = -1
                if used[t] < n_units:
                    k = used[t]
                else:
                    for kk in range(n_units):
                        if tk[t, kk] + size[j] <= unit_cap and (k < 0 or ex[t, kk] < ex[t, k]):
                            k = kk
                if k < 0:
                    continue
                ne = ex[t, k] + e
                nl = level[t] if level[t] > ne else ne
                val = (_imbalance(tc, nl, total[t] + e, n_units)
                       - _imbalance(tc, level[t], total[t], n_units) + delay_penalty * t)
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
