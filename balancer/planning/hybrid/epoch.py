"""One epoch of a hybrid DP x CP plan, as the loader trains it: the epoch's sample order
(``epoch_order(seed, epoch)``), cut into global batches of ``batch_tokens``, each planned by a
hybrid-mode strategy; items name sample ids.

The one place that turns (samples, CP cost model, pool, config, epoch) into the epoch's
:class:`packing.hybrid_cp.HybridPlan`: :class:`balancer.loader.HybridBatchSampler` plans with it
in the training process, :func:`balancer.store.hybrid.precompute_hybrid` writes the same plan
to disk ahead of training, so a stored plan and a planned one are identical by construction
(tested).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from packing.hybrid_cp import HybridPlan

from ...config import MODE_DEFAULTS, PlannerConfig, renamed
from ...cost.cp import CPCostModel
from ...strategies import registry as strategies
from ..stream import epoch_order
from .dispatch import (HYBRID_DEFAULT_STRATEGY, check_pieces, check_pool_limit, hybrid_config,
                       plan_strategy)

#: steps a document may move from its global batch (hybrid_stream), the hybrid mode's default
#: (:data:`balancer.config.MODE_DEFAULTS`, where the reason is)
HYBRID_MAX_DELAY = MODE_DEFAULTS["hybrid"]["max_delay"]


@renamed(over_limit="over_length", model="cost")
def plan_hybrid_epoch(lengths: np.ndarray, cost: CPCostModel, n_ranks: int, batch_tokens: int,
                      config: Optional[PlannerConfig] = None, *, strategy: Optional[str] = None,
                      seed: Optional[int] = None, epoch: int = 0,
                      max_delay: Optional[int] = None,
                      over_length: Optional[str] = None) -> HybridPlan:
    """The plan of epoch ``epoch`` over a pool of ``n_ranks`` ranks, with ``config`` and the
    keywords on top (:func:`~.dispatch.hybrid_config`: strategy ``hybrid_stream``, seed 0,
    ``max_delay`` 2 and ``over_length="error"`` unless set; older names ``model=``,
    ``over_limit=``).

    ``lengths`` int64[n] are the samples' lengths (sample id = position); the plan's
    ``item_doc`` int64[I] are sample ids and ``item_length`` int64[I] the tokens of every item
    (a whole sample, or a piece of one cut by ``fixed_cp<c>`` or ``over_length="chunk"``).
    A sample longer than the pool holds is an error naming it (``over_length="error"``), except
    for ``fixed_cp<c>``, whose cutting is the baseline."""
    config = hybrid_config(config, strategy=strategy, seed=seed, max_delay=max_delay,
                           over_length=over_length)
    if config.global_batch_tokens not in (None, int(batch_tokens)):
        raise ValueError(f"batch_tokens={batch_tokens} disagrees with the config's "
                         f"global_batch_tokens={config.global_batch_tokens}: give one of them")
    lengths = np.asarray(lengths, dtype=np.int64)
    if "over_length" in strategies.knobs(config.strategy):   # fixed_cp<c> cuts by design
        check_pool_limit(lengths, cost, n_ranks, config.over_length)   # names the sample
    check_pieces(lengths, cost, n_ranks, config.strategy, config.over_length)
    order = epoch_order(lengths.shape[0], config.seed, epoch)
    plan, _ = plan_strategy(config.strategy, lengths[order], cost, n_ranks, batch_tokens,
                            config)
    plan = plan._replace(item_doc=order[plan.item_doc])
    if not plan.item_length.any():
        plan = plan._replace(item_length=lengths[plan.item_doc])
    return plan


__all__ = ["HYBRID_DEFAULT_STRATEGY", "HYBRID_MAX_DELAY", "plan_hybrid_epoch"]
