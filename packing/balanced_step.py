"""The ``balanced`` planner's step packing after LPT (:func:`packing.steppack._pack_step`):
every microbatch gets an item, microbatches get their final positions (rank-major, cost
descending inside a rank, a 1F1B-friendly order with pp > 1; microbatch units are first spread
over ranks), and the step's entries are written in that order (CSR rows of the plan).
Per-step scratch arrays travel in one named tuple, :class:`StepScratch`."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._jit import kernel
from .partition import _group_loads, _kk, _lpt_equal, _refine_swaps
from .pipeline import _pipeline_order
from .steppack import _priority_order


class StepScratch(NamedTuple):
    """Per-step scratch of :func:`_bin_positions` (allocated once per epoch)."""
    rank_of: np.ndarray    # int64[dp * m]: rank of every bin
    pos: np.ndarray        # int64[dp * m]: final position of every bin
    rank_bins: np.ndarray  # int64[m]: one rank's bins
    rank_fill: np.ndarray  # int64[dp]: bins counted per rank
    by_rank: np.ndarray    # int64[dp * m]: bins grouped by rank
    rank_cost: np.ndarray  # float64[m]: one rank's bin costs
    rank_perm: np.ndarray  # int64[m]: their 1F1B order


@kernel
def _new_scratch(dp, m):
    return StepScratch(np.empty(dp * m, dtype=np.int64), np.empty(dp * m, dtype=np.int64),
                       np.empty(m, dtype=np.int64), np.empty(dp, dtype=np.int64),
                       np.empty(dp * m, dtype=np.int64), np.empty(m),
                       np.empty(m, dtype=np.int64))


@kernel
def _fill_empty_bins(items, sizes, costs, bin_of, bin_tokens, bin_cost, bin_count):
    """Every microbatch gets an item: an empty bin takes the cheapest item (the first on ties)
    of a bin holding two or more. ``bin_of[t]`` is the bin of ``items[t]`` (-1: not placed)."""
    nc = items.shape[0]
    for b in range(bin_count.shape[0]):
        if bin_count[b] == 0:
            best = -1
            for t in range(nc):
                if bin_of[t] >= 0 and bin_count[bin_of[t]] >= 2:
                    if best < 0 or costs[items[t]] < costs[items[best]]:
                        best = t
            src = bin_of[best]
            bin_count[src] -= 1
            bin_tokens[src] -= sizes[items[best]]
            bin_cost[src] -= costs[items[best]]
            bin_of[best] = b
            bin_count[b] += 1
            bin_tokens[b] += sizes[items[best]]
            bin_cost[b] += costs[items[best]]


@kernel
def _rank_of_bins(bin_cost, dp, m, rank_units, rank_out):
    """Rank of every bin: consecutive for rank units, else the better of LPT and KK equal-count
    partitions of the bin costs, each refined by swaps."""
    nb = bin_cost.shape[0]
    if rank_units or dp == 1:
        for b in range(nb):
            rank_out[b] = b // m
        return
    g1 = np.empty(nb, dtype=np.int64)
    g2 = np.empty(nb, dtype=np.int64)
    _lpt_equal(bin_cost, dp, g1)
    _refine_swaps(bin_cost, g1, dp, 4 * dp + 16)
    _kk(bin_cost, dp, np.bool_(True), g2)
    _refine_swaps(bin_cost, g2, dp, 4 * dp + 16)
    if _group_loads(bin_cost, g2, dp).max() < _group_loads(bin_cost, g1, dp).max():
        rank_out[:] = g2
    else:
        rank_out[:] = g1


@kernel
def _lockstep_time(bin_cost, dp):
    """The least lockstep time of a step's microbatch costs ``bin_cost`` (float64[dp * m]) over
    ``dp`` ranks: the sum over positions of the costliest microbatch there, with the
    microbatches by cost descending taken ``dp`` to a position (the placement of
    :func:`_bin_positions` with ``lockstep``). Summed in position order."""
    key = np.empty(bin_cost.shape[0])
    for b in range(bin_cost.shape[0]):
        key[b] = -bin_cost[b]
    ob = np.argsort(key, kind="mergesort")
    t = 0.0
    for q in range(0, ob.shape[0], dp):
        t += bin_cost[ob[q]]
    return t


@kernel
def _bin_positions(bin_cost, dp, m, rank_units, pp, sc, lockstep):
    """Final position of every bin into ``sc.pos``: rank-major, by cost descending inside a
    rank (then the 1F1B-friendly order with pp > 1). ``lockstep`` (microbatch units, pp 1:
    the ranks wait for each other after every microbatch, so a step takes the sum over
    positions of the costliest microbatch there): the microbatches by cost descending, ``dp``
    to a position, over the ranks in snake order; that sum is then the least any placement of
    these microbatches gives."""
    n_bins = dp * m
    key = np.empty(n_bins)
    for b in range(n_bins):
        key[b] = -bin_cost[b]
    ob = np.argsort(key, kind="mergesort")
    if lockstep:
        for q in range(n_bins):
            j = q // dp
            k = q - j * dp
            rr = k if j % 2 == 0 else dp - 1 - k
            sc.pos[ob[q]] = rr * m + j
        return
    _rank_of_bins(bin_cost, dp, m, rank_units, sc.rank_of)
    # bins of every rank in ``ob`` order (a counting sort by rank; m bins per rank)
    for rr in range(dp):
        sc.rank_fill[rr] = 0
    for q in range(n_bins):
        rr = sc.rank_of[ob[q]]
        sc.by_rank[rr * m + sc.rank_fill[rr]] = ob[q]
        sc.rank_fill[rr] += 1
    for rr in range(dp):
        t0 = rr * m
        for q in range(m):
            sc.rank_bins[q] = sc.by_rank[t0 + q]
        if pp > 1:  # a 1F1B-friendly order of the rank's microbatches
            for q in range(m):
                sc.rank_cost[q] = bin_cost[sc.rank_bins[q]]
            _pipeline_order(sc.rank_cost, pp, np.int64(8), sc.rank_perm)
            for q in range(m):
                sc.pos[sc.rank_bins[sc.rank_perm[q]]] = t0 + q
        else:
            for q in range(m):
                sc.pos[sc.rank_bins[q]] = t0 + q


@kernel
def _emit_step(items, order, bin_of, parr, step, bin_pos, entry_item, entry_delay, counts,
               placed):
    """Write the placed ``items`` (pool slots ``order``, bins ``bin_of``) grouped by final
    microbatch position (``bin_pos``; a counting sort, placement order inside a microbatch)
    into ``entry_item``/``entry_delay`` (delay = step - arrival step ``parr``), the items per
    microbatch into ``counts`` (int64[dp * m]), and mark their pool slots in ``placed``.
    Returns the entries written."""
    n_bins = counts.shape[0]
    nc = items.shape[0]
    start = np.zeros(n_bins + 1, dtype=np.int64)
    for t in range(nc):
        if bin_of[t] >= 0:
            start[bin_pos[bin_of[t]] + 1] += 1
    for b in range(n_bins):
        counts[b] = start[b + 1]
        start[b + 1] += start[b]
    for t in range(nc):
        if bin_of[t] >= 0:
            p = bin_pos[bin_of[t]]
            entry_item[start[p]] = items[t]
            entry_delay[start[p]] = step - parr[order[t]]
            start[p] += 1
            placed[order[t]] = True
    return start[n_bins - 1] if n_bins > 0 else 0


@kernel
def _with_fresh(order, ocls, pool, lo, hi, sizes, costs, cpt, thr):
    """A step's candidates in priority order after its top-up: ``order`` (pool slots) and
    ``ocls`` (their classes, int64) of the first round with the light items of pool slots
    ``lo..hi-1`` (class 3: fresh, read after every old slot) merged in. The same order as
    :func:`packing.steppack._priority_order` of the whole set (class ascending, cost descending,
    pool order on ties: an old item before a fresh one of equal cost), at the cost of sorting
    the fresh items only. Returns (order, classes)."""
    nf = 0
    for k in range(lo, hi):
        if not (costs[pool[k]] - sizes[pool[k]] * cpt > thr):
            nf += 1
    fk = np.empty(nf, dtype=np.int64)
    fc = np.empty(nf)
    fcls = np.full(nf, 3, dtype=np.int64)
    j = 0
    for k in range(lo, hi):
        if not (costs[pool[k]] - sizes[pool[k]] * cpt > thr):
            fk[j] = k
            fc[j] = costs[pool[k]]
            j += 1
    of = np.empty(nf, dtype=np.int64)
    _priority_order(fcls, fc, of)
    n0 = order.shape[0]
    out = np.empty(n0 + nf, dtype=np.int64)
    out_cls = np.empty(n0 + nf, dtype=np.int64)
    i = 0
    j = 0
    for t in range(n0 + nf):
        take_fresh = j < nf
        if take_fresh and i < n0 and ocls[i] < 3:
            take_fresh = False
        if take_fresh and i < n0:
            # the radix sort's key: the complement of the cost's bits, ascending; an old item
            # goes first on equal keys
            ko = ~np.float64(costs[pool[order[i]]]).view(np.uint64)
            kf = ~np.float64(fc[of[j]]).view(np.uint64)
            take_fresh = kf < ko
        if take_fresh:
            out[t] = fk[of[j]]
            out_cls[t] = 3
            j += 1
        else:
            out[t] = order[i]
            out_cls[t] = ocls[i]
            i += 1
    return out, out_cls
