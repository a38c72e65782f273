"""The ``balanced`` whole-epoch planner as one compiled loop (see :func:`packing.stream.
plan_balanced` for the policy). Python only prepares arrays and finishes the epoch's tail; the
step loop, intake, outlier scheduling, step packing, rank placement and CSR assembly all run
compiled, so a step costs microseconds and the planner allocates O(1) bytes per sample beyond
its output. By phase: the intake and outlier scheduling are here; the pool of items read but not
placed is :mod:`packing.balanced_pool`; a packed step's empty-bin fix, microbatch order and
entries are :mod:`packing.balanced_step`.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel
from .balanced_fill import _take_ahead, _token_first
from .balanced_intake import _count_long, _read_until, _scan_lookahead
from .binpack import BFD_MAX_CAPACITY
from .balanced_pool import _compact_pool, _grow, _grow_bool, _grow_float, _grow_pool, _pool_add
from .balanced_step import (_bin_positions, _emit_step, _fill_empty_bins, _new_scratch,
                            _with_fresh)
from .delay import _schedule_lumps
from .rank_swap import SWAP_TOL, _rank_swaps
from .steppack import _pack_step, _priority_order

_CHUNK = 1024  # pool slots made room for at once by the intake
#: Long items (more than half a microbatch: no two share one) a step's intake reads at most, in
#: steps' worth of microbatches: with the pool holding one long item per microbatch, reading on
#: only makes long items wait. The token budget alone let them queue without bound where they
#: arrive faster than one a microbatch (half of the documents 0.6-1.0 of a microbatch: delays
#: of 900+ steps) and, where they arrive about as fast (uniform lengths up to the capacity),
#: kept the token-first step from reading ahead.
LONG_READ_STEPS = 1
#: ... and the top-up after the step is packed (it reads for the step's holes; the long items
#: that come with those light ones wait at most a step more)
LONG_TOPUP_STEPS = 2
#: The same for lumps by their tokens: the intake stops once the pool's lumps hold a step's
#: capacity, the top-up two. Lumps shorter than half a microbatch were read without bound
#: where the light items beside them are tiny (70% of documents 1-19 tokens, the rest
#: 6-9K, 8 x 4 x 32K, L + L^2/4096): the top-up read the stream's every lump for the holes of
#: the first step and they waited up to 225 steps (14,429 of 15K beyond the delay bound on
#: 50K samples; now 12, by one step).
LUMP_READ_STEPS = 1
LUMP_TOPUP_STEPS = 2
#: The look-ahead sees the lumps from the stream's position on until their tokens reach this
#: many times the capacity of its ``max_delay + max_advance + 1`` steps. Its window is light
#: weight, and where light items are tiny and lumps many (55% of 50-200-token documents, the
#: rest 17-32K at 8 x 4 x 32K) it held every lump of the stream: each step scheduled all of
#: them and the plan took time quadratic in its length (100K samples: 7.6 s; now 0.9 s). No
#: schedule places more than the horizon's capacity, so the lumps past the cut only waited to be
#: scheduled again. 8: no plan of the bench's suite or the held-out efficiency cases changes
#: (from 4 on), and long documents arriving faster than the microbatches keep the delay bound
#: (at 4 one waited 5 steps: tests/strategies/test_balanced_efficiency.py).
LOOK_LUMP_STEPS = 8


@kernel
def _plan_balanced_kernel(sizes, costs, w, dp, m, capacity, budget, lump_budget, max_delay,
                          rank_units, lump_tol, lookahead, max_advance, delay_penalty, pp,
                          topup, lockstep, entry_item, entry_delay):
    """Fill ``entry_item``/``entry_delay`` (preallocated, length n); returns (entries written,
    mb_counts int64[M], step_mbs int64[S], pool items left for the tail, their arrival steps).
    ``lump_budget``: the most weight of heavy items a step takes, up to the one crossing it
    (the step budget when it is below the step's capacity, else unbounded). ``topup``: a step
    whose packing leaves more than 0.25% of its capacity empty reads fresh items of that weight
    and is packed again (token budgets of the whole capacity only). ``lockstep``: microbatch
    units whose ranks wait for each other after every microbatch (pp 1), placed for the least
    lockstep time (``balanced_step._bin_positions``)."""
    n = sizes.shape[0]
    if rank_units:
        n_units = dp
        bpu = m
    else:
        n_units = dp * m
        bpu = 1
    n_bins = dp * m
    unit_cap = capacity * bpu
    # reference cost per token: median of cost/size over a fixed strided sample
    stride = max(1, n // 65536)
    ns = (n + stride - 1) // stride
    r = np.empty(ns)
    for k in range(ns):
        r[k] = costs[k * stride] / sizes[k * stride]
    cpt = np.median(r) if ns > 0 else 1.0
    tc = unit_cap * cpt
    thr = lump_tol * tc
    horizon = max_delay + 1

    pool = np.empty(1024, dtype=np.int64)
    parr = np.empty(1024, dtype=np.int64)
    now = np.zeros(1024, dtype=np.bool_)
    np_ = np.int64(0)  # typed: a literal start compiles callees for Literal[int]
    # look-ahead: lumps among [pos, look) and the fluid weight read so far
    fut = np.empty(256, dtype=np.int64)
    fut_cum = np.empty(256, dtype=np.int64)
    nf = np.int64(0)  # typed: a literal start compiles callees for Literal[int]
    f0 = np.int64(0)  # first look-ahead entry not yet read into the pool
    look = np.int64(0)
    look_cum = np.int64(0)  # fluid weight of [0, look)
    # the look-ahead's lumps' tokens before each (``fut_tok_before``): lumps from ``pos`` on
    # (read ahead or not) stop at LOOK_LUMP_STEPS times the look-ahead's steps of capacity
    fut_tok_before = np.empty(256, dtype=np.int64)
    fut_tok = np.int64(0)
    look_lump_cap = LOOK_LUMP_STEPS * (max_delay + max_advance + 1) * n_bins * capacity
    pos = np.int64(0)
    pos_cum = 0   # light weight of [0, pos), items read ahead of their turn (taken) included
    ahead_w = 0   # light weight of the items at pos or later read ahead (the token-first step)
    # items from pos up to ahead_skip[0] are taken or lumps: the token-first step's read-ahead
    # starts past them (balanced_fill._ahead); lowered to pos where pos moves back
    ahead_skip = np.zeros(1, dtype=np.int64)
    # the token-first step's room structure (balanced_fill: a count tree over rooms
    # 0..capacity and a stack per room), made once: making it each step cost O(capacity)
    bp = 1
    if topup and capacity <= BFD_MAX_CAPACITY:
        while bp < capacity + 1:
            bp *= 2
    bf_tree = np.zeros(2 * bp, dtype=np.int32)
    bf_head = np.full(bp if bp > 1 else 1, -1, dtype=np.int64)
    light_total = 0
    for i in range(n):
        if not (costs[i] - sizes[i] * cpt > thr):
            light_total += w[i]
    step = np.int64(0)
    ne = 0
    nmb = 0
    # per-step scratch
    lex = np.empty(256)
    lsz = np.empty(256, dtype=np.int64)
    llo = np.empty(256, dtype=np.int64)
    lhi = np.empty(256, dtype=np.int64)
    lt = np.empty(256, dtype=np.int64)
    lpool = np.empty(256, dtype=np.int64)
    lest = np.empty(256, dtype=np.int64)
    bin_tokens = np.zeros(n_bins, dtype=np.int64)
    bin_cost = np.zeros(n_bins)
    bin_count = np.zeros(n_bins, dtype=np.int64)
    scratch = _new_scratch(dp, m)
    mb_counts = np.empty(1024, dtype=np.int64)
    step_mbs = np.empty(64, dtype=np.int64)
    taken = np.zeros(n if max_advance > 0 else 0, dtype=np.bool_)  # read ahead of their turn
    pull = np.empty(256, dtype=np.int64)   # look-ahead lumps to read now
    pull_est = np.empty(256, dtype=np.int64)
    npull = 0
    # pool slots holding lumps (ascending) and the weight of the light items in the pool, kept
    # up to date so each intake round touches the lumps only, not the whole pool
    ls = np.empty(256, dtype=np.int64)
    nls = np.int64(0)
    fluid_w = 0
    pool_long = np.int64(0)  # items longer than half the capacity in the pool
    pool_lump_tok = np.int64(0)  # tokens of the lumps in the pool
    lump_tok_cap = LUMP_READ_STEPS * n_bins * capacity
    while pos < n or np_ > 0:
        n_old = np_
        nlong = pool_long  # the pool is as the last step's compaction left it
        lump_tok = pool_lump_tok
        fluid_w_old = fluid_w
        for it in range(4):
            # ---- schedule lumps (pending + look-ahead) -----------------------------------
            if pos < n and lookahead:
                while True:
                    look, look_cum, nf, f0, fut_tok, full = _scan_lookahead(
                        sizes, costs, w, cpt, thr, look, look_cum,
                        pos_cum + (max_delay + max_advance) * budget, pos, fut, fut_cum,
                        fut_tok_before, nf, f0, fut_tok, look_lump_cap)
                    if not full:
                        break
                    fut = _grow(fut, nf + 1)
                    fut_cum = _grow(fut_cum, nf + 1)
                    fut_tok_before = _grow(fut_tok_before, nf + 1)
            now = _grow_bool(now, np_)
            for q in range(nls):
                now[ls[q]] = pos >= n
            # every look-ahead lump is re-planned (or, once the stream is fully read, already
            # in the pool and counted there): pulls of an earlier round must not count twice
            npull = 0
            if pos < n:
                nl = 0
                need_cap = nls + nf - f0 + 1  # pending lumps plus every look-ahead one
                if need_cap > lex.shape[0]:
                    lex = _grow_float(lex, need_cap)
                    lsz = _grow(lsz, need_cap)
                    llo = _grow(llo, need_cap)
                    lhi = _grow(lhi, need_cap)
                    lt = _grow(lt, need_cap)
                    lpool = _grow(lpool, need_cap)
                    lest = _grow(lest, need_cap)
                for q in range(nls):  # every pending lump, in pool order
                    k = ls[q]
                    i = pool[k]
                    lex[nl] = costs[i] - sizes[i] * cpt
                    lsz[nl] = sizes[i]
                    llo[nl] = 0
                    h = parr[k] + max_delay - step
                    lhi[nl] = h if h < horizon - 1 else horizon - 1
                    if lhi[nl] < 0:
                        lhi[nl] = 0
                    lpool[nl] = k
                    nl += 1
                n_pending = nl
                if lookahead:
                    while f0 < nf and fut[f0] < pos:
                        f0 += 1
                    for q in range(f0, nf):
                        if fut_tok_before[q] - fut_tok_before[f0] >= look_lump_cap:
                            break  # (a give-back moved pos back behind the scan's cut)
                        i = fut[q]
                        if max_advance > 0 and taken[i]:
                            continue
                        est = 1 + (fut_cum[q] - pos_cum) // max(budget, 1)
                        if est - max_advance >= horizon:
                            break
                        lex[nl] = costs[i] - sizes[i] * cpt
                        lsz[nl] = sizes[i]
                        lest[nl] = est
                        llo[nl] = est - max_advance if est > max_advance else 0
                        e2 = est + max_delay
                        lhi[nl] = e2 if e2 < horizon - 1 else horizon - 1
                        lpool[nl] = -1 - i  # a look-ahead lump: -1 - stream index
                        nl += 1
                if nl > 0:
                    _schedule_lumps(lex[:nl], lsz[:nl], llo[:nl], lhi[:nl], horizon, n_units,
                                    unit_cap, tc, delay_penalty, lt[:nl])
                    for q in range(n_pending):
                        if lt[q] == 0:
                            now[lpool[q]] = True
                    if max_advance > 0:
                        pull = _grow(pull, nl - n_pending)  # (npull is 0: grown out of the loop)
                        pull_est = _grow(pull_est, nl - n_pending)
                        for q in range(n_pending, nl):
                            if lt[q] == 0:
                                pull[npull] = -1 - lpool[q]
                                pull_est[npull] = lest[q]
                                npull += 1
                # the scheduler gives every unit of a step a lump; a budget below the step's
                # capacity cannot take them all: the lumps going now (at their deadline first,
                # then scheduled ones in pool order, then look-ahead ones) stop at the one that
                # crosses the budget, and the others wait for a later step
                acc = 0
                for q in range(nls):
                    k = ls[q]
                    if step - parr[k] >= max_delay:
                        acc += w[pool[k]]
                for q in range(nls):
                    k = ls[q]
                    if now[k] and step - parr[k] < max_delay:
                        if acc < lump_budget:
                            acc += w[pool[k]]
                        else:
                            now[k] = False
                j = 0
                for q in range(npull):
                    if acc < lump_budget:
                        acc += w[pull[q]]
                        pull[j] = pull[q]
                        pull_est[j] = pull_est[q]
                        j += 1
                npull = j
            # ---- weight of what goes now ---------------------------------------------------
            emit_w = 0
            pull_w = 0  # look-ahead lumps that will be read now take room too
            for q in range(npull):
                pull_w += w[pull[q]]
            emit_w = pull_w + fluid_w
            for q in range(nls):
                k = ls[q]
                if now[k] or step - parr[k] >= max_delay:
                    emit_w += w[pool[k]]
            if (emit_w < budget and pos < n and it < 3 and nlong < LONG_READ_STEPS * n_bins
                    and lump_tok < lump_tok_cap):
                # read fresh items until their light weight covers the shortfall, or until the
                # pool holds a long item for every microbatch or a step's capacity of lumps
                need = budget - emit_w
                got = 0
                while (pos < n and got < need and nlong < LONG_READ_STEPS * n_bins
                       and lump_tok < lump_tok_cap):
                    # room for a chunk at a time: growing (re-binding the arrays) inside the
                    # per-item loop made this loop ten times slower
                    lim = np_ + _CHUNK
                    pool, parr, now, ls = _grow_pool(pool, parr, now, ls, lim, nls + _CHUNK)
                    # ``now`` of a new lump is set by the next round's schedule before any read
                    pos, np_, nls, g, gt, gl, glt = _read_until(
                        sizes, costs, w, taken, cpt, thr, pos, need - got, np.bool_(True), np_,
                        lim, nls, step, pool, parr, now, ls, capacity,
                        LONG_READ_STEPS * n_bins - nlong, lump_tok_cap - lump_tok)
                    nlong += gl
                    lump_tok += glt
                    got += g + gt  # items read ahead count as read: the stream's weight
                    pos_cum += g + gt
                    ahead_w -= gt
                    fluid_w += g
                continue
            if emit_w > budget and np_ > n_old:
                # give back the end of this step's intake that overfills it
                keep_w = pull_w + fluid_w_old
                for q in range(nls):
                    k = ls[q]
                    if k >= n_old:
                        break
                    if now[k] or step - parr[k] >= max_delay:
                        keep_w += w[pool[k]]
                acc = keep_w
                cut = np_
                for k in range(n_old, np_):
                    i = pool[k]
                    if now[k] or not (costs[i] - sizes[i] * cpt > thr):
                        acc += w[i]
                    if acc >= budget:
                        cut = k + 1
                        break
                if cut < np_:
                    while f0 > 0 and fut[f0 - 1] >= pool[cut]:
                        f0 -= 1
                    for k in range(cut, np_):
                        i = pool[k]
                        if not (costs[i] - sizes[i] * cpt > thr):
                            pos_cum -= w[i]
                            fluid_w -= w[i]
                    while nls > 0 and ls[nls - 1] >= cut:
                        nls -= 1
                    for j in range(pool[cut], pos if max_advance > 0 else 0):
                        # items read ahead (taken) that pos moves back over
                        if taken[j] and not (costs[j] - sizes[j] * cpt > thr):
                            pos_cum -= w[j]
                            ahead_w += w[j]
                    pos = pool[cut]
                    np_ = cut
                    if ahead_skip[0] > pos:
                        ahead_skip[0] = pos
            break
        # ---- look-ahead lumps scheduled now are read ahead of their turn -------------------
        if pos < n:
            pool, parr, now, ls = _grow_pool(pool, parr, now, ls, np_ + npull, nls + npull)
            for q in range(npull):
                i = pull[q]
                if i >= pos and not taken[i]:
                    taken[i] = True
                    # delay = -(steps read early)
                    nls = _pool_add(pool, parr, now, ls, np_, nls, i, step + pull_est[q],
                                    np.bool_(True), np.bool_(True))
                    np_ += 1
        npull = 0
        # ---- at least one candidate per microbatch: a step whose budget holds fewer (heavy
        # lumps, or a small budget) reads on, past the budget, lumps read so going now
        if pos < n:
            # every light item is a candidate, a lump one when it goes now or is due (``ls``
            # holds exactly the pool's lumps: one pass over them, not over the pool)
            nc = np_ - nls
            for q in range(nls):
                k = ls[q]
                if now[k] or step - parr[k] >= max_delay:
                    nc += 1
            if nc < n_bins:  # room for what this reads (no growing in the loop)
                pool, parr, now, ls = _grow_pool(pool, parr, now, ls, np_ + n_bins - nc,
                                                 nls + n_bins - nc)
            while pos < n and nc < n_bins:
                if max_advance > 0 and taken[pos]:
                    if not (costs[pos] - sizes[pos] * cpt > thr):  # read ahead: counted now
                        pos_cum += w[pos]
                        ahead_w -= w[pos]
                    pos += 1
                    continue
                lump = (costs[pos] - sizes[pos] * cpt > thr)
                nls = _pool_add(pool, parr, now, ls, np_, nls, pos, step, np.bool_(True), lump)
                if not lump:
                    pos_cum += w[pos]
                    fluid_w += w[pos]
                np_ += 1
                pos += 1
                nc += 1
        # ---- pack the step; a step left with holes (heavy items that do not fill its
        # microbatches: its budget counted them, so no light item was read to fill in) reads
        # fresh items of the holes' weight and is packed again, once
        tail_break = False
        n1 = np_  # pool slots from here on were read by the top-up
        for rnd in range(2):
            if rnd == 0:
                # ---- candidates in priority order: deadline, scheduled lumps, old light,
                # fresh light
                nc = 0
                cls = np.empty(np_, dtype=np.int64)
                ck = np.empty(np_, dtype=np.int64)
                ccost = np.empty(np_)
                for k in range(np_):
                    i = pool[k]
                    lump = (costs[i] - sizes[i] * cpt > thr)
                    d = step - parr[k]
                    if d >= max_delay:
                        c = 0
                    elif lump:
                        if not now[k]:
                            continue
                        c = 1
                    elif d > 0:
                        c = 2
                    else:
                        c = 3
                    cls[nc] = c
                    ck[nc] = k
                    ccost[nc] = costs[i]
                    nc += 1
                if pos >= n:
                    # the stream is read: what is left goes to the tail
                    # (``stream._finish_tail``, only the microbatches it needs) when too few
                    # items or tokens remain for a full step
                    ctok = 0
                    for t in range(nc):
                        ctok += sizes[pool[ck[t]]]
                    if nc < n_bins or ctok <= dp * (m - 1) * capacity:
                        tail_break = True
                        break
                o1 = np.empty(nc, dtype=np.int64)
                _priority_order(cls[:nc], ccost[:nc], o1)
                order = np.empty(nc, dtype=np.int64)  # pool slots, by class then cost descending
                ocls = np.empty(nc, dtype=np.int64)
                for t in range(nc):
                    order[t] = ck[o1[t]]
                    ocls[t] = cls[o1[t]]
            else:
                # the top-up adds fresh light items only (its lumps do not go now): merged
                # into the first round's order, not sorted again
                order, ocls = _with_fresh(order, ocls, pool, n1, np_, sizes, costs, cpt, thr)
                nc = order.shape[0]
            items = np.empty(nc, dtype=np.int64)
            for t in range(nc):
                items[t] = pool[order[t]]
            bin_tokens[:] = 0
            bin_cost[:] = 0.0
            bin_count[:] = 0
            bin_of = np.empty(nc, dtype=np.int64)
            _pack_step(items, sizes, costs, n_units, bpu, capacity, bin_of, bin_tokens, bin_cost,
                       bin_count)
            _fill_empty_bins(items, sizes, costs, bin_of, bin_tokens, bin_cost, bin_count)
            if not topup or rnd == 1 or pos >= n:
                break
            hole = n_bins * capacity
            for b in range(n_bins):
                hole -= bin_tokens[b]
            if hole * 400 <= n_bins * capacity:
                break
            n1 = np_
            got = np.int64(0)
            nlong = _count_long(pool, np_, sizes, capacity)
            lump_tok = np.int64(0)
            for q in range(nls):
                lump_tok += sizes[pool[ls[q]]]
            while (pos < n and got < hole and nlong < LONG_TOPUP_STEPS * n_bins
                   and lump_tok < LUMP_TOPUP_STEPS * n_bins * capacity):
                # room for a chunk at a time (balanced_intake: no growing in a per-item loop)
                lim = np_ + _CHUNK
                pool, parr, now, ls = _grow_pool(pool, parr, now, ls, lim, nls + _CHUNK)
                pos, np_, nls, g, gt, gl, glt = _read_until(
                    sizes, costs, w, taken, cpt, thr, pos, hole - got, np.bool_(False), np_,
                    lim, nls, step, pool, parr, now, ls, capacity,
                    LONG_TOPUP_STEPS * n_bins - nlong,
                    LUMP_TOPUP_STEPS * n_bins * capacity - lump_tok)
                got += g
                nlong += gl
                lump_tok += glt
                pos_cum += g + gt  # taken light items passed: read ahead, counted now
                ahead_w -= gt
                fluid_w += g
        if tail_break:
            break
        # a token budget of the whole capacity: a step LPT left with holes is packed for tokens
        # first when that holds more at no worse balance (packing.balanced_fill; its best fit
        # keeps a count tree over rooms 0..capacity, so capacities above 4M tokens keep LPT's)
        if topup and (dp > 1 or not rank_units) and capacity <= BFD_MAX_CAPACITY:
            tok = np.int64(0)  # typed: a literal start compiles the callee for Literal[int]
            for b in range(n_bins):
                tok += bin_tokens[b]
            if (n_bins * capacity - tok) * 400 > n_bins * capacity:
                read_ahead = (max_advance > 0 and pos < n and light_total - pos_cum - ahead_w
                              > (max_delay + max_advance + 1) * budget)
                adopt, bo, bt, bn, fi, fe = _token_first(
                    items, order, ocls, parr, sizes, costs, w, taken, cpt, thr, pos,
                    max(budget, 1), max_advance, read_ahead, dp, m, capacity, bin_of, tok,
                    rank_units, lockstep, ahead_skip, bf_tree, bf_head)
                if adopt:
                    for a in range(fi.shape[0]):
                        if not (costs[fi[a]] - sizes[fi[a]] * cpt > thr):  # lumps: no weight
                            ahead_w += w[fi[a]]
                    pool, parr, now, ls, np_, nls, items, order = _take_ahead(
                        pool, parr, now, ls, np_, nls, taken, items, order, fi, fe, step)
                    bin_of = bo
                    bin_tokens[:] = bt
                    bin_count[:] = bn
                    bin_cost[:] = 0.0
                    for t in range(items.shape[0]):
                        if bin_of[t] >= 0:
                            bin_cost[bin_of[t]] += costs[items[t]]
        # whole-rank units: exchanges between the costliest and the cheapest rank while the
        # step is more than 0.5% above its lower bound (packing.rank_swap)
        if rank_units and dp > 1:
            # (bin_cost summed afresh there when an exchange is made)
            _rank_swaps(items, sizes, costs, bin_of, bin_tokens, bin_count, dp, m, capacity,
                        np.float64(SWAP_TOL), 2 * dp + 8, bin_cost)
        # final microbatch order (rank-major, cost descending inside a rank, 1F1B with pp > 1;
        # in lockstep by cost, dp to a position) and the step's entries
        _bin_positions(bin_cost, dp, m, rank_units, pp, scratch, lockstep)
        mb_counts = _grow(mb_counts, nmb + n_bins)
        step_mbs = _grow(step_mbs, step + 1)
        placed = np.zeros(np_, dtype=np.bool_)
        ne += _emit_step(items, order, bin_of, parr, step, scratch.pos, entry_item[ne:],
                         entry_delay[ne:], mb_counts[nmb:nmb + n_bins], placed)
        nmb += n_bins
        step_mbs[step] = m
        step += 1
        np_, nls, fluid_w, pool_long, pool_lump_tok = _compact_pool(
            pool, parr, ls, np_, placed, sizes, costs, w, cpt, thr, capacity)
    return ne, mb_counts[:nmb].copy(), step_mbs[:step].copy(), pool[:np_].copy(), parr[:np_].copy()
