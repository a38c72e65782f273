"""``ffd_tokens``: the multipack baseline. First-fit decreasing on token counts over the longest
stream prefix that fits the step, then ranks balanced by tokens. Knobs: ``tail``."""
from __future__ import annotations

import packing

from .registry import register, token_and_count_budget


@register("ffd_tokens", "multipack: FFD on tokens over the longest prefix that fits, ranks "
                        "balanced by tokens", baseline=True, knobs=("tail",))
def plan(sizes, costs, layout, config, budget, weights):
    tokens, count = token_and_count_budget(budget, weights)
    return packing.plan_ffd_tokens(sizes, costs, layout.dp, layout.microbatches, layout.capacity,
                                   tokens, tail=config.tail, max_items=count)
