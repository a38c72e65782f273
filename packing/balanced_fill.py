"""The ``balanced`` planner's token-first step, for a token budget of the whole capacity, tried
when LPT on cost (:func:`packing.steppack._pack_step`) leaves more than 0.25% of a step empty.

Why: LPT sends every item to the cheapest rank with room, so the ranks' costs come out even but
the step's short items end up wherever a rank was cheap, not in the holes next to long items.
When about half the documents are longer than half a microbatch (uniform lengths up to the
capacity, say), every microbatch must hold one long document plus short ones that make up
its complement, and LPT leaves 5-6% of every step empty. The token-first step packs for tokens
first and balances cost afterwards:

1. best fit of the step's candidates into its ``dp * m`` microbatches: items at their deadline
   first (largest first), then items longer than half a microbatch oldest first (at most one a
   microbatch; first in, first out keeps their delay bounded), then the rest largest first
   (:func:`_bfd_bins`);
2. the holes left are filled with light items read ahead of their turn (:func:`_ahead`):
   the stream's next light items, within ``max_advance`` steps of light weight, best fit
   largest first; each is marked taken (the stream skips it later) and its delay is minus the
   steps it was read early, as for look-ahead lumps. Taking short items from the stream's
   future makes its long items come faster; the intake keeps their queue, and so their delay,
   short (it reads no further once the pool holds a long item for every microbatch:
   ``packing.balanced.LONG_READ_STEPS``). Not within ``max_delay + max_advance + 1`` steps of
   light weight of the stream's end (the long items left there would have no short ones);
   then, with whole-rank units, each microbatch still with room gives one item back to the
   pool for an item ahead larger by at most the room (:mod:`packing.hole_swap`; lumps ahead
   included);
3. whole-rank units: the microbatches go to ranks by the better of the LPT and Karmarkar-Karp
   equal-count partitions of their costs, each refined by a few swaps (:func:`_bins_to_ranks`),
   then the rank exchange pass runs as for LPT. Microbatch units: the microbatches go to their
   places as LPT's do (``balanced_step._bin_positions``).

The step keeps it when it holds more tokens than LPT's and is no less balanced. Whole-rank
units: its costliest rank no further above the mean rank than LPT's. Microbatch units (pipeline
stages, or ranks that wait for each other after every microbatch, :func:`_keep_microbatches`):
its costliest microbatch no further above the mean microbatch than LPT's, with dp > 1 also its
costliest rank after the split of the microbatches over ranks (in lockstep instead: its
lockstep time no further above the mean rank's cost than LPT's), and no more tokens of
documents already waiting (at their deadline or read in an earlier step) left for later than
LPT leaves; their best fit also takes the documents read this step after the waiting ones.
Without those two age rules, a microbatch unit's step that took fresh documents over waiting
ones let the waiting ones pile up past the delay bound (lognormal 4K-median documents, 4 DP x
2 PP x 8 x 32K, L + L^2/4096: 74 documents held 5 steps). Otherwise LPT's packing stands and
nothing is read ahead. Capacities above ``binpack.BFD_MAX_CAPACITY`` never try it (the best
fit's tree has a slot per room). The plain version, step for step the same, is in
``tests/naive/balanced.py``.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel
from .argsort import _argsort_int
from .balanced_pool import _grow_pool, _pool_add
from .balanced_step import _fill_empty_bins, _lockstep_time, _rank_of_bins
from .binpack import _first_at_or_after, _tree_add
from .hole_swap import _hole_swaps
from .partition import _group_loads, _kk, _lpt_equal, _refine_swaps

#: the step's holes are filled from at most this many light items read ahead (per microbatch,
#: plus a constant): the best fit for a hole is among the next few hundred items
AHEAD_PER_BIN = 16
AHEAD_BASE = 256
#: swap rounds refining the microbatches' split over ranks (the exchange pass follows; the full
#: 4 dp + 16 rounds cost O(bins dp^2) a step: 12 ms at 256 ranks x 4)
REFINE_ROUNDS = 8


# The best-fit structure (a step's bins by room) is three arrays: ``tree`` (int32[2p], a count
# tree of the bins with each room 0..capacity), ``head`` (int64[capacity + 1], the bin pushed
# last with that room) and ``nxt`` (int64[bins], the bin pushed before it with the same room).
# The fullest bin with room for ``s`` is the one on top of the smallest room >= s, found in
# O(log capacity) (a scan over the bins made a step cost O(bins^2): 29 s for 1M documents on
# 256 ranks). Ties go to the bin pushed last; the plain reference keeps the same stacks.


@kernel
def _rooms_push(tree, head, nxt, p, b, r):
    """Bin ``b`` now has room ``r`` (> 0; a full bin is not kept)."""
    nxt[b] = head[r]
    head[r] = b
    _tree_add(tree, p, r, np.int64(1))


@kernel
def _rooms_pop(tree, head, nxt, p, s):
    """The fullest bin with room >= ``s`` taken off its stack: (bin, its room), or (-1, -1)."""
    r = _first_at_or_after(tree, p, s)
    if r < 0:
        return -1, -1
    b = head[r]
    head[r] = nxt[b]
    _tree_add(tree, p, r, np.int64(-1))
    return b, r


@kernel
def _rooms_clear(tree, head, p):
    """Empty the room structure (every count 0, every stack -1) in O(rooms held x log
    capacity): the structure is made once per plan, not once per step (O(capacity): 24 MB
    filled a step at a capacity of 1M tokens)."""
    while tree[1] > 0:
        r = _first_at_or_after(tree, p, np.int64(0))
        _tree_add(tree, p, r, np.int64(-tree[p + r]))
        head[r] = -1


@kernel
def _place(tree, head, nxt, p, s, bin_tokens, bin_count):
    """An item of ``s`` tokens into the fullest bin with room (its room updated in the
    structure, its tokens and count in ``bin_tokens``/``bin_count``): that bin, or -1."""
    b, r = _rooms_pop(tree, head, nxt, p, s)
    if b >= 0:
        if r > s:
            _rooms_push(tree, head, nxt, p, b, r - s)
        bin_tokens[b] += s
        bin_count[b] += 1
    return b


@kernel
def _bfd_bins(items, cls, arr, sizes, capacity, tree, head, nxt, p, bin_of, bin_tokens,
              bin_count):
    """Token-first packing of one step's candidates ``items`` (``cls``: 0 at the deadline,
    2 read this step and put after the others (microbatch units), 1 otherwise; ``arr`` their
    arrival steps) into ``bin_tokens.shape[0]`` bins (zeroed by the caller; the room structure
    ``tree``/``head``/``nxt`` empty): the deadline items largest first, then items over half
    the capacity oldest first, then the others largest first, class 1 before class 2 (a stable
    order), each into the fullest bin with room. ``bin_of[t]`` gets the bin of
    ``items[t]`` or -1; the room structure holds the bins' rooms after. Returns tokens placed."""
    nc = items.shape[0]
    nb = bin_tokens.shape[0]
    for b in range(nb):
        _rooms_push(tree, head, nxt, p, b, capacity)
    key = np.empty(nc, dtype=np.int64)
    lo = arr.min() if nc > 0 else 0
    for t in range(nc):
        s = sizes[items[t]]
        if cls[t] == 0:
            key[t] = capacity - s
        elif 2 * s > capacity:
            key[t] = (1 << 61) + (arr[t] - lo) * (capacity + 1) + (capacity - s)
        else:
            key[t] = ((1 + cls[t]) << 61) + (capacity - s)
    o = np.empty(nc, dtype=np.int64)
    _argsort_int(key, o)  # np.argsort(key, kind="mergesort"), in linear time
    placed = 0
    for q in range(nc):
        t = o[q]
        s = sizes[items[t]]
        bin_of[t] = _place(tree, head, nxt, p, s, bin_tokens, bin_count)
        if bin_of[t] >= 0:
            placed += s
    return placed


