"""Plain numpy/Python version of the ``balanced`` planner, step for step the policy of the
compiled ``packing.balanced`` kernel: the tests require both to give identical plans. It imports
nothing from production code: the outlier scheduler and the step assembly are the plain ones of
:mod:`tests.naive.core` and :mod:`tests.naive.steps`."""
import bisect

import numpy as np

from tests.naive.core import balanced_equal, kk_equal, lpt_equal, refine_swaps, schedule_lumps
from tests.naive.steps import (Steps, check_common, fill_empty_bins, finish_bins, finish_tail,
                               lpt_bins, pack_exact)

#: the look-ahead's lumps stop where their tokens reach this many times the capacity of its
#: steps (the kernel's ``LOOK_LUMP_STEPS``)
LOOK_LUMP_STEPS = 8


def reference_cost_per_token(sizes, costs) -> float:
    """Cost per token of typical (light) items: the median of cost/size over a fixed strided
    sample of at most 65,536 items (deterministic, O(1) memory in n)."""
    n = sizes.shape[0]
    stride = max(1, n // 65536)
    r = costs[::stride] / sizes[::stride]
    return float(np.median(r)) if r.shape[0] else 1.0


class _Rooms:
    """A step's bins by room, as ``packing.balanced_fill`` keeps them: a stack of bins per room;
    the fullest bin with room for ``s`` is the top of the smallest room >= s."""

    def __init__(self):
        self.stack = {}

    def push(self, b, r):
        if r > 0:   # a full bin is not kept
            self.stack.setdefault(r, []).append(b)

    def pop(self, s):
        rooms = [r for r, st in self.stack.items() if r >= s and st]
        if not rooms:
            return -1
        return self.stack[min(rooms)].pop()


def bins_to_ranks(costs, dp, rounds=8):
    """``packing.balanced_fill._bins_to_ranks``: the better of LPT and KK equal-count
    partitions, each refined by ``rounds`` rounds of swaps (KK only when strictly lower)."""
    def largest(groups):
        loads = [0.0] * dp
        for i, g in enumerate(groups):
            loads[g] += costs[i]
        return max(loads)
    a = refine_swaps(costs, lpt_equal(costs, dp), dp, rounds)
    b = refine_swaps(costs, kk_equal(costs, dp), dp, rounds)
    return [int(g) for g in (b if largest(b) < largest(a) else a)]


def keep_microbatches(cls, lpt_placed, bo, lpt_cost, new_cost, sizes, cand, dp, lockstep):
    """Whether a microbatch unit's step keeps its token-first packing (``bo``, microbatch costs
    ``new_cost``) over LPT's (``lpt_placed``, costs ``lpt_cost``): no more tokens
    of waiting candidates (class 0 or 2) left unplaced and no less balanced: with ``lockstep``
    its least lockstep time (the costliest of every ``dp`` microbatches by cost, summed) no
    further above the mean rank than LPT's; otherwise its costliest microbatch no further
    above the mean, and with dp > 1 its costliest rank no further above the mean rank after the
    balanced split of the microbatches over ranks."""
    nc = len(cand)
    placed = set(lpt_placed)
    waiting = [t for t in range(nc) if cls[t] in (0, 2)]
    left_lpt = sum(int(sizes[cand[t]]) for t in waiting if t not in placed)
    left_new = sum(int(sizes[cand[t]]) for t in waiting if bo[t] < 0)
    if left_new > left_lpt:
        return False

    def total(xs):
        acc = 0.0
        for x in xs:
            acc += x
        return acc
    if lockstep:
        def least_lockstep(c):
            return total(sorted(c, reverse=True)[::dp])
        return (least_lockstep(new_cost) * total(lpt_cost)
                <= least_lockstep(lpt_cost) * total(new_cost))
    if not max(new_cost) * total(lpt_cost) <= max(lpt_cost) * total(new_cost):
        return False
    if dp == 1:
        return True
    sums = []
    for c in (lpt_cost, new_cost):
        r = [0.0] * dp
        for b, g in enumerate(balanced_equal(c, dp)):
            r[g] += c[b]
        sums.append(r)
    return max(sums[1]) * total(sums[0]) <= max(sums[0]) * total(sums[1])


def hole_swaps(cand, stay, bo, room, fill, est, sizes, w, taken, is_lump, pos, budget,
               max_advance, limit):
    """The holes left after the fill (``packing.hole_swap``): each bin with room, in order,
    gives back the candidate (not one that must ``stay``) whose best partner ahead (the
    largest unused item, lumps included, with ``size < z <= size + room``) gains the most
    tokens, the first on ties; the partner joins ``fill``. Changes the lists in place."""
    ahead_items, ahead, q = [], 0, pos
    while q < sizes.shape[0] and len(ahead_items) < limit:
        if taken[q]:
            q += 1
            continue
        e = 1 + ahead // budget
        if e > max_advance:
            break
        ahead_items.append((int(q), e))
        if not is_lump[q]:
            ahead += int(w[q])
        q += 1
    filled = set(fill)
    free = sorted(ahead_items, key=lambda f: int(sizes[f[0]]))  # stable: stream order
    used = [f[0] in filled for f in free]
    fs = [int(sizes[f[0]]) for f in free]
    for b in range(len(room)):
        if len(fill) >= limit:
            break
        if room[b] <= 0:
            continue
        best = None
        for t in range(len(cand)):
            if bo[t] != b or stay[t]:
                continue
            y = int(sizes[cand[t]])
            k = bisect.bisect_right(fs, y + room[b]) - 1
            while k >= 0 and fs[k] > y and used[k]:
                k -= 1
            if k >= 0 and fs[k] - y > (best[0] if best else 0):
                best = (fs[k] - y, t, k)
        if best is not None:
            gain, t, k = best
            used[k] = True
            bo[t] = -1
            room[b] -= gain
            bo.append(b)
            fill.append(free[k][0])
            est.append(free[k][1])


def token_first(cand, cls, arr, lpt_placed, lpt_b_of, sizes, costs, w, taken, is_lump, pos,
                budget, max_advance, read_ahead, dp, m, capacity, rank_units=True,
                lockstep=False):
    """The token-first packing of a step LPT left with holes (``packing.balanced_fill``):
    best fit of the candidates ``cand`` (deadline ones largest first, then those over half the
    capacity oldest first, then the rest largest first; with microbatch units those read this
    step, class 3, after the others), the holes filled from the light items ahead of ``pos``
    (when ``read_ahead``); whole-rank units: the bins to ranks by the balanced partition of
    their costs. Returns None (LPT's packing stands) or (bins of the candidates then of the
    items read ahead, with whole-rank units ranks' bins consecutive; the items read ahead;
    their steps early)."""
    nb = dp * m
    nc = len(cand)

    def key(t):
        s = int(sizes[cand[t]])
        if cls[t] == 0:
            return (0, 0, capacity - s, t)
        if 2 * s > capacity:
            return (1, int(arr[t]), capacity - s, t)
        return (3 if not rank_units and cls[t] == 3 else 2, 0, capacity - s, t)
    room = [capacity] * nb
    rooms = _Rooms()
    for b in range(nb):
        rooms.push(b, capacity)
    bo = [-1] * nc
    for t in sorted(range(nc), key=key):
        s = int(sizes[cand[t]])
        b = rooms.pop(s)
        if b >= 0:
            bo[t] = b
            room[b] -= s
            rooms.push(b, room[b])
    fill, est = [], []
    if read_ahead and sum(room) * 400 > nb * capacity:
        maxroom = max(room)
        found, ahead, q = [], 0, pos
        while q < sizes.shape[0] and len(found) < 16 * nb + 256:
            if taken[q] or is_lump[q]:
                q += 1
                continue
            e = 1 + ahead // budget
            if e > max_advance:
                break
            if sizes[q] <= maxroom:
                found.append((int(q), e))
            ahead += int(w[q])
            q += 1
        for i, e in sorted(found, key=lambda f: -int(sizes[f[0]])):  # stable: stream order
            b = rooms.pop(int(sizes[i]))
            if b >= 0:
                room[b] -= int(sizes[i])
                rooms.push(b, room[b])
                bo.append(b)
                fill.append(i)
                est.append(e)
        if rank_units:
            hole_swaps(cand, [c == 0 for c in cls], bo, room, fill, est, sizes, w, taken,
                       is_lump, pos, budget, max_advance, 16 * nb + 256)
    tokens = nb * capacity - sum(room)
    lpt_tokens = sum(int(sizes[cand[k]]) for k in lpt_placed)
    if tokens <= lpt_tokens:
        return None
    items = list(cand) + fill
    placed = [t for t in range(len(items)) if bo[t] >= 0]
    b_of = [bo[t] for t in placed]
    count = [0] * nb
    for b in b_of:
        count[b] += 1
    fill_empty_bins(b_of, [costs[items[t]] for t in placed], count)
    for t, b in zip(placed, b_of):
        bo[t] = b
    bcost = [0.0] * nb
    for t in placed:
        bcost[bo[t]] += costs[items[t]]
    if not rank_units:
        lc = [0.0] * nb
        for k, b in zip(lpt_placed, lpt_b_of):
            lc[b] += costs[cand[k]]
        if not keep_microbatches(cls, lpt_placed, bo, lc, bcost, sizes, cand, dp, lockstep):
            return None
        return bo, fill, est
    rank = bins_to_ranks(bcost, dp)
    r_lpt, r_new = [0.0] * dp, [0.0] * dp
    for k, b in zip(lpt_placed, lpt_b_of):
        r_lpt[b // m] += costs[cand[k]]
    for t in placed:
        r_new[rank[bo[t]]] += costs[items[t]]
    s_lpt = s_new = 0.0
    for r in range(dp):
        s_lpt += r_lpt[r]
        s_new += r_new[r]
    if not max(r_new) * s_lpt <= max(r_lpt) * s_new:
        return None
    new_bin, used = [0] * nb, [0] * dp
    for b in range(nb):
        new_bin[b] = rank[b] * m + used[rank[b]]
        used[rank[b]] += 1
    return [new_bin[b] if b >= 0 else -1 for b in bo], fill, est


def plan_balanced(sizes, costs, dp, m, capacity, budget, max_delay, *, weights=None,
                  rank_units=False, lump_tol=0.02, lookahead=True, max_advance=0,
                  delay_penalty=0.002, tail="partial", pp=1, lockstep=False):
    """Cost-balanced packing with bounded outlier delay.

    Each step takes the items carried over plus fresh items up to ``budget`` (in ``weights``:
    tokens by default, 1 per item for a sample-count budget). Heavy items ("lumps": excess cost
    above ``lump_tol`` of a unit's light-item cost) are scheduled by :mod:`packing.delay` over
    the next ``max_delay + 1`` steps, seeing the lumps that will arrive (``lookahead``), so that
    lumps share steps with similar ones; an item is never held more than ``max_delay`` steps.
    With a token budget of the whole capacity, a step whose packing leaves more than 0.25% of
    its capacity empty reads fresh items of the holes' weight and is packed again, once; a step
    still left with holes is also packed for tokens first (:func:`token_first`) and keeps that
    when it holds more tokens at no worse balance (microbatch units: and no more waiting
    tokens left behind, :func:`keep_microbatches`).
    The step is packed with LPT on cost under the token capacity (``pack_step``), items at their
    deadline first, then scheduled lumps, then light items oldest first. Units are microbatches
    (``rank_units=False``; then spread over ranks by balanced equal-count partition) or whole DP
    ranks (``rank_units=True``, when only per-rank sums matter)."""
    check_common(sizes, dp, m, capacity, tail)
    if max_delay < 1:
        raise ValueError(f"max_delay {max_delay} must be >= 1: an item that does not fit its "
                         "step's capacity moves to the next step")
    if not lookahead:
        max_advance = 0  # nothing is read ahead of its turn without the look-ahead (as the kernel)
    n = sizes.shape[0]
    w = sizes if weights is None else np.ascontiguousarray(weights, dtype=np.int64)
    n_units, bpu = (dp, m) if rank_units else (dp * m, 1)
    unit_cap = capacity * bpu
    cpt = reference_cost_per_token(sizes, costs)
    tc = unit_cap * cpt
    is_lump = (costs - sizes * cpt) > lump_tol * tc
    cumf = np.cumsum(np.where(is_lump, 0, w))
    horizon = max_delay + 1
    lump_budget = budget if weights is None and budget < dp * m * capacity else 1 << 62
    topup = weights is None and budget >= dp * m * capacity
    builder = Steps(dp)
    taken = np.zeros(n, bool)
    pull = [np.zeros(0, np.int64), np.zeros(0, np.int64)]  # look-ahead lumps to read now, est
    pool = np.zeros(0, np.int64)
    arr = np.zeros(0, np.int64)
    pos = 0
    step = 0

    def schedule(pool, arr, pos):
        """Mask over ``pool``: lumps to emit now."""
        pl = np.flatnonzero(is_lump[pool])
        lumps = pool[pl]
        lo = np.zeros(pl.shape[0], np.int64)
        # a lump past its deadline (it found no room in time) still goes now: it holds room in
        # step 0 of the schedule
        hi = np.clip(arr[pl] + max_delay - step, 0, horizon - 1)
        fut = est = np.zeros(0, np.int64)
        if lookahead and pos < n:
            base = cumf[pos - 1] if pos else 0
            end = int(np.searchsorted(cumf, base + (max_delay + max_advance) * budget,
                                      side="right"))
            # the lumps from pos on (read ahead or not) stop where their tokens reach
            # LOOK_LUMP_STEPS times the capacity of the look-ahead's steps
            lp = pos + np.flatnonzero(is_lump[pos:end])
            before = np.cumsum(sizes[lp]) - sizes[lp]
            lp = lp[before < LOOK_LUMP_STEPS * (max_delay + max_advance + 1) * dp * m * capacity]
            fut = lp[~taken[lp]]
            est = 1 + (cumf[fut] - base) // max(budget, 1)
            keep = est - max_advance < horizon
            fut, est = fut[keep], est[keep]
            lumps = np.concatenate([lumps, fut])
            lo = np.concatenate([lo, np.maximum(est - max_advance, 0)])
            hi = np.concatenate([hi, np.minimum(est + max_delay, horizon - 1)])
        now = np.zeros(pool.shape[0], bool)
        pull[0], pull[1] = np.zeros(0, np.int64), np.zeros(0, np.int64)
        if lumps.shape[0]:
            t = schedule_lumps(costs[lumps] - sizes[lumps] * cpt, sizes[lumps], lo, hi, horizon,
                               n_units, unit_cap, tc, delay_penalty)
            now[pl] = t[:pl.shape[0]] == 0
            if max_advance > 0:
                sel = t[pl.shape[0]:] == 0
                pull[0], pull[1] = fut[sel], est[sel]
        # lumps going now stop at the one crossing a budget below the step's capacity: at
        # their deadline first, then scheduled ones in pool order, then look-ahead ones
        forced_l = is_lump[pool] & (step - arr >= max_delay)
        acc = int(w[pool[forced_l]].sum())
        for k in np.flatnonzero(now & ~forced_l):
            if acc < lump_budget:
                acc += int(w[pool[k]])
            else:
                now[k] = False
        keep = np.zeros(pull[0].shape[0], bool)
        for q in range(pull[0].shape[0]):
            if acc < lump_budget:
                acc += int(w[pull[0][q]])
                keep[q] = True
        pull[0], pull[1] = pull[0][keep], pull[1][keep]
        return now

    is_long = 2 * sizes > capacity  # no two share a microbatch
    while pos < n or pool.shape[0]:
        # intake: read until the items emitted now (light ones, lumps scheduled now, items at
        # their deadline) fill the budget, or until the pool holds a long item for every
        # microbatch (more could only wait); re-plan the lumps with what was read; give back
        # the end of the intake (it stays unread) when lumps arriving with it overfill the step
        n_old = pool.shape[0]
        nlong = int(is_long[pool].sum())
        lump_cap = dp * m * capacity  # the lumps in the pool: a step's capacity of tokens
        lump_tok = int(sizes[pool[is_lump[pool]]].sum())
        for it in range(4):
            if pos < n:
                now = schedule(pool, arr, pos)
            else:  # every lump is in the pool and goes now; no look-ahead lump is left to pull
                now = np.ones(pool.shape[0], bool)
                pull[0], pull[1] = np.zeros(0, np.int64), np.zeros(0, np.int64)
            go = ~is_lump[pool] | now | (step - arr >= max_delay)
            pull_w = int(w[pull[0]].sum())  # look-ahead lumps read now take room too
            emit_w = int(w[pool[go]].sum()) + pull_w
            if emit_w < budget and pos < n and it < 3 and nlong < dp * m and lump_tok < lump_cap:
                base = cumf[pos - 1] if pos else 0
                newpos = min(int(np.searchsorted(cumf, base + budget - emit_w, side="left")) + 1, n)
                rd = np.arange(pos, newpos, dtype=np.int64)
                rd = rd[~taken[rd]]
                longs = np.flatnonzero(is_long[rd])
                stop = None
                if longs.shape[0] >= dp * m - nlong:  # stop at the long item that fills them
                    stop = longs[dp * m - nlong - 1] + 1
                lump_cum = lump_tok + np.cumsum(np.where(is_lump[rd], sizes[rd], 0))
                full = np.flatnonzero(lump_cum >= lump_cap)
                if full.shape[0] and (stop is None or full[0] + 1 < stop):
                    stop = full[0] + 1  # ... or at the lump that fills the lumps' cap
                if stop is not None:
                    rd = rd[:stop]
                    newpos = int(rd[-1]) + 1
                nlong += int(is_long[rd].sum())
                lump_tok += int(sizes[rd[is_lump[rd]]].sum())
                pool = np.concatenate([pool, rd])
                arr = np.concatenate([arr, np.full(rd.shape[0], step, np.int64)])
                pos = newpos
                continue
            if emit_w > budget and pool.shape[0] > n_old:
                keep_w = int(w[pool[:n_old][go[:n_old]]].sum()) + pull_w
                contrib = np.where(go[n_old:], w[pool[n_old:]], 0)
                cut = int(np.searchsorted(np.cumsum(contrib), budget - keep_w, side="left")) + 1
                if n_old + cut < pool.shape[0]:
                    pos = int(pool[n_old + cut])
                    pool, arr, now = pool[:n_old + cut], arr[:n_old + cut], now[:n_old + cut]
            break
        if pos < n and pull[0].shape[0]:
            sel = (pull[0] >= pos) & ~taken[pull[0]]
            pl_, es_ = pull[0][sel], pull[1][sel]
            taken[pl_] = True
            pool = np.concatenate([pool, pl_])
            arr = np.concatenate([arr, step + es_])
            now = np.concatenate([now, np.ones(pl_.shape[0], bool)])
        pull[0], pull[1] = np.zeros(0, np.int64), np.zeros(0, np.int64)
        # at least one candidate per microbatch: read on past the budget (lumps read so go now)
        short = dp * m - int((~is_lump[pool] | now | (step - arr >= max_delay)).sum())
        if pos < n and short > 0:
            rd = []
            while pos < n and len(rd) < short:
                if not taken[pos]:
                    rd.append(pos)
                pos += 1
            rd = np.asarray(rd, dtype=np.int64)
            pool = np.concatenate([pool, rd])
            arr = np.concatenate([arr, np.full(rd.shape[0], step, np.int64)])
            now = np.concatenate([now, np.ones(rd.shape[0], bool)])
        # pack the step; a step left with more than 0.25% of its capacity empty (heavy items
        # its budget counted that do not fill its microbatches) reads fresh items of the
        # holes' weight (lumps among them wait in the pool) and is packed again, once
        to_tail = False
        for rnd in range(2):
            delay = step - arr
            forced = delay >= max_delay
            emit = forced | ~is_lump[pool] | now
            cand_idx = np.flatnonzero(emit)
            if rnd == 0 and pos >= n and (
                    cand_idx.shape[0] < dp * m
                    or int(sizes[pool[cand_idx]].sum()) <= dp * (m - 1) * capacity):
                to_tail = True  # the stream is read and what is left is no full step
                break
            cand = pool[cand_idx]
            cls = np.where(forced[cand_idx], 0,
                           np.where(is_lump[cand], 1, np.where(delay[cand_idx] > 0, 2, 3)))
            o = np.lexsort((-costs[cand], cls))
            cand, cand_idx = cand[o], cand_idx[o]
            out, counts, idx, rest = pack_exact(cand, sizes, costs, dp, m, capacity, rank_units,
                                                True, pp, lockstep)
            hole = dp * m * capacity - int(sizes[out].sum())
            if not topup or rnd == 1 or pos >= n or hole * 400 <= dp * m * capacity:
                break
            rd, got = [], 0
            nlong = int(is_long[pool].sum())  # at most two steps' worth of long items
            lump_tok = int(sizes[pool[is_lump[pool]]].sum())  # and of lumps' tokens
            while pos < n and got < hole and nlong < 2 * dp * m and lump_tok < 2 * lump_cap:
                if not taken[pos]:
                    rd.append(pos)
                    nlong += int(is_long[pos])
                    if is_lump[pos]:
                        lump_tok += int(sizes[pos])
                    if not is_lump[pos]:
                        got += int(w[pos])
                pos += 1
            rd = np.asarray(rd, dtype=np.int64)
            pool = np.concatenate([pool, rd])
            arr = np.concatenate([arr, np.full(rd.shape[0], step, np.int64)])
            now = np.concatenate([now, np.zeros(rd.shape[0], bool)])
        if to_tail:
            break  # the tail takes what is left
        if (topup and (dp > 1 or not rank_units) and capacity <= 1 << 22
                and hole * 400 > dp * m * capacity):
            placed, b_of, rest = lpt_bins(cand, sizes, costs, dp, m, capacity, rank_units)
            untaken = ~is_lump[pos:] & ~taken[pos:]
            read_ahead = (max_advance > 0 and pos < n and int(w[pos:][untaken].sum())
                          > (max_delay + max_advance + 1) * budget)
            tf = token_first(cand, cls[o], (arr[cand_idx]), placed, b_of, sizes, costs, w, taken,
                             is_lump, pos, max(budget, 1), max_advance, read_ahead, dp, m,
                             capacity, rank_units, lockstep)
            if tf is not None:
                bins, fill, est = tf
                fill = np.asarray(fill, dtype=np.int64)
                taken[fill] = True
                new_idx = np.arange(pool.shape[0], pool.shape[0] + fill.shape[0])
                pool = np.concatenate([pool, fill])
                arr = np.concatenate([arr, step + np.asarray(est, dtype=np.int64)])
                delay = step - arr
                cand = np.concatenate([cand, fill])
                cand_idx = np.concatenate([cand_idx, new_idx])
                placed = [t for t in range(len(bins)) if bins[t] >= 0]
                rest = [t for t in range(len(bins)) if bins[t] < 0]
                out, counts, idx, rest = finish_bins(cand, placed, [bins[t] for t in placed],
                                                     rest, sizes, costs, dp, m, capacity,
                                                     rank_units, True, pp, lockstep)
        builder.emit(out, counts, delay[cand_idx[idx]].astype(np.int32))
        keep = np.ones(pool.shape[0], bool)
        keep[cand_idx[idx]] = False
        pool, arr = pool[keep], arr[keep]
        step += 1
    leftover = finish_tail(builder, pool, (step - arr).astype(np.int32), sizes, costs, dp, m,
                           capacity, tail, rank_units, True, pp, lockstep)
    return builder.finish(leftover)
