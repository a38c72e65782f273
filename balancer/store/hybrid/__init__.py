"""Hybrid DP x CP plans on disk (``balancer-hybrid-plan``): written ahead of training
(:func:`precompute_hybrid`), read back memory-mapped and checked against the job
(:func:`load_hybrid_plan`, :func:`hybrid_plan_source` for ``HybridBatchSampler(plan=)``) in
:mod:`.plan_dir`; the invariants a stored plan must hold, as ValueErrors, in :mod:`.check`."""
from __future__ import annotations

from .check import check_stored_hybrid
from .plan_dir import (PLANNED_WITH, check_hybrid_compatible, hybrid_header, hybrid_plan_source,
                       load_hybrid_manifest, load_hybrid_plan, precompute_hybrid,
                       save_hybrid_plans)

__all__ = ["PLANNED_WITH", "check_hybrid_compatible", "check_stored_hybrid", "hybrid_header",
           "hybrid_plan_source", "load_hybrid_manifest", "load_hybrid_plan", "precompute_hybrid",
           "save_hybrid_plans"]