@kernel
def _ahead(sizes, costs, w, taken, cpt, thr, pos, budget, max_advance, capacity, tree, head,
           nxt, p, bin_tokens, bin_count, out_item, out_est, out_bin, skip):
    """Fill the holes of the bins (their rooms in ``tree``/``head``/``nxt``) with light items
    read ahead from ``pos`` (skipping taken items and lumps; the light weight before an item,
    from ``pos``, gives its steps early ``est = 1 + weight // budget``, at most
    ``max_advance``; at most ``out_item.shape[0]`` items that fit some hole are looked at),
    largest first (a stable order), each into the fullest bin with room. Writes the placed
    items, their ``est`` and bins to ``out_*`` and updates ``bin_tokens``/``bin_count``
    (nothing is marked taken). ``skip`` (int64[1], the caller's state): every item from ``pos``
    up to ``skip[0]`` is taken or a lump (the caller lowers it to ``pos`` when ``pos`` moves
    back); the scan starts there and leaves in it its own first item neither taken nor a lump.
    Taken items stay taken, so where the fill has taken the light items far ahead (tiny ones
    beside lumps: up to ``max_advance`` steps of them) a step does not scan them again.
    Returns how many."""
    n = sizes.shape[0]
    maxroom = 0
    for b in range(bin_tokens.shape[0]):
        if capacity - bin_tokens[b] > maxroom:
            maxroom = capacity - bin_tokens[b]
    wmax = out_item.shape[0]
    cand = np.empty(wmax, dtype=np.int64)
    cest = np.empty(wmax, dtype=np.int64)
    nc = 0
    ahead = 0
    q = pos if pos > skip[0] else skip[0]
    first = -1
    while q < n and nc < wmax:
        if taken[q] or costs[q] - sizes[q] * cpt > thr:
            q += 1
            continue
        if first < 0:
            first = q
        est = 1 + ahead // budget
        if est > max_advance:
            break
        if sizes[q] <= maxroom:
            cand[nc] = q
            cest[nc] = est
            nc += 1
        ahead += w[q]
        q += 1
    skip[0] = first if first >= 0 else q
    key = np.empty(nc, dtype=np.int64)
    for t in range(nc):
        key[t] = capacity - sizes[cand[t]]
    o = np.empty(nc, dtype=np.int64)
    _argsort_int(key, o)  # np.argsort(key, kind="mergesort"), in linear time
    na = 0
    for j in range(nc):
        t = o[j]
        b = _place(tree, head, nxt, p, sizes[cand[t]], bin_tokens, bin_count)
        if b >= 0:
            out_item[na] = cand[t]
            out_est[na] = cest[t]
            out_bin[na] = b
            na += 1
    return na


