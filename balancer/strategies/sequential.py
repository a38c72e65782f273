"""``sequential``: what most packers do. Next fit in arrival order up to the step budget, each
DP rank taking a consecutive run of microbatches. Knobs: ``tail``."""
from __future__ import annotations

import packing

from .registry import register, token_and_count_budget


@register("sequential", "fill microbatches in arrival order (next fit) up to the step budget, "
                        "consecutive runs per rank", baseline=True, knobs=("tail",))
def plan(sizes, costs, layout, config, budget, weights):
    tokens, count = token_and_count_budget(budget, weights)
    return packing.plan_sequential(sizes, costs, layout.dp, layout.microbatches, layout.capacity,
                                   tail=config.tail, budget=tokens, max_items=count)
