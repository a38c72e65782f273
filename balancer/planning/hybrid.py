"""Hybrid DP x CP plans of global batches, their baselines and the step-time estimate
(issue #15, items 2-4).

* :func:`plan_hybrid`: per-document CP degree on one pool of ``P = dp x cp`` ranks, the compiled
  planner of :mod:`packing.hybrid_cp` on the cost table of :class:`balancer.cp_cost.CPCostModel`.
  Documents are never cut unless ``over_limit="chunk"`` and a document is longer than the largest
  aligned group holds.
* :func:`plan_fixed_cp`: fixed CP of degree ``cp`` (``P / cp`` groups, the same partition every
  round); documents longer than ``cp x rank_capacity`` are cut into pieces (counted).
* :func:`plan_megatron_hybrid`: Megatron-LM's hybrid CP scheduler, re-implemented.
* :func:`estimate`: the step time of any of these plans under the CP cost model.

All plans are :class:`packing.hybrid_cp.HybridPlan` (see there for the CSR layout); an item is a
document, or a piece ``[item_start, item_start + item_length)`` of document ``item_doc``.
"""
from __future__ import annotations

from collections import deque
from math import ceil, log2
from typing import Literal, NamedTuple, Optional

import numpy as np

from packing.hybrid_cp import HybridPlan, assemble, concat_plans, plan_batch, shelf_cost
from packing.validate import as_sizes

from ..cost.cp import CPCostModel, CPCostTable

OverLimit = Literal["error", "chunk"]


