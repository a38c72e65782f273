"""Packing strategies by name, of both CP modes (``Layout.cp_mode``): ours and faithful
re-implementations of the baselines they are judged against. One module per strategy, one line
of :data:`STRATEGY_MODULES` per module; every list of strategies (the CLI's defaults, the
reports' baselines, the default strategy of each mode, the tests) is derived from here.

**cp_mode fixed** (``balanced``, ours, and ``sequential``, ``ffd_tokens``, ``kk_tokens``)::

    fn(sizes int64[n], costs float64[n], layout, config, budget, weights) -> packing.StreamPlan

``sizes`` are the items' token counts as they occupy a microbatch (CP padding included) and
``costs`` their forward + backward cost, both in stream (training) order. ``budget`` is what a
step takes: tokens (``weights`` None) or samples (``weights`` all ones). Every strategy honours
it -- a step takes at most its budget plus the item that crosses it, except that it always takes
at least one item per microbatch -- and a budget below :func:`balancer.config.min_budget` is
refused (ValueError naming the budget, the layout and the minimum) before anything is planned.

**cp_mode hybrid** (``hybrid_stream``, ours, ``hybrid``, and ``megatron_hybrid``,
``fixed_cp<c>``)::

    fn(lengths int64[n], cost CPCostModel, n_ranks, budget, config) -> (HybridPlan, seconds)

``lengths`` are the documents in stream order, planned on a pool of ``n_ranks`` ranks in
consecutive global batches of about ``budget`` tokens (a batch closes with the document that
reaches it); ``seconds`` the planning time of every step (the cost table timed apart). A
*family* (``fixed_cp<c>``) is one registration for every degree ``c``: ``get("fixed_cp4")``.
"""
from __future__ import annotations

import functools
import importlib
import re
from typing import Callable

from ..config import PlannerConfig, check_budget, check_fixed_delay, mode_config, with_values

#: the strategy modules of this package, in the order of names(), of the CLI's default
#: --strategies and of every report: adding a strategy is one new module here plus its line
STRATEGY_MODULES = (
    # cp_mode fixed
    "sequential",
    "ffd_tokens",
    "kk_tokens",
    "balanced",
    # cp_mode hybrid
    "hybrid",
    "hybrid_stream",
    "megatron_hybrid",
    "fixed_cp",
)
#: the CP modes (``Layout.cp_mode``), each served by its own strategies
MODES = ("fixed", "hybrid")
#: a family's name: ``prefix<c>``, one strategy per power-of-two degree ``c``
_FAMILY = re.compile(r"^(\w+)<c>$")

StrategyFn = Callable[..., "packing.StreamPlan"]  # noqa: F821 (numba-free import of the registry)
_REGISTRY: dict[str, StrategyFn] = {}
_DOCS: dict[str, str] = {}
_BASELINE: dict[str, bool] = {}
_KNOBS: dict[str, tuple[str, ...]] = {}
_MODE: dict[str, str] = {}
_DEFAULT: dict[str, str] = {}
_ORDER: dict[str, int] = {}   # name -> its module's place in STRATEGY_MODULES


def _registered() -> list[str]:
    """Every registered name in STRATEGY_MODULES order (modules import each other, so
    registration order is not that order)."""
    _load()
    return sorted(_REGISTRY, key=_ORDER.__getitem__)


def register(name: str, doc: str, *, mode: str = "fixed", baseline: bool = False,
             knobs: tuple[str, ...] = (), default: bool = False):
    """Register ``fn`` as strategy ``name`` of ``mode`` (signatures in the module docstring).
    ``doc``: one line on what it is; ``baseline``: a re-implementation of another system's
    packer that ours is judged against (the reports' speedup reference); ``knobs``: the
    :class:`~balancer.config.PlannerConfig` fields it reads beyond the budget; ``default``: what
    the mode plans with when no strategy is named (one per mode). A name ``prefix<c>`` registers
    a family: ``fn(..., degree=c)`` for every name ``prefix`` + a power of two."""
    unknown = [k for k in knobs if k not in PlannerConfig.model_fields]
    if unknown:
        raise ValueError(f"strategy {name!r}: knobs {unknown} are not PlannerConfig fields")
    if mode not in MODES:
        raise ValueError(f"strategy {name!r}: mode {mode!r} is not one of {list(MODES)}")

    def deco(fn: StrategyFn) -> StrategyFn:
        if name in _REGISTRY:
            raise ValueError(f"strategy {name!r} is already registered")
        if default and mode in _DEFAULT:
            raise ValueError(f"strategy {name!r}: mode {mode!r} already defaults to "
                             f"{_DEFAULT[mode]!r}")
        if mode == "fixed":
            @functools.wraps(fn)
            def checked(sizes, costs, layout, config, budget, weights):
                check_budget(layout, budget, weights is not None)
                check_fixed_delay(config.max_delay)
                return fn(sizes, costs, layout, config, budget, weights)
        else:
            @functools.wraps(fn)
            def checked(lengths, cost, n_ranks, budget, config, **kw):
                if not int(budget) > 0:
                    raise ValueError(f"batch tokens {budget}: must be a positive number of "
                                     f"tokens")
                return fn(lengths, cost, n_ranks, budget, config, **kw)

        _REGISTRY[name] = checked
        _DOCS[name] = doc
        _BASELINE[name] = baseline
        _KNOBS[name] = tuple(knobs)
        _MODE[name] = mode
        mod = fn.__module__.rpartition(".")[2]
        _ORDER[name] = STRATEGY_MODULES.index(mod) if mod in STRATEGY_MODULES else \
            len(STRATEGY_MODULES) + len(_ORDER)
        if default:
            _DEFAULT[mode] = name
        return checked
    return deco


