"""Hybrid DP x CP planning of one global batch: per-document CP degree on one pool of ranks.

The ``dp x cp`` ranks of a pipeline stage form one pool of ``P`` ranks. A step runs ``R``
microbatch *rounds*; in every round the pool is partitioned into **aligned groups**: a group of
``2^k`` ranks starts at a rank id that is a multiple of ``2^k`` (the buddy rule, so a trainer
pre-creates one process group per aligned block: ``2P - 1`` groups at most). Every rank runs
exactly one microbatch per round (equal rounds on every rank), holding at most
``rank_capacity`` tokens. A document runs in one round, either **sharded** over all ranks of a
group (zigzag, as :mod:`balancer.cp_shard`; ``owner = -1``) or **whole** on one rank of its group
(``owner`` = that rank's index in the group, the cp_shard owner convention); nothing is cut.
Long documents get large groups, short ones stay whole.

The cost of a plan is the sum over rounds of the slowest rank's time in that round (a round ends
when its slowest rank does); a rank's time is the sum of the per-rank times of its documents
(``time[d, k]``: compute plus exposed K/V exchange on a group of ``2^k``, from
:meth:`balancer.cp_cost.CPCostModel.table`).

Algorithm (compiled kernels, deterministic, ties to the lower index):

1. **Round heights.** ``W`` = the pool's work at each document's most area-efficient size;
   candidate heights ``H_c = min(W / (P (j + c)), (1 - c/10) F)`` for ``c = 0 .. candidates-1``,
   ``j`` the memory minimum of rounds (tokens / (P x rank_capacity)) and ``F`` the height of a
   round of short documents that fills a rank's memory (a round cannot usefully be taller for
   them). Every candidate is planned (steps 2-3) and the smallest estimated step time wins;
   step 4 then repairs the winner.
2. **Group documents**: longer than a rank holds, or slower than ``H`` whole.

   a. *Tall* ones (no group size brings them under ``H``) share tall rounds ("shelves"): a
      shelf's documents each take the smallest group reaching the shelf's height, groups packed
      largest first from rank 0 (always aligned), and the height is chosen to minimise
      ``height - (work short documents can still do in the shelf's free room, by time and by
      memory) / P``. Shelves are formed greedily (each document joins the shelf whose score
      rises least, or opens one) and by dynamic programming over documents sorted by their
      fastest time (consecutive shelves of at most 8), the better kept, then repaired by moving
      a document to another or a new shelf, or swapping two, while the summed score drops.
   b. The others, by decreasing area, take the placement that raises least the estimate
      ``sum over rounds of max(height, H) + (short-document work the rounds cannot absorb) / P``:
      whole on the least-loaded rank of a round, on an existing group, on a free aligned block of
      a round (sizes from the smallest that fits memory to one above the smallest reaching
      ``H``), or a new round of its own height.
3. **Whole documents** by decreasing time, LPT over all (round, rank) slots keyed by load minus
   ``max(round height, H)`` (a round made tall by a long document takes short ones up to that
   height), slots whose memory is full set aside until a document fits them; rounds of height
   ``H`` are added first for the work the existing rounds cannot absorb (by time and by memory),
   and one more whenever no slot has room.
4. **Repair.** Local search on whole documents: a document on the slowest rank of a round moves
   to the slot with the most room below its own round's maximum (any round), or swaps with a
   cheaper document on one of the four least-loaded ranks of the same round, while that lowers
   the round's maximum without raising another's (at most ``local_search`` sweeps).

Output (:class:`HybridPlan`, CSR, every array int64):

* ``step_rounds[S + 1]``: rounds of step ``s`` are ``step_rounds[s]:step_rounds[s + 1]``;
* ``round_groups[R + 1]``: groups of round ``r`` are ``round_groups[r]:round_groups[r + 1]``,
  sorted by rank offset, tiling ``[0, P)`` exactly (ranks with nothing to do are empty groups of
  one);
* ``group_offset[G]``, ``group_size[G]``: first rank and size (a power of two, offset a multiple
  of it);
* ``group_entries[G + 1]``: entries of group ``g`` are ``group_entries[g]:group_entries[g + 1]``;
* ``entry_item[E]``: item ids (a document, or a piece of one when cutting was asked for);
* ``entry_owner[E]``: -1 sharded over the group, else the member (0 .. size - 1) holding it whole;
* ``item_doc[N]``, ``item_start[N]``, ``item_length[N]``: what each item is (identity without
  cutting);
* ``n_ranks``, ``rank_capacity``, ``documents_cut``.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._heap import heap_pop, heap_push
from ._jit import kernel
from .validate import MAX_LENGTH

#: relative slack under which a load counts as fitting a round's height
_TOL = 1e-9
#: most ranks in one pool
MAX_POOL = 2 ** 16


class HybridPlan(NamedTuple):
    step_rounds: np.ndarray
    round_groups: np.ndarray
    group_offset: np.ndarray
    group_size: np.ndarray
    group_entries: np.ndarray
    entry_item: np.ndarray
    entry_owner: np.ndarray
    item_doc: np.ndarray
    item_start: np.ndarray
    item_length: np.ndarray
    n_ranks: int
    rank_capacity: int
    documents_cut: int

    @property
    def n_rounds(self) -> int:
        return int(self.round_groups.shape[0] - 1)

    @property
    def n_steps(self) -> int:
        return int(self.step_rounds.shape[0] - 1)

    def round_of_group(self) -> np.ndarray:
        """int64[G]: the round of every group."""
        return np.repeat(np.arange(self.n_rounds, dtype=np.int64), np.diff(self.round_groups))

    def group_of_entry(self) -> np.ndarray:
        """int64[E]: the group of every entry."""
        return np.repeat(np.arange(self.group_size.shape[0], dtype=np.int64),
                         np.diff(self.group_entries))

    def rank_items(self, rnd: int, rank: int):
        """``(items, owner)`` of one rank in one round: the items of its group, with owner -1
        (a zigzag shard of it is this rank's) or the member holding it whole."""
        lo, hi = self.round_groups[rnd], self.round_groups[rnd + 1]
        off = self.group_offset[lo:hi]
        g = lo + int(np.searchsorted(off, rank, side="right")) - 1
        a, b = self.group_entries[g], self.group_entries[g + 1]
        return self.entry_item[a:b], self.entry_owner[a:b]


# ---- kernel helpers ------------------------------------------------------------------------
@kernel
def _free_block(gid, r, k, P):
    """Lowest offset of an aligned block of 2^k free ranks in round r, or -1."""
    size = 1 << k
    o = 0
    while o + size <= P:
        ok = True
        for p in range(o, o + size):
            if gid[r, p] >= 0:
                ok = False
                break
        if ok:
            return o
        o += size
    return -1


@kernel
def _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, r, o, k):
    g_off[ng] = o
    g_k[ng] = k
    g_round[ng] = r
    g_load[ng] = 0.0
    g_tok[ng] = 0
    for p in range(o, o + (1 << k)):
        gid[r, p] = ng
    return ng + 1


@kernel
def _slot_room(load, rtok, r, p, Teff, rho, cap):
    """Whole-document work slot (r, p) can still absorb below height Teff within its memory."""
    a = Teff - load[r, p]
    m = rho * (cap - rtok[r, p])
    if m < a:
        a = m
    return a if a > 0 else 0.0


@kernel
def _round_room(load, rtok, gid, g_k, r, Teff, rho, cap, P, whole_ok, ex_o, ex_size):
    """Room of every slot of round r (slots of groups of two or more excluded without whole
    documents there, and the block [ex_o, ex_o + ex_size) too, a group about to be made)."""
    s = 0.0
    for p in range(P):
        if not whole_ok and ((gid[r, p] >= 0 and g_k[gid[r, p]] > 0)
                             or ex_o <= p < ex_o + ex_size):
            continue
        s += _slot_room(load, rtok, r, p, Teff, rho, cap)
    return s


