"""Hybrid DP x CP planning of one global batch: per-document CP degree on one pool of ranks.

The ``dp x cp`` ranks of a pipeline stage form one pool of ``P`` ranks. A step runs ``R``
microbatch *rounds*; in every round the pool is partitioned into **aligned groups**: a group of
``2^k`` ranks starts at a rank id that is a multiple of ``2^k`` (the buddy rule, so a trainer
pre-creates one process group per aligned block: ``2P - 1`` groups at most). Every rank runs
exactly one microbatch per round (equal rounds on every rank), holding at most
``rank_capacity`` tokens. A document runs in one round, either **sharded** over all ranks of a
group (zigzag, as :mod:`balancer.loader.cp_shard`; ``owner = -1``) or **whole** on one rank of its group
(``owner`` = that rank's index in the group, the cp_shard owner convention); nothing is cut.
Long documents get large groups, short ones stay whole.

The cost of a plan is the sum over rounds of the slowest rank's time in that round (a round ends
when its slowest rank does); a rank's time is the sum of the per-rank times of its documents
(``time[d, k]``: compute plus exposed K/V exchange on a group of ``2^k``, from
:meth:`balancer.cost.cp.CPCostModel.table`).

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

Modules (one concept each; this one keeps the public names): :mod:`packing.hybrid_groups` (the
round state and its helpers), :mod:`packing.hybrid_shelf` (step 2a: shelf sizing and forming),
:mod:`packing.hybrid_place` (steps 2b and 3), :mod:`packing.hybrid_search` (step 4),
:mod:`packing.hybrid_candidate` (one candidate height, the choice among candidates).

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

from ._jit import kernel
from .hybrid_candidate import _plan_kernel
from .hybrid_groups import Placement, batch
from .hybrid_shelf import _shelf_cost_kernel
from .validate import MAX_LENGTH
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
    #: steps planned by Megatron-LM's rule instead because it was estimated faster there
    #: (:func:`balancer.strategies.hybrid.plan_hybrid`); not stored with the plan
    megatron_steps: int = 0

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
    e.g. from :meth:`balancer.cost.cp.CPCostModel.table`. ``sizes=(lo, hi)`` restricts sharded
    documents to groups of ``2^lo .. 2^hi`` ranks (default: any size >= 2); ``whole=False``
    forbids whole documents on members of groups of two or more; ``fixed=k`` makes every round
    the fixed partition into blocks of ``2^k`` ranks (fixed CP). ``candidates`` round heights are
    tried; ``local_search`` bounds the repair sweeps (0: none). A document that no group holds
    is an error naming it (cutting is the caller's policy: :func:`balancer.planning.hybrid.plan_hybrid`).
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
        nr, _, _ = _plan_kernel(batch(time, tokens, cap, P, lo, hi, whole, fk),
                                np.int64(candidates), np.int64(local_search), oa, ob,
                                Placement(d_round, d_off, d_k, d_owner))
    return assemble(d_round, d_off, d_k, d_owner, int(nr), P, cap, fixed=fk,
                    doc_ids=doc_ids, lengths=lengths)


@kernel
def _assemble_kernel(pl, nr, P, fixed_k, round_groups, group_offset, group_size, group_entries,
                     entry_item, entry_owner):
    """CSR of a plan from per-item (round, offset, size exponent, owner: :class:`Placement`)
    into preallocated arrays (groups <= nr * P); returns the group count."""
    d_round, d_off, d_k, d_owner = pl.d_round, pl.d_off, pl.d_k, pl.d_owner
    n = d_round.shape[0]
    start = np.full(nr * P, -1, dtype=np.int64)
    for d in range(n):
        start[d_round[d] * P + d_off[d]] = d_k[d]
    bs = 1 << fixed_k if fixed_k >= 0 else 1
    gidx = np.full(nr * P, -1, dtype=np.int64)
    G = np.int64(0)
    for r in range(nr):
        round_groups[r] = G
        p = np.int64(0)
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
    return float(_shelf_cost_kernel(batch(time, tokens, cap, P, 1, K - 1, True, -1), docs,
                                    np.float64(density)))


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
    pl = Placement(*(np.ascontiguousarray(a, np.int64) for a in (d_round, d_off, d_k, d_owner)))
    G = _assemble_kernel(pl, np.int64(nr), np.int64(P), np.int64(fixed), rg, go, gs, ge, ei, eo)
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
    meg = 0
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
        meg += p.megatron_steps
    cat = np.concatenate
    return HybridPlan(np.asarray(step_rounds, np.int64), cat(rg + [np.array([g0])]), cat(go),
                      cat(gs), cat(ge + [np.array([e0])]), cat(ei), cat(eo), cat(idoc), cat(ist),
                      cat(ilen), P, cap, cut, meg)


def rank_tokens(plan: HybridPlan, tokens) -> np.ndarray:
    """int64[R, P]: the tokens every rank holds in every round, ``tokens`` int64[N, K] the
    items' per-rank tokens on groups of ``2^k`` ranks (a sharded item counts its share on
    every rank of its group, a whole one on its owner)."""
    tokens = np.asarray(tokens)
    P = plan.n_ranks
    g_of = plan.group_of_entry()
    gsz = plan.group_size[g_of]
    own, ent = plan.entry_owner, plan.entry_item
    k = np.log2(gsz).astype(np.int64)
    per = np.where(own < 0, tokens[ent, k], tokens[ent, 0])
    rnd = plan.round_of_group()[g_of]
    first = plan.group_offset[g_of]
    sh = own < 0
    out = np.zeros((plan.n_rounds, P + 1), dtype=np.int64)
    np.add.at(out, (rnd[sh], first[sh]), per[sh])
    np.add.at(out, (rnd[sh], first[sh] + gsz[sh]), -per[sh])
    out = np.cumsum(out, axis=1)[:, :P]
    np.add.at(out, (rnd[~sh], first[~sh] + own[~sh]), per[~sh])
    return out


def runnable(plan: HybridPlan, tokens) -> bool:
    """Whether a trainer of this package can run ``plan`` as it is: every group an aligned
    power of two (its process group pre-created) and no rank over ``rank_capacity`` tokens in
    any round (``tokens`` as :func:`rank_tokens`). Megatron-LM's rule meets neither always."""
    s, o = plan.group_size, plan.group_offset
    if ((s & (s - 1)) != 0).any() or (o % s != 0).any():
        return False
    return bool(rank_tokens(plan, tokens).max(initial=0) <= plan.rank_capacity)


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


__all__ = ["HybridPlan", "assemble", "check_plan", "concat_plans", "plan_batch", "rank_tokens",
           "runnable", "shelf_cost"]
