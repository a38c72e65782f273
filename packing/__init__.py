"""Numba kernels and pure array algorithms: bin packing, multiway partition, step packing,
outlier scheduling and whole-epoch stream planners. Numpy arrays and scalars in, arrays out.

The names below are imported on first use (PEP 562), so ``import packing.validate`` (the input
checks the configs and the loader use) does not import numba or compile anything."""
from __future__ import annotations

import importlib

#: public name -> the module that defines it
_NAMES = {
    "CACHE_ENABLED": "_jit",
    "BFD_MAX_CAPACITY": "binpack", "best_fit_decreasing": "binpack", "bins_lower_bound": "binpack",
    "bins_lower_bound_l2": "binpack",
    "first_fit_decreasing": "binpack", "next_fit": "binpack",
    "expand_pieces": "chunking",
    "schedule_lumps": "delay",
    "rank_step_times": "pipeline", "simulate_1f1b": "pipeline",
    "balanced_equal": "partition", "group_loads": "partition", "kk": "partition",
    "kk_equal": "partition", "lpt_equal": "partition", "refine_swaps": "partition",
    "pack_step": "steppack",
    "StreamPlan": "stream", "plan_balanced": "stream", "plan_ffd_tokens": "stream",
    "plan_kk_tokens": "stream", "plan_sequential": "stream",
}


def __getattr__(name):
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    elif name == "BIN_PACKERS":
        #: Bin-packing algorithms by name: ``fn(sizes, capacity) -> (bin_of, n_bins)``.
        value = {"next_fit": __getattr__("next_fit"), "ffd": __getattr__("first_fit_decreasing"),
                 "bfd": __getattr__("best_fit_decreasing")}
    elif name == "PARTITIONERS":
        #: Equal-count multiway partitions by name: ``fn(costs, m) -> group_of``.
        value = {"lpt": __getattr__("lpt_equal"), "kk": __getattr__("kk_equal"),
                 "balanced": __getattr__("balanced_equal")}
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "BFD_MAX_CAPACITY", "BIN_PACKERS", "CACHE_ENABLED", "PARTITIONERS", "StreamPlan",
    "expand_pieces", "rank_step_times", "simulate_1f1b",
    "balanced_equal", "best_fit_decreasing", "bins_lower_bound", "bins_lower_bound_l2",
    "first_fit_decreasing",
    "group_loads", "kk", "kk_equal", "lpt_equal", "next_fit", "pack_step", "plan_balanced",
    "plan_ffd_tokens", "plan_kk_tokens", "plan_sequential", "refine_swaps", "schedule_lumps",
]