@kernel
def _size_for(time, tok, cap, d, h, ka_lo, ka_hi):
    """Smallest group size exponent (0: whole on one rank) at which document d fits memory and
    takes at most h seconds; -1 if none."""
    if tok[d, 0] <= cap and time[d, 0] <= h * (1 + _TOL):
        return 0
    for k in range(ka_lo, ka_hi + 1):
        if tok[d, k] <= cap and time[d, k] <= h * (1 + _TOL):
            return k
    return -1


@kernel
def _best_shelf(time, tok, cap, P, mem, m, ka_lo, ka_hi, rho, budget, out_k):
    """Best height of a round holding exactly the documents mem[:m] (each on the smallest group
    reaching the height; groups packed largest first, so any set with total size <= P fits):
    the height minus the whole-document work its free room absorbs (at most ``budget``) over P.
    Writes the sizes to out_k[:m]; returns (score, height), score inf when none fits."""
    best = np.inf
    best_h = 0.0
    lo = 0.0
    for i in range(m):  # no height below the slowest document's fastest time
        d = mem[i]
        f = np.inf
        if tok[d, 0] <= cap:
            f = time[d, 0]
        for k in range(ka_lo, ka_hi + 1):
            if tok[d, k] <= cap and time[d, k] < f:
                f = time[d, k]
        if f > lo:
            lo = f
    kk = np.empty(m, dtype=np.int64)
    for i in range(m):
        for k in range(0, ka_hi + 1):
            if k > 0 and k < ka_lo:
                continue
            h = time[mem[i], k]
            if tok[mem[i], k] > cap or h < lo * (1 - _TOL):
                continue
            used = 0
            absorb = 0.0
            ok = True
            for j in range(m):
                kj = _size_for(time, tok, cap, mem[j], h, ka_lo, ka_hi)
                if kj < 0:
                    ok = False
                    break
                kk[j] = kj
                used += 1 << kj
                a = h - time[mem[j], kj]
                b = rho * (cap - tok[mem[j], kj])
                if b < a:
                    a = b
                if a > 0:
                    absorb += a * (1 << kj)
            if not ok or used > P:
                continue
            f = h if h < rho * cap else rho * cap
            absorb += (P - used) * f
            if absorb > budget:
                absorb = budget
            sc = h - absorb / P
            if sc < best - 1e-12 or (abs(sc - best) <= 1e-12 and h < best_h):
                best = sc
                best_h = h
                out_k[:m] = kk
    return best, best_h


@kernel
def _shelf_dp(time, tok, cap, P, zs, nz, ka_lo, ka_hi, rho, fluid, out_shelf):
    """Shelves of consecutive documents (by decreasing fastest time, at most 8 a shelf): the
    partition with the smallest summed shelf score, by dynamic programming. Writes each
    document's shelf to out_shelf[:nz]; returns the number of shelves (its score summed is
    :func:`shelf_cost`)."""
    fast = np.empty(nz)
    for zi in range(nz):
        d = zs[zi]
        f = np.inf
        if tok[d, 0] <= cap:
            f = time[d, 0]
        for k in range(ka_lo, ka_hi + 1):
            if tok[d, k] <= cap and time[d, k] < f:
                f = time[d, k]
        fast[zi] = -f
    zo = np.argsort(fast, kind="mergesort")
    zsorted = zs[:nz][zo]
    dp = np.full(nz + 1, np.inf)
    dp[0] = 0.0
    prev = np.zeros(nz + 1, dtype=np.int64)
    mem = np.empty(8, dtype=np.int64)
    kk = np.empty(8, dtype=np.int64)
    for i in range(1, nz + 1):
        for j in range(max(0, i - 8), i):
            if dp[j] == np.inf:
                continue
            for q in range(j, i):
                mem[q - j] = zsorted[q]
            sc, h = _best_shelf(time, tok, cap, P, mem, i - j, ka_lo, ka_hi, rho, fluid, kk)
            if dp[j] + sc < dp[i] - 1e-12:
                dp[i] = dp[j] + sc
                prev[i] = j
    alt = np.empty(nz, dtype=np.int64)
    i = nz
    ns = 0
    while i > 0:
        j = prev[i]
        for q in range(j, i):
            alt[q] = ns
        i = j
        ns += 1
    for q in range(nz):
        out_shelf[zo[q]] = alt[q]
    return ns


@kernel
def _shelf_cost_kernel(time, tok, cap, P, docs, ka_lo, ka_hi, rho):
    nz = docs.shape[0]
    shelf = np.empty(nz, dtype=np.int64)
    ns = _shelf_dp(time, tok, cap, P, docs, nz, ka_lo, ka_hi, rho, np.inf, shelf)
    mem = np.empty(nz, dtype=np.int64)
    kk = np.empty(nz, dtype=np.int64)
    total = 0.0
    for s_ in range(ns):
        m = 0
        for zi in range(nz):
            if shelf[zi] == s_:
                mem[m] = docs[zi]
                m += 1
        sc, h = _best_shelf(time, tok, cap, P, mem, m, ka_lo, ka_hi, rho, np.inf, kk)
        total += sc
    return total


@kernel
def _shelf_eval(time, tok, cap, P, zs, shelf, nz, s, drop, add, ka_lo, ka_hi, rho, budget,
                mem, kk):
    """Score and absorbed work of shelf s without document index ``drop`` (-1: none) and with
    document ``add`` (-1: none); (0, 0) for an empty shelf."""
    m = 0
    for zj in range(nz):
        if shelf[zj] == s and zj != drop:
            mem[m] = zs[zj]
            m += 1
    if add >= 0:
        mem[m] = add
        m += 1
    if m == 0:
        return 0.0, 0.0
    sc, h = _best_shelf(time, tok, cap, P, mem, m, ka_lo, ka_hi, rho, budget, kk)
    return sc, (h - sc) * P