# ---- items: documents, or pieces of them --------------------------------------------------------
def cut_documents(lengths: np.ndarray, limit: int):
    """``(item_doc, item_start, item_length)``, int64 each: every document longer than
    ``limit`` cut into consecutive pieces of ``limit`` tokens (the last one shorter), the others
    whole; pieces in document order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    limit = int(limit)
    pieces = np.maximum(1, -(-lengths // limit))
    item_doc = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), pieces)
    first = np.cumsum(pieces) - pieces
    j = np.arange(item_doc.shape[0], dtype=np.int64) - np.repeat(first, pieces)
    item_start = j * limit
    item_length = np.minimum(limit, lengths[item_doc] - item_start)
    return item_doc, item_start, item_length


def _items(lengths, limit: int, over_limit: OverLimit, what: str, detail: str = ""):
    if over_limit not in ("error", "chunk"):
        raise ValueError(f"over_limit {over_limit!r}: expected 'error' or 'chunk'")
    over = np.flatnonzero(lengths > limit)
    if over.size and over_limit == "error":
        i = int(over[0])
        raise ValueError(f"sample {i}: length {int(lengths[i])} exceeds {what} of {limit} "
                         f"tokens{detail}; over_limit='chunk' cuts such documents into pieces "
                         f"(counted as documents_cut)")
    doc, start, length = cut_documents(lengths, limit)
    return doc, start, length, int(over.size)


def _largest_group(n_ranks: int) -> int:
    return 1 << (int(n_ranks).bit_length() - 1)


# ---- planners ---------------------------------------------------------------------------------
def plan_hybrid(lengths, model: CPCostModel, n_ranks: int, *, over_limit: OverLimit = "error",
                candidates: int = 2, local_search: int = 64,
                table: Optional[CPCostTable] = None) -> HybridPlan:
    """Hybrid plan of one global batch (``lengths``: its documents) on ``n_ranks`` ranks.

    A document longer than the largest aligned group holds (``model.doc_limit(g)``, ``g`` the
    largest power of two <= n_ranks) is an error naming it, or with ``over_limit="chunk"`` is cut
    into pieces of that limit (counted in ``documents_cut``). ``table`` may pass the documents'
    cost table already computed (no cut documents then)."""
    lengths = as_sizes(lengths)
    g = _largest_group(n_ranks)
    limit = model.doc_limit(g)
    doc, start, length, cut = _items(lengths, limit, over_limit, "the pool's limit",
                                     f" ({g} ranks x rank_capacity {model.rank_capacity}, CP "
                                     f"padding included)")
    if table is None or cut:
        table = model.table(length, n_ranks)
    plan = plan_batch(table.time, table.tokens, model.rank_capacity, n_ranks,
                      candidates=candidates, local_search=local_search, doc_ids=doc,
                      lengths=length)
    return plan._replace(item_start=start, documents_cut=cut)


def plan_fixed_cp(lengths, model: CPCostModel, n_ranks: int, cp: int, *, whole: bool = False,
                  candidates: int = 2, local_search: int = 64) -> HybridPlan:
    """Fixed CP of degree ``cp``: every round the pool is ``n_ranks / cp`` groups of ``cp``
    ranks; documents longer than a group holds are cut into pieces of that limit (counted).
    ``whole=False`` (standard CP) shards every document over its group; ``whole=True`` lets a
    document that fits one rank stay whole on one member (cp_shard ``choose_owners`` style).
    Documents are packed by LPT on per-rank time under the memory limit over the rounds."""
    lengths = as_sizes(lengths)
    cp = int(cp)
    if cp < 1 or cp & (cp - 1) or n_ranks % cp:
        raise ValueError(f"cp {cp} must be a power of two dividing the pool of {n_ranks} ranks")
    limit = model.doc_limit(cp)
    doc, start, length, cut = _items(lengths, limit, "chunk", "")
    table = model.table(length, n_ranks)
    plan = plan_batch(table.time, table.tokens, model.rank_capacity, n_ranks,
                      candidates=candidates, local_search=local_search, whole=whole,
                      fixed=cp.bit_length() - 1, doc_ids=doc, lengths=length)
    return plan._replace(item_start=start, documents_cut=cut)


def plan_megatron_hybrid(lengths, n_ranks: int, rank_capacity: int, *,
                         over_limit: OverLimit = "error", delta: float = 0.05) -> HybridPlan:
    """Megatron-LM's hybrid context-parallel schedule of one global batch, re-implemented from
    ``megatron/core/pipeline_parallel/hybrid_cp_schedule.py`` (``BalancedCPScheduler``,
    NVIDIA/Megatron-LM, 2025; our own code, same rule): CP degree
    ``max(1, 2^ceil(log2(L / rank_capacity)))``, workload proxy ``L^2 / degree``; documents by
    decreasing length are cut into as many buckets of about equal proxy work as there are
    distinct degrees, and each round ("group" there, ending in a barrier) takes, in bucket order,
    the first bucket head that can be placed: on a new group of the lowest-index free ranks while
    enough are free, else on the least-loaded existing group of its degree; once a smaller degree
    than the first one was placed, the round closes when the proxy loads are within ``delta`` of
    each other. Then the last document of the most-loaded group is pushed back while that lowers
    the spread, and the smallest group is doubled (consecutive ranks, later groups shifted) until
    no rank is idle. Every document of a group is sharded over it (each its own forward/backward
    there: memory bounds only each share, ``L / degree``). Groups are consecutive rank ranges, not
    always aligned to their size. Needs a power-of-two pool."""
    lengths = as_sizes(lengths)
    P = int(n_ranks)
    cap = int(rank_capacity)
    if P < 1 or P & (P - 1):
        raise ValueError(f"the Megatron rule needs a power-of-two pool, got {P} ranks")
    doc, start, length, cut = _items(lengths, P * cap, over_limit, "the pool's limit",
                                     f" ({P} ranks x rank_capacity {cap})")
    rounds = _megatron_schedule(length.tolist(), P, cap, delta)
    n = length.shape[0]
    d_round = np.empty(n, np.int64)
    d_off = np.empty(n, np.int64)
    d_k = np.empty(n, np.int64)
    d_owner = np.empty(n, np.int64)
    for r, groups in enumerate(rounds):
        for off, size, items in groups:
            for i in items:
                d_round[i], d_off[i], d_k[i] = r, off, size.bit_length() - 1
                d_owner[i] = -1 if size > 1 else 0
    plan = assemble(d_round, d_off, d_k, d_owner, len(rounds), P, cap, doc_ids=doc,
                    lengths=length)
    return plan._replace(item_start=start, documents_cut=cut)


def _megatron_schedule(lengths: list, P: int, cap: int, delta: float):
    """Rounds of ``(first rank, size, item ids)`` groups (Megatron's ``get_groups_and_
    subsamples`` with ``next_hdp_group``, ``trim_overload`` and ``fill_empty_gpus``)."""

    def needed(L):
        return max(1, 2 ** ceil(log2(L / cap)))

    def work(L, g=None):
        return L * L / (g or needed(L))

    samples = sorted(enumerate(lengths), key=lambda x: x[1], reverse=True)
    rounds = []
    while samples:
        groups, samples = _megatron_round(samples, P, needed, work, delta)
        rounds.append(groups)
    return rounds


def _megatron_buckets(samples, needed, work):
    k = len({needed(L) for _, L in samples})
    total = sum(work(L, needed(L)) for _, L in samples)
    target = total / k
    buckets, cur, cur_w = [], [], 0.0
    for i, (sid, L) in enumerate(samples):
        w = work(L)
        if cur and (cur_w + w > target * 1.1 or len(samples) - i <= k - len(buckets)):
            buckets.append(deque(cur))
            cur, cur_w = [], 0.0
        cur.append((sid, L))
        cur_w += w
    if cur:
        buckets.append(deque(cur))
    return buckets


def _megatron_round(samples, P, needed, work, delta):
    length_of = dict(samples)
    buckets = _megatron_buckets(samples, needed, work)
    load = [0.0] * P                 # proxy work per rank
    items = [[] for _ in range(P)]   # item ids per rank
    owner = [None] * P               # group id per rank
    members: dict[int, list] = {}
    gsize: dict[int, int] = {}
    first_need = None
    check = False
    while buckets:
        pick = None
        for b, bucket in enumerate(buckets):
            if not bucket:
                continue
            need = needed(bucket[0][1])
            free = sum(1 for o in owner if o is None)
            if any(s == need for s in gsize.values()) or free >= need:
                pick = b
                break
        if pick is None:
            break
        sid, L = buckets[pick][0]
        need = needed(L)
        if first_need is None:
            first_need = need
        best, best_load = None, float("inf")
        for g, s in gsize.items():
            if s == need:
                gl = max(load[r] for r in members[g])
                if gl < best_load:
                    best, best_load = g, gl
        free = [r for r in range(P) if owner[r] is None]
        if len(free) >= need:
            cand = sorted(free, key=lambda r: load[r])[:need]
            if load[cand[-1]] < best_load:
                best = len(gsize)
                members[best], gsize[best] = cand, need
                for r in cand:
                    owner[r] = best
        w = work(L)
        for r in members[best]:
            items[r].append(sid)
            load[r] += w
        buckets[pick].popleft()
        while buckets and not buckets[0]:
            buckets.pop(0)
        if need < first_need:
            check = True
        if check and buckets and max(load) - min(load) <= delta * max(load):
            break
    leftover = [x for b in buckets for x in b]
    # trim_overload: push back the last document of the most-loaded group while that helps
    while True:
        hi, lo = max(load), min(load)
        if hi - lo <= delta * hi or lo == 0:
            break
        r = load.index(hi)
        g = owner[r]
        if len(items[r]) <= 1:
            break
        sid = items[r][-1]
        w = work(length_of[sid])
        proj = load[:]
        for m in members[g]:
            proj[m] -= w
        if max(proj) - min(proj) < hi - lo:
            for m in members[g]:
                items[m].pop()
                load[m] -= w
            leftover.append((sid, length_of[sid]))
        else:
            break
    # groups in rank order (ranks are handed out lowest first, so ids follow rank order)
    order = sorted(members, key=lambda g: members[g][0])
    groups = [[members[g][0], gsize[g], items[members[g][0]]] for g in order]
    # fill_empty_gpus: double the first smallest group, shifting later groups, until no rank idles
    used = sum(s for _, s, _ in groups)
    while used < P:
        smallest = min(s for _, s, _ in groups)
        grow = min(2 * smallest, P) - smallest
        j = next(i for i, (_, s, _) in enumerate(groups) if s == smallest)
        groups[j][1] += grow
        for i in range(j + 1, len(groups)):
            groups[i][0] += grow
        used += grow
    return [(o, s, list(it)) for o, s, it in groups], leftover


# ---- the estimate --------------------------------------------------------------------------------
class HybridEstimate(NamedTuple):
    """Step time of a plan under a CP cost model (seconds).

    * ``step_time``: sum over rounds of the slowest rank's time in the round (a barrier ends every
      round: what Megatron-LM runs, and what FSDP's per-microbatch collectives impose);
    * ``step_time_async``: no barrier: a group starts when all its ranks finished their previous
      round, the step ends with the slowest rank (DDP-style gradient accumulation); for a fixed
      partition this is the slowest group's sum over rounds;
    * ``lower_bound``: the documents' compute whole on one rank (no padding, no exchange, not cut)
      over the pool, or the longest document's fastest no-exchange time on any group if larger;
    * ``exposed_comm_fraction``: exposed exchange over all busy time of all ranks;
    * ``documents_cut``; ``attention_removed``: the fraction of the documents' causal query-key
      pairs that cutting removed (0 without cuts);
    * ``round_time`` float64[R]; ``compute``/``exposed`` float64[R, P]: per rank and round;
    * ``tight_lower_bound`` (and per step ``step_tight_bounds``): :func:`tight_lower_bound`, the
      no-cut bound that charges each document its least area on any group it fits, forced
      exposed exchange included (valid for the per-document exchange of this estimate).
    """

    step_time: float
    step_time_async: float
    lower_bound: float
    exposed_comm_fraction: float
    documents_cut: int
    attention_removed: float
    round_time: np.ndarray
    compute: np.ndarray
    exposed: np.ndarray
    step_times: np.ndarray
    step_times_async: np.ndarray
    step_lower_bounds: np.ndarray
    tight_lower_bound: float = 0.0
    step_tight_bounds: Optional[np.ndarray] = None

    @property
    def ratio(self) -> float:
        return self.step_time / self.lower_bound if self.lower_bound > 0 else 1.0

    @property
    def tight_ratio(self) -> float:
        return self.step_time / self.tight_lower_bound if self.tight_lower_bound > 0 else 1.0


def doc_bounds(table: CPCostTable, n_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Per document (float64[n] each): the least **area** (group size x per-rank time,
    compute plus exposed exchange) and the least **per-rank time** over the group sizes it fits
    (``tokens <= rank_capacity``). A document longer than one rank holds must run on a group
    of at least ``ceil(L / rank_capacity)`` ranks (rounded up to a power of two) and so pays
    that group's padding, small-shard attention and exposed exchange: no planner avoids them.
    A document no group holds falls back to its whole work and whole time."""
    feas = table.tokens <= table.rank_capacity
    size = table.sizes[None, :].astype(np.float64)
    area = np.where(feas, table.time * size, np.inf).min(axis=1)
    fast = np.where(feas, table.time, np.inf).min(axis=1)
    area = np.where(np.isfinite(area), area, table.work)
    fast = np.where(np.isfinite(fast), fast, table.time[:, 0])
    return area, fast


