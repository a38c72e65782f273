"""The ``balanced`` planner's reads of the stream (:mod:`packing.balanced`): the intake's read into
the pool (:func:`_read_until`) and the look-ahead's scan for the lumps ahead of the stream's
position (:func:`_scan_lookahead`).

Arrays are grown by the caller, between calls, never inside a per-item loop: a loop that
re-binds an array (``a = _grow(a, k)``) pays numba's reference counting on every iteration,
taken branch or not (the look-ahead's scan of 1M wikipedia documents: 17 ms that way, 1.6 ms
with the arrays grown outside it).
"""
from __future__ import annotations

from ._jit import kernel


@kernel
def _scan_lookahead(sizes, costs, w, cpt, thr, look, look_cum, lim_cum, pos, fut, fut_cum,
                    fut_tok_before, nf, f0, fut_tok, look_lump_cap):
    """Advance the look-ahead's end ``look`` while the light weight read, ``look_cum``, is
    below ``lim_cum``, listing each lump passed in ``fut`` (its stream index), ``fut_cum`` (the
    light weight before it) and ``fut_tok_before`` (the listed lumps' tokens before it).
    It stops at a lump where the lumps from the stream's position ``pos`` on
    (``fut[f0:]``; ``f0`` is advanced to it) already hold ``look_lump_cap`` tokens, or where the
    three arrays are full. Returns (look, look_cum, nf, f0, fut_tok, full): ``full`` says the
    caller must grow the arrays and call again."""
    n = sizes.shape[0]
    room = fut.shape[0]
    while look < n and look_cum < lim_cum:
        if costs[look] - sizes[look] * cpt > thr:
            # the cut counts from pos: where the intake read past the look-ahead's end, the
            # lumps appended since lie before pos (read already)
            while f0 < nf and fut[f0] < pos:
                f0 += 1
            if f0 < nf and fut_tok - fut_tok_before[f0] >= look_lump_cap:
                break
            if nf >= room:
                return look, look_cum, nf, f0, fut_tok, True
            fut[nf] = look
            fut_cum[nf] = look_cum
            fut_tok_before[nf] = fut_tok
            fut_tok += sizes[look]
            nf += 1
        else:
            look_cum += w[look]
        look += 1
    return look, look_cum, nf, f0, fut_tok, False


@kernel
def _read_until(sizes, costs, w, taken, cpt, thr, pos, need, np_, lim, nls, step, pool, parr,
                now, ls, capacity, long_room, lump_room):
    """Read stream items from ``pos`` into pool slots ``np_..lim-1`` (the pool arrays have room)
    until the light weight passed reaches ``need``, ``long_room`` items longer than half the
    ``capacity`` were read or the lumps read reach ``lump_room`` tokens, skipping items
    ``taken`` (read ahead; empty array: none; a light one's weight counts as passed); arrival
    ``step``, not going now. Returns (pos, np_, nls, light weight read, light weight of the
    taken items skipped, long items read, the lumps' tokens read)."""
    n = sizes.shape[0]
    got = 0
    skipped = 0
    longs = 0
    lump_tok = 0
    adv = taken.shape[0] > 0
    while pos < n and got + skipped < need and np_ < lim:
        lump = costs[pos] - sizes[pos] * cpt > thr  # a lump: heavy beyond the tolerance
        if adv and taken[pos]:
            if not lump:
                skipped += w[pos]
            pos += 1
            continue
        pool[np_] = pos
        parr[np_] = step
        now[np_] = False
        if lump:
            ls[nls] = np_
            nls += 1
            lump_tok += sizes[pos]
        else:
            got += w[pos]
        np_ += 1
        pos += 1
        if 2 * sizes[pos - 1] > capacity:
            longs += 1
        if longs >= long_room or lump_tok >= lump_room:
            break
    return pos, np_, nls, got, skipped, longs, lump_tok


@kernel
def _count_long(pool, np_, sizes, capacity):
    """How many of the items in pool slots ``0..np_-1`` are longer than half ``capacity``."""
    c = 0
    for k in range(np_):
        if 2 * sizes[pool[k]] > capacity:
            c += 1
    return c


@kernel
def _read_topup(sizes, costs, w, taken, cpt, thr, pos, np_, lim, nls, step, pool, parr, now,
                ls, capacity, hole, got, nlong, long_cap, lump_tok, lump_cap):
    """The top-up's read (:mod:`packing.balanced`, a step packed with holes): stream items from
    ``pos`` into pool slots ``np_..lim-1`` (the pool arrays have room), not going now, while
    the light weight read, ``got``, is below ``hole``, fewer than ``long_cap`` items longer
    than half the ``capacity`` are in the pool (``nlong``) and its lumps hold fewer than
    ``lump_cap`` tokens (``lump_tok``); items ``taken`` (read ahead; empty array: none) are
    passed, a light one's weight counted as read past. Returns (pos, np_, nls, got, nlong,
    lump_tok, the light weight read, the light weight of the taken items passed)."""
    n = sizes.shape[0]
    adv = taken.shape[0] > 0
    read_w = 0
    skipped = 0
    while pos < n and got < hole and nlong < long_cap and lump_tok < lump_cap and np_ < lim:
        lump = costs[pos] - sizes[pos] * cpt > thr
        if adv and taken[pos]:
            if not lump:
                skipped += w[pos]
            pos += 1
            continue
        pool[np_] = pos
        parr[np_] = step
        now[np_] = False
        if lump:
            ls[nls] = np_
            nls += 1
            lump_tok += sizes[pos]
        else:
            got += w[pos]
            read_w += w[pos]
        if 2 * sizes[pos] > capacity:
            nlong += 1
        np_ += 1
        pos += 1
    return pos, np_, nls, got, nlong, lump_tok, read_w, skipped