@kernel
def _kernel_candidate(time, tok, cap, P, ka_lo, ka_hi, whole_ok, fixed_k, H, j_rounds, R_cap,
                      order_a, order_b, min_len_b, ls_iters, d_round, d_off, d_k, d_owner):
    """Plan with round height ``H`` (``j_rounds`` rounds pre-created with a fixed partition).
    Returns (status, rounds, objective); status 1: ``R_cap`` rounds were too few (retry)."""
    n = time.shape[0]
    G_cap = R_cap * P
    load = np.zeros((R_cap, P))
    rtok = np.zeros((R_cap, P), dtype=np.int64)
    gid = np.full((R_cap, P), -1, dtype=np.int64)
    T = np.zeros(R_cap)
    room = np.zeros(R_cap)
    g_off = np.empty(G_cap, dtype=np.int64)
    g_k = np.empty(G_cap, dtype=np.int64)
    g_round = np.empty(G_cap, dtype=np.int64)
    g_load = np.empty(G_cap)
    g_tok = np.empty(G_cap, dtype=np.int64)
    nr = 0
    ng = 0
    fsize = 1 << fixed_k if fixed_k >= 0 else 0
    nb = order_b.shape[0]
    # whole documents as a fluid: their work, tokens and work per token
    s_area = 0.0
    s_tok = 0
    for q in range(nb):
        s_area += time[order_b[q], 0]
        s_tok += tok[order_b[q], 0]
    rho = s_area / s_tok if s_tok > 0 else 0.0
    if fixed_k >= 0:
        if j_rounds > R_cap:
            return 1, nr, 0.0
        for r in range(j_rounds):
            for o in range(0, P - fsize + 1, fsize):
                ng = _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, r, o, fixed_k)
        nr = j_rounds
    # ---- 2a. tall documents (no size reaches H) share rounds: each joins the round where the
    # re-optimised sizes raise the score least, or opens one ------------------------------------
    placed = np.zeros(n, dtype=np.bool_)
    if fixed_k < 0:
        na_ = order_a.shape[0]
        zs = np.empty(na_, dtype=np.int64)
        nz = 0
        fluid = s_area
        for q in range(na_):
            d = order_a[q]
            f = np.inf
            if tok[d, 0] <= cap:
                f = time[d, 0]
            for k in range(ka_lo, ka_hi + 1):
                if tok[d, k] <= cap and time[d, k] < f:
                    f = time[d, k]
            if f > H * (1 + _TOL) and nz < 32:
                zs[nz] = d
                nz += 1
            else:
                fluid += time[d, 0]
        if nz > 0:
            shelf = np.empty(nz, dtype=np.int64)
            sh_sc = np.empty(nz)
            sh_h = np.empty(nz)
            sh_ab = np.empty(nz)  # the budget each shelf's score used
            ns = 0
            mem = np.empty(nz, dtype=np.int64)
            kk = np.empty(nz, dtype=np.int64)
            used_ab = 0.0
            for zi in range(nz):
                d = zs[zi]
                mem[0] = d
                sc, h = _best_shelf(time, tok, cap, P, mem, 1, ka_lo, ka_hi, rho,
                                    fluid - used_ab, kk)
                best = sc
                b_s = -1
                b_h = h
                for s_ in range(ns):
                    m = 0
                    for zj in range(zi):
                        if shelf[zj] == s_:
                            mem[m] = zs[zj]
                            m += 1
                    mem[m] = d
                    m += 1
                    sc2, h2 = _best_shelf(time, tok, cap, P, mem, m, ka_lo, ka_hi, rho,
                                          fluid - used_ab + sh_ab[s_], kk)
                    if sc2 - sh_sc[s_] < best - 1e-12:
                        best = sc2 - sh_sc[s_]
                        b_s = s_
                        b_h = h2
                if b_s < 0:
                    b_s = ns
                    ns += 1
                    sh_sc[b_s] = 0.0
                    sh_ab[b_s] = 0.0
                shelf[zi] = b_s
                used_ab -= sh_ab[b_s]
                sh_sc[b_s] += best
                sh_h[b_s] = b_h
                sh_ab[b_s] = b_h - sh_sc[b_s]  # absorbed / P
                sh_ab[b_s] *= P
                used_ab += sh_ab[b_s]
            # the alternative: shelves of consecutive documents by decreasing fastest time,
            # the best such partition by dynamic programming; keep the better of the two
            used_ab = 0.0
            tot_g = 0.0
            for s_ in range(ns):
                sh_sc[s_], sh_ab[s_] = _shelf_eval(time, tok, cap, P, zs, shelf, nz, s_, -1, -1,
                                                   ka_lo, ka_hi, rho, fluid - used_ab, mem, kk)
                used_ab += sh_ab[s_]
                tot_g += sh_sc[s_]
            alt_shelf = np.empty(nz, dtype=np.int64)
            na_s = _shelf_dp(time, tok, cap, P, zs, nz, ka_lo, ka_hi, rho, fluid, alt_shelf)
            used2 = 0.0
            tot_a = 0.0
            a_sc = np.empty(nz)
            a_ab = np.empty(nz)
            for s_ in range(na_s):
                a_sc[s_], a_ab[s_] = _shelf_eval(time, tok, cap, P, zs, alt_shelf, nz, s_, -1,
                                                 -1, ka_lo, ka_hi, rho, fluid - used2, mem, kk)
                used2 += a_ab[s_]
                tot_a += a_sc[s_]
            if tot_a < tot_g - 1e-12:
                shelf[:nz] = alt_shelf
                ns = na_s
                sh_sc[:ns] = a_sc[:ns]
                sh_ab[:ns] = a_ab[:ns]
                used_ab = used2
            # repair the shelves: move a document to another (or a new) shelf, or swap two
            # documents of different shelves, while the summed score drops
            for it in range(4 * nz):
                bd = -1e-9
                b_z = -1
                b_z2 = -1
                b_s1 = -1
                for zi in range(nz):
                    s0 = shelf[zi]
                    cnt0 = 0
                    for zj in range(nz):
                        if shelf[zj] == s0:
                            cnt0 += 1
                    others = used_ab - sh_ab[s0]
                    sc0m, ab0m = _shelf_eval(time, tok, cap, P, zs, shelf, nz, s0, zi, -1,
                                             ka_lo, ka_hi, rho, fluid - others, mem, kk)
                    for s1 in range(ns + 1):
                        if s1 == s0 or (s1 == ns and cnt0 == 1):
                            continue
                        old1 = sh_sc[s1] if s1 < ns else 0.0
                        oab1 = sh_ab[s1] if s1 < ns else 0.0
                        sc1p, ab1p = _shelf_eval(time, tok, cap, P, zs, shelf, nz, s1, -1,
                                                 zs[zi], ka_lo, ka_hi, rho,
                                                 fluid - (others - oab1) - ab0m, mem, kk)
                        dl = sc0m + sc1p - sh_sc[s0] - old1
                        if dl < bd:
                            bd = dl
                            b_z = zi
                            b_z2 = -1
                            b_s1 = s1
                    for zj in range(zi + 1, nz):
                        s1 = shelf[zj]
                        if s1 == s0:
                            continue
                        rest = used_ab - sh_ab[s0] - sh_ab[s1]
                        # zi leaves s0 for s1, zj leaves s1 for s0
                        shelf[zj] = -2
                        sc0, ab0 = _shelf_eval(time, tok, cap, P, zs, shelf, nz, s0, zi,
                                               zs[zj], ka_lo, ka_hi, rho, fluid - rest, mem, kk)
                        shelf[zj] = s1
                        shelf[zi] = -2
                        sc1, ab1 = _shelf_eval(time, tok, cap, P, zs, shelf, nz, s1, zj,
                                               zs[zi], ka_lo, ka_hi, rho, fluid - rest - ab0,
                                               mem, kk)
                        shelf[zi] = s0
                        dl = sc0 + sc1 - sh_sc[s0] - sh_sc[s1]
                        if dl < bd:
                            bd = dl
                            b_z = zi
                            b_z2 = zj
                            b_s1 = s1
                if b_z < 0:
                    break
                s0 = shelf[b_z]
                if b_z2 >= 0:
                    shelf[b_z2] = s0
                    shelf[b_z] = b_s1
                else:
                    if b_s1 == ns:
                        sh_sc[ns] = 0.0
                        sh_ab[ns] = 0.0
                        ns += 1
                    shelf[b_z] = b_s1
                    empty = True
                    for zj in range(nz):
                        if shelf[zj] == s0:
                            empty = False
                    if empty:  # the last shelf takes the empty one's number
                        ns -= 1
                        for zj in range(nz):
                            if shelf[zj] == ns:
                                shelf[zj] = s0
                        if b_s1 == ns:
                            b_s1 = s0
                used_ab = 0.0
                for s_ in range(ns):
                    sh_sc[s_], sh_ab[s_] = _shelf_eval(time, tok, cap, P, zs, shelf, nz, s_, -1,
                                                       -1, ka_lo, ka_hi, rho, fluid - used_ab,
                                                       mem, kk)
                    used_ab += sh_ab[s_]
            # materialise: one round per shelf, groups largest first from rank 0
            for s_ in range(ns):
                m = 0
                for zj in range(nz):
                    if shelf[zj] == s_:
                        mem[m] = zs[zj]
                        m += 1
                _best_shelf(time, tok, cap, P, mem, m, ka_lo, ka_hi, rho, np.inf, kk)
                if nr == R_cap:
                    return 1, nr, 0.0
                r = nr
                nr += 1
                o = 0
                for kq in range(ka_hi, -1, -1):
                    for i in range(m):
                        if kk[i] != kq:
                            continue
                        ng = _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, r, o, kq)
                        if kq == 0:
                            _add_whole(mem[i], r, o, time, tok, gid, g_off, g_k, load, rtok,
                                       d_round, d_off, d_k, d_owner)
                        else:
                            _add_shard(mem[i], ng - 1, kq, time, tok, g_off, g_k, g_round,
                                       g_load, g_tok, load, rtok, d_round, d_off, d_k, d_owner)
                        placed[mem[i]] = True
                        o += 1 << kq
                mx = 0.0
                for p in range(P):
                    if load[r, p] > mx:
                        mx = load[r, p]
                T[r] = mx
    # ---- 2b. other group documents ----------------------------------------------------------
    s_room = 0.0  # sum of room[r]
    for r in range(nr):
        te = T[r] if T[r] > H else H
        room[r] = _round_room(load, rtok, gid, g_k, r, te, rho, cap, P, whole_ok, 0, 0)
        s_room += room[r]
    for q in range(order_a.shape[0]):
        d = order_a[q]
        if placed[d]:
            continue
        if fixed_k >= 0:
            # fixed groups: LPT, the group whose load grows least with memory room
            k = fixed_k
            bg = -1
            bl = np.inf
            for gi in range(ng):
                if g_tok[gi] + tok[d, k] <= cap and g_load[gi] + time[d, k] < bl:
                    bl = g_load[gi] + time[d, k]
                    bg = gi
            if bg < 0:
                if nr == R_cap:
                    return 1, nr, 0.0
                for o in range(0, P - fsize + 1, fsize):
                    ng = _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, nr, o, k)
                nr += 1
                bg = ng - P // fsize
            _add_shard(d, bg, k, time, tok, g_off, g_k, g_round, g_load, g_tok, load, rtok,
                       d_round, d_off, d_k, d_owner)
            r = g_round[bg]
            if g_load[bg] > T[r]:
                T[r] = g_load[bg]
            continue
        # hybrid: the placement that raises the estimated step time least, where the estimate
        # is sum over rounds of max(height, H) plus the whole-document work that the rounds'
        # free slots cannot absorb (by height and by memory), spread over the pool
        rem = s_area - s_room
        base_rem = rem if rem > 0 else 0.0
        best = np.inf
        b_r = -1
        b_k = -1
        b_kind = -1   # 0 whole on slot, 1 existing group, 2 new block, 3 new round
        b_t = -1      # slot / group / block offset
        whole_fits = tok[d, 0] <= cap
        # sizes worth trying: up to one above the smallest that reaches H
        k_top = ka_hi
        for k in range(ka_lo, ka_hi + 1):
            if tok[d, k] <= cap and time[d, k] <= H:
                k_top = k + 1 if k + 1 < ka_hi else ka_hi
                break
        for r in range(nr):
            te_old = T[r] if T[r] > H else H
            for k in range(0, k_top + 1):
                if k == 0:
                    if not whole_fits:
                        continue
                    t = time[d, 0]
                    # least-loaded slot with memory room
                    sp = -1
                    for p in range(P):
                        if not whole_ok and gid[r, p] >= 0 and g_k[gid[r, p]] > 0:
                            continue
                        if rtok[r, p] + tok[d, 0] <= cap and (sp < 0 or load[r, p] < load[r, sp]):
                            sp = p
                    if sp < 0:
                        continue
                    nt = load[r, sp] + t
                    newT = T[r] if T[r] > nt else nt
                    te = newT if newT > H else H
                    old_s = _slot_room(load, rtok, r, sp, te_old, rho, cap)
                    load[r, sp] += t
                    rtok[r, sp] += tok[d, 0]
                    if te != te_old:
                        nroom = _round_room(load, rtok, gid, g_k, r, te, rho, cap, P, whole_ok, 0,
                                            0)
                    else:
                        nroom = room[r] - old_s + _slot_room(load, rtok, r, sp, te, rho, cap)
                    load[r, sp] -= t
                    rtok[r, sp] -= tok[d, 0]
                    rem2 = rem - (nroom - room[r])
                    df = (te - te_old) + ((rem2 if rem2 > 0 else 0.0) - base_rem) / P
                    if df < best - 1e-12:
                        best = df
                        b_r = r
                        b_k = 0
                        b_kind = 0
                        b_t = sp
                    continue
                if k < ka_lo or tok[d, k] > cap:
                    continue
                t = time[d, k]
                size = 1 << k
                # an existing group of this size with memory room (least loaded), and a free block
                for kind in range(1, 3):
                    tgt = -1
                    if kind == 1:
                        for gi in range(ng):
                            if g_round[gi] == r and g_k[gi] == k and g_tok[gi] + tok[d, k] <= cap:
                                if tgt < 0 or g_load[gi] < g_load[tgt]:
                                    tgt = gi
                        if tgt < 0:
                            continue
                        o = g_off[tgt]
                    else:
                        o = _free_block(gid, r, k, P)
                        if o < 0:
                            continue
                        tgt = o
                    mx = 0.0
                    for p in range(o, o + size):
                        if load[r, p] > mx:
                            mx = load[r, p]
                    nt = mx + t
                    newT = T[r] if T[r] > nt else nt
                    te = newT if newT > H else H
                    old_s = 0.0
                    if te == te_old:
                        for p in range(o, o + size):
                            if whole_ok or gid[r, p] < 0 or g_k[gid[r, p]] == 0:
                                old_s += _slot_room(load, rtok, r, p, te_old, rho, cap)
                    for p in range(o, o + size):
                        load[r, p] += t
                        rtok[r, p] += tok[d, k]
                    if te == te_old:
                        nroom = room[r] - old_s
                        if whole_ok:
                            for p in range(o, o + size):
                                nroom += _slot_room(load, rtok, r, p, te, rho, cap)
                    else:
                        nroom = _round_room(load, rtok, gid, g_k, r, te, rho, cap, P, whole_ok,
                                            o, size if kind == 2 else 0)
                    for p in range(o, o + size):
                        load[r, p] -= t
                        rtok[r, p] -= tok[d, k]
                    rem2 = rem - (nroom - room[r])
                    df = (te - te_old) + ((rem2 if rem2 > 0 else 0.0) - base_rem) / P
                    if df < best - 1e-12:
                        best = df
                        b_r = r
                        b_k = k
                        b_kind = kind
                        b_t = tgt
        # a new round of this document's height
        for k in range(0, k_top + 1):
            if k == 0:
                if not whole_fits:
                    continue
            elif k < ka_lo or tok[d, k] > cap:
                continue
            t = time[d, k]
            size = 1 << k
            te = t if t > H else H
            a = te - t
            m = rho * (cap - tok[d, k])
            if m < a:
                a = m
            nroom = size * (a if a > 0 else 0.0)
            if k > 0 and not whole_ok:
                nroom = 0.0
            free = te if te < rho * cap else rho * cap
            nroom += (P - size) * free
            rem2 = rem - nroom
            df = te + ((rem2 if rem2 > 0 else 0.0) - base_rem) / P
            if df < best - 1e-12:
                best = df
                b_r = -1
                b_k = k
                b_kind = 3
                b_t = 0
        # apply
        if b_kind == 3:
            if nr == R_cap:
                return 1, nr, 0.0
            r = nr
            nr += 1
            ng = _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, r, 0, b_k)
            if b_k == 0:
                _add_whole(d, r, 0, time, tok, gid, g_off, g_k, load, rtok, d_round, d_off,
                           d_k, d_owner)
            else:
                _add_shard(d, ng - 1, b_k, time, tok, g_off, g_k, g_round, g_load, g_tok, load,
                           rtok, d_round, d_off, d_k, d_owner)
        else:
            r = b_r
            if b_kind == 0:
                if gid[r, b_t] < 0:
                    ng = _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, r, b_t, 0)
                _add_whole(d, r, b_t, time, tok, gid, g_off, g_k, load, rtok, d_round, d_off,
                           d_k, d_owner)
            elif b_kind == 1:
                _add_shard(d, b_t, b_k, time, tok, g_off, g_k, g_round, g_load, g_tok, load,
                           rtok, d_round, d_off, d_k, d_owner)
            else:
                ng = _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, r, b_t, b_k)
                _add_shard(d, ng - 1, b_k, time, tok, g_off, g_k, g_round, g_load, g_tok, load,
                           rtok, d_round, d_off, d_k, d_owner)
        m = 0.0
        for p in range(P):
            if load[r, p] > m:
                m = load[r, p]
        T[r] = m
        te = m if m > H else H
        s_room -= room[r]
        room[r] = _round_room(load, rtok, gid, g_k, r, te, rho, cap, P, whole_ok, 0, 0)
        s_room += room[r]
    # ---- 3. whole documents -----------------------------------------------------------------
    if nb > 0:
        absorb = 0.0
        free_tok = 0
        for r in range(nr):
            te = T[r] if T[r] > H else H
            absorb += _round_room(load, rtok, gid, g_k, r, te, rho, cap, P, whole_ok, 0, 0)
            for p in range(P):
                if not whole_ok and gid[r, p] >= 0 and g_k[gid[r, p]] > 0:
                    continue
                free_tok += cap - rtok[r, p]
        level = H if H < rho * cap else rho * cap
        extra = 0
        if s_area > absorb * (1 + 1e-9):
            extra = int(np.ceil((s_area - absorb) / (P * level) - 1e-9))
        if s_tok > free_tok:
            e2 = int(np.ceil((s_tok - free_tok) / (P * cap)))
            if e2 > extra:
                extra = e2
        if nr + extra > R_cap:
            return 1, nr, 0.0
        for e in range(extra):
            if fixed_k >= 0:
                for o in range(0, P - fsize + 1, fsize):
                    ng = _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, nr, o, fixed_k)
            nr += 1
        Te = np.empty(R_cap)
        for r in range(R_cap):
            Te[r] = T[r] if T[r] > H else H
        keys = np.empty(R_cap * P)
        ids = np.empty(R_cap * P, dtype=np.int64)
        pkeys = np.empty(R_cap * P)  # slots set aside for memory: max-heap on free tokens
        pids = np.empty(R_cap * P, dtype=np.int64)
        hs = 0
        ps = 0
        for r in range(nr):
            for p in range(P):
                if not whole_ok and gid[r, p] >= 0 and g_k[gid[r, p]] > 0:
                    continue
                hs = heap_push(keys, ids, hs, load[r, p] - Te[r], r * P + p)
        for q in range(nb):
            d = order_b[q]
            t = time[d, 0]
            L = tok[d, 0]
            while ps > 0 and -pkeys[0] >= L:  # set-aside slots that fit again
                ps = heap_pop(pkeys, pids, ps)
                j = pids[ps]
                hs = heap_push(keys, ids, hs, load[j // P, j % P] - Te[j // P], j)
            while True:
                if hs == 0:
                    if nr == R_cap:
                        return 1, nr, 0.0
                    if fixed_k >= 0:
                        for o in range(0, P - fsize + 1, fsize):
                            ng = _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, nr, o,
                                            fixed_k)
                    for p in range(P):
                        hs = heap_push(keys, ids, hs, -Te[nr], nr * P + p)
                    nr += 1
                hs = heap_pop(keys, ids, hs)
                ident = ids[hs]
                r = ident // P
                p = ident % P
                if rtok[r, p] + L <= cap:
                    break
                if cap - rtok[r, p] >= min_len_b[q + 1]:  # may still take a later document
                    ps = heap_push(pkeys, pids, ps, -float(cap - rtok[r, p]), ident)
            if gid[r, p] < 0:
                ng = _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, r, p, 0)
            _add_whole(d, r, p, time, tok, gid, g_off, g_k, load, rtok, d_round, d_off, d_k,
                       d_owner)
            if cap - rtok[r, p] >= min_len_b[q + 1]:
                hs = heap_push(keys, ids, hs, load[r, p] - Te[r], ident)
    # ---- 4. repair: local search on whole documents ------------------------------------------
    rmax = np.zeros(nr)
    for r in range(nr):
        m = 0.0
        for p in range(P):
            if load[r, p] > m:
                m = load[r, p]
        rmax[r] = m
    if ls_iters > 0:
        ng = _local_search(time, tok, cap, P, whole_ok, nr, ng, ls_iters, load, rtok, gid,
                           g_off, g_k, g_round, g_load, g_tok, rmax, d_round, d_off, d_k,
                           d_owner, order_a, order_b)
    obj = 0.0
    for r in range(nr):
        obj += rmax[r]
    return 0, nr, obj


