"""Step assembly shared by the whole-epoch planners of :mod:`packing.stream`: the CSR plan
layout (:class:`StreamPlan`, built step by step by :class:`_Builder` into preallocated arrays),
packing one step's items into exactly ``dp x m`` microbatches or the fewest that take them,
ordering microbatches rank-major, and finishing the tail of an epoch (the last, short step).
The layout itself is documented in :mod:`packing.stream`."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .partition import balanced_equal, lpt_equal
from .pipeline import pipeline_order
from .rank_swap import rank_swaps
from .steppack import pack_step

TAILS = ("partial", "carry", "drop")


class StreamPlan(NamedTuple):
    entry_item: np.ndarray
    entry_delay: np.ndarray
    mb_offsets: np.ndarray
    step_mbs: np.ndarray
    leftover: np.ndarray


class _Builder:
    """Appends steps into preallocated arrays (no per-step Python lists of entries)."""

    def __init__(self, n_items: int, dp: int):
        self.entry_item = np.empty(n_items, dtype=np.int64)
        self.entry_delay = np.empty(n_items, dtype=np.int32)
        self.n = 0
        self.dp = dp
        self.mb_counts: list[np.ndarray] = []
        self.step_mbs: list[int] = []

    def emit(self, items: np.ndarray, mb_counts: np.ndarray, delays: np.ndarray) -> None:
        """``items`` grouped by microbatch in final (rank-major) order, ``mb_counts`` per
        microbatch (length dp * m)."""
        k = items.shape[0]
        assert mb_counts.shape[0] % self.dp == 0 and (mb_counts > 0).all()
        self.entry_item[self.n:self.n + k] = items
        self.entry_delay[self.n:self.n + k] = delays
        self.n += k
        self.mb_counts.append(np.asarray(mb_counts, dtype=np.int64))
        self.step_mbs.append(mb_counts.shape[0] // self.dp)

    def pop(self):
        """Remove the last step; returns its items and delays."""
        counts = self.mb_counts.pop()
        self.step_mbs.pop()
        k = int(counts.sum())
        self.n -= k
        return self.entry_item[self.n:self.n + k].copy(), self.entry_delay[self.n:self.n + k].copy()

    def finish(self, leftover: np.ndarray) -> StreamPlan:
        counts = np.concatenate(self.mb_counts) if self.mb_counts else np.zeros(0, np.int64)
        offsets = np.zeros(counts.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return StreamPlan(self.entry_item[:self.n], self.entry_delay[:self.n], offsets,
                          np.asarray(self.step_mbs, dtype=np.int64),
                          np.asarray(leftover, dtype=np.int64))


# --------------------------------------------------------------------------------------------
# shared step assembly


def _fill_empty_bins(bin_of, costs_k, bin_count):
    """Give every empty bin one item: the cheapest item of any bin holding two or more. Only
    needed when few items remain or one huge item made a rank skip its other microbatches."""
    empty = np.flatnonzero(bin_count == 0)
    for b in empty:
        donors = bin_count[bin_of] >= 2
        if not donors.any():  # callers guarantee at least one item per microbatch
            raise AssertionError(f"{bin_of.shape[0]} items cannot fill {bin_count.shape[0]} "
                                 f"microbatches")
        cand = np.flatnonzero(donors)
        k = cand[np.argmin(costs_k[cand])]
        bin_count[bin_of[k]] -= 1
        bin_of[k] = b
        bin_count[b] += 1


def _order_bins(bin_cost, dp: int, m: int, rank_units: bool, balance: bool,
                pp: int = 1, lockstep: bool = False) -> np.ndarray:
    """Final position of every bin: rank-major, microbatches of a rank by cost, descending
    (then, with ``balance`` and pp > 1, in the 1F1B-friendly order of
    :func:`packing.pipeline.pipeline_order`). With microbatch units the bins are first spread
    over ranks (equal counts, balanced cost); with ``lockstep`` (the ranks wait for each other
    after every microbatch) they go by cost descending, ``dp`` to a position, over the ranks in
    snake order (``balanced_step._bin_positions``: the least lockstep time)."""
    n_bins = dp * m
    if lockstep:
        ob = np.argsort(-bin_cost, kind="stable")
        q = np.arange(n_bins)
        j, k = q // dp, q % dp
        pos = np.empty(n_bins, dtype=np.int64)
        pos[ob] = np.where(j % 2 == 0, k, dp - 1 - k) * m + j
        return pos
    if rank_units or dp == 1:
        rank = np.arange(n_bins) // m
    elif balance:
        rank = balanced_equal(bin_cost, dp)
    else:
        rank = lpt_equal(bin_cost, dp)
    order = np.lexsort((-bin_cost, rank))  # by rank, then cost descending
    if balance and pp > 1:
        for r in range(dp):
            sl = order[r * m:(r + 1) * m]
            order[r * m:(r + 1) * m] = sl[pipeline_order(bin_cost[sl], pp)]
    pos = np.empty(n_bins, dtype=np.int64)
    pos[order] = np.arange(n_bins)
    return pos


def _assemble(items, bin_of, n_bins, pos_of_bin):
    """Sort placed items by final microbatch position; returns (items, mb_counts)."""
    key = pos_of_bin[bin_of]
    o = np.argsort(key, kind="stable")
    return items[o], np.bincount(key, minlength=n_bins), o


def _pack_exact(items, sizes, costs, dp, m, capacity, rank_units, balance, pp=1,
                lockstep=False):
    """Pack ``items`` (priority order) into exactly dp*m microbatches. Returns
    (emitted items in final order, mb_counts, index into ``items`` of each emitted one,
    index of the ones that did not fit)."""
    if rank_units:
        n_units, bpu = dp, m
    else:
        n_units, bpu = dp * m, 1
    bin_of, _, bin_cost, bin_count = pack_step(items, sizes, costs, n_units, bpu, capacity)
    placed = np.flatnonzero(bin_of >= 0)
    rest = np.flatnonzero(bin_of < 0)
    b = bin_of[placed]
    if (bin_count == 0).any():
        _fill_empty_bins(b, costs[items[placed]], bin_count)
        bin_cost = np.bincount(b, weights=costs[items[placed]], minlength=dp * m)
    if balance and rank_units and dp > 1:
        # the exchange pass of the main loop (packing.rank_swap) on this step too: a tail or a
        # batch planned alone is balanced like every other step
        b = np.ascontiguousarray(b, dtype=np.int64)
        tokens = np.bincount(b, weights=sizes[items[placed]], minlength=dp * m).astype(np.int64)
        count = np.bincount(b, minlength=dp * m).astype(np.int64)
        if rank_swaps(items[placed], sizes, costs, b, tokens, count, dp, m, capacity) > 0:
            bin_cost = np.bincount(b, weights=costs[items[placed]], minlength=dp * m)
    pos = _order_bins(bin_cost, dp, m, rank_units, balance, pp, lockstep)
    out, counts, o = _assemble(items[placed], b, dp * m, pos)
    return out, counts, placed[o], rest


def _step_times(out, counts, costs, dp, m, rank_units, lockstep=False):
    """What a step of ``dp x m`` microbatches (``out``/``counts`` as :func:`_pack_exact` returns
    them) costs, by every measure a plan is judged on: the slowest rank's sum; with microbatch
    units also the lockstep time (the sum over microbatch positions of the slowest rank there);
    with ``lockstep`` (the ranks meet after every microbatch, so rank sums do not count) that
    time alone. With pp > 1 more microbatches shorten the 1F1B bubble: not balance, not
    compared here."""
    c = np.add.reduceat(costs[out], np.concatenate(([0], np.cumsum(counts)[:-1]))).reshape(dp, m)
    lock = float(c.max(axis=0).sum())
    if lockstep:
        return [lock]
    t = [float(c.sum(axis=1).max())]
    if not rank_units:
        t.append(lock)
    return t


def _pack_fewest(items, sizes, costs, dp, m_hi, capacity, rank_units, balance, pp=1,
                 lockstep=False):
    """Pack ``items`` (priority order) into the fewest microbatches per rank, at most ``m_hi``,
    that take all of them (from the token lower bound up), so a short final step gets only the
    microbatches it needs; when even ``m_hi`` cannot take all, ``m_hi`` and the rest as
    :func:`_pack_exact` returns it. With ``balance`` a count below ``m_hi`` is kept only where
    the step is no slower by any measure of :func:`_step_times` than with ``m_hi`` (a step
    packed to the brim leaves no room to balance cost: fewer microbatches must never cost
    balance). Returns ``(mm, out, counts, idx, rest)``."""
    need = -(-int(sizes[items].sum()) // (dp * capacity))
    full = _pack_exact(items, sizes, costs, dp, m_hi, capacity, rank_units, balance, pp,
                       lockstep)
    limit = None
    if balance:
        limit = [t * (1 + 1e-9) for t in _step_times(full[0], full[1], costs, dp, m_hi,
                                                      rank_units, lockstep)]
    for mm in range(max(1, min(need, m_hi)), m_hi):
        out, counts, idx, rest = _pack_exact(items, sizes, costs, dp, mm, capacity, rank_units,
                                             balance, pp, lockstep)
        if rest.shape[0] == 0:
            if limit is None or all(t <= u for t, u in zip(
                    _step_times(out, counts, costs, dp, mm, rank_units, lockstep), limit)):
                return mm, out, counts, idx, rest
    return (m_hi,) + full


def _finish_tail(builder, pool, pool_delay, sizes, costs, dp, m, capacity, tail, rank_units,
                 balance, pp=1, lockstep=False):
    """Emit the items left when the stream is exhausted; every rank keeps the same number of
    microbatches, only as many as the items need (:func:`_pack_fewest`). Fewer items than DP
    ranks are merged into the previous step (tail='partial') or returned as leftover ('carry',
    'drop').

    Two counts go with every item: ``pool_delay``, its priority (the oldest first; it goes up
    by one each round it is held), and its arrival step, from which the delay it is recorded
    with is counted: the step it goes in minus its arrival. A re-planned step takes the tail
    back to an earlier step, so a round is not always a step waited (counting rounds recorded
    delays of 5-7 for documents that waited at most 4 steps)."""
    guard = 0
    arr = len(builder.step_mbs) - pool_delay.astype(np.int64)  # arrival steps

    def emit(out, counts, item_arr):
        builder.emit(out, counts, (len(builder.step_mbs) - item_arr).astype(np.int32))

    while pool.shape[0]:
        mm = min(m, pool.shape[0] // dp)
        if mm == 0:
            if tail != "partial":
                return pool
            if not builder.step_mbs or guard > 4:
                # the steps around cannot be re-planned into whole steps (the items near the
                # end go alone, an odd count of them): put the few left into microbatches of
                # the emitted steps that have room (issue 26 item 3; this raised before)
                true_delay = (len(builder.step_mbs) - arr).astype(np.int32)
                if _place_in_room(builder, pool, true_delay, sizes, costs, capacity, rank_units):
                    return np.zeros(0, np.int64)
                raise ValueError(
                    f"{pool.shape[0]} items cannot be spread over {dp} DP ranks: every rank "
                    f"needs at least one item per step; use tail='carry' or 'drop'"
                )
            guard += 1
            # re-plan the previous step together with the tail: all in that step if it fits,
            # else keep back the dp cheapest items for a final step of one microbatch per rank;
            # when what is left is too few for that step, the step before joins them too
            prev_m = 0
            while True:
                prev_m = max(prev_m, builder.step_mbs[-1])
                prev, prev_delay = builder.pop()
                pool = np.concatenate([prev, pool])
                pool_delay = np.concatenate([prev_delay, pool_delay])
                arr = np.concatenate([len(builder.step_mbs) - prev_delay.astype(np.int64), arr])
                order = np.lexsort((-costs[pool], -pool_delay))
                pool, pool_delay, arr = pool[order], pool_delay[order], arr[order]
                out, counts, idx, rest = _pack_exact(pool, sizes, costs, dp, prev_m, capacity,
                                                     rank_units, balance, pp, lockstep)
                if rest.shape[0] == 0:
                    emit(out, counts, arr[idx])
                    return np.zeros(0, np.int64)
                cheap = np.argsort(costs[pool], kind="stable")[:dp]
                keep = np.ones(pool.shape[0], bool)
                keep[cheap] = False
                body, body_delay, body_arr = pool[keep], pool_delay[keep], arr[keep]
                m1 = min(prev_m, body.shape[0] // dp)
                if m1 > 0 or not builder.step_mbs:
                    break
            if m1 == 0:
                raise ValueError(
                    f"the last {pool.shape[0]} items fit neither one step of {dp} ranks x "
                    f"{prev_m} microbatches nor two steps; use tail='carry' or 'drop'")
            out, counts, idx, rest = _pack_exact(body, sizes, costs, dp, m1, capacity,
                                                 rank_units, balance, pp, lockstep)
            emit(out, counts, body_arr[idx])
            pool = np.concatenate([body[rest], pool[~keep]])
            pool_delay = np.concatenate([body_delay[rest], pool_delay[~keep]]) + 1
            arr = np.concatenate([body_arr[rest], arr[~keep]])
            continue
        order = np.lexsort((-costs[pool], -pool_delay))
        pool, pool_delay, arr = pool[order], pool_delay[order], arr[order]
        _, out, counts, idx, rest = _pack_fewest(pool, sizes, costs, dp, mm, capacity,
                                                 rank_units, balance, pp, lockstep)
        emit(out, counts, arr[idx])
        pool, pool_delay, arr = pool[rest], pool_delay[rest] + 1, arr[rest]
    return np.zeros(0, np.int64)


#: how many emitted steps back the last resort of a 'partial' tail looks (:func:`_place_in_room`)
ROOM_STEPS = 64


def _emitted_steps(builder, last: int) -> list:
    """The builder's last ``last`` steps as lists (per step, per microbatch) of
    ``[item, delay]``."""
    out = []
    k = builder.n - sum(int(c.sum()) for c in builder.mb_counts[-last:]) if last else builder.n
    for counts in builder.mb_counts[len(builder.mb_counts) - last:]:
        mbs = []
        for c in counts.tolist():
            mbs.append([[int(builder.entry_item[k + q]), int(builder.entry_delay[k + q])]
                        for q in range(c)])
            k += c
        out.append(mbs)
    return out


def _reemit(builder, steps, last: int) -> None:
    """Replace the builder's last ``last`` steps by ``steps``."""
    for _ in range(last):
        builder.pop()
    for mbs in steps:
        flat = [e for mb in mbs for e in mb]
        builder.emit(np.array([i for i, _ in flat], np.int64),
                     np.array([len(mb) for mb in mbs], np.int64),
                     np.array([d for _, d in flat], np.int32))


