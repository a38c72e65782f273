"""Whole-epoch planners: turn a stream of items (in training order) into steps of
``dp x microbatches`` packed microbatches. One function per strategy, arrays in, arrays out.

Every planner returns a :class:`StreamPlan` in the same CSR layout:

* ``entry_item`` int64[E]: item ids (positions in the stream) grouped by microbatch;
* ``entry_delay`` int32[E]: steps each entry waited after the planner first read it;
* ``mb_offsets`` int64[n_mb + 1]: entries of microbatch ``j`` are ``entry_item[mb_offsets[j]:
  mb_offsets[j + 1]]``;
* ``step_mbs`` int64[n_steps]: microbatches per DP rank in each step. Microbatches are stored
  step by step, rank-major: step ``s`` rank ``r`` slot ``j`` is microbatch
  ``step_start[s] + r * step_mbs[s] + j`` with ``step_start = cumsum(dp * step_mbs)``;
* ``leftover`` int64[L]: items not emitted (only with ``tail="carry"`` or ``"drop"``).

Every microbatch holds at least one item and at most ``capacity`` tokens; every DP rank has the
same number of microbatches in a step; every item appears exactly once in ``entry_item`` or
``leftover``.

A step takes at most its ``budget`` (tokens, or items with ``max_items``/``weights``) plus the
item that crosses it, but never fewer items than it has microbatches: a step whose budget holds
fewer items takes one per microbatch. The last step (what is left when the stream ends) gets
only as many microbatches per rank as it needs (:func:`_pack_fewest`), the same on every rank.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .binpack import _ffd, _next_fit_steps, _split_runs
from .partition import balanced_equal, kk, kk_equal, lpt_equal
from .pipeline import pipeline_order
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
                pp: int = 1) -> np.ndarray:
    """Final position of every bin: rank-major, microbatches of a rank by cost, descending
    (then, with ``balance`` and pp > 1, in the 1F1B-friendly order of
    :func:`packing.pipeline.pipeline_order`). With microbatch units the bins are first spread
    over ranks (equal counts, balanced cost)."""
    n_bins = dp * m
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


def _pack_exact(items, sizes, costs, dp, m, capacity, rank_units, balance, pp=1):
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
    pos = _order_bins(bin_cost, dp, m, rank_units, balance, pp)
    out, counts, o = _assemble(items[placed], b, dp * m, pos)
    return out, counts, placed[o], rest


def _pack_fewest(items, sizes, costs, dp, m_hi, capacity, rank_units, balance, pp=1):
    """Pack ``items`` (priority order) into the fewest microbatches per rank, at most ``m_hi``,
    that take all of them (from the token lower bound up), so a short final step gets only the
    microbatches it needs; when even ``m_hi`` cannot take all, ``m_hi`` and the rest as
    :func:`_pack_exact` returns it. Returns ``(mm, out, counts, idx, rest)``."""
    need = -(-int(sizes[items].sum()) // (dp * capacity))
    for mm in range(max(1, min(need, m_hi)), m_hi):
        out, counts, idx, rest = _pack_exact(items, sizes, costs, dp, mm, capacity, rank_units,
                                             balance, pp)
        if rest.shape[0] == 0:
            return mm, out, counts, idx, rest
    return (m_hi,) + _pack_exact(items, sizes, costs, dp, m_hi, capacity, rank_units, balance,
                                 pp)


def _finish_tail(builder, pool, pool_delay, sizes, costs, dp, m, capacity, tail, rank_units,
                 balance, pp=1):
    """Emit the items left when the stream is exhausted; every rank keeps the same number of
    microbatches, only as many as the items need (:func:`_pack_fewest`). Fewer items than DP
    ranks are merged into the previous step (tail='partial') or returned as leftover ('carry',
    'drop')."""
    guard = 0
    while pool.shape[0]:
        mm = min(m, pool.shape[0] // dp)
        if mm == 0:
            if tail != "partial":
                return pool
            if not builder.step_mbs or guard > 4:
                raise ValueError(
                    f"{pool.shape[0]} items cannot be spread over {dp} DP ranks: every rank "
                    f"needs at least one item per step; use tail='carry' or 'drop'"
                )
            guard += 1
            # re-plan the previous step together with the tail: all in that step if it fits,
            # else keep back the dp cheapest items for a final step of one microbatch per rank
            prev_m = builder.step_mbs[-1]
            prev, prev_delay = builder.pop()
            pool = np.concatenate([prev, pool])
            pool_delay = np.concatenate([prev_delay, pool_delay])
            order = np.lexsort((-costs[pool], -pool_delay))
            pool, pool_delay = pool[order], pool_delay[order]
            out, counts, idx, rest = _pack_exact(pool, sizes, costs, dp, prev_m, capacity,
                                                 rank_units, balance, pp)
            if rest.shape[0] == 0:
                builder.emit(out, counts, pool_delay[idx])
                return np.zeros(0, np.int64)
            cheap = np.argsort(costs[pool], kind="stable")[:dp]
            keep = np.ones(pool.shape[0], bool)
            keep[cheap] = False
            body, body_delay = pool[keep], pool_delay[keep]
            m1 = min(prev_m, body.shape[0] // dp)
            if m1 == 0:
                raise ValueError(
                    f"the last {pool.shape[0]} items fit neither one step of {dp} ranks x "
                    f"{prev_m} microbatches nor two steps; use tail='carry' or 'drop'")
            out, counts, idx, rest = _pack_exact(body, sizes, costs, dp, m1, capacity,
                                                 rank_units, balance, pp)
            builder.emit(out, counts, body_delay[idx])
            pool = np.concatenate([body[rest], pool[~keep]])
            pool_delay = np.concatenate([body_delay[rest], pool_delay[~keep]]) + 1
            continue
        order = np.lexsort((-costs[pool], -pool_delay))
        pool, pool_delay = pool[order], pool_delay[order]
        _, out, counts, idx, rest = _pack_fewest(pool, sizes, costs, dp, mm, capacity,
                                                 rank_units, balance, pp)
        builder.emit(out, counts, pool_delay[idx])
        pool, pool_delay = pool[rest], pool_delay[rest] + 1
    return np.zeros(0, np.int64)


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


# --------------------------------------------------------------------------------------------
# strategies


def plan_sequential(sizes, costs, dp, m, capacity, tail="partial", budget=None, max_items=None):
    """Fill microbatches in arrival order (next fit); a step is the next ``dp*m`` microbatches,
    or fewer when the step budget (``budget`` tokens, at most ``max_items`` items; default
    ``dp*m*capacity``, which never binds) ends it first, and rank r takes the r-th run of m
    consecutive microbatches. A step that fills fewer than ``dp*m`` microbatches within its
    budget has its fullest runs cut in two (arrival order kept) until every microbatch has an
    item. What most packers do."""
    _check_common(sizes, dp, m, capacity, tail)
    n = sizes.shape[0]
    per_step = dp * m
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    budget = per_step * int(capacity) if budget is None else int(budget)
    limit = n + 1 if max_items is None else int(max_items)
    bin_of = np.empty(n, dtype=np.int64)
    step_end = np.empty(max(n, 1), dtype=np.int64)
    step_bins = np.empty(max(n, 1), dtype=np.int64)
    ns = int(_next_fit_steps(sizes, np.int64(capacity), np.int64(per_step), np.int64(budget),
                             np.int64(limit), bin_of, step_end, step_bins))
    # the tail: the stream ends before the last step fills its microbatches
    full = ns - 1 if ns and step_end[ns - 1] == n and step_bins[ns - 1] < per_step else ns
    builder = _Builder(n, dp)
    items = np.arange(n, dtype=np.int64)
    counts = np.empty(per_step, dtype=np.int64)
    lo = 0
    for s in range(full):
        hi = int(step_end[s])
        if step_bins[s] == per_step:
            c = np.bincount(bin_of[lo:hi], minlength=per_step)
        else:
            _split_runs(sizes, np.int64(lo), np.int64(hi), bin_of, step_bins[s],
                        np.int64(per_step), counts)
            c = counts.copy()
        builder.emit(items[lo:hi], c, np.zeros(hi - lo, np.int32))
        lo = hi
    # the tail (fewer than dp*m microbatches): only as many microbatches per rank as it needs
    tail_items = items[lo:]
    leftover = _finish_tail(builder, tail_items, np.zeros(tail_items.shape[0], np.int32), sizes,
                            sizes.astype(np.float64), dp, m, capacity, tail, False, False)
    return builder.finish(leftover)


def _ffd_bins(sizes_k, capacity):
    b = np.empty(sizes_k.shape[0], dtype=np.int64)
    return int(_ffd(sizes_k, np.int64(capacity), b)), b


def plan_ffd_tokens(sizes, costs, dp, m, capacity, budget, tail="partial", max_items=None):
    """Multipack-style: per step, the longest prefix of the stream (within the token budget and
    at most ``max_items`` items) that first-fit-decreasing packs into dp*m microbatches (binary
    search on the prefix length), then microbatches spread over ranks balancing tokens."""
    _check_common(sizes, dp, m, capacity, tail)
    n = sizes.shape[0]
    per_step = dp * m
    builder = _Builder(n, dp)
    cum = np.cumsum(sizes)
    pos = 0
    tok_f = sizes.astype(np.float64)
    while pos < n:
        base = cum[pos - 1] if pos else 0
        hi = int(np.searchsorted(cum, base + budget, side="right")) - pos  # prefix within budget
        hi = max(1, min(hi, n - pos, max_items or n))
        lo = 1
        if _ffd_bins(sizes[pos:pos + hi], capacity)[0] <= per_step:
            lo = hi
        else:
            hi_bad = hi
            while hi_bad - lo > 1:
                mid = (lo + hi_bad) // 2
                if _ffd_bins(sizes[pos:pos + mid], capacity)[0] <= per_step:
                    lo = mid
                else:
                    hi_bad = mid
        k = max(lo, per_step)  # at least one item per microbatch, past the budget if need be
        if pos + k >= n:
            break  # the tail: the stream ends in this step
        items = np.arange(pos, pos + k, dtype=np.int64)
        nb, b = _ffd_bins(sizes[pos:pos + k], capacity)
        if nb < per_step:
            order = items[np.argsort(-sizes[items], kind="stable")]
            out, counts, _, rest = _pack_exact(order, sizes, tok_f, dp, m, capacity, False, False)
            assert rest.shape[0] == 0
        else:
            bin_tok = np.bincount(b, weights=tok_f[items], minlength=per_step)
            rank = lpt_equal(bin_tok, dp)
            o = np.lexsort((-bin_tok, rank))
            pos_of = np.empty(per_step, np.int64)
            pos_of[o] = np.arange(per_step)
            out, counts, _ = _assemble(items, b, per_step, pos_of)
        builder.emit(out, counts, np.zeros(k, np.int32))
        pos += k
    rest = np.arange(pos, n, dtype=np.int64)
    if rest.shape[0]:
        order = rest[np.argsort(-sizes[rest], kind="stable")]
        leftover = _finish_tail(builder, order, np.zeros(order.shape[0], np.int32), sizes, tok_f,
                                dp, m, capacity, tail, False, False)
    else:
        leftover = rest
    return builder.finish(leftover)


def plan_kk_tokens(sizes, costs, dp, m, capacity, budget, tail="partial", max_items=None):
    """verl-style: per step take the stream up to the token budget, split it over DP ranks with
    balanced Karmarkar-Karp on token counts (equal sample counts), then each rank's samples into
    m microbatches with Karmarkar-Karp on tokens. Microbatches over capacity give up their
    smallest samples to microbatches with room, or to the next step. ``max_items`` caps the
    samples per step (a sample-count global batch)."""
    _check_common(sizes, dp, m, capacity, tail)
    n = sizes.shape[0]
    per_step = dp * m
    builder = _Builder(n, dp)
    cum = np.cumsum(sizes)
    tok_f = sizes.astype(np.float64)
    carry = np.zeros(0, np.int64)
    carry_delay = np.zeros(0, np.int32)
    pos = 0
    while pos < n:
        carry_tok = int(sizes[carry].sum())
        base = cum[pos - 1] if pos else 0
        end = int(np.searchsorted(cum, base + max(budget - carry_tok, 0), side="right"))
        if max_items is not None:
            end = min(end, pos + max(max_items - carry.shape[0], 0))
        # at least one item per microbatch, past the budget if need be
        end = max(end, pos + 1, pos + per_step - carry.shape[0])
        if end >= n:
            break
        pool = np.concatenate([carry, np.arange(pos, end, dtype=np.int64)])
        pool_delay = np.concatenate([carry_delay, np.zeros(end - pos, np.int32)])
        pos = end
        pad = (-pool.shape[0]) % dp
        w = np.concatenate([tok_f[pool], np.zeros(pad)])
        rank = kk_equal(w, dp)[:pool.shape[0]]
        bins = np.full(pool.shape[0], -1, np.int64)
        spill = []
        for r in range(dp):
            idx = np.flatnonzero(rank == r)
            g = kk(tok_f[pool[idx]], m)
            bins[idx] = r * m + g
        bin_tok = np.bincount(bins, weights=tok_f[pool], minlength=per_step)
        # capacity repair: move the smallest items out of overfull microbatches
        for b in np.flatnonzero(bin_tok > capacity):
            r = b // m
            members = np.flatnonzero(bins == b)
            members = members[np.argsort(sizes[pool[members]], kind="stable")]
            for k in members:
                if bin_tok[b] <= capacity:
                    break
                s = sizes[pool[k]]
                room = capacity - bin_tok[r * m:(r + 1) * m]
                ok = np.flatnonzero(room >= s)
                bin_tok[b] -= s
                if ok.shape[0]:
                    dst = r * m + ok[np.argmin(room[ok])]
                    bins[k] = dst
                    bin_tok[dst] += s
                else:
                    bins[k] = -1
                    spill.append(k)
        counts = np.bincount(bins[bins >= 0], minlength=per_step)
        # an empty microbatch takes a spilled item first (any one item fits an empty one)
        for b in np.flatnonzero(counts == 0):
            if not spill:
                break
            k = spill.pop(0)
            bins[k] = b
            counts[b] += 1
        keep = np.flatnonzero(bins >= 0)
        if (counts == 0).any():
            b = bins[keep]
            _fill_empty_bins(b, tok_f[pool[keep]], counts)
            bins[keep] = b
        pos_of = np.arange(per_step, dtype=np.int64)
        out, counts, o = _assemble(pool[keep], bins[keep], per_step, pos_of)
        builder.emit(out, counts, pool_delay[keep][o])
        sp = np.asarray(spill, dtype=np.int64)
        carry, carry_delay = pool[sp], pool_delay[sp] + 1
    pool = np.concatenate([carry, np.arange(pos, n, dtype=np.int64)])
    pool_delay = np.concatenate([carry_delay, np.zeros(n - pos, np.int32)])
    leftover = _finish_tail(builder, pool, pool_delay, sizes, tok_f, dp, m, capacity, tail,
                            False, False)
    return builder.finish(leftover)


def plan_balanced(sizes, costs, dp, m, capacity, budget, max_delay, *, weights=None,
                  rank_units=False, lump_tol=0.02, lookahead=True, max_advance=0,
                  delay_penalty=0.002, tail="partial", pp=1):
    """Cost-balanced packing with bounded outlier delay.

    Each step takes the items carried over plus fresh items up to ``budget`` (in ``weights``:
    tokens by default, 1 per item for a sample-count budget). Heavy items ("lumps": excess cost
    above ``lump_tol`` of a unit's light-item cost) are scheduled by :mod:`packing.delay` over
    the next ``max_delay + 1`` steps, seeing the lumps that will arrive (``lookahead``), so that
    lumps share steps with similar ones; an item is never held more than ``max_delay`` steps.
    The intake reads until the items going now fill the budget and gives back the end of what it
    read when lumps arriving with it overfill the step. The step is packed with LPT on cost under
    the token capacity (:mod:`packing.steppack`), items at their deadline first, then scheduled
    lumps, then light items oldest first. Units are microbatches (``rank_units=False``; then
    spread over ranks by a balanced equal-count partition) or whole DP ranks (``rank_units=True``,
    when only per-rank sums matter); with ``pp > 1`` a rank's microbatches are put in a
    1F1B-friendly order. With ``max_advance > 0`` a lump the look-ahead schedules
    for now is read up to that many steps before its turn (its delay is recorded as minus the
    steps it was read early), so heavy samples can meet partners from both sides of their
    position. The loop is compiled (:mod:`packing.balanced`); a plain
    numpy version of the same policy, step for step, is ``tests/naive/balanced.py``."""
    _check_common(sizes, dp, m, capacity, tail)
    if max_delay < 1:
        raise ValueError(f"max_delay {max_delay} must be >= 1: an item that does not fit its "
                         "step's capacity moves to the next step")
    from .balanced import _plan_balanced_kernel
    n = sizes.shape[0]
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    w = sizes if weights is None else np.ascontiguousarray(weights, dtype=np.int64)
    entry_item = np.empty(n, dtype=np.int64)
    entry_delay = np.empty(n, dtype=np.int32)
    # heavy items going now are held to a token budget below the step's capacity (the outlier
    # scheduler fills every unit of a step, which only a budget of the whole capacity holds)
    lump_budget = budget if weights is None and budget < dp * m * capacity else 1 << 62
    ne, mb_counts, step_mbs, rest, rest_arr = _plan_balanced_kernel(
        sizes, costs, w, np.int64(dp), np.int64(m), np.int64(capacity), np.int64(budget),
        np.int64(lump_budget), np.int64(max_delay), bool(rank_units), float(lump_tol), bool(lookahead),
        np.int64(max_advance if lookahead else 0), float(delay_penalty), np.int64(pp), entry_item,
        entry_delay)
    if rest.shape[0] == 0:  # the kernel emitted every item: no tail to finish, no re-split
        offsets = np.zeros(mb_counts.shape[0] + 1, dtype=np.int64)
        np.cumsum(mb_counts, out=offsets[1:])
        return StreamPlan(entry_item[:ne], entry_delay[:ne], offsets, step_mbs,
                          np.zeros(0, np.int64))
    builder = _Builder(n, dp)
    builder.entry_item, builder.entry_delay = entry_item, entry_delay
    builder.n = int(ne)
    if mb_counts.shape[0]:
        builder.mb_counts = list(np.split(mb_counts, np.cumsum(step_mbs * dp)[:-1]))
        builder.step_mbs = step_mbs.tolist()
    steps = int(step_mbs.shape[0])
    leftover = _finish_tail(builder, rest, (steps - rest_arr).astype(np.int32), sizes, costs,
                            dp, m, capacity, tail, rank_units, True, pp)
    return builder.finish(leftover)