@kernel
def _add_whole(d, r, p, time, tok, gid, g_off, g_k, load, rtok, d_round, d_off, d_k, d_owner):
    gi = gid[r, p]
    load[r, p] += time[d, 0]
    rtok[r, p] += tok[d, 0]
    d_round[d] = r
    d_off[d] = g_off[gi]
    d_k[d] = g_k[gi]
    d_owner[d] = p - g_off[gi]


@kernel
def _local_search(time, tok, cap, P, whole_ok, nr, ng, iters, load, rtok, gid, g_off, g_k,
                  g_round, g_load, g_tok, rmax, d_round, d_off, d_k, d_owner, order_a, order_b):
    """Move or swap whole documents off the slowest rank of each round while that lowers the
    round's maximum and raises no other round's; returns the group count."""
    n = time.shape[0]
    head = np.full(nr * P, -1, dtype=np.int64)
    nxt = np.full(n, -1, dtype=np.int64)
    prv = np.full(n, -1, dtype=np.int64)
    for src in range(2):
        order = order_b if src == 0 else order_a
        for q in range(order.shape[0] - 1, -1, -1):  # lists in decreasing time order
            d = order[q]
            if d_owner[d] < 0:
                continue
            _link(d, d_round[d] * P + d_off[d] + d_owner[d], head, nxt, prv)
    low = np.empty(4, dtype=np.int64)
    stuck = np.zeros(nr, dtype=np.bool_)  # no move found: skipped until a final full sweep
    final = False
    for it in range(iters):
        before = 0.0
        for r in range(nr):
            before += rmax[r]
        for r in range(nr):
            if stuck[r] and not final:
                continue
            p = 0
            for pp in range(P):
                if load[r, pp] > load[r, p]:
                    p = pp
            mx = load[r, p]
            x = head[r * P + p]
            moved = False
            while x >= 0:
                t = time[x, 0]
                L = tok[x, 0]
                bid = -1
                bsl = _TOL * mx
                for s in range(nr):
                    lim = mx if s == r else rmax[s]
                    if lim - t <= bsl:
                        continue
                    for q in range(P):
                        if rtok[s, q] + L > cap or load[s, q] + t >= lim - bsl:
                            continue
                        if s == r and q == p:
                            continue
                        if not whole_ok and gid[s, q] >= 0 and g_k[gid[s, q]] > 0:
                            continue
                        bsl = lim - (load[s, q] + t)
                        bid = s * P + q
                if bid >= 0:
                    s = bid // P
                    q = bid % P
                    _unlink(x, r * P + p, head, nxt, prv)
                    _link(x, bid, head, nxt, prv)
                    load[r, p] -= t
                    rtok[r, p] -= L
                    if gid[s, q] < 0:
                        ng = _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, s, q, 0)
                    _add_whole(x, s, q, time, tok, gid, g_off, g_k, load, rtok, d_round, d_off,
                               d_k, d_owner)
                    moved = True
                    break
                x = nxt[x]
            if not moved:
                # swap a document of the slowest rank with a cheaper one on one of the four
                # least-loaded ranks of the same round
                nl = 0
                for q in range(P):
                    if q == p or (not whole_ok and gid[r, q] >= 0 and g_k[gid[r, q]] > 0):
                        continue
                    if nl < 4:
                        low[nl] = q
                        nl += 1
                    else:
                        w = 0
                        for j in range(1, 4):
                            if load[r, low[j]] > load[r, low[w]]:
                                w = j
                        if load[r, q] < load[r, low[w]]:
                            low[w] = q
                bx = -1
                by = -1
                bq = -1
                bnew = mx * (1 - _TOL)
                x = head[r * P + p]
                while x >= 0:
                    for j in range(nl):
                        q = low[j]
                        y = head[r * P + q]
                        while y >= 0:
                            dlt = time[x, 0] - time[y, 0]
                            if dlt > 0:
                                a = mx - dlt
                                b = load[r, q] + dlt
                                nm = a if a > b else b
                                if (nm < bnew and rtok[r, q] - tok[y, 0] + tok[x, 0] <= cap
                                        and rtok[r, p] - tok[x, 0] + tok[y, 0] <= cap):
                                    bnew = nm
                                    bx = x
                                    by = y
                                    bq = q
                            y = nxt[y]
                    x = nxt[x]
                if bx >= 0:
                    _swap_whole(bx, by, r, p, bq, P, time, tok, load, rtok, head, nxt, prv,
                                gid, g_off, g_k, d_round, d_off, d_k, d_owner)
                    moved = True
            if moved:
                m = 0.0
                for pp in range(P):
                    if load[r, pp] > m:
                        m = load[r, pp]
                rmax[r] = m
            else:
                stuck[r] = True
        after = 0.0
        for r in range(nr):
            after += rmax[r]
        if after >= before * (1 - 1e-9):
            if final:
                break
            final = True
            stuck[:] = False
        else:
            final = False
    return ng