@kernel
def _bins_to_ranks(bcost, dp, rank):
    """``rank`` (int64[bins]): the better (lower largest load; LPT on ties) of the LPT and
    Karmarkar-Karp equal-count partitions of the bin costs ``bcost`` over ``dp`` ranks, each
    refined by :data:`REFINE_ROUNDS` rounds of swaps."""
    nb = bcost.shape[0]
    g1 = np.empty(nb, dtype=np.int64)
    g2 = np.empty(nb, dtype=np.int64)
    _lpt_equal(bcost, dp, g1)
    _refine_swaps(bcost, g1, dp, np.int64(REFINE_ROUNDS))
    _kk(bcost, dp, np.bool_(True), g2)
    _refine_swaps(bcost, g2, dp, np.int64(REFINE_ROUNDS))
    if _group_loads(bcost, g2, dp).max() < _group_loads(bcost, g1, dp).max():
        rank[:] = g2
    else:
        rank[:] = g1


@kernel
def _top_no_further_above(top_new, new, top_old, old):
    """Whether ``top_new`` is no further above the mean of the loads ``new`` than ``top_old``
    is above the mean of ``old`` (float64 arrays of one length; sums in index order, as the
    plain reference takes them, so both decide alike)."""
    s_old = 0.0
    s_new = 0.0
    for k in range(old.shape[0]):
        s_old += old[k]
        s_new += new[k]
    return top_new * s_old <= top_old * s_new


@kernel
def _no_further_above(new, old):
    """Whether the largest of the loads ``new`` is no further above their mean than the largest
    of ``old`` is above theirs."""
    return _top_no_further_above(new.max(), new, old.max(), old)