def tight_lower_bound(table: CPCostTable, n_ranks: int, doc_step: np.ndarray,
                      n_steps: int) -> np.ndarray:
    """float64[S]: a lower bound on each step's time (barrier per round, per-document
    exchange) of ANY plan that trains the documents of ``doc_step == s`` whole in step ``s``:
    ``max(sum of their least areas / P, their largest least per-rank time + the round
    constant)`` (:func:`doc_bounds`). Every rank-second of a step is some document's time on
    some rank, and a step lasts at least as long as its slowest document on its fastest group.
    It is the old no-cut bound (whole-document work over the pool, zero exposure) raised by the
    forced cost of documents longer than a rank holds."""
    area, fast = doc_bounds(table, n_ranks)
    out = np.zeros(int(n_steps))
    ok = doc_step >= 0
    s = doc_step[ok]
    a = np.bincount(s, weights=area[ok], minlength=n_steps)[:n_steps] / int(n_ranks)
    f = np.zeros(int(n_steps))
    np.maximum.at(f, s, fast[ok] + table.round_constant)
    has = np.bincount(s, minlength=n_steps)[:n_steps] > 0
    out[has] = np.maximum(a, f)[has]
    return out


def estimate(plan: HybridPlan, model: CPCostModel, lengths, *,
             exchange: str = "document") -> HybridEstimate:
    """Evaluate ``plan`` (of the documents ``lengths``, indexed by ``plan.item_doc``) under
    ``model``: per rank and round, the sum of its items' compute and exposed exchange (a sharded
    item counts on every rank of its group, a whole one on its owner), plus the per-microbatch
    constant on every rank that runs something.

    ``exchange="document"`` (the planner's model) charges every sharded document its own
    exchange (latency included), as when each runs its own pass (Megatron's schedule);
    ``exchange="group"`` charges one exchange per group and round for all the documents sharded
    there together (their bytes summed, one latency, hidden behind their summed attention:
    :meth:`CPCostModel.group_exposed`), as a ring or all-gather over a packed group microbatch
    runs."""
    if exchange not in ("document", "group"):
        raise ValueError(f"exchange {exchange!r}: expected 'document' or 'group'")
    lengths = as_sizes(lengths)
    P = plan.n_ranks
    R = plan.n_rounds
    items = plan.item_length if plan.item_length.any() else lengths[plan.item_doc]
    tab = model.table(items, P)
    comp = np.zeros((R, P))
    expo = np.zeros((R, P))
    busy = np.zeros((R, P), dtype=bool)
    g_of = plan.group_of_entry()
    size = plan.group_size[g_of]
    off = plan.group_offset[g_of]
    rnd = plan.round_of_group()[g_of]
    it = plan.entry_item
    own = plan.entry_owner
    k = np.log2(size).astype(np.int64)
    sh = own < 0
    whole = ~sh
    k_eff = np.where(sh, k, 0)
    c_e = tab.compute[it, k_eff]
    x_e = tab.exposed[it, k_eff]
    np.add.at(comp, (rnd[whole], off[whole] + own[whole]), c_e[whole])
    np.add.at(expo, (rnd[whole], off[whole] + own[whole]), x_e[whole])
    busy[rnd[whole], off[whole] + own[whole]] = True
    if sh.any() and exchange == "group":
        # one exchange per (round, group) for its sharded documents together
        parts = model.exchange_parts(items, P)
        G = plan.group_size.shape[0]
        gs = g_of[sh]
        ks = k[sh]
        sums = [np.bincount(gs, weights=a[it[sh], ks], minlength=G)
                for a in (parts.bytes_s, parts.attn_f, parts.attn_b)]
        x_e = x_e.copy()
        x_e[sh] = 0.0
        has = np.bincount(gs, minlength=G) > 0
        gk = np.log2(plan.group_size).astype(np.int64)
        grp_x = np.zeros(G)
        for gi in np.flatnonzero(has).tolist():
            grp_x[gi] = model.group_exposed(sums[0][gi], sums[1][gi], sums[2][gi], int(gk[gi]),
                                            parts.latency)
        grnd = plan.round_of_group()
        dgx = np.zeros((R, P + 1))
        hg = np.flatnonzero(has)
        np.add.at(dgx, (grnd[hg], plan.group_offset[hg]), grp_x[hg])
        np.add.at(dgx, (grnd[hg], plan.group_offset[hg] + plan.group_size[hg]), -grp_x[hg])
        expo += np.maximum(np.cumsum(dgx, axis=1)[:, :P], 0.0)
    if sh.any():
        # a sharded item adds to every rank of its group: difference arrays over rank ranges
        dc = np.zeros((R, P + 1))
        dx = np.zeros((R, P + 1))
        db = np.zeros((R, P + 1), dtype=np.int64)
        np.add.at(dc, (rnd[sh], off[sh]), c_e[sh])
        np.add.at(dc, (rnd[sh], off[sh] + size[sh]), -c_e[sh])
        np.add.at(dx, (rnd[sh], off[sh]), x_e[sh])
        np.add.at(dx, (rnd[sh], off[sh] + size[sh]), -x_e[sh])
        np.add.at(db, (rnd[sh], off[sh]), 1)
        np.add.at(db, (rnd[sh], off[sh] + size[sh]), -1)
        comp += np.maximum(np.cumsum(dc, axis=1)[:, :P], 0.0)
        expo += np.maximum(np.cumsum(dx, axis=1)[:, :P], 0.0)
        busy |= np.cumsum(db, axis=1)[:, :P] > 0
    load = comp + expo + tab.round_constant * busy
    round_time = load.max(axis=1) if R else np.zeros(0)
    # per step
    S = plan.n_steps
    sr = plan.step_rounds
    step_t = np.array([round_time[sr[s]:sr[s + 1]].sum() for s in range(S)])
    step_a = np.array([_async_time(plan, load, sr[s], sr[s + 1]) for s in range(S)])
    # lower bound per step from the documents of that step (whole, not cut)
    doc_tab = model.table(lengths, P)
    item_step = np.searchsorted(sr, rnd, side="right") - 1
    doc_step = np.full(lengths.shape[0], -1, dtype=np.int64)
    doc_step[plan.item_doc[it]] = item_step
    step_lb = np.zeros(S)
    for s in range(S):
        docs = np.flatnonzero(doc_step == s)
        if docs.size == 0:
            continue
        lb = doc_tab.work[docs].sum() / P
        feas = doc_tab.tokens[docs] <= model.rank_capacity
        fastest = np.where(feas, doc_tab.compute[docs], np.inf).min(axis=1).max()
        step_lb[s] = max(lb, fastest if np.isfinite(fastest) else 0.0)
    step_tb = tight_lower_bound(doc_tab, P, doc_step, S)
    total_busy = float(load.sum())
    # attention removed by cutting: query-key pairs of whole documents vs of their pieces
    used = np.unique(plan.item_doc)
    lf = lengths[used].astype(np.float64)
    pairs_whole = float((lf * (lf + 1) / 2).sum())
    pf = items.astype(np.float64)
    pairs_items = float((pf * (pf + 1) / 2).sum())
    removed = 1.0 - pairs_items / pairs_whole if pairs_whole > 0 else 0.0
    return HybridEstimate(float(step_t.sum()), float(step_a.sum()), float(step_lb.sum()),
                          float(expo.sum() / total_busy) if total_busy > 0 else 0.0,
                          int(plan.documents_cut), max(0.0, removed), round_time, comp, expo,
                          step_t, step_a, step_lb, float(step_tb.sum()), step_tb)