def _load() -> None:
    # imported on first use, not at the top: the strategy modules import register() from here
    if len(_REGISTRY) < len(STRATEGY_MODULES):
        for m in STRATEGY_MODULES:
            importlib.import_module(f"{__package__}.{m}")


def _entry(name: str) -> tuple[str, int | None]:
    """``(registered name, degree)`` of a strategy name: itself, or a family member's family
    (``fixed_cp4`` -> ``("fixed_cp<c>", 4)``); ``(name, None)`` when nothing matches."""
    _load()
    if name in _REGISTRY:
        return name, None
    for fam in _registered():
        m = _FAMILY.match(fam)
        if m and isinstance(name, str) and name.startswith(m.group(1)):
            c = name[len(m.group(1)):]
            if c.isdigit() and int(c) > 0 and not int(c) & (int(c) - 1) and c[0] != "0":
                return fam, int(c)
    return name, None


def get(name: str, mode: str = "fixed") -> StrategyFn:
    """The planning function of strategy ``name`` of ``mode``; an unknown name, or one of the
    other mode, is one ValueError listing the mode's strategies."""
    key, degree = _entry(name)
    if key not in _REGISTRY:
        fam = [f for f in names(mode) if _FAMILY.match(f)
               and isinstance(name, str) and name.startswith(_FAMILY.match(f).group(1))]
        why = f" ({fam[0]} takes a power of two c: 1, 2, 4, ...)" if fam else ""
        raise ValueError(f"unknown strategy {name!r}{why}; known: {names(mode)}")
    if _MODE[key] != mode:
        raise ValueError(f"strategy {name!r} plans cp_mode {_MODE[key]!r}, not {mode!r} "
                         f"(cp_mode {mode!r} strategies: {names(mode)})")
    fn = _REGISTRY[key]
    return fn if degree is None else functools.partial(fn, degree=degree)


def names(mode: str = "fixed", n_ranks: int | None = None) -> list[str]:
    """Every strategy of ``mode``, in :data:`STRATEGY_MODULES` order; a family as its pattern
    (``fixed_cp<c>``), or with ``n_ranks`` as one name per degree that tiles a pool of that many
    ranks (``fixed_cp1``, ``fixed_cp2``, ...)."""
    if mode not in MODES:
        raise ValueError(f"cp_mode {mode!r}: expected one of {list(MODES)}")
    out = []
    for n in _registered():
        if _MODE[n] != mode:
            continue
        fam = _FAMILY.match(n)
        if fam and n_ranks is not None:
            out += [f"{fam.group(1)}{c}" for c in degrees(n_ranks)]
        else:
            out.append(n)
    return out


def degrees(n_ranks: int) -> list[int]:
    """Power-of-two degrees that tile a pool of ``n_ranks``: 1, 2, 4, ... dividing it."""
    n = int(n_ranks)
    return [1 << k for k in range(n.bit_length()) if n % (1 << k) == 0]


def is_family(name: str) -> bool:
    """Whether ``name`` is a family's pattern (``fixed_cp<c>``) or one of its members."""
    key, degree = _entry(name)
    return degree is not None or bool(_FAMILY.match(key))


def baselines(mode: str = "fixed") -> list[str]:
    """The baselines (``baseline=True``) of ``mode``, in :func:`names` order."""
    return [n for n in names(mode) if _BASELINE[n]]


def is_baseline(name: str) -> bool:
    """Whether strategy ``name`` (a family member too) is a baseline."""
    key, _ = _entry(name)
    get(name, mode_of(name))
    return _BASELINE[key]


def default(mode: str = "fixed") -> str:
    """The strategy ``mode`` plans with when none is named."""
    _load()
    return _DEFAULT[mode]


def mode_of(name: str) -> str:
    """The CP mode strategy ``name`` serves."""
    key, _ = _entry(name)
    if key not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; known: "
                         f"{[n for m in MODES for n in names(m)]}")
    return _MODE[key]


def knobs(name: str) -> tuple[str, ...]:
    """The PlannerConfig fields the strategy reads."""
    key, _ = _entry(name)
    get(name, mode_of(name))
    return _KNOBS[key]


def describe(name: str) -> str:
    """One line on what the strategy does."""
    key, _ = _entry(name)
    get(name, mode_of(name))
    return _DOCS[key]


def configure(mode: str, config: PlannerConfig | None = None, **values) -> PlannerConfig:
    """The config ``mode`` plans with: ``config`` (default ``PlannerConfig()``) with the keyword
    ``values`` that are not None on top (one that disagrees with a field the config sets is an
    error), the mode's defaults for what neither sets (:func:`default` strategy,
    :data:`balancer.config.MODE_DEFAULTS`), a field the mode does not read refused, and the
    strategy checked to serve ``mode``."""
    config = mode_config(with_values(config, **values), mode, default(mode))
    get(config.strategy, mode)
    return config


def token_and_count_budget(budget: int, weights) -> tuple[int, int | None]:
    """A step budget as the baselines' kernels take it: ``(tokens, None)`` for a token budget
    (``weights`` None), ``(unbounded tokens, samples)`` for a sample budget."""
    return (budget, None) if weights is None else (1 << 62, budget)
