"""Packing strategies by name: ours (``balanced``) and faithful re-implementations of the
baselines it is judged against, all behind one signature::

    fn(sizes int64[n], costs float64[n], layout, config, budget, weights) -> packing.StreamPlan

``sizes`` are the items' token counts as they occupy a microbatch (CP padding included) and
``costs`` their forward + backward cost, both in stream (training) order.
"""
from __future__ import annotations

from typing import Callable

import packing

from .config import Layout, PlannerConfig

StrategyFn = Callable[..., packing.StreamPlan]
_REGISTRY: dict[str, StrategyFn] = {}
_DOCS: dict[str, str] = {}


def register(name: str, doc: str):
    def deco(fn: StrategyFn) -> StrategyFn:
        if name in _REGISTRY:
            raise ValueError(f"strategy {name!r} is already registered")
        _REGISTRY[name] = fn
        _DOCS[name] = doc
        return fn
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
    """Whether ``balanced`` equalises whole ranks (True) or every microbatch (False)."""
    if config.balance == "rank":
        return True
    if config.balance == "microbatch":
        return False
    return layout.pp == 1 and layout.dp > 1


@register("sequential", "fill microbatches in arrival order (next fit), consecutive runs per rank")
def _sequential(sizes, costs, layout, config, budget, weights):
    return packing.plan_sequential(sizes, costs, layout.dp, layout.microbatches, layout.capacity,
                                   tail=config.tail)


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
