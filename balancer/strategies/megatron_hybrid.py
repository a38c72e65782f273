"""``megatron_hybrid``: Megatron-LM's hybrid context-parallel rule as a baseline of the hybrid DP x
CP planner: :func:`plan_megatron_hybrid`, re-implemented from
``megatron/core/pipeline_parallel/hybrid_cp_schedule.py`` (NVIDIA/Megatron-LM, 2025; our own
code, the same rule), returning a :class:`packing.hybrid_cp.HybridPlan`; the strategy plans
every global batch of the stream on its own. Knobs: ``over_length`` (older name:
``over_limit``).
"""
from __future__ import annotations

import time
from collections import deque
from math import ceil, log2

import numpy as np

from packing.hybrid_cp import HybridPlan, assemble
from packing.validate import as_sizes

from ..config import renamed
from .hybrid import OverLimit, _items, plan_batches
from .registry import register


@renamed(over_limit="over_length")
def plan_megatron_hybrid(lengths, n_ranks: int, rank_capacity: int, *,
                         over_length: OverLimit = "error", delta: float = 0.05) -> HybridPlan:
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
    always aligned to their size. Needs a power-of-two pool. ``over_length="chunk"`` (older
    name: ``over_limit``) cuts a document longer than the pool holds into pieces (counted)."""
    lengths = as_sizes(lengths)
    P = int(n_ranks)
    cap = int(rank_capacity)
    if P < 1 or P & (P - 1):
        raise ValueError(f"the Megatron rule needs a power-of-two pool, got {P} ranks")
    doc, start, length, cut = _items(lengths, P * cap, over_length, "the pool's limit",
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


@register("megatron_hybrid", "Megatron-LM's hybrid CP rule: degree from the length, buckets of "
                             "equal L^2 work, groups of consecutive ranks", mode="hybrid",
          baseline=True, knobs=("over_length",))
def plan(lengths, cost, n_ranks, budget, config):
    def one(docs):
        t0 = time.perf_counter()
        p = plan_megatron_hybrid(docs, n_ranks, cost.rank_capacity,
                                 over_length=config.over_length)
        return p, time.perf_counter() - t0
    return plan_batches(lengths, budget, one)


__all__ = ["plan_megatron_hybrid"]
