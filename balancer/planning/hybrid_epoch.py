"""One epoch of a hybrid DP x CP plan, as the loader trains it: the epoch's sample order
(``epoch_order(seed, epoch)``), cut into global batches of ``batch_tokens``, each planned by a
hybrid-mode strategy; items name sample ids.

The one place that turns (samples, CP cost model, pool, strategy, seed, epoch) into the
epoch's :class:`packing.hybrid_cp.HybridPlan`: :class:`balancer.loader.HybridBatchSampler`
plans with it in the training process, :func:`balancer.store.hybrid_store.precompute_hybrid`
writes the same plan to disk ahead of training, so a stored plan and a planned one are
identical by construction (tested).
"""
from __future__ import annotations

import numpy as np

from packing.hybrid_cp import HybridPlan

from ..cost.cp import CPCostModel
from .hybrid_eval import HYBRID_DEFAULT_STRATEGY, check_pool_limit, plan_strategy
from .planner import epoch_order

#: steps a document may move from its global batch (hybrid_stream), the hybrid loader's default
HYBRID_MAX_DELAY = 2


def plan_hybrid_epoch(lengths: np.ndarray, model: CPCostModel, n_ranks: int, batch_tokens: int,
                      *, strategy: str = HYBRID_DEFAULT_STRATEGY, seed: int = 0, epoch: int = 0,
                      max_delay: int = HYBRID_MAX_DELAY, over_limit: str = "error") -> HybridPlan:
    """The plan of epoch ``epoch`` over a pool of ``n_ranks`` ranks.

    ``lengths`` int64[n] are the samples' lengths (sample id = position); the plan's
    ``item_doc`` int64[I] are sample ids and ``item_length`` int64[I] the tokens of every item
    (a whole sample, or a piece of one cut by ``fixed_cp<c>`` or ``over_limit="chunk"``).
    A sample longer than the pool holds is an error naming it (``over_limit="error"``), except
    for ``fixed_cp<c>``, whose cutting is the baseline."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not strategy.startswith("fixed_cp"):   # fixed degrees cut by design
        check_pool_limit(lengths, model, n_ranks, over_limit)   # names the sample
    order = epoch_order(lengths.shape[0], seed, epoch)
    plan, _ = plan_strategy(strategy, lengths[order], model, n_ranks, batch_tokens,
                            max_delay=max_delay, over_limit=over_limit)
    plan = plan._replace(item_doc=order[plan.item_doc])
    if not plan.item_length.any():
        plan = plan._replace(item_length=lengths[plan.item_doc])
    return plan


__all__ = ["HYBRID_DEFAULT_STRATEGY", "HYBRID_MAX_DELAY", "plan_hybrid_epoch"]