@kernel
def _add_shard(d, gi, k, time, tok, g_off, g_k, g_round, g_load, g_tok, load, rtok, d_round,
               d_off, d_k, d_owner):
    t = time[d, k]
    r = g_round[gi]
    g_load[gi] += t
    g_tok[gi] += tok[d, k]
    for p in range(g_off[gi], g_off[gi] + (1 << g_k[gi])):
        load[r, p] += t
        rtok[r, p] += tok[d, k]
    d_round[d] = r
    d_off[d] = g_off[gi]
    d_k[d] = k
    d_owner[d] = -1


@kernel
def _unlink(x, s, head, nxt, prv):
    if prv[x] >= 0:
        nxt[prv[x]] = nxt[x]
    else:
        head[s] = nxt[x]
    if nxt[x] >= 0:
        prv[nxt[x]] = prv[x]
    prv[x] = -1
    nxt[x] = -1


@kernel
def _link(x, s, head, nxt, prv):
    nxt[x] = head[s]
    prv[x] = -1
    if head[s] >= 0:
        prv[head[s]] = x
    head[s] = x


@kernel
def _swap_whole(x, y, r, p, q, P, time, tok, load, rtok, head, nxt, prv, gid, g_off, g_k,
                d_round, d_off, d_k, d_owner):
    """Exchange whole document x (on rank p of round r) with y (rank q of round r)."""
    _unlink(x, r * P + p, head, nxt, prv)
    _unlink(y, r * P + q, head, nxt, prv)
    _link(x, r * P + q, head, nxt, prv)
    _link(y, r * P + p, head, nxt, prv)
    dt = time[x, 0] - time[y, 0]
    dl = tok[x, 0] - tok[y, 0]
    load[r, p] -= dt
    load[r, q] += dt
    rtok[r, p] -= dl
    rtok[r, q] += dl
    gp = gid[r, p]
    gq = gid[r, q]
    d_off[x] = g_off[gq]
    d_k[x] = g_k[gq]
    d_owner[x] = q - g_off[gq]
    d_off[y] = g_off[gp]
    d_k[y] = g_k[gp]
    d_owner[y] = p - g_off[gp]