def _place_in_room(builder, pool, pool_delay, sizes, costs, capacity, rank_units) -> bool:
    """Last resort of a 'partial' tail whose last items go alone and are fewer than the ranks
    (issue 26 item 3; this raised before): put every item of ``pool`` (pool order) into a
    microbatch of an emitted step (of the last :data:`ROOM_STEPS`) with room for it, the latest
    step with room, there the
    microbatch of the rank with the least cost (microbatch units: the cheapest microbatch),
    the first on ties; its delay minus the steps it went back. Else, when no microbatch has
    room, take the cheapest item of a microbatch holding two or more (latest step first, its
    delay plus the steps it moves on) until the pool fills one final step of one microbatch
    per rank. All or nothing: False (the builder untouched) when neither can."""
    n, dp = min(ROOM_STEPS, len(builder.step_mbs)), builder.dp
    steps = _emitted_steps(builder, n)
    placed = True
    for it, d in zip(pool.tolist(), pool_delay.tolist()):
        for t in range(n - 1, -1, -1):
            mbs = steps[t]
            load = np.array([sum(int(sizes[i]) for i, _ in mb) for mb in mbs])
            room = np.flatnonzero(load + int(sizes[it]) <= capacity)
            if room.shape[0] == 0:
                continue
            cost = np.array([sum(float(costs[i]) for i, _ in mb) for mb in mbs])
            if rank_units:
                per = len(mbs) // dp
                key = np.add.reduceat(cost, np.arange(0, len(mbs), per))[room // per]
            else:
                key = cost[room]
            mbs[int(room[np.argmin(key)])].append([it, d - (n - t)])
            break
        else:
            placed = False
            break
    if placed:
        _reemit(builder, steps, n)
        return True
    steps = _emitted_steps(builder, n)
    final = [[[it, d]] for it, d in zip(pool.tolist(), pool_delay.tolist())]
    for t in range(n - 1, -1, -1):
        while len(final) < dp:
            donors = [(float(costs[e[0]]), b, q) for b, mb in enumerate(steps[t])
                      if len(mb) >= 2 for q, e in enumerate(mb)]
            if not donors:
                break
            _, b, q = min(donors)
            it, d = steps[t][b].pop(q)
            final.append([[it, d + (n - t)]])
        if len(final) == dp:
            _reemit(builder, steps + [final], n)
            return True
    return False


def _check_common(sizes, dp, m, capacity, tail):
    if tail not in TAILS:
        raise ValueError(f"tail policy {tail!r} is not one of {TAILS}")
    if dp <= 0 or m <= 0:
        raise ValueError(f"dp ({dp}) and microbatches ({m}) must be positive")
    if sizes.shape[0] < dp:
        raise ValueError(
            f"{sizes.shape[0]} samples cannot fill {dp} DP ranks: every rank needs at least one "
            f"sample per step"
        )
    if sizes.shape[0] and int(sizes.max()) > capacity:
        i = int(np.argmax(sizes))
        raise ValueError(f"item {i}: size {int(sizes[i])} exceeds the capacity {capacity}")
