"""Event-by-event simulation of a non-interleaved 1F1B pipeline schedule (PipeDream-Flush).

Stage ``s`` runs ``min(pp - 1 - s, m)`` warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards. A forward of microbatch ``j`` on stage ``s`` waits
for the forward of ``j`` on stage ``s - 1``; a backward waits for the backward on stage ``s + 1``
(or the forward on the last stage). Every op also waits for the previous op of its stage.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel


@kernel
def _stage_ops(s, pp, m, kind, mb):
    """Fill the op order of stage s: kind 0 = forward, 1 = backward. Returns the count."""
    warm = pp - 1 - s
    if warm > m:
        warm = m
    n = 0
    f = 0
    b = 0
    for _ in range(warm):
        kind[n] = 0
        mb[n] = f
        f += 1
        n += 1
    while b < m:
        if f < m:
            kind[n] = 0
            mb[n] = f
            f += 1
            n += 1
        kind[n] = 1
        mb[n] = b
        b += 1
        n += 1
    return n


@kernel
def _new_sim(pp, m):
    """Scratch of :func:`_simulate_with` for ``pp`` stages and ``m`` microbatches: the ops in
    the order the event-by-event simulation runs them (which op can run next depends on which
    ran, never on durations, so the order is the same for every duration), each as flat
    indices (int64[2 m pp] each): its stage, its duration (``k * m + j`` for kind ``k``, 0
    forward / 1 backward, of microbatch ``j``) and the end times it waits for (slot ``1 + q`` of
    op ``q`` in that order; slot 0 is 0.0): the previous op of its stage and the op it depends
    on. Returns (stage, duration, previous, dependency, every stage's last end slot int64[pp],
    end times float64[2 m pp + 1])."""
    kinds = np.empty((pp, 2 * m), dtype=np.int64)
    mbs = np.empty((pp, 2 * m), dtype=np.int64)
    nops = np.empty(pp, dtype=np.int64)
    for s in range(pp):
        nops[s] = _stage_ops(s, pp, m, kinds[s], mbs[s])
    total = 2 * m * pp
    seq_s = np.empty(total, dtype=np.int64)
    seq_d = np.empty(total, dtype=np.int64)
    seq_prev = np.empty(total, dtype=np.int64)
    seq_dep = np.empty(total, dtype=np.int64)
    f_slot = np.zeros((pp, m), dtype=np.int64)  # end slot of a done op (0: not done)
    b_slot = np.zeros((pp, m), dtype=np.int64)
    last = np.zeros(pp, dtype=np.int64)  # end slot of the stage's last op run
    nxt = np.zeros(pp, dtype=np.int64)
    done = 0
    while done < total:
        progressed = False
        for s in range(pp):
            while nxt[s] < nops[s]:
                k = kinds[s, nxt[s]]
                j = mbs[s, nxt[s]]
                if k == 0:
                    dep = 0 if s == 0 else f_slot[s - 1, j]
                    ready = s == 0 or dep > 0
                else:
                    dep = f_slot[s, j] if s == pp - 1 else b_slot[s + 1, j]
                    ready = dep > 0
                if not ready:
                    break
                seq_s[done] = s
                seq_d[done] = k * m + j
                seq_prev[done] = last[s]
                seq_dep[done] = dep
                last[s] = done + 1
                if k == 0:
                    f_slot[s, j] = done + 1
                else:
                    b_slot[s, j] = done + 1
                nxt[s] += 1
                done += 1
                progressed = True
        if not progressed:
            raise ValueError("no valid 1F1B op order")  # unreachable: 1F1B always runs
    return seq_s, seq_d, seq_prev, seq_dep, last, np.zeros(total + 1)


@kernel
def _simulate_with(dur, pp, busy_out, sim):
    """The 1F1B makespan of the per-stage durations ``dur`` (float64[2m]: the forwards, then
    the backwards; ``busy_out[s]`` gets stage s's busy time added) in the op order of ``sim``
    (:func:`_new_sim` for this pp and m): every op starts at the later of its stage's previous
    end and its dependency's end, the arithmetic of an event-by-event simulation, in a straight
    loop (a search that simulates many orders of one rank's microbatches makes ``sim`` once)."""
    seq_s, seq_d, seq_prev, seq_dep, last, ends = sim
    for q in range(seq_s.shape[0]):
        a = ends[seq_prev[q]]
        b = ends[seq_dep[q]]
        d = dur[seq_d[q]]
        ends[q + 1] = (a if a > b else b) + d
        busy_out[seq_s[q]] += d
    mx = 0.0
    for s in range(pp):
        if ends[last[s]] > mx:
            mx = ends[last[s]]
    return mx


@kernel
def _rank_times(mb_fwd, mb_bwd, step_start, step_mbs, dp, pp, times, bubble):
    """Per step and DP rank: 1F1B makespan (``times`` float64[S, dp]) and bubble fraction
    (``bubble``: 1 - busy / (pp * makespan)). Stage durations are microbatch costs / pp."""
    n_steps = step_mbs.shape[0]
    busy = np.zeros(pp)
    # the op order, made again only where a step's microbatch count changes (0 to start: an
    # order with no op, whose makespan is 0)
    sim_m = np.int64(0)
    sim = _new_sim(pp, sim_m)
    dur = np.empty(0)
    for st in range(n_steps):
        m = step_mbs[st]
        if m != sim_m:
            sim = _new_sim(pp, m)
            dur = np.empty(2 * m)
            sim_m = m
        for r in range(dp):
            a = step_start[st] + r * m
            for j in range(m):
                dur[j] = mb_fwd[a + j] / pp
                dur[m + j] = mb_bwd[a + j] / pp
            busy[:] = 0.0
            t = _simulate_with(dur, pp, busy, sim)
            times[st, r] = t
            bubble[st, r] = 1.0 - busy.sum() / (pp * t) if t > 0 else 0.0


def simulate_1f1b(fwd, bwd, pp: int):
    """Makespan and per-stage busy time of one rank's microbatches (per-stage durations)."""
    fwd = np.ascontiguousarray(fwd, dtype=np.float64)
    bwd = np.ascontiguousarray(bwd, dtype=np.float64)
    if fwd.shape != bwd.shape or fwd.ndim != 1:
        raise ValueError(f"fwd and bwd must be 1-D of one length, got {fwd.shape} and {bwd.shape}")
    busy = np.zeros(int(pp))
    sim = _new_sim(np.int64(pp), np.int64(fwd.shape[0]))
    t = float(_simulate_with(np.concatenate([fwd, bwd]), np.int64(pp), busy, sim))
    return t, busy


def rank_step_times(mb_fwd, mb_bwd, step_mbs, dp: int, pp: int):
    """``(times float64[S, dp], bubble float64[S, dp])`` for a whole plan."""
    step_mbs = np.ascontiguousarray(step_mbs, dtype=np.int64)
    step_start = np.zeros(step_mbs.shape[0], dtype=np.int64)
    if step_mbs.shape[0] > 1:
        np.cumsum(step_mbs[:-1] * dp, out=step_start[1:])
    times = np.zeros((step_mbs.shape[0], dp))
    bubble = np.zeros((step_mbs.shape[0], dp))
    _rank_times(np.ascontiguousarray(mb_fwd, dtype=np.float64),
                np.ascontiguousarray(mb_bwd, dtype=np.float64), step_start, step_mbs,
                np.int64(dp), np.int64(pp), times, bubble)
    return times, bubble


@kernel
def _pipeline_order(cost, pp, swap_limit, out):
    """Order of one rank's microbatches (``cost`` float64[m], forward:backward taken as 1:2)
    for a short 1F1B makespan: a "mountain" (cheap ones at both ends, the costliest in the
    middle, which lets the warm-up and the drain run on cheap microbatches) unless ascending or
    descending order simulates shorter, then pairwise swaps while they shorten the simulated
    schedule (only when ``m <= swap_limit``)."""
    m = cost.shape[0]
    a = np.argsort(cost, kind="mergesort")
    k = 0
    for i in range(0, m, 2):
        out[k] = a[i]
        k += 1
    last = m - 1 if (m - 1) % 2 == 1 else m - 2
    for i in range(last, 0, -2):
        out[k] = a[i]
        k += 1
    if pp <= 1 or m < 3:
        return
    dur = np.empty(2 * m)  # forwards, then backwards
    busy = np.zeros(pp)
    sim = _new_sim(pp, m)  # made once: the search below simulates up to ~m^2 orders

    def makespan(order):
        for j in range(m):
            dur[j] = cost[order[j]]
            dur[m + j] = 2.0 * cost[order[j]]
        busy[:] = 0.0
        return _simulate_with(dur, pp, busy, sim)

    # start from the best of mountain, ascending and descending
    best = makespan(out)
    alt = np.empty(m, dtype=np.int64)
    for direction in range(2):
        for j in range(m):
            alt[j] = a[j] if direction == 0 else a[m - 1 - j]
        v = makespan(alt)
        if v < best * (1.0 - 1e-12):
            best = v
            out[:] = alt
    if m > swap_limit:
        return
    improved = True
    while improved:
        improved = False
        for i in range(m):
            for j in range(i + 1, m):
                t = out[i]
                out[i] = out[j]
                out[j] = t
                v = makespan(out)
                if v < best * (1.0 - 1e-12):
                    best = v
                    improved = True
                else:
                    out[j] = out[i]
                    out[i] = t


def pipeline_order(cost, pp: int, swap_limit: int = 8) -> np.ndarray:
    """Positions (int64[m]) in which to run one rank's microbatches under 1F1B."""
    cost = np.ascontiguousarray(cost, dtype=np.float64)
    out = np.empty(cost.shape[0], dtype=np.int64)
    _pipeline_order(cost, np.int64(pp), np.int64(swap_limit), out)
    return out