def _async_time(plan: HybridPlan, load: np.ndarray, r0: int, r1: int) -> float:
    """Step time without barriers: every group of a round starts when its slowest member is
    ready; each member is then busy for its own load."""
    ready = np.zeros(plan.n_ranks)
    for r in range(r0, r1):
        for g in range(plan.round_groups[r], plan.round_groups[r + 1]):
            o, s = plan.group_offset[g], plan.group_size[g]
            start = ready[o:o + s].max()
            ready[o:o + s] = start + load[r, o:o + s]
    return float(ready.max())


def plan_stream(lengths, model: CPCostModel, n_ranks: int, batch_tokens: int, planner="hybrid",
                **kw) -> tuple[HybridPlan, np.ndarray]:
    """Consecutive global batches of about ``batch_tokens`` tokens (a batch closes at the first
    document that reaches the budget), each planned by ``planner`` (``"hybrid"``,
    ``"megatron"``, or ``("fixed", cp)``), as one plan of many steps; also returns the first
    document of every batch (int64[S + 1])."""
    lengths = as_sizes(lengths)
    cs = np.cumsum(lengths)
    cuts = np.searchsorted(cs, np.arange(batch_tokens, int(cs[-1]), batch_tokens), side="left")
    bounds = np.unique(np.concatenate([[0], cuts + 1, [lengths.shape[0]]]))
    bounds = bounds[bounds <= lengths.shape[0]]
    plans = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        docs = lengths[a:b]
        if planner == "hybrid":
            p = plan_hybrid(docs, model, n_ranks, **kw)
        elif planner == "megatron":
            p = plan_megatron_hybrid(docs, n_ranks, model.rank_capacity, **kw)
        else:
            p = plan_fixed_cp(docs, model, n_ranks, planner[1], **kw)
        plans.append(p._replace(item_doc=p.item_doc + a))
    return concat_plans(plans), bounds


