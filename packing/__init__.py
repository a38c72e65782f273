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


def warmup() -> None:
    """Compile (or load from the disk cache) every kernel once, on tiny inputs, so that no
    later call pays compile time."""
    import numpy as np

    from .chunking import expand_pieces
    from .delay import schedule_lumps
    from .partition import kk
    from .pipeline import rank_step_times
    from .steppack import pack_step
    from .stream import plan_balanced
    BIN_PACKERS, PARTITIONERS = __getattr__("BIN_PACKERS"), __getattr__("PARTITIONERS")
    sizes = np.array([3, 1, 2, 2], dtype=np.int64)
    costs = sizes.astype(np.float64)
    for fn in BIN_PACKERS.values():
        fn(sizes, 4)
    for fn in PARTITIONERS.values():
        fn(costs, 2)
    kk(costs, 3)
    pack_step(np.arange(4), sizes, costs, 2, 1, 4)
    schedule_lumps(costs, sizes, np.zeros(4, np.int64), np.ones(4, np.int64), 2, 2, 4, 1.0)
    expand_pieces(np.arange(4), sizes, 2)
    rank_step_times(costs, costs, np.array([2, 2]), 1, 2)
    for ru in (False, True):
        plan_balanced(sizes, costs, 2, 1, 4, 8, 2, rank_units=ru, max_advance=1)


__all__ = [
    "BFD_MAX_CAPACITY", "BIN_PACKERS", "CACHE_ENABLED", "PARTITIONERS", "StreamPlan",
    "expand_pieces", "rank_step_times", "simulate_1f1b",
    "balanced_equal", "best_fit_decreasing", "bins_lower_bound", "first_fit_decreasing",
    "group_loads", "kk", "kk_equal", "lpt_equal", "next_fit", "pack_step", "plan_balanced",
    "plan_ffd_tokens", "plan_kk_tokens", "plan_sequential", "refine_swaps", "schedule_lumps",
    "warmup",
]
