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

import numpy as np

from .binpack import _ffd, _next_fit_steps, _split_runs
from .partition import kk, kk_equal, lpt_equal
# the step assembly lives in its own module; names re-exported for the code and tests that
# import them from here
from .step_assembly import (TAILS, StreamPlan, _assemble, _Builder, _check_common,  # noqa: F401
                            _fill_empty_bins, _finish_tail, _order_bins, _pack_exact,
                            _pack_fewest)


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
                  delay_penalty=0.002, tail="partial", pp=1, lockstep=False):
    """Cost-balanced packing with bounded outlier delay.

    Each step takes the items carried over plus fresh items up to ``budget`` (in ``weights``:
    tokens by default, 1 per item for a sample-count budget). Heavy items ("lumps": excess cost
    above ``lump_tol`` of a unit's light-item cost) are scheduled by :mod:`packing.delay` over
    the next ``max_delay + 1`` steps, seeing the lumps that will arrive (``lookahead``), so that
    lumps share steps with similar ones; an item is never held more than ``max_delay`` steps.
    The intake reads until the items going now fill the budget and gives back the end of what it
    read when lumps arriving with it overfill the step. With a token budget of the whole
    capacity, a step whose packing leaves more than 0.25% of its capacity empty (heavy items the
    budget counted that do not fill its microbatches, as in the first steps of a heavy-tailed
    epoch, where the look-ahead reads heavy items early) reads fresh items of the holes' weight
    and is packed again, once; a step still left with holes is also packed for tokens first,
    its holes filled with light items read ahead of their turn, and keeps that when it holds
    more tokens at no worse balance (microbatch units: and no more waiting tokens left behind;
    :mod:`packing.balanced_fill`). The step is packed with LPT on cost under
    the token capacity (:mod:`packing.steppack`), items at their deadline first, then scheduled
    lumps, then light items oldest first. Units are microbatches (``rank_units=False``; then
    spread over ranks by a balanced equal-count partition) or whole DP ranks (``rank_units=True``,
    when only per-rank sums matter); with ``pp > 1`` a rank's microbatches are put in a
    1F1B-friendly order; ``lockstep`` (microbatch units, pp 1, ranks that wait for each other
    after every microbatch): microbatches by cost descending, dp to a position, for the least
    lockstep time. With ``max_advance > 0`` a lump the look-ahead schedules
    for now is read up to that many steps before its turn (its delay is recorded as minus the
    steps it was read early), so heavy samples can meet partners from both sides of their
    position. The loop is compiled (:mod:`packing.balanced`); a plain
    numpy version of the same policy, step for step, is ``tests/naive/balanced.py``."""
    _check_common(sizes, dp, m, capacity, tail)
    if max_delay < 1:
        raise ValueError(f"max_delay {max_delay} must be >= 1: an item that does not fit its "
                         "step's capacity moves to the next step")
    if lockstep and (rank_units or pp > 1):
        raise ValueError("lockstep=True places microbatch units of a single pipeline stage: "
                         f"it needs rank_units=False and pp == 1 (got rank_units={rank_units}, "
                         f"pp={pp})")
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
        np.int64(max_advance if lookahead else 0), float(delay_penalty), np.int64(pp),
        bool(weights is None and budget >= dp * m * capacity), bool(lockstep), entry_item,
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
                            dp, m, capacity, tail, rank_units, True, pp, lockstep)
    return builder.finish(leftover)
