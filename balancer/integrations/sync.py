"""The balance target follows the trainer's synchronisation (``Layout.sync``).

* ``sync="step"``: the DP ranks meet once per step (DDP accumulating under ``no_sync()``; the
  gradient all-reduce runs after the last microbatch). A rank's step time is the sum of its
  microbatches, so only per-rank sums need to be equal (``balanced`` with whole-rank units).
* ``sync="microbatch"``: the ranks meet after every microbatch (FSDP and ZeRO-3 gather and
  reduce-scatter per microbatch, DDP without ``no_sync``, accelerate/HF Trainer under FSDP or
  DeepSpeed ZeRO-3). Microbatch ``k`` of every rank runs in lockstep: the step takes
  ``sum_k max_r cost[r, k]``, so every microbatch has to be balanced.

:func:`lockstep_imbalance` measures the second: per step, ``sum_k max_r cost[r, k]`` over the
mean per-rank cost ``sum cost / dp`` (1.0 = no rank ever waits at a microbatch boundary).
:func:`rank_sum_imbalance` is the first (max / mean of per-rank sums). ``dp_imbalance`` of
:func:`balancer.report.metrics.step_metrics` follows the layout: the first with pp == 1 and
``sync="step"``, the second with ``sync="microbatch"`` (and ``balanced`` places a lockstep
step's microbatches for the least such time).
"""
from __future__ import annotations

import numpy as np

from ..cost.model import CostModel
from ..planning.planner import Plan

#: the ``Layout.sync`` each trainer needs (what :func:`sync_for` answers)
TRAINER_SYNC = {
    "ddp": "step",                 # DDP, no_sync() over all but the last microbatch
    "ddp_every_microbatch": "microbatch",  # DDP all-reducing after every backward
    "fsdp": "microbatch",          # all-gather / reduce-scatter in every microbatch
    "deepspeed_zero3": "microbatch",
    "megatron": "step",            # pp == 1: the grad reduce runs with the last microbatch
    "hf_trainer": "step",          # Trainer / accelerate under DDP: accumulate() is no_sync
    "hf_trainer_fsdp": "microbatch",
}


def sync_for(trainer: str) -> str:
    """``Layout.sync`` for a trainer name of :data:`TRAINER_SYNC` (a ValueError names the
    known ones)."""
    try:
        return TRAINER_SYNC[trainer]
    except KeyError:
        raise ValueError(f"unknown trainer {trainer!r}; known: {sorted(TRAINER_SYNC)}") from None


def _mb_costs(plan: Plan, cost: CostModel) -> np.ndarray:
    """float64[M]: every microbatch's cost (forward + backward, recomputed from the entries,
    microbatch constant included), in the plan's order."""
    if plan.n_microbatches == 0:
        return np.zeros(0)
    fwd, bwd = cost.doc_costs(plan.entry_length)
    cf, cb = cost.microbatch_constant
    return np.add.reduceat(fwd + bwd, plan.mb_offsets[:-1]) + cf + cb


def _rank_costs(plan: Plan, cost: CostModel):
    """Per step a float64[dp, m_s] array of microbatch cost (:func:`_mb_costs`), rank-major in
    the plan's order."""
    if plan.n_microbatches == 0:
        return []
    mb = _mb_costs(plan, cost)
    so = plan.step_offsets
    dp = plan.layout.dp
    return [mb[so[s]:so[s + 1]].reshape(dp, int(plan.step_mbs[s])) for s in range(plan.n_steps)]


def lockstep_imbalance(plan: Plan, cost: CostModel) -> np.ndarray:
    """float64[S]: per step, ``sum_k max_r c[r, k] / (sum c / dp)`` -- the step time of ranks
    that synchronise after every microbatch (``Plan.lockstep_times``) over the perfectly
    balanced time (>= 1)."""
    mb = _mb_costs(plan, cost)
    total = np.bincount(plan.mb_step, weights=mb, minlength=plan.n_steps)
    return plan.lockstep_times(mb) * plan.layout.dp / total


def rank_sum_imbalance(plan: Plan, cost: CostModel) -> np.ndarray:
    """float64[S]: per step, max / mean of the per-rank cost sums (>= 1)."""
    out = np.empty(plan.n_steps)
    for s, c in enumerate(_rank_costs(plan, cost)):
        r = c.sum(axis=1)
        out[s] = r.max() / r.mean()
    return out
