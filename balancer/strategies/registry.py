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
import importlib
from typing import Callable

from ..config import PlannerConfig, check_budget

#: the strategy modules of this package, in the order of names(), of the CLI's default
#: --strategies and of every report: adding a strategy is one new module here plus its line
STRATEGY_MODULES = (
    "sequential",
    "ffd_tokens",
    "kk_tokens",
    "balanced",
)

StrategyFn = Callable[..., "packing.StreamPlan"]  # noqa: F821 (numba-free import of the registry)
_REGISTRY: dict[str, StrategyFn] = {}
_DOCS: dict[str, str] = {}
_BASELINE: dict[str, bool] = {}
_KNOBS: dict[str, tuple[str, ...]] = {}


def register(name: str, doc: str, *, baseline: bool = False, knobs: tuple[str, ...] = ()):
    """Register ``fn(sizes, costs, layout, config, budget, weights) -> StreamPlan`` as strategy
    ``name``. ``doc``: one line on what it is; ``baseline``: a re-implementation of another
    system's packer that ours is judged against (the reports' speedup reference); ``knobs``:
    the :class:`~balancer.config.PlannerConfig` fields it reads beyond the budget."""
    unknown = [k for k in knobs if k not in PlannerConfig.model_fields]
    if unknown:
        raise ValueError(f"strategy {name!r}: knobs {unknown} are not PlannerConfig fields")

    def deco(fn: StrategyFn) -> StrategyFn:
        if name in _REGISTRY:
            raise ValueError(f"strategy {name!r} is already registered")

        @functools.wraps(fn)
        def checked(sizes, costs, layout, config, budget, weights):
            check_budget(layout, budget, weights is not None)
            return fn(sizes, costs, layout, config, budget, weights)

        _REGISTRY[name] = checked
        _DOCS[name] = doc
        _BASELINE[name] = baseline
        _KNOBS[name] = tuple(knobs)
        return checked
    return deco


def _load() -> None:
    # imported on first use, not at the top: the strategy modules import register() from here
    if len(_REGISTRY) < len(STRATEGY_MODULES):
        for m in STRATEGY_MODULES:
            importlib.import_module(f"{__package__}.{m}")


def get(name: str) -> StrategyFn:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {names()}") from None


def names() -> list[str]:
    """Every strategy, in :data:`STRATEGY_MODULES` order."""
    _load()
    return list(_REGISTRY)


def baselines() -> list[str]:
    """The baselines (``baseline=True``), in :func:`names` order."""
    return [n for n in names() if _BASELINE[n]]


def knobs(name: str) -> tuple[str, ...]:
    """The PlannerConfig fields the strategy reads."""
    get(name)
    return _KNOBS[name]


def describe(name: str) -> str:
    """One line on what the strategy does."""
    get(name)
    return _DOCS[name]


def token_and_count_budget(budget: int, weights) -> tuple[int, int | None]:
    """A step budget as the baselines' kernels take it: ``(tokens, None)`` for a token budget
    (``weights`` None), ``(unbounded tokens, samples)`` for a sample budget."""
    return (budget, None) if weights is None else (1 << 62, budget)

