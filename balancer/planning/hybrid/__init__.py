"""Hybrid DP x CP: the ``dp x cp`` ranks of a pipeline stage are one pool and every document
gets its own CP degree on aligned power-of-two groups, per microbatch round. The mode's planning
names, one concept per module underneath:

* the strategies, in the one strategy registry (:mod:`balancer.strategies`, cp_mode hybrid):
  :func:`plan_hybrid` (one global batch; :mod:`balancer.strategies.hybrid`),
  :func:`plan_hybrid_stream`, :func:`plan_stream`, :func:`stream_steps`, :class:`StreamResult`
  (tall documents moved to nearby steps; :mod:`balancer.strategies.hybrid_stream`),
  :func:`plan_megatron_hybrid` (Megatron-LM's rule), :func:`plan_fixed_cp` (fixed CP of degree
  ``c``, cutting what a group cannot hold), :func:`cut_documents`;
* :func:`plan_strategy`: a strategy by name over a stream of documents, with a
  :class:`~balancer.config.PlannerConfig` resolved in the hybrid mode's defaults
  (:func:`hybrid_config`), :data:`HYBRID_DEFAULT_STRATEGY`, :func:`default_strategies`
  (:mod:`.dispatch`);
* :func:`plan_hybrid_epoch`: one epoch as the sampler and the store plan it (:mod:`.epoch`);
* :func:`estimate`: the step time of any of these plans under the CP cost model;
  :class:`HybridEstimate`, :func:`doc_bounds`, :func:`tight_lower_bound` (:mod:`.bound`);
* :func:`fixed_to_rounds`: a fixed-mode plan as CP rounds (:mod:`.rounds`).

All plans are :class:`packing.hybrid_cp.HybridPlan` (see there for the CSR layout); an item is a
document, or a piece ``[item_start, item_start + item_length)`` of document ``item_doc``.
"""
from __future__ import annotations

from ...strategies.fixed_cp import plan_fixed_cp
from ...strategies.hybrid import OverLimit, cut_documents, global_batches, plan_hybrid
from ...strategies.hybrid_stream import StreamResult, plan_hybrid_stream, plan_stream, stream_steps
from ...strategies.megatron_hybrid import plan_megatron_hybrid
from .bound import HybridEstimate, doc_bounds, estimate, tight_lower_bound
from .dispatch import (HYBRID_DEFAULT_STRATEGY, HYBRID_STRATEGIES, check_pieces, check_pool_limit,
                       cp_cost_model, default_strategies, fixed_degrees, hybrid_config,
                       plan_strategy)
from .epoch import HYBRID_MAX_DELAY, plan_hybrid_epoch
from .rounds import fixed_to_rounds

__all__ = ["HYBRID_DEFAULT_STRATEGY", "HYBRID_MAX_DELAY", "HYBRID_STRATEGIES", "HybridEstimate",
           "OverLimit", "StreamResult", "check_pieces", "check_pool_limit", "cp_cost_model", "cut_documents",
           "default_strategies", "doc_bounds", "estimate", "fixed_degrees", "fixed_to_rounds",
           "global_batches", "hybrid_config", "plan_fixed_cp", "plan_hybrid", "plan_hybrid_epoch",
           "plan_hybrid_stream", "plan_megatron_hybrid", "plan_stream", "plan_strategy",
           "stream_steps", "tight_lower_bound"]
