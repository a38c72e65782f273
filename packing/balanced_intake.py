"""The ``balanced`` planner's reads of the stream (:mod:`packing.balanced`): the intake's and the
top-up's read into the pool (:func:`_read_until`) and the look-ahead's scan for the lumps ahead
of the stream's position (:func:`_scan_lookahead`).

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
def _read_until(sizes, costs, w, taken, cpt, thr, pos, need, count_passed, np_, lim, nls, step,
                pool, parr, now, ls, capacity, long_room, lump_room):
    """Read stream items from ``pos`` into pool slots ``np_..lim-1`` (the pool arrays have room;
    arrival ``step``, not going now) while the light weight read (with ``count_passed``, plus
    the light weight of the taken items passed) is below ``need``, fewer than ``long_room``
    items longer than half the ``capacity`` were read and the lumps read hold fewer than
    ``lump_room`` tokens (every limit checked before each item). Items ``taken`` (read ahead;
    empty array: none) are passed. The intake reads so (``count_passed``: items read ahead
    count as the stream's weight), and the top-up of a step packed with holes (its hole in
    light items read). Returns (pos, np_, nls, light weight read, light weight of the taken
    items passed, long items read, the lumps' tokens read)."""
    n = sizes.shape[0]
    got = 0
    skipped = 0
    longs = 0
    lump_tok = 0
    adv = taken.shape[0] > 0
    while (pos < n and np_ < lim and longs < long_room and lump_tok < lump_room
           and got + (skipped if count_passed else 0) < need):
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
        if 2 * sizes[pos] > capacity:
            longs += 1
        np_ += 1
        pos += 1
    return pos, np_, nls, got, skipped, longs, lump_tok


@kernel
def _count_long(pool, np_, sizes, capacity):
    """How many of the items in pool slots ``0..np_-1`` are longer than half ``capacity``."""
    c = 0
    for k in range(np_):
        if 2 * sizes[pool[k]] > capacity:
            c += 1
    return c
