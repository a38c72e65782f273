"""``balanced``: ours. LPT on forward + backward cost under the capacity, with look-ahead
outlier scheduling: a sample far heavier than a unit's typical cost waits (at most
``max_delay`` steps) or is read early (at most ``max_advance`` steps) to meet partners of
similar cost. How it works: "How ``balanced`` works" in docs/planner.md and ``packing/balanced.py``.

Knobs: ``max_delay``, ``max_advance``, ``balance`` (what is equalised: microbatches or whole
ranks, :func:`rank_units`), ``lookahead``, ``lump_tolerance``, ``tail``."""
from __future__ import annotations

import packing

from ..config import Layout, PlannerConfig
from .registry import register


def rank_units(layout: Layout, config: PlannerConfig) -> bool:
    """Whether ``balanced`` equalises whole ranks (True) or every microbatch (False).

    Per-rank sums are the target only when the ranks wait for each other once per step
    (``layout.sync == "step"``: DDP accumulating under ``no_sync``) and nothing else forces
    equal microbatches: with pp > 1 every microbatch crosses every stage, with dp == 1 there are
    no ranks, and with ``sync == "microbatch"`` (FSDP, ZeRO-3) every microbatch ends at a
    collective, so the step takes the sum over microbatch positions of the slowest rank's
    microbatch there, which balanced rank sums do not bound."""
    if config.balance == "rank":
        if layout.sync == "microbatch" and layout.dp > 1:
            raise ValueError("balance='rank' equalises only per-rank sums, but the layout's "
                             "sync='microbatch' makes the ranks wait for each other after "
                             "every microbatch; use balance='auto' or 'microbatch', or "
                             "sync='step' for DDP with no_sync accumulation")
        return True
    if config.balance == "microbatch":
        return False
    return layout.pp == 1 and layout.dp > 1 and layout.sync == "step"


@register("balanced", "ours: cost-aware LPT under capacity with look-ahead outlier scheduling "
                      "and bounded delay", default=True,
          knobs=("max_delay", "max_advance", "balance", "lookahead", "lump_tolerance", "tail"))
def plan(sizes, costs, layout, config, budget, weights):
    # in lockstep (FSDP, ZeRO-3) a step takes the sum over positions of the costliest
    # microbatch there: microbatches are placed for that, not for equal rank sums
    return packing.plan_balanced(
        sizes, costs, layout.dp, layout.microbatches, layout.capacity, budget, config.max_delay,
        weights=weights, rank_units=rank_units(layout, config), lump_tol=config.lump_tolerance,
        lookahead=config.lookahead, max_advance=config.advance, tail=config.tail, pp=layout.pp,
        lockstep=layout.lockstep)
