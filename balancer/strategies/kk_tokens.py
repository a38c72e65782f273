"""``kk_tokens``: the verl baseline. Karmarkar-Karp on token counts over the DP ranks, then
over each rank's microbatches. Knobs: ``tail``."""
from __future__ import annotations

import packing

from .registry import register, token_and_count_budget


@register("kk_tokens", "verl: Karmarkar-Karp on token counts over DP ranks, then over "
                       "microbatches", baseline=True, knobs=("tail",))
def plan(sizes, costs, layout, config, budget, weights):
    tokens, count = token_and_count_budget(budget, weights)
    return packing.plan_kk_tokens(sizes, costs, layout.dp, layout.microbatches, layout.capacity,
                                  tokens, tail=config.tail, max_items=count)