@kernel
def _run_candidate(time, tok, cap, P, ka_lo, ka_hi, whole_ok, fixed_k, H, j_rounds, shard_all,
                   oa, ob, ls_iters, c_round, c_off, c_k, c_owner):
    """Split documents into group and whole ones at height H and plan them; (rounds, obj)."""
    n = time.shape[0]
    shard_ok = ka_lo >= 1 and ka_hi >= ka_lo
    in_a = np.zeros(n, dtype=np.bool_)
    na = 0
    for d in range(n):
        if shard_all or tok[d, 0] > cap or (shard_ok and time[d, 0] > H):
            in_a[d] = True
            na += 1
    order_a = np.empty(na, dtype=np.int64)
    order_b = np.empty(n - na, dtype=np.int64)
    ia = 0
    for q in range(n):
        if in_a[oa[q]]:
            order_a[ia] = oa[q]
            ia += 1
    ib = 0
    for q in range(n):
        if not in_a[ob[q]]:
            order_b[ib] = ob[q]
            ib += 1
    min_len_b = np.empty(n - na + 1, dtype=np.int64)
    min_len_b[n - na] = cap + 1
    for q in range(n - na - 1, -1, -1):
        L = tok[order_b[q], 0]
        min_len_b[q] = L if L < min_len_b[q + 1] else min_len_b[q + 1]
    R_cap = j_rounds + na + 4
    while True:
        st, nr, obj = _kernel_candidate(time, tok, cap, P, ka_lo, ka_hi, whole_ok, fixed_k, H,
                                        j_rounds, R_cap, order_a, order_b, min_len_b, ls_iters,
                                        c_round, c_off, c_k, c_owner)
        if st == 0:
            return nr, obj
        R_cap *= 2


@kernel
def _plan_kernel(time, tok, cap, P, ka_lo, ka_hi, whole_ok, fixed_k, n_cand, ls_iters, oa, ob,
                 d_round, d_off, d_k, d_owner):
    """Plan one global batch: every candidate round height without repair, then the best one
    again with repair, written to the outputs (int64[n] each). ``oa``: documents by decreasing
    area at their smallest size, ``ob``: by decreasing whole time. Returns (rounds, objective,
    candidate index)."""
    n = time.shape[0]
    K = time.shape[1]
    # fixed groups of two or more without whole documents: every document is sharded
    shard_all = fixed_k >= 1 and not whole_ok
    # the pool's work at each document's most area-efficient size, the memory minimum of
    # rounds, and the height a round of short documents reaches when its memory is full
    work = 0.0
    tokens = 0
    st_ = 0.0
    sk_ = 0
    for d in range(n):
        best = np.inf
        for k in range(K):
            if tok[d, k] > cap:
                continue
            if k > 0 and (k < ka_lo or k > ka_hi):
                continue
            if k == 0 and shard_all:
                continue
            a = time[d, k] * (1 << k)
            if a < best:
                best = a
        work += best
        tokens += tok[d, 0]
        if 2 * tok[d, 0] <= cap:
            st_ += time[d, 0]
            sk_ += tok[d, 0]
    j_lo = max(1, int(np.ceil(tokens / (P * cap) - 1e-12)))
    full = st_ / sk_ * cap if sk_ > 0 else np.inf
    best_obj = np.inf
    best_c = -1
    best_nr = 0
    best_H = 0.0
    c_round = np.empty(n, dtype=np.int64)
    c_off = np.empty(n, dtype=np.int64)
    c_k = np.empty(n, dtype=np.int64)
    c_owner = np.empty(n, dtype=np.int64)
    for c in range(n_cand):
        H = work / (P * (j_lo + c))
        if H > full * (1 - 0.1 * c):
            H = full * (1 - 0.1 * c)
        nr, obj = _run_candidate(time, tok, cap, P, ka_lo, ka_hi, whole_ok, fixed_k, H,
                                 j_lo + c, shard_all, oa, ob, 0, c_round, c_off, c_k, c_owner)
        if obj < best_obj * (1 - 1e-12):
            best_obj = obj
            best_c = c
            best_nr = nr
            best_H = H
            d_round[:] = c_round
            d_off[:] = c_off
            d_k[:] = c_k
            d_owner[:] = c_owner
    if ls_iters > 0 and best_nr > 0:
        best_obj = _repair(time, tok, cap, P, whole_ok, fixed_k, best_nr, ls_iters, ob, d_round,
                           d_off, d_k, d_owner)
    return best_nr, best_obj, best_c


