"""Packing strategies by name: ours (``balanced``) and faithful re-implementations of the
baselines it is judged against, all behind one signature::

    fn(sizes int64[n], costs float64[n], layout, config, budget, weights) -> packing.StreamPlan

``sizes`` are the items' token counts as they occupy a microbatch (CP padding included) and
``costs`` their forward + backward cost, both in stream (training) order. ``budget`` is what a
step takes: tokens (``weights`` None) or samples (``weights`` all ones). Every strategy honours
it -- a step takes at most its budget plus the item that crosses it, except that it always takes
at least one item per microbatch -- and a budget below :func:`balancer.config.min_budget` is
refused (ValueError naming the budget, the layout and the minimum) before anything is planned.
"""
from __future__ import annotations

import functools
from typing import Callable

import packing

from ..config import Layout, PlannerConfig, check_budget

StrategyFn = Callable[..., packing.StreamPlan]
_REGISTRY: dict[str, StrategyFn] = {}
_DOCS: dict[str, str] = {}


def register(name: str, doc: str):
    def deco(fn: StrategyFn) -> StrategyFn:
        if name in _REGISTRY:
            raise ValueError(f"strategy {name!r} is already registered")

        @functools.wraps(fn)
        def checked(sizes, costs, layout, config, budget, weights):
            check_budget(layout, budget, weights is not None)
            return fn(sizes, costs, layout, config, budget, weights)

        _REGISTRY[name] = checked
        _DOCS[name] = doc
        return checked
    return deco


def get(name: str) -> StrategyFn:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {names()}") from None


def names() -> list[str]:
    return list(_REGISTRY)


def describe(name: str) -> str:
    """One line on what the strategy does."""
    get(name)
    return _DOCS[name]


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


@register("sequential", "fill microbatches in arrival order (next fit) up to the step budget, "
                        "consecutive runs per rank")
def _sequential(sizes, costs, layout, config, budget, weights):
    tokens, count = (budget, None) if weights is None else (1 << 62, budget)
    return packing.plan_sequential(sizes, costs, layout.dp, layout.microbatches, layout.capacity,
                                   tail=config.tail, budget=tokens, max_items=count)


@register("ffd_tokens", "multipack: FFD on tokens over the longest prefix that fits, ranks "
                        "balanced by tokens")
def _ffd_tokens(sizes, costs, layout, config, budget, weights):
    tokens, count = (budget, None) if weights is None else (1 << 62, budget)
    return packing.plan_ffd_tokens(sizes, costs, layout.dp, layout.microbatches, layout.capacity,
                                   tokens, tail=config.tail, max_items=count)


@register("kk_tokens", "verl: Karmarkar-Karp on token counts over DP ranks, then over "
                       "microbatches")
def _kk_tokens(sizes, costs, layout, config, budget, weights):
    tokens, count = (budget, None) if weights is None else (1 << 62, budget)
    return packing.plan_kk_tokens(sizes, costs, layout.dp, layout.microbatches, layout.capacity,
                                  tokens, tail=config.tail, max_items=count)


@register("balanced", "ours: cost-aware LPT under capacity with look-ahead outlier scheduling "
                      "and bounded delay")
def _balanced(sizes, costs, layout, config, budget, weights):
    return packing.plan_balanced(
        sizes, costs, layout.dp, layout.microbatches, layout.capacity, budget, config.max_delay,
        weights=weights, rank_units=rank_units(layout, config), lump_tol=config.lump_tolerance,
        lookahead=config.lookahead, max_advance=config.advance, tail=config.tail, pp=layout.pp)