@kernel
def _keep_microbatches(items, ocls, bin_of, bo, lc, bcost, sizes, dp, m, lockstep):
    """Whether a microbatch unit's step keeps its token-first packing (bins ``bo`` of the
    candidates ``items[:len(bin_of)]`` and the items read ahead; microbatch costs ``bcost``)
    over LPT's (``bin_of``, microbatch costs ``lc``): no more tokens of waiting candidates
    (``ocls`` 0 or 2: at their deadline or read in an earlier step) left unplaced, and no less
    balanced. ``lockstep`` (ranks that wait for each other after every microbatch): its
    lockstep time (``balanced_step._lockstep_time``, the placement the step then gets) no
    further above the mean rank's cost than LPT's. Otherwise its costliest microbatch no
    further above the mean than LPT's, and with dp > 1 its costliest rank no further above the
    mean rank after the split of the microbatches over ranks (``balanced_step._rank_of_bins``,
    the split the step then gets)."""
    nb = dp * m
    left_lpt = 0
    left_new = 0
    for t in range(bin_of.shape[0]):
        if ocls[t] == 0 or ocls[t] == 2:
            if bin_of[t] < 0:
                left_lpt += sizes[items[t]]
            if bo[t] < 0:
                left_new += sizes[items[t]]
    if left_new > left_lpt:
        return False
    if lockstep:
        return _top_no_further_above(_lockstep_time(bcost, dp), bcost, _lockstep_time(lc, dp),
                                     lc)
    if not _no_further_above(bcost, lc):
        return False
    if dp == 1:
        return True
    g_lpt = np.empty(nb, dtype=np.int64)
    g_new = np.empty(nb, dtype=np.int64)
    _rank_of_bins(lc, dp, m, np.bool_(False), g_lpt)
    _rank_of_bins(bcost, dp, m, np.bool_(False), g_new)
    r_lpt = np.zeros(dp)
    r_new = np.zeros(dp)
    for b in range(nb):
        r_lpt[g_lpt[b]] += lc[b]
        r_new[g_new[b]] += bcost[b]
    return _no_further_above(r_new, r_lpt)