@kernel
def _repair(time, tok, cap, P, whole_ok, fixed_k, nr, iters, ob, d_round, d_off, d_k, d_owner):
    """Local search (step 4) on a finished plan, rebuilt from its per-item arrays, which are
    updated in place; returns the objective."""
    n = time.shape[0]
    G_cap = nr * P
    load = np.zeros((nr, P))
    rtok = np.zeros((nr, P), dtype=np.int64)
    gid = np.full((nr, P), -1, dtype=np.int64)
    g_off = np.empty(G_cap, dtype=np.int64)
    g_k = np.empty(G_cap, dtype=np.int64)
    g_round = np.empty(G_cap, dtype=np.int64)
    g_load = np.empty(G_cap)
    g_tok = np.empty(G_cap, dtype=np.int64)
    ng = 0
    if fixed_k >= 0:
        fs = 1 << fixed_k
        for r in range(nr):
            for o in range(0, P - fs + 1, fs):
                ng = _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, r, o, fixed_k)
    for d in range(n):
        r = d_round[d]
        o = d_off[d]
        if gid[r, o] < 0:
            ng = _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, r, o, d_k[d])
        if d_owner[d] < 0:
            _add_shard(d, gid[r, o], d_k[d], time, tok, g_off, g_k, g_round, g_load, g_tok, load,
                       rtok, d_round, d_off, d_k, d_owner)
        else:
            load[r, o + d_owner[d]] += time[d, 0]
            rtok[r, o + d_owner[d]] += tok[d, 0]
    rmax = np.zeros(nr)
    for r in range(nr):
        for p in range(P):
            if load[r, p] > rmax[r]:
                rmax[r] = load[r, p]
    none = np.empty(0, dtype=np.int64)
    _local_search(time, tok, cap, P, whole_ok, nr, ng, iters, load, rtok, gid, g_off, g_k,
                  g_round, g_load, g_tok, rmax, d_round, d_off, d_k, d_owner, none, ob)
    obj = 0.0
    for r in range(nr):
        obj += rmax[r]
    return obj


# ---- public wrappers -------------------------------------------------------------------------
def _check_table(time, tokens, rank_capacity, n_ranks):
    n_ranks = int(n_ranks)
    if not 1 <= n_ranks <= MAX_POOL:
        raise ValueError(f"pool of {n_ranks} ranks: must be 1..{MAX_POOL}")
    cap = int(rank_capacity)
    if not 1 <= cap <= MAX_LENGTH:
        raise ValueError(f"rank_capacity {cap} must be in 1..{MAX_LENGTH}")
    time = np.ascontiguousarray(time, dtype=np.float64)
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    K = n_ranks.bit_length()
    if time.ndim != 2 or time.shape[1] != K or tokens.shape != time.shape:
        raise ValueError(f"time and tokens must be [n, {K}] (group sizes 1..{1 << (K - 1)} of "
                         f"a pool of {n_ranks}), got {time.shape} and {tokens.shape}")
    if time.size and not (np.isfinite(time).all() and (time >= 0).all()):
        d, k = np.argwhere(~np.isfinite(time) | (time < 0))[0]
        raise ValueError(f"sample {d}: time {time[d, k]!r} on {1 << k} ranks is not a finite "
                         f"non-negative number")
    if tokens.size and (tokens < 1).any():
        d, k = np.argwhere(tokens < 1)[0]
        raise ValueError(f"sample {d}: {tokens[d, k]} tokens per rank on {1 << k} ranks must "
                         f"be >= 1")
    return time, tokens, cap, n_ranks


def plan_batch(time, tokens, rank_capacity: int, n_ranks: int, *, candidates: int = 2,
               local_search: int = 64, sizes: tuple | None = None, whole: bool = True,
               fixed: int | None = None, doc_ids=None, lengths=None) -> HybridPlan:
    """Plan one global batch of documents on a pool of ``n_ranks`` ranks.

    ``time`` float64[n, K] and ``tokens`` int64[n, K]: per-rank seconds and tokens of every
    document on aligned groups of ``1, 2, ..., 2^(K-1)`` ranks (``K = n_ranks.bit_length()``),
    e.g. from :meth:`balancer.cp_cost.CPCostModel.table`. ``sizes=(lo, hi)`` restricts sharded
    documents to groups of ``2^lo .. 2^hi`` ranks (default: any size >= 2); ``whole=False``
    forbids whole documents on members of groups of two or more; ``fixed=k`` makes every round
    the fixed partition into blocks of ``2^k`` ranks (fixed CP). ``candidates`` round heights are
    tried; ``local_search`` bounds the repair sweeps (0: none). A document that no group holds
    is an error naming it (cutting is the caller's policy: :func:`balancer.hybrid.plan_hybrid`).
    ``doc_ids``/``lengths`` only label the items of the returned plan."""
    time, tokens, cap, P = _check_table(time, tokens, rank_capacity, n_ranks)
    n, K = time.shape
    lo, hi = (1, K - 1) if sizes is None else (int(sizes[0]), int(sizes[1]))
    if not (hi < lo or (1 <= lo <= hi <= K - 1)):
        raise ValueError(f"sizes {sizes}: group size exponents must lie in 1..{K - 1}")
    fk = -1 if fixed is None else int(fixed)
    if fixed is not None:
        if not 0 <= fk <= K - 1 or P % (1 << fk):
            raise ValueError(f"fixed group of {1 << fk} ranks does not tile a pool of {P}")
        lo, hi = (fk, fk) if fk >= 1 else (1, 0)
    if int(candidates) < 1:
        raise ValueError(f"candidates {candidates} must be >= 1")
    fits = tokens[:, 0] <= cap
    if hi >= lo:
        fits = fits | (tokens[:, lo:hi + 1] <= cap).any(axis=1)
    if n and not fits.all():
        d = int(np.flatnonzero(~fits)[0])
        big = 1 << max(hi, 0) if hi >= lo else 1
        raise ValueError(f"sample {d}: {int(tokens[d, 0])} tokens do not fit any group of the "
                         f"pool ({P} ranks, at most {big} per group, rank_capacity {cap} "
                         f"tokens, CP padding included)")
    d_round = np.zeros(n, dtype=np.int64)
    d_off = np.zeros(n, dtype=np.int64)
    d_k = np.zeros(n, dtype=np.int64)
    d_owner = np.zeros(n, dtype=np.int64)
    nr = 0
    if n:
        # documents by decreasing area at their smallest size (whole when it fits), and by
        # decreasing whole time (stable: ties to the lower index)
        shard_all = fk >= 1 and not whole
        kk = np.where((tokens[:, 0] <= cap) & (not shard_all), 0, -1)
        if hi >= lo:
            first = lo + np.argmax(tokens[:, lo:hi + 1] <= cap, axis=1)
            kk = np.where(kk < 0, first, kk)
        area = time[np.arange(n), kk] * (1 << kk)
        oa = np.argsort(-area, kind="stable").astype(np.int64)
        ob = np.argsort(-time[:, 0], kind="stable").astype(np.int64)
        nr, _, _ = _plan_kernel(time, tokens, np.int64(cap), np.int64(P), np.int64(lo),
                                np.int64(hi), bool(whole), np.int64(fk), np.int64(candidates),
                                np.int64(local_search), oa, ob, d_round, d_off, d_k, d_owner)
    return assemble(d_round, d_off, d_k, d_owner, int(nr), P, cap, fixed=fk,
                    doc_ids=doc_ids, lengths=lengths)


