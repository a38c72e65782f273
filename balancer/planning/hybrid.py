"""Hybrid DP x CP plans of global batches, their baselines and the step-time estimate
(issue #15, items 2-4): the public names, one concept per module underneath.

* :func:`plan_hybrid`: per-document CP degree on one pool of ``P = dp x cp`` ranks, the compiled
  planner of :mod:`packing.hybrid_cp` on the cost table of :class:`balancer.cost.cp.CPCostModel`.
  Documents are never cut unless ``over_limit="chunk"`` and a document is longer than the largest
  aligned group holds. :func:`plan_fixed_cp`: fixed CP of degree ``cp`` (``P / cp`` groups, the
  same partition every round); documents longer than ``cp x rank_capacity`` are cut into pieces
  (counted). :func:`cut_documents`. (:mod:`.hybrid_batch`)
* :func:`plan_megatron_hybrid`: Megatron-LM's hybrid CP scheduler, re-implemented
  (:mod:`.megatron_hybrid`).
* :func:`estimate`: the step time of any of these plans under the CP cost model;
  :class:`HybridEstimate`, :func:`doc_bounds`, :func:`tight_lower_bound` (:mod:`.hybrid_bound`).
* :func:`plan_stream`, :func:`plan_hybrid_stream`, :class:`StreamResult`: consecutive global
  batches, tall documents moved to nearby steps (:mod:`.hybrid_stream`).

All plans are :class:`packing.hybrid_cp.HybridPlan` (see there for the CSR layout); an item is a
document, or a piece ``[item_start, item_start + item_length)`` of document ``item_doc``.
"""
from __future__ import annotations

from .hybrid_batch import OverLimit, cut_documents, plan_fixed_cp, plan_hybrid
from .hybrid_bound import HybridEstimate, doc_bounds, estimate, tight_lower_bound
from .hybrid_stream import StreamResult, plan_hybrid_stream, plan_stream, stream_steps
from .megatron_hybrid import plan_megatron_hybrid

__all__ = ["HybridEstimate", "StreamResult", "cut_documents", "doc_bounds", "estimate",
           "plan_fixed_cp", "tight_lower_bound",
           "plan_hybrid", "plan_hybrid_stream", "plan_megatron_hybrid", "plan_stream",
           "stream_steps"]
