"""Post-balancing of encoder work: per step, give every item (an image, a video clip, an audio
clip) an encoder rank so the per-rank encoder loads are balanced, keeping items on their home
rank (the DP rank whose sample needs the embedding) where balance allows, so few embeddings
travel. Items are grouped by step in CSR form; counts per rank are free (unlike the planner's
equal-count partitions).

Per step, two candidates:

* *home first*: items by cost, descending, stay home while the home load stays within
  ``target = (1 + slack) * max(total / dp, largest item)``, else go to the least-loaded rank;
* *LPT*: largest item to the least-loaded rank, ranks then relabelled to match the homes
  (a greedy assignment on the cost each rank already holds at home: balance is unchanged).

Both are polished by single-item moves and pairwise swaps off the heaviest rank; the home-first
one is kept when its maximum is within the target (or no worse than LPT's), else LPT's.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel
from .partition import _refine_swaps
from .validate import as_costs


@kernel
def _loads(costs, group_of, m):
    out = np.zeros(m)
    for i in range(costs.shape[0]):
        out[group_of[i]] += costs[i]
    return out


@kernel
def _refine_moves(costs, group_of, m, max_rounds):
    """Move one item from the heaviest group to the lightest while that lowers their maximum."""
    n = costs.shape[0]
    loads = _loads(costs, group_of, m)
    for _ in range(max_rounds):
        g = 0
        h = 0
        for j in range(1, m):
            if loads[j] > loads[g]:
                g = j
            if loads[j] < loads[h]:
                h = j
        gap = loads[g] - loads[h]
        if gap <= 0.0:
            return
        best = -1
        best_new = loads[g]
        for i in range(n):
            if group_of[i] == g and costs[i] < gap:
                new = max(loads[g] - costs[i], loads[h] + costs[i])
                if new < best_new - 1e-12 * best_new:
                    best_new = new
                    best = i
        if best < 0:
            return
        group_of[best] = h
        loads[g] -= costs[best]
        loads[h] += costs[best]


@kernel
def _polish(costs, group_of, m):
    _refine_moves(costs, group_of, m, 4 * m + 16)
    _refine_swaps(costs, group_of, m, 4 * m + 16)
    _refine_moves(costs, group_of, m, 2 * m + 8)
    return _loads(costs, group_of, m).max()


@kernel
def _post_balance_kernel(costs, home, step_offsets, dp, slack, rank_out):
    n_steps = step_offsets.shape[0] - 1
    for s in range(n_steps):
        lo = step_offsets[s]
        hi = step_offsets[s + 1]
        k = hi - lo
        if k == 0:
            continue
        c = costs[lo:hi].copy()
        hm = home[lo:hi]
        total = c.sum()
        target = (1.0 + slack) * max(total / dp, c.max())
        order = np.argsort(-c, kind="mergesort")
        # candidate 1: home first
        g1 = np.empty(k, dtype=np.int64)
        load = np.zeros(dp)
        for t in range(k):
            i = order[t]
            r = hm[i]
            if load[r] + c[i] > target:
                r = np.argmin(load)  # the least loaded rank, the first on ties
            g1[i] = r
            load[r] += c[i]
        m1 = load.max()
        if m1 > target:  # polishing costs O(k * dp) per round: only when it can matter
            m1 = _polish(c, g1, dp)
        if m1 <= target:
            rank_out[lo:hi] = g1
            continue
        # candidate 2: LPT, then ranks relabelled towards the homes
        g2 = np.empty(k, dtype=np.int64)
        load[:] = 0.0
        for t in range(k):
            i = order[t]
            r = np.argmin(load)
            g2[i] = r
            load[r] += c[i]
        m2 = _polish(c, g2, dp)
        if m1 <= m2:
            rank_out[lo:hi] = g1
            continue
        overlap = np.zeros((dp, dp))  # [group, home rank]: cost that would stay local
        for i in range(k):
            overlap[g2[i], hm[i]] += c[i]
        label = np.full(dp, -1, dtype=np.int64)
        taken = np.zeros(dp, dtype=np.bool_)
        flat = np.argsort(-overlap.ravel(), kind="mergesort")
        for f in flat:
            g = f // dp
            r = f % dp
            if label[g] < 0 and not taken[r]:
                label[g] = r
                taken[r] = True
        for i in range(k):
            rank_out[lo + i] = label[g2[i]]


def post_balance(costs, home, step_offsets, dp: int, slack: float = 0.01) -> np.ndarray:
    """Encoder rank (int64[K]) of every item.

    ``costs`` float64[K] (encoder forward + backward of each item), ``home`` int64[K] (DP rank
    that needs the item's embedding), ``step_offsets`` int64[S + 1] (items of step ``s`` are
    ``step_offsets[s]:step_offsets[s + 1]``), ``dp`` ranks, ``slack``: how far above the step's
    lower bound the home-first assignment may stay before balance wins over locality."""
    costs = as_costs(costs, name="encoder cost")
    home = np.ascontiguousarray(home, dtype=np.int64)
    step_offsets = np.ascontiguousarray(step_offsets, dtype=np.int64)
    dp = int(dp)
    if dp <= 0:
        raise ValueError(f"dp {dp} must be positive")
    if home.shape != costs.shape:
        raise ValueError(f"home has shape {home.shape}, costs {costs.shape}")
    if home.size and (home.min() < 0 or home.max() >= dp):
        i = int(np.flatnonzero((home < 0) | (home >= dp))[0])
        raise ValueError(f"item {i}: home rank {int(home[i])} is outside 0..{dp - 1}")
    if step_offsets.shape[0] < 1 or step_offsets[0] != 0 or step_offsets[-1] != costs.shape[0] \
            or (np.diff(step_offsets) < 0).any():
        raise ValueError(f"step_offsets must be non-decreasing from 0 to {costs.shape[0]}")
    if not slack >= 0:
        raise ValueError(f"slack {slack} must be >= 0")
    out = np.empty(costs.shape[0], dtype=np.int64)
    _post_balance_kernel(costs, home, step_offsets, np.int64(dp), float(slack), out)
    return out
