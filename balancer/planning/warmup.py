"""Compile every kernel a set of strategies uses before anything is timed or trained: the one
warm-up of the package (the report, the compare command, precompute and the tools call it)."""
from __future__ import annotations

import numpy as np

import packing

from ..config import Layout, PlannerConfig
from ..cost.model import CostModel
from ..samples import SampleTable
from ..strategies import registry as strategies
from .planner import plan_epoch


def warmup(strategies_: list[str] | None, cost: CostModel, layout: Layout,
           config: PlannerConfig) -> None:
    """Compile every kernel the strategies use (None: every registered one) on a small input,
    so no timing includes JIT."""
    packing.warmup()
    if strategies_ is None:
        strategies_ = strategies.names()
    rng = np.random.default_rng(0)
    n = max(64, 8 * layout.dp * layout.microbatches)
    lengths = rng.integers(1, max(2, layout.capacity // 4), n)
    small = SampleTable(lengths)
    for s in strategies_:
        plan_epoch(small, cost, layout, config.model_copy(update={"strategy": s}))
