"""Plain-Python step assembly for the whole-epoch references: the step packer, the placement of
microbatches on ranks, the epoch's tail and the CSR plan, written from the documented policy of
``packing.steppack`` and ``packing.stream`` (imports nothing from production code).

Item ids index ``sizes`` (int64) and ``costs`` (float64); an order is a list of item ids.
Every float sum is accumulated in the order the policy names, as the kernels do, so that plans
are identical to the last bit, ties included.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from tests.naive import core

TAILS = ("partial", "carry", "drop")


class Plan(NamedTuple):
    """The fields of ``packing.stream.StreamPlan``, in its order."""
    entry_item: np.ndarray
    entry_delay: np.ndarray
    mb_offsets: np.ndarray
    step_mbs: np.ndarray
    leftover: np.ndarray


class Steps:
    """The plan being written: per step, its microbatches (lists of (item, delay))."""

    def __init__(self, dp):
        self.dp = dp
        self.steps = []

    def emit(self, items, counts, delays):
        """``items`` grouped by microbatch in final order, ``counts`` items per microbatch."""
        assert len(counts) % self.dp == 0 and min(counts) > 0
        mbs, k = [], 0
        for c in counts:
            mbs.append([(int(items[k + q]), int(delays[k + q])) for q in range(c)])
            k += c
        self.steps.append(mbs)

    @property
    def step_mbs(self):
        return [len(mbs) // self.dp for mbs in self.steps]

    def pop(self):
        """Take back the last step: its items and delays, in emitted order."""
        entries = [e for mb in self.steps.pop() for e in mb]
        return (np.array([i for i, _ in entries], dtype=np.int64),
                np.array([d for _, d in entries], dtype=np.int32))

    def finish(self, leftover):
        mbs = [mb for step in self.steps for mb in step]
        offsets = [0]
        for mb in mbs:
            offsets.append(offsets[-1] + len(mb))
        return Plan(np.array([i for mb in mbs for i, _ in mb], dtype=np.int64),
                    np.array([d for mb in mbs for _, d in mb], dtype=np.int32),
                    np.array(offsets, dtype=np.int64), np.array(self.step_mbs, dtype=np.int64),
                    np.asarray(leftover, dtype=np.int64))


def check_common(sizes, dp, m, capacity, tail):
    """The input checks every planner makes, with the same messages."""
    if tail not in TAILS:
        raise ValueError(f"tail policy {tail!r} is not one of {TAILS}")
    if dp <= 0 or m <= 0:
        raise ValueError(f"dp ({dp}) and microbatches ({m}) must be positive")
    if len(sizes) < dp:
        raise ValueError(f"{len(sizes)} samples cannot fill {dp} DP ranks: every rank needs at "
                         f"least one sample per step")
    top = max(sizes, default=0)
    if top > capacity:
        i = list(sizes).index(top)  # the first of the longest
        raise ValueError(f"item {i}: size {int(top)} exceeds the capacity {capacity}")


def _cheapest_unit(unit_cost, unit_room, s):
    """The unit a step packer's segment tree returns: a depth-first walk over the units padded
    to a power of two (padding: cost inf, no room), the subtree of the cheaper minimum first (the
    left one on ties), skipping a subtree with no unit of room >= ``s`` or whose minimum is not
    below the best found. So among feasible units of least cost the first one reached wins, which
    is the lowest id unless a cheaper unit without room sits in the other subtree."""
    width = 1
    while width < len(unit_cost):
        width *= 2
    pad = width - len(unit_cost)
    cost = list(unit_cost) + [math.inf] * pad
    room = list(unit_room) + [-1] * pad
    found = [math.inf, -1]

    def visit(lo, hi):
        if max(room[lo:hi]) < s or min(cost[lo:hi]) >= found[0]:
            return
        if hi - lo == 1:
            found[:] = [cost[lo], lo]
            return
        mid = (lo + hi) // 2
        halves = [(lo, mid), (mid, hi)]
        if min(cost[lo:mid]) > min(cost[mid:hi]):
            halves.reverse()
        for a, b in halves:
            visit(a, b)

    visit(0, width)
    return found[1]


def pack_step(order, sizes, costs, n_units, bins_per_unit, capacity):
    """LPT under a token capacity: each item of ``order`` to the cheapest unit with room
    (:func:`_cheapest_unit`), inside it an empty bin first (lowest index), else the bin with the
    least room that still fits (lowest index on ties); -1 when no unit has room. Returns
    ``(bin_of, bin_tokens, bin_cost, bin_count)`` as lists."""
    n_bins = n_units * bins_per_unit
    tokens, bcost, count = [0] * n_bins, [0.0] * n_bins, [0] * n_bins
    unit_cost, unit_room = [0.0] * n_units, [capacity] * n_units
    bin_of = []
    for i in order:
        s = int(sizes[i])
        u = _cheapest_unit(unit_cost, unit_room, s)
        if u < 0:
            bin_of.append(-1)
            continue
        mine = range(u * bins_per_unit, (u + 1) * bins_per_unit)
        empty = [b for b in mine if count[b] == 0]
        if empty:
            b = empty[0]
        else:
            b = min((b for b in mine if capacity - tokens[b] >= s),
                    key=lambda b: (capacity - tokens[b], b))
        bin_of.append(b)
        tokens[b] += s
        bcost[b] += costs[i]
        count[b] += 1
        unit_cost[u] += costs[i]
        unit_room[u] = capacity - min(tokens[q] for q in mine)
    return bin_of, tokens, bcost, count


def fill_empty_bins(bin_of, item_cost, count):
    """Every bin left empty (by id) takes the cheapest item (first on ties) of a bin holding two
    or more."""
    for b in [b for b in range(len(count)) if count[b] == 0]:
        donors = [k for k in range(len(bin_of)) if count[bin_of[k]] >= 2]
        if not donors:
            raise AssertionError(f"{len(bin_of)} items cannot fill {len(count)} microbatches")
        k = min(donors, key=lambda k: (item_cost[k], k))
        count[bin_of[k]] -= 1
        bin_of[k] = b
        count[b] += 1


def bin_positions(bin_cost, dp, m, rank_units, balance, pp=1, lockstep=False):
    """Final position of every bin: ranks in order, a rank's bins by cost descending (id on
    ties), then with ``balance`` and pp > 1 in the 1F1B order; bins of microbatch units go to
    ranks by the balanced (``balance``) or LPT equal-count partition of their costs. With
    ``lockstep`` the bins by cost descending (id on ties) fill the positions in turn, ``dp`` to
    a position, over the ranks left to right at even positions and right to left at odd ones."""
    n_bins = dp * m
    if lockstep:
        pos = [0] * n_bins
        for q, b in enumerate(sorted(range(n_bins), key=lambda b: (-bin_cost[b], b))):
            j, k = divmod(q, dp)
            pos[b] = (k if j % 2 == 0 else dp - 1 - k) * m + j
        return pos
    if rank_units or dp == 1:
        rank = [b // m for b in range(n_bins)]
    elif balance:
        rank = core.balanced_equal(bin_cost, dp).tolist()
    else:
        rank = core.lpt_equal(bin_cost, dp).tolist()
    order = sorted(range(n_bins), key=lambda b: (rank[b], -bin_cost[b], b))
    if balance and pp > 1:
        for r in range(dp):
            mine = order[r * m:(r + 1) * m]
            run = core.pipeline_order([bin_cost[b] for b in mine], pp)
            order[r * m:(r + 1) * m] = [mine[j] for j in run]
    pos = [0] * n_bins
    for p, b in enumerate(order):
        pos[b] = p
    return pos


def _best_exchange(sz, cs, b_of, tokens, count, m, capacity, top, U, V, cu, cv):
    """The best exchange of :func:`rank_swaps` between ranks U and V: (what, cost moved), or
    None."""
    nc = len(b_of)
    gap = cu - cv
    ua = [t for t in range(nc) if b_of[t] // m == U]
    vt = sorted([t for t in range(nc) if b_of[t] // m == V], key=lambda t: (cs[t], t))
    best, pick = cu, None

    def consider(d, what):
        nonlocal best, pick
        nm = max(cu - d, cv + d)
        if nm < best:
            best, pick = nm, (what, d)

    for ta in ua:
        A = b_of[ta]
        if count[A] >= 2 and float(cs[ta]) < gap:
            for B in range(V * m, V * m + m):
                if capacity - tokens[B] >= int(sz[ta]):
                    consider(float(cs[ta]), ("move", ta, B))
    for ta in ua:
        A = b_of[ta]
        sa, ca = int(sz[ta]), float(cs[ta])
        room_a = capacity - tokens[A] + sa
        for tb in vt:
            B = b_of[tb]
            sb, cb = int(sz[tb]), float(cs[tb])
            if ca - gap < cb < ca and sb <= room_a and sa <= capacity - tokens[B] + sb:
                consider(ca - cb, ("swap", ta, tb))
    by_cost = lambda ts: sorted(ts, key=lambda t: (-cs[t], t))[:top]  # noqa: E731
    for ta in by_cost(ua):
        A = b_of[ta]
        sa, ca = int(sz[ta]), float(cs[ta])
        room_a = capacity - tokens[A] + sa
        for tb in by_cost(vt):
            B = b_of[tb]
            sb, cb = int(sz[tb]), float(cs[tb])
            if cb >= ca:
                continue
            lo_c, hi_c = max(sa - (capacity - tokens[B] + sb), 1), room_a - sb
            for tc in vt:
                if tc == tb or b_of[tc] != B or not lo_c <= int(sz[tc]) <= hi_c:
                    continue
                d = (ca - cb) - float(cs[tc])
                if d > 0.0:
                    consider(d, ("two", ta, tb, tc))
    return pick


def rank_swaps(sz, cs, b_of, dp, m, capacity, tol=5e-3, rounds=None, top=8, tries=8):
    """Exchanges between whole ranks of a packed step (rank r holds bins r*m..r*m+m-1), the
    policy of ``packing.rank_swap``: while the costliest rank U (lowest index on ties) is more
    than ``tol`` above the step's lower bound (max(total / dp, the costliest item)), the
    exchange with a cheaper rank V whose new max(cost U, cost V) is smallest and below U's cost,
    the first found on ties, V the first of the ``tries`` cheapest ranks by (cost, index) that
    has one, looked for in this order:

    1. moves: a of U (item order) into a bin of V with room (by bin), a's bin keeping an item;
    2. swaps: a of U (item order) for b of V (by (cost, item order)), both bins within capacity;
    3. two-for-one: a among U's ``top`` costliest items, b among V's (both by (cost descending,
       item order)), cb < ca, and c of b's bin (V's items by (cost, item order)): b and c into
       a's bin, a into theirs, both within capacity.

    ``sz``/``cs``: sizes and costs of the placed items in item order; ``b_of`` (their bins) is
    changed in place. Returns the number of exchanges."""
    nc = len(b_of)
    rounds = 2 * dp + 8 if rounds is None else rounds
    tokens = [0] * (dp * m)
    count = [0] * (dp * m)
    for t in range(nc):
        tokens[b_of[t]] += int(sz[t])
        count[b_of[t]] += 1
    uc = [0.0] * dp
    for t in range(nc):
        uc[b_of[t] // m] += cs[t]
    total = 0.0
    for u in range(dp):
        total += uc[u]
    lb = max(total / dp, max([0.0] + [float(c) for c in cs]))
    made = 0
    for _ in range(rounds):
        U = min(range(dp), key=lambda u: (-uc[u], u))
        cu = uc[U]
        if cu <= lb * (1.0 + tol):
            break
        pick = None
        for V in sorted(range(dp), key=lambda u: (uc[u], u))[:tries]:
            cv = uc[V]
            if cv >= cu:
                break
            pick = _best_exchange(sz, cs, b_of, tokens, count, m, capacity, top, U, V, cu, cv)
            if pick is not None:
                break
        if pick is None:
            break
        what, d = pick
        ta = what[1]
        A = b_of[ta]
        if what[0] == "move":
            moved = [(ta, what[2])]
        else:
            moved = [(ta, b_of[what[2]])] + [(t, A) for t in what[2:]]
        for t, dst in moved:
            src = b_of[t]
            tokens[src] -= int(sz[t])
            count[src] -= 1
            tokens[dst] += int(sz[t])
            count[dst] += 1
            b_of[t] = dst
        uc[U] = cu - d
        uc[V] = cv + d
        made += 1
    return made


def pack_exact(items, sizes, costs, dp, m, capacity, rank_units, balance, pp=1,
               lockstep=False):
    """``items`` (priority order) into exactly dp*m microbatches. Returns (emitted items in final
    order, items per microbatch, index into ``items`` of each emitted one, index of the ones that
    did not fit). With ``balance``, whole-rank units and dp > 1 the step goes through
    :func:`rank_swaps` before its microbatches get their positions (every step: the main loop's
    and the tail's)."""
    placed, b_of, rest = lpt_bins(items, sizes, costs, dp, m, capacity, rank_units)
    return finish_bins(items, placed, b_of, rest, sizes, costs, dp, m, capacity, rank_units,
                       balance, pp, lockstep)


def lpt_bins(items, sizes, costs, dp, m, capacity, rank_units):
    """The LPT packing of :func:`pack_exact` before its exchanges: (indices into ``items`` of
    the placed ones, their bins, indices of the others); every bin holds an item."""
    n_units, bpu = (dp, m) if rank_units else (dp * m, 1)
    bin_of, _, _, count = pack_step(items, sizes, costs, n_units, bpu, capacity)
    placed = [k for k, b in enumerate(bin_of) if b >= 0]
    rest = [k for k, b in enumerate(bin_of) if b < 0]
    b_of = [bin_of[k] for k in placed]
    fill_empty_bins(b_of, [costs[items[k]] for k in placed], count)
    return placed, b_of, rest


def finish_bins(items, placed, b_of, rest, sizes, costs, dp, m, capacity, rank_units, balance,
                pp=1, lockstep=False):
    """The rest of :func:`pack_exact` from a packing (``placed``: indices into ``items``, ``b_of``
    their bins, ranks' bins consecutive): the exchanges, then the microbatch positions."""
    b_of = list(b_of)
    if balance and rank_units and dp > 1:
        rank_swaps([sizes[items[k]] for k in placed], [costs[items[k]] for k in placed], b_of,
                   dp, m, capacity)
    bin_cost = [0.0] * (dp * m)
    for k, b in zip(placed, b_of):
        bin_cost[b] += costs[items[k]]
    pos = bin_positions(bin_cost, dp, m, rank_units, balance, pp, lockstep)
    final = sorted(range(len(placed)), key=lambda q: pos[b_of[q]])  # stable: placement order
    counts = [0] * (dp * m)
    for b in b_of:
        counts[pos[b]] += 1
    idx = np.array([placed[q] for q in final], dtype=np.int64)
    return (np.asarray(items, dtype=np.int64)[idx], np.array(counts, dtype=np.int64), idx,
            np.array(rest, dtype=np.int64))


def step_times(out, counts, costs, dp, m, rank_units, lockstep=False):
    """The measures a step is judged on: slowest rank sum; lockstep time (microbatch units);
    with ``lockstep`` the lockstep time alone."""
    c = np.add.reduceat(costs[out], np.concatenate(([0], np.cumsum(counts)[:-1]))).reshape(dp, m)
    if lockstep:
        return [float(c.max(axis=0).sum())]
    t = [float(c.sum(axis=1).max())]
    if not rank_units:
        t.append(float(c.max(axis=0).sum()))
    return t


def pack_fewest(items, sizes, costs, dp, m_hi, capacity, rank_units, balance, pp=1,
                lockstep=False):
    """The fewest microbatches per rank (from the token lower bound up to ``m_hi``) that take
    all of ``items`` and, with ``balance``, make a step no slower by any measure of
    :func:`step_times` than ``m_hi`` does; ``m_hi`` (with what does not fit) otherwise.
    Returns (mm, out, counts, idx, rest)."""
    tokens = sum(int(sizes[i]) for i in items)
    full = pack_exact(items, sizes, costs, dp, m_hi, capacity, rank_units, balance, pp,
                      lockstep)
    limit = [t * (1 + 1e-9) for t in step_times(full[0], full[1], costs, dp, m_hi, rank_units,
                                                 lockstep)]
    for mm in range(max(1, min(-(-tokens // (dp * capacity)), m_hi)), m_hi):
        got = pack_exact(items, sizes, costs, dp, mm, capacity, rank_units, balance, pp,
                         lockstep)
        if len(got[3]) == 0 and (not balance or all(
                t <= u for t, u in zip(step_times(got[0], got[1], costs, dp, mm, rank_units,
                                                  lockstep), limit))):
            return (mm,) + got
    return (m_hi,) + full


def _by_delay_then_cost(pool, delay, costs):
    """Pool order for the tail: longest waiting first, then costliest, then pool order."""
    o = sorted(range(len(pool)), key=lambda k: (-delay[k], -costs[pool[k]], k))
    return pool[o], delay[o]


def _place_in_room(steps, pool, delay, sizes, costs, capacity, rank_units):
    """The few items no step can take (fewer than the ranks) go into emitted microbatches with
    room: the latest step with room, there the least-cost rank's (or the cheapest) microbatch
    with room, first on ties; delay minus the steps gone back. Without room anywhere, the
    cheapest items of microbatches holding two or more (latest step first; delay plus the
    steps moved on) join them in a final step of one microbatch per rank. All or nothing."""
    back = max(0, len(steps.steps) - 64)  # the last 64 steps (packing.step_assembly.ROOM_STEPS)
    keep = steps.steps[:back]
    new = [[list(mb) for mb in mbs] for mbs in steps.steps[back:]]
    n, dp = len(new), steps.dp
    ok = True
    for it, d in zip(pool.tolist(), delay.tolist()):
        placed = False
        for t in reversed(range(n)):
            mbs = new[t]
            per = len(mbs) // dp
            fits = [b for b, mb in enumerate(mbs)
                    if sum(int(sizes[i]) for i, _ in mb) + int(sizes[it]) <= capacity]
            if not fits:
                continue

            def key(b):
                if rank_units:
                    r = b // per
                    return sum(float(costs[i]) for mb in mbs[r * per:(r + 1) * per] for i, _ in mb)
                return sum(float(costs[i]) for i, _ in mbs[b])
            b = min(fits, key=lambda b: (key(b), b))
            mbs[b].append((it, d - (n - t)))
            placed = True
            break
        if not placed:
            ok = False
            break
    if ok:
        steps.steps = keep + new
        return True
    new = [[list(mb) for mb in mbs] for mbs in steps.steps[back:]]
    final = [[(it, d)] for it, d in zip(pool.tolist(), delay.tolist())]
    for t in reversed(range(n)):
        while len(final) < dp:
            donors = [(float(costs[e[0]]), b, q) for b, mb in enumerate(new[t]) if len(mb) >= 2
                      for q, e in enumerate(mb)]
            if not donors:
                break
            _, b, q = min(donors)
            it, d = new[t][b].pop(q)
            final.append([(it, d + (n - t))])
        if len(final) == dp:
            steps.steps = keep + new + [final]
            return True
    return False


def finish_tail(steps, pool, delay, sizes, costs, dp, m, capacity, tail, rank_units, balance,
                pp=1, lockstep=False):
    """The items left when the stream is read: steps of the fewest microbatches per rank they
    need (at most m); fewer items than ranks either re-plan the previous step with them (all in
    it if they fit, else the dp cheapest held back for one more step of one microbatch per rank)
    with tail='partial', or are returned as leftover. ``delay`` orders them (oldest first, one
    more each round held); every item is recorded with the step it goes in minus the step it
    arrived at (``len(steps.step_mbs) - delay`` at the start, a popped step's index minus its
    recorded delay)."""
    pool = np.asarray(pool, dtype=np.int64)
    delay = np.asarray(delay, dtype=np.int32)
    arrived = {int(i): len(steps.step_mbs) - int(d) for i, d in zip(pool, delay)}

    def emit(out, counts):
        now = len(steps.step_mbs)
        steps.emit(out, counts, np.array([now - arrived[int(i)] for i in out], np.int32))

    merges = 0
    while len(pool):
        mm = min(m, len(pool) // dp)
        if mm > 0:
            pool, delay = _by_delay_then_cost(pool, delay, costs)
            _, out, counts, idx, rest = pack_fewest(pool, sizes, costs, dp, mm, capacity,
                                                    rank_units, balance, pp, lockstep)
            emit(out, counts)
            pool, delay = pool[rest], delay[rest] + 1
            continue
        if tail != "partial":
            return pool
        if not steps.steps or merges > 4:
            true = np.array([len(steps.step_mbs) - arrived[int(i)] for i in pool], np.int32)
            if _place_in_room(steps, pool, true, sizes, costs, capacity, rank_units):
                return np.zeros(0, np.int64)
            raise ValueError(f"{len(pool)} items cannot be spread over {dp} DP ranks: every rank "
                             f"needs at least one item per step; use tail='carry' or 'drop'")
        merges += 1
        prev_m = 0
        while True:  # too few left for the held-back step: the step before joins them too
            prev_m = max(prev_m, steps.step_mbs[-1])
            prev, prev_delay = steps.pop()
            for i, d in zip(prev, prev_delay):
                arrived[int(i)] = len(steps.step_mbs) - int(d)
            pool, delay = _by_delay_then_cost(np.concatenate([prev, pool]),
                                              np.concatenate([prev_delay, delay]), costs)
            out, counts, idx, rest = pack_exact(pool, sizes, costs, dp, prev_m, capacity,
                                                rank_units, balance, pp, lockstep)
            if len(rest) == 0:
                emit(out, counts)
                return np.zeros(0, np.int64)
            held = sorted(range(len(pool)), key=lambda k: (costs[pool[k]], k))[:dp]
            body = [k for k in range(len(pool)) if k not in held]
            held = sorted(held)
            m1 = min(prev_m, len(body) // dp)
            if m1 > 0 or not steps.steps:
                break
        if m1 == 0:
            raise ValueError(f"the last {len(pool)} items fit neither one step of {dp} ranks x "
                             f"{prev_m} microbatches nor two steps; use tail='carry' or 'drop'")
        out, counts, idx, rest = pack_exact(pool[body], sizes, costs, dp, m1, capacity,
                                            rank_units, balance, pp, lockstep)
        emit(out, counts)
        pool = np.concatenate([pool[body][rest], pool[held]])
        delay = np.concatenate([delay[body][rest], delay[held]]) + 1
    return np.zeros(0, np.int64)