@kernel
def _assemble_kernel(d_round, d_off, d_k, d_owner, nr, P, fixed_k, round_groups, group_offset,
                     group_size, group_entries, entry_item, entry_owner):
    """CSR of a plan from per-item (round, offset, size exponent, owner) into preallocated
    arrays (groups <= nr * P); returns the group count."""
    n = d_round.shape[0]
    start = np.full(nr * P, -1, dtype=np.int64)
    for d in range(n):
        start[d_round[d] * P + d_off[d]] = d_k[d]
    bs = 1 << fixed_k if fixed_k >= 0 else 1
    gidx = np.full(nr * P, -1, dtype=np.int64)
    G = 0
    for r in range(nr):
        round_groups[r] = G
        p = 0
        while p < P:
            k = start[r * P + p]
            size = bs if k < 0 else 1 << k
            group_offset[G] = p
            group_size[G] = size
            gidx[r * P + p] = G
            G += 1
            p += size
    round_groups[nr] = G
    # entries by group, inside a group by owner (-1, sharded, first) then item: two stable
    # counting sorts
    cnt = np.zeros(P + 2, dtype=np.int64)
    for d in range(n):
        cnt[d_owner[d] + 2] += 1
    for j in range(1, P + 2):
        cnt[j] += cnt[j - 1]
    by_owner = np.empty(n, dtype=np.int64)
    for d in range(n):
        j = d_owner[d] + 1
        by_owner[cnt[j]] = d
        cnt[j] += 1
    for g in range(G + 1):
        group_entries[g] = 0
    for d in range(n):
        group_entries[gidx[d_round[d] * P + d_off[d]] + 1] += 1
    for g in range(G):
        group_entries[g + 1] += group_entries[g]
    fill = group_entries[:G].copy()
    for q in range(n):
        d = by_owner[q]
        g = gidx[d_round[d] * P + d_off[d]]
        entry_item[fill[g]] = d
        entry_owner[fill[g]] = d_owner[d]
        fill[g] += 1
    return G


def shelf_cost(time, tokens, rank_capacity: int, n_ranks: int, docs, density: float) -> float:
    """Summed score of the rounds that the documents ``docs`` (rows of the cost table) would
    share as tall rounds: per round its height minus the work whole short documents of
    ``density`` seconds per token could still do in its free room, over the pool (the planner's
    phase 2a estimate, with unlimited short documents)."""
    time, tokens, cap, P = _check_table(time, tokens, rank_capacity, n_ranks)
    docs = np.ascontiguousarray(docs, dtype=np.int64)
    if docs.shape[0] == 0:
        return 0.0
    K = time.shape[1]
    return float(_shelf_cost_kernel(time, tokens, np.int64(cap), np.int64(P), docs, np.int64(1),
                                    np.int64(K - 1), float(density)))


def assemble(d_round, d_off, d_k, d_owner, n_rounds, n_ranks, rank_capacity, *, fixed=-1,
             doc_ids=None, lengths=None, documents_cut=0, item_start=None) -> HybridPlan:
    """The CSR plan of one step from per-item (round, group offset, group size exponent,
    owner); ranks no group covers become empty groups of one (of ``2^fixed`` ranks with a fixed
    partition)."""
    n = d_round.shape[0]
    P = int(n_ranks)
    nr = int(n_rounds)
    rg = np.empty(nr + 1, dtype=np.int64)
    go = np.empty(nr * P, dtype=np.int64)
    gs = np.empty(nr * P, dtype=np.int64)
    ge = np.empty(nr * P + 1, dtype=np.int64)
    ei = np.empty(n, dtype=np.int64)
    eo = np.empty(n, dtype=np.int64)
    G = _assemble_kernel(np.ascontiguousarray(d_round, np.int64),
                         np.ascontiguousarray(d_off, np.int64),
                         np.ascontiguousarray(d_k, np.int64),
                         np.ascontiguousarray(d_owner, np.int64), np.int64(nr), np.int64(P),
                         np.int64(fixed), rg, go, gs, ge, ei, eo)
    ids = np.arange(n, dtype=np.int64) if doc_ids is None else np.asarray(doc_ids, np.int64)
    starts = np.zeros(n, np.int64) if item_start is None else np.asarray(item_start, np.int64)
    lens = np.zeros(n, np.int64) if lengths is None else np.asarray(lengths, np.int64)
    return HybridPlan(np.array([0, nr], dtype=np.int64), rg, go[:G], gs[:G], ge[:G + 1], ei, eo,
                      ids, starts, lens, P, int(rank_capacity), int(documents_cut))


def concat_plans(plans) -> HybridPlan:
    """Steps one after another: the plans of consecutive global batches as one plan whose item
    ids are renumbered consecutively (``item_doc`` keeps each plan's own labels)."""
    plans = list(plans)
    if not plans:
        raise ValueError("no plans to concatenate")
    P, cap = plans[0].n_ranks, plans[0].rank_capacity
    step_rounds = [0]
    rg, go, gs, ge, ei, eo, idoc, ist, ilen = [], [], [], [], [], [], [], [], []
    r0 = g0 = e0 = i0 = 0
    cut = 0
    for p in plans:
        if p.n_ranks != P:
            raise ValueError(f"plans of {p.n_ranks} and {P} ranks cannot be concatenated")
        for s in range(p.n_steps):
            step_rounds.append(r0 + int(p.step_rounds[s + 1]))
        rg.append(p.round_groups[:-1] + g0)
        go.append(p.group_offset)
        gs.append(p.group_size)
        ge.append(p.group_entries[:-1] + e0)
        ei.append(p.entry_item + i0)
        eo.append(p.entry_owner)
        idoc.append(p.item_doc)
        ist.append(p.item_start)
        ilen.append(p.item_length)
        r0 += p.n_rounds
        g0 += p.group_size.shape[0]
        e0 += p.entry_item.shape[0]
        i0 += p.item_doc.shape[0]
        cut += p.documents_cut
    cat = np.concatenate
    return HybridPlan(np.asarray(step_rounds, np.int64), cat(rg + [np.array([g0])]), cat(go),
                      cat(gs), cat(ge + [np.array([e0])]), cat(ei), cat(eo), cat(idoc), cat(ist),
                      cat(ilen), P, cap, cut)


def check_plan(plan: HybridPlan, tokens=None, *, aligned: bool = True) -> None:
    """Raise AssertionError unless the plan is well formed: groups of each round tile the pool,
    (aligned power-of-two groups when ``aligned``), every item exactly once, owners inside their
    group, and (with ``tokens`` int64[N, K]) no rank over its token limit in any round."""
    P = plan.n_ranks
    rg, off, size = plan.round_groups, plan.group_offset, plan.group_size
    assert rg[0] == 0 and rg[-1] == off.shape[0] and (np.diff(rg) >= 1).all()
    assert plan.step_rounds[0] == 0 and plan.step_rounds[-1] == plan.n_rounds
    for r in range(plan.n_rounds):
        o, s = off[rg[r]:rg[r + 1]], size[rg[r]:rg[r + 1]]
        assert o[0] == 0 and (o[1:] == (o + s)[:-1]).all() and o[-1] + s[-1] == P, r
        if aligned:
            assert ((s & (s - 1)) == 0).all() and (o % s == 0).all(), r
    ent = plan.entry_item
    assert np.array_equal(np.sort(ent), np.arange(plan.item_doc.shape[0]))
    gsz = np.repeat(size, np.diff(plan.group_entries))
    own = plan.entry_owner
    assert ((own == -1) | ((own >= 0) & (own < gsz))).all()
    if tokens is not None:
        tokens = np.asarray(tokens)
        k = np.log2(gsz).astype(np.int64)
        g_of = plan.group_of_entry()
        per = np.where(own < 0, tokens[ent, k], tokens[ent, 0])
        rank_tok = np.zeros((plan.n_rounds, P), dtype=np.int64)
        rnd = plan.round_of_group()[g_of]
        first = off[g_of]
        sh = own < 0
        for e in np.flatnonzero(sh):
            rank_tok[rnd[e], first[e]:first[e] + gsz[e]] += per[e]
        np.add.at(rank_tok, (rnd[~sh], first[~sh] + own[~sh]), per[~sh])
        assert rank_tok.max(initial=0) <= plan.rank_capacity, rank_tok.max()


__all__ = ["HybridPlan", "assemble", "check_plan", "concat_plans", "plan_batch", "shelf_cost"]