class StreamResult(NamedTuple):
    """A multi-step plan of a stream: ``plan`` (steps one after another), ``doc_step``
    int64[n] (the step each document trains in), ``delay`` int64[n] (that step minus the step
    the document would train in without moving: > 0 waited, < 0 read early)."""

    plan: HybridPlan
    doc_step: np.ndarray
    delay: np.ndarray


def plan_hybrid_stream(lengths, model: CPCostModel, n_ranks: int, batch_tokens: int, *,
                       max_delay: int = 2, max_advance: int = 2, over_limit: OverLimit = "error",
                       candidates: int = 2, local_search: int = 64) -> StreamResult:
    """Hybrid plans of consecutive global batches of about ``batch_tokens`` tokens, where
    **tall** documents (slower on any group than a round of short documents filling a rank's
    memory) may move to a nearby step so that several share one tall round: a document trains
    at most ``max_delay`` steps after and ``max_advance`` steps before its own step.

    Tall documents start in their own step, or in consecutive clusters (at most 8, within the
    window) chosen by dynamic programming, each at its members' mean step, whichever scores
    lower summed over steps; then each, in stream order (two passes), moves to the
    step in its window where the tall-round scores (:func:`packing.hybrid_cp.shelf_cost`) of
    the step it leaves and the step it joins drop most, if they drop; only documents of steps
    with at most 4 tall ones move, into steps with at most 8 (fuller steps already share tall
    rounds). Every other document trains in its own step (so a step that takes tall documents holds
    more tokens than the budget and one that gives them fewer; the loss is normalised by each
    step's own token count). ``max_delay = max_advance = 0`` is :func:`plan_stream`."""
    lengths = as_sizes(lengths)
    n = lengths.shape[0]
    P = int(n_ranks)
    budget = int(batch_tokens)
    if budget < 1 or max_delay < 0 or max_advance < 0:
        raise ValueError("batch_tokens must be positive and max_delay, max_advance >= 0")
    cs = np.cumsum(lengths)
    before = cs - lengths
    home = before // budget  # the step of every document without moving
    limit = model.doc_limit(_largest_group(P))
    tab = model.table(np.minimum(lengths, limit), P)
    cap = model.rank_capacity
    short = lengths * 2 <= cap
    full = (tab.work[short].sum() / lengths[short].sum() * cap) if short.any() else np.inf
    feas = tab.tokens <= cap
    fastest = np.where(feas, tab.time, np.inf).min(axis=1)
    tall = np.flatnonzero(fastest > full)
    rho = full / cap if np.isfinite(full) else 0.0
    emit = home[tall].copy()
    span = max_delay + max_advance
    if tall.shape[0] and span > 0:
        cache: dict[tuple, float] = {}

        def cost(zis) -> float:
            key = tuple(sorted(zis))
            if key not in cache:
                cache[key] = shelf_cost(tab.time, tab.tokens, cap, P, tall[list(key)], rho) \
                    if key else 0.0
            return cache[key]

        def by_step(em):
            out: dict[int, list] = {}
            for zi, st_ in enumerate(em.tolist()):
                out.setdefault(st_, []).append(zi)
            return out

        # a second start: consecutive clusters (at most 8, spanning at most the window) chosen
        # by dynamic programming, each at its members' mean step clamped into their windows
        m = tall.shape[0]
        best = np.full(m + 1, np.inf)
        best[0] = 0.0
        prev = np.zeros(m + 1, dtype=np.int64)
        for i in range(1, m + 1):
            for j in range(i - 1, max(-1, i - 9), -1):
                if home[tall[i - 1]] - home[tall[j]] > span:
                    break
                c = best[j] + cost(list(range(j, i)))
                if c < best[i] - 1e-12:
                    best[i], prev[i] = c, j
        alt = np.empty(m, dtype=np.int64)
        i = m
        while i > 0:
            j = prev[i]
            hs = home[tall[j:i]]
            e = int(round(float(hs.mean())))
            alt[j:i] = min(int(hs.min()) + max_delay, max(int(hs.max()) - max_advance, e))
            i = j
        if sum(cost(v) for v in by_step(alt).values()) < \
                sum(cost(v) for v in by_step(emit).values()) - 1e-9:
            emit = alt
        members = by_step(emit)

        for _ in range(2):
            for zi in range(tall.shape[0]):
                s0 = int(emit[zi])
                here = members[s0]
                if len(here) > 4:
                    continue
                h = int(home[tall[zi]])
                without = [z for z in here if z != zi]
                base = cost(here) - cost(without)
                best, best_s = -1e-9, s0
                for s1 in range(h - max_advance, h + max_delay + 1):
                    there = members.get(s1, [])
                    if s1 == s0 or s1 < 0 or len(there) >= 8:
                        continue
                    gain = cost(there + [zi]) - cost(there) - base
                    if gain < best:
                        best, best_s = gain, s1
                if best_s != s0:
                    members[s0] = without
                    members.setdefault(best_s, []).append(zi)
                    emit[zi] = best_s
    step_of = home.copy()
    step_of[tall] = emit
    steps = np.split(np.argsort(step_of, kind="stable"),
                     np.flatnonzero(np.diff(np.sort(step_of, kind="stable"))) + 1)
    plans = []
    doc_step = np.empty(n, dtype=np.int64)
    for s, docs in enumerate(steps):
        doc_step[docs] = s
        rows = None if (lengths[docs] > limit).any() else CPCostTable(
            tab.sizes, tab.time[docs], tab.compute[docs], tab.exposed[docs], tab.tokens[docs],
            tab.work[docs], tab.round_constant, tab.rank_capacity)
        p = plan_hybrid(lengths[docs], model, P, over_limit=over_limit, candidates=candidates,
                        local_search=local_search, table=rows)
        plans.append(p._replace(item_doc=docs[p.item_doc]))
    return StreamResult(concat_plans(plans), doc_step, doc_step - home)


__all__ = ["HybridEstimate", "StreamResult", "cut_documents", "doc_bounds", "estimate",
           "plan_fixed_cp", "tight_lower_bound",
           "plan_hybrid", "plan_hybrid_stream", "plan_megatron_hybrid", "plan_stream"]
