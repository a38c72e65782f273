"""Slow, independent reference for hybrid DP x CP plans: plain Python, imports nothing from the
production code. It reads a plan only through its public arrays (the CSR layout documented in
``packing/hybrid_cp.py``) and

* checks it (:func:`violations`): groups of each round tile the pool, are aligned powers of two,
  every item appears exactly once, owners lie inside their group, no rank holds more than the
  rank capacity in a round, sharded items only on groups of two or more;
* evaluates it (:func:`round_loads`, :func:`step_time`, :func:`step_time_async`);
* finds the optimum of tiny instances by exhaustive search (:func:`optimum`): every assignment of
  items to rounds, each item whole on one rank or sharded over one aligned block, sharded blocks
  of a round equal or disjoint, memory respected; the smallest sum over rounds of the slowest
  rank's time.
"""
from __future__ import annotations

import math


def _groups(plan):
    """[(round, offset, size, [(item, owner), ...]), ...] from the CSR arrays."""
    out = []
    rg = [int(x) for x in plan.round_groups]
    ge = [int(x) for x in plan.group_entries]
    for r in range(len(rg) - 1):
        for g in range(rg[r], rg[r + 1]):
            ents = [(int(plan.entry_item[e]), int(plan.entry_owner[e]))
                    for e in range(ge[g], ge[g + 1])]
            out.append((r, int(plan.group_offset[g]), int(plan.group_size[g]), ents))
    return out


def violations(plan, tokens, cap, aligned=True):
    """List of what is wrong with the plan (empty when it is valid). ``tokens[i][k]``: tokens
    per rank of item i on a group of 2^k ranks."""
    bad = []
    P = int(plan.n_ranks)
    n_items = len(plan.item_doc)
    groups = _groups(plan)
    n_rounds = len(plan.round_groups) - 1
    seen = [0] * n_items
    rank_tok = [[0] * P for _ in range(n_rounds)]
    by_round = [[] for _ in range(n_rounds)]
    for r, off, size, ents in groups:
        by_round[r].append((off, size))
        if size < 1 or (aligned and (size & (size - 1) or off % size)):
            bad.append(f"round {r}: group at {off} of {size} is not aligned")
        k = int(round(math.log2(size))) if size & (size - 1) == 0 else None
        for item, owner in ents:
            if not 0 <= item < n_items:
                bad.append(f"item {item} out of range")
                continue
            seen[item] += 1
            if owner == -1:
                if size < 2:
                    bad.append(f"item {item} sharded on a group of one")
                    continue
                if k is None:
                    bad.append(f"item {item} sharded on a group of {size} ranks")
                    continue
                for p in range(off, off + size):
                    rank_tok[r][p] += tokens[item][k]
            elif 0 <= owner < size:
                rank_tok[r][off + owner] += tokens[item][0]
            else:
                bad.append(f"item {item}: owner {owner} outside a group of {size}")
    for r in range(n_rounds):
        pos = 0
        for off, size in sorted(by_round[r]):
            if off != pos:
                bad.append(f"round {r}: ranks {pos}..{off - 1} uncovered or overlapped")
            pos = off + size
        if pos != P:
            bad.append(f"round {r}: groups end at {pos}, pool has {P}")
        for p in range(P):
            if rank_tok[r][p] > cap:
                bad.append(f"round {r} rank {p}: {rank_tok[r][p]} tokens > {cap}")
    for i, c in enumerate(seen):
        if c != 1:
            bad.append(f"item {i} appears {c} times")
    return bad


def round_loads(plan, time):
    """loads[r][p]: seconds of rank p in round r (``time[i][k]`` per item and size exponent)."""
    P = int(plan.n_ranks)
    n_rounds = len(plan.round_groups) - 1
    loads = [[0.0] * P for _ in range(n_rounds)]
    for r, off, size, ents in _groups(plan):
        k = int(round(math.log2(size)))
        for item, owner in ents:
            if owner < 0:
                for p in range(off, off + size):
                    loads[r][p] += time[item][k]
            else:
                loads[r][off + owner] += time[item][0]
    return loads


def step_time(plan, time):
    return sum(max(row) if row else 0.0 for row in round_loads(plan, time))


def step_time_async(plan, time):
    """No barriers: a group starts when all its ranks are ready."""
    loads = round_loads(plan, time)
    ready = [0.0] * int(plan.n_ranks)
    for r, off, size, _ in _groups(plan):
        start = max(ready[off:off + size])
        for p in range(off, off + size):
            ready[p] = start + loads[r][p]
    return max(ready) if ready else 0.0


def _blocks(P):
    """Aligned power-of-two blocks of two or more ranks: (offset, size, k)."""
    out = []
    k = 1
    while (1 << k) <= P:
        s = 1 << k
        for o in range(0, P - s + 1, s):
            out.append((o, s, k))
        k += 1
    return out


def optimum(time, tokens, cap, P):
    """Smallest sum over rounds of the slowest rank's time over all valid plans (exhaustive;
    only for a handful of items and ranks)."""
    n = len(time)
    blocks = _blocks(P)
    best = [math.inf]

    def places(i):
        if tokens[i][0] <= cap:
            for p in range(P):
                yield ("w", p)
        for o, s, k in blocks:
            if tokens[i][k] <= cap:
                yield ("s", (o, s, k))

    assign = []

    def evaluate():
        n_rounds = max(r for r, _ in assign) + 1
        total = 0.0
        for r in range(n_rounds):
            load = [0.0] * P
            tok = [0] * P
            used = []
            for i, (rr, (kind, where)) in enumerate(assign):
                if rr != r:
                    continue
                if kind == "w":
                    load[where] += time[i][0]
                    tok[where] += tokens[i][0]
                else:
                    o, s, k = where
                    for (o2, s2, _) in used:
                        if (o2, s2) != (o, s) and o < o2 + s2 and o2 < o + s:
                            return math.inf  # overlapping, different blocks
                    used.append(where)
                    for p in range(o, o + s):
                        load[p] += time[i][k]
                        tok[p] += tokens[i][k]
            if max(tok) > cap:
                return math.inf
            total += max(load)
        return total

    def rec(i, n_rounds):
        if i == n:
            v = evaluate()
            if v < best[0]:
                best[0] = v
            return
        for r in range(min(n_rounds + 1, n)):
            for pl in places(i):
                assign.append((r, pl))
                rec(i + 1, max(n_rounds, r + 1))
                assign.pop()

    rec(0, 0)
    return best[0]