@kernel
def _token_first(items, order, ocls, parr, sizes, costs, w, taken, cpt, thr, pos, budget,
                 max_advance, read_ahead, dp, m, capacity, bin_of, lpt_tokens, rank_units,
                 lockstep, skip, tree, head):
    """The token-first packing of a step whose LPT packing (``bin_of``: bin of ``items[t]``,
    -1 not placed; ``lpt_tokens`` its tokens) left holes. ``items``/``order``/``ocls``: the
    step's candidates, their pool slots and priority classes; ``read_ahead``: whether the holes
    may be filled from the stream ahead of ``pos``; ``rank_units``: whole-rank units (else
    microbatch units; ``lockstep``: their ranks wait for each other after every microbatch,
    :func:`_keep_microbatches`; ``skip``: the read-ahead's state, :func:`_ahead`; ``tree``,
    ``head``: an empty room structure for ``capacity``, left empty). Returns ``(adopt, bins
    int64[nc + na]`` (the new bin of every candidate, then of every item read ahead; with
    whole-rank units ranks' bins consecutive),
    ``bin_tokens, bin_count, ahead items, their steps early)``; with ``adopt`` False the step
    keeps LPT's packing and nothing is read ahead."""
    n_bins = dp * m
    nc = items.shape[0]
    cls = np.empty(nc, dtype=np.int64)
    arr = np.empty(nc, dtype=np.int64)
    for t in range(nc):
        # microbatch units: the documents read this step (class 3) after the waiting ones
        cls[t] = 0 if ocls[t] == 0 else (2 if not rank_units and ocls[t] == 3 else 1)
        arr[t] = parr[order[t]]
    wmax = AHEAD_PER_BIN * n_bins + AHEAD_BASE
    bo = np.full(nc + wmax, -1, dtype=np.int64)
    bt = np.zeros(n_bins, dtype=np.int64)
    bn = np.zeros(n_bins, dtype=np.int64)
    p = tree.shape[0] // 2  # the bins' rooms: the caller's structure, made once a plan
    nxt = np.empty(n_bins, dtype=np.int64)
    tok = _bfd_bins(items, cls, arr, sizes, capacity, tree, head, nxt, p, bo[:nc], bt, bn)
    fi = np.empty(wmax, dtype=np.int64)
    fe = np.empty(wmax, dtype=np.int64)
    na = 0
    if read_ahead and (n_bins * capacity - tok) * 400 > n_bins * capacity:
        na = _ahead(sizes, costs, w, taken, cpt, thr, pos, budget, max_advance, capacity, tree,
                    head, nxt, p, bt, bn, fi, fe, bo[nc:], skip)
        if rank_units:
            # the holes left: exchanges of candidates (not at their deadline) for slightly
            # larger items ahead. Whole-rank units only: with microbatch units the items given
            # back count against the step (_keep_microbatches) and the suite lost by them
            # (prolong 0.9959 -> 0.9948)
            stay = np.empty(nc, dtype=np.bool_)
            for t in range(nc):
                stay[t] = cls[t] == 0
            na = _hole_swaps(items, stay, bo[:nc], sizes, costs, w, taken, cpt, thr, pos,
                             budget, max_advance, capacity, bt, fi, fe, bo[nc:], na)
        tok = np.int64(0)  # the fill's items and the exchanges' gains
        for b in range(n_bins):
            tok += bt[b]
    _rooms_clear(tree, head, p)  # read no more: empty for the next step
    ntot = nc + na
    bo = bo[:ntot]
    if tok <= lpt_tokens:
        return False, bo, bt, bn, fi[:0], fe[:0]
    all_items = np.empty(ntot, dtype=np.int64)
    all_items[:nc] = items
    all_items[nc:] = fi[:na]
    bcost = np.zeros(n_bins)
    _fill_empty_bins(all_items, sizes, costs, bo, bt, bcost, bn)
    bcost[:] = 0.0   # costs summed in item order (as the plain reference does)
    for t in range(ntot):
        if bo[t] >= 0:
            bcost[bo[t]] += costs[all_items[t]]
    if not rank_units:
        lc = np.zeros(n_bins)  # LPT's microbatch costs, summed in item order
        for t in range(nc):
            if bin_of[t] >= 0:
                lc[bin_of[t]] += costs[items[t]]
        if not _keep_microbatches(items, ocls, bin_of, bo, lc, bcost, sizes, dp, m, lockstep):
            return False, bo, bt, bn, fi[:0], fe[:0]
        return True, bo, bt, bn, fi[:na], fe[:na]
    rank = np.empty(n_bins, dtype=np.int64)
    _bins_to_ranks(bcost, dp, rank)
    r_lpt = np.zeros(dp)
    r_new = np.zeros(dp)
    for t in range(nc):
        if bin_of[t] >= 0:
            r_lpt[bin_of[t] // m] += costs[items[t]]
    for t in range(ntot):
        if bo[t] >= 0:
            r_new[rank[bo[t]]] += costs[all_items[t]]
    # more tokens, the costliest rank no further above the mean rank than LPT's
    if not _no_further_above(r_new, r_lpt):
        return False, bo, bt, bn, fi[:0], fe[:0]
    new_bin = np.empty(n_bins, dtype=np.int64)
    used = np.zeros(dp, dtype=np.int64)
    for b in range(n_bins):
        new_bin[b] = rank[b] * m + used[rank[b]]
        used[rank[b]] += 1
    bt2 = np.empty(n_bins, dtype=np.int64)
    bn2 = np.empty(n_bins, dtype=np.int64)
    for b in range(n_bins):
        bt2[new_bin[b]] = bt[b]
        bn2[new_bin[b]] = bn[b]
    for t in range(ntot):
        if bo[t] >= 0:
            bo[t] = new_bin[bo[t]]
    return True, bo, bt2, bn2, fi[:na], fe[:na]


@kernel
def _take_ahead(pool, parr, now, ls, np_, nls, taken, items, order, fi, fe, step):
    """The items ``fi`` read ahead by the token-first step into the pool (marked taken, going
    now, arrived ``step + fe``: their delay is minus the steps they were read early) and after
    the step's candidates ``items`` (their pool slots ``order``). Every one is placed in this
    step, so a lump among them (read by an exchange) is not listed with the pool's lumps: it
    leaves with the step. Returns (pool, parr, now, ls, items in the pool, lumps among them,
    items, order)."""
    nc = items.shape[0]
    na = fi.shape[0]
    items2 = np.empty(nc + na, dtype=np.int64)
    order2 = np.empty(nc + na, dtype=np.int64)
    items2[:nc] = items
    order2[:nc] = order
    pool, parr, now, ls = _grow_pool(pool, parr, now, ls, np_ + na, nls + 1)
    for a in range(na):
        taken[fi[a]] = True
        nls = _pool_add(pool, parr, now, ls, np_, nls, fi[a], step + fe[a], np.bool_(True),
                        np.bool_(False))
        items2[nc + a] = fi[a]
        order2[nc + a] = np_
        np_ += 1
    return pool, parr, now, ls, np_, nls, items2, order2
