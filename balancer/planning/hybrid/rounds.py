"""A fixed-mode plan seen as CP rounds (:func:`fixed_to_rounds`), so that it is evaluated by the
hybrid mode's step-time estimate (:func:`~.bound.estimate`) like any hybrid plan: the fixed-mode
figures of ``compare`` and ``tools/bench.py`` with ``--rank-capacity``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from packing.hybrid_cp import HybridPlan


def fixed_to_rounds(plan, n_samples: Optional[int] = None) -> HybridPlan:
    """A fixed-mode :class:`~balancer.planning.planner.Plan` as CP rounds on the stage's pool of
    ``dp x cp`` ranks: microbatch ``j`` of DP rank ``d`` in a step is round ``j`` of that step
    on the group of ranks ``d cp .. d cp + cp - 1``, every document sharded over it (whole on
    its one rank when cp == 1). Items are the plan's entries (pieces of cut samples included);
    ``documents_cut`` counts the samples cut."""
    lay = plan.layout
    dp, cp = lay.dp, lay.cp
    P = dp * cp
    E = plan.entry_sample.shape[0]
    mb_of = np.repeat(np.arange(plan.n_microbatches, dtype=np.int64), np.diff(plan.mb_offsets))
    so = plan.step_offsets
    step_of_mb = np.repeat(np.arange(plan.n_steps, dtype=np.int64), plan.step_mbs * dp)
    m = plan.step_mbs[step_of_mb]
    local = np.arange(plan.n_microbatches, dtype=np.int64) - so[step_of_mb]
    rank_of_mb, slot_of_mb = local // m, local % m
    step_rounds = np.concatenate([[0], np.cumsum(plan.step_mbs)]).astype(np.int64)
    round_of_mb = step_rounds[step_of_mb] + slot_of_mb
    R = int(step_rounds[-1])
    # groups: round-major, then DP rank (rank offsets ascending); one group per microbatch
    g_of_mb = round_of_mb * dp + rank_of_mb
    order = np.argsort(g_of_mb[mb_of], kind="stable")
    counts = np.bincount(g_of_mb, weights=np.diff(plan.mb_offsets), minlength=R * dp)
    ge = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    go = np.tile(np.arange(dp, dtype=np.int64) * cp, R)
    gs = np.full(R * dp, cp, dtype=np.int64)
    rg = np.arange(R + 1, dtype=np.int64) * dp
    owner = np.full(E, -1 if cp > 1 else 0, dtype=np.int64)
    lengths = plan.entry_length
    cut = np.unique(plan.entry_sample[plan.entry_length < _sample_lengths(plan, n_samples)[
        plan.entry_sample]]).shape[0]
    return HybridPlan(step_rounds, rg, go, gs, ge, order.astype(np.int64), owner,
                      plan.entry_sample.astype(np.int64), plan.entry_start.astype(np.int64),
                      lengths.astype(np.int64), P, int(lay.capacity // cp), int(cut))


def _sample_lengths(plan, n_samples: Optional[int]) -> np.ndarray:
    n = plan.n_samples if n_samples is None else int(n_samples)
    out = np.zeros(n, np.int64)
    np.add.at(out, plan.entry_sample, plan.entry_length)
    if plan.leftover.sample.shape[0]:
        np.add.at(out, plan.leftover.sample, plan.leftover.length)
    return out


__all__ = ["fixed_to_rounds"]
