"""Numba kernels and pure array algorithms: bin packing, multiway partition, step packing,
outlier scheduling and whole-epoch stream planners. Numpy arrays and scalars in, arrays out."""
from __future__ import annotations

import numpy as np

from ._jit import CACHE_ENABLED
from .binpack import (BFD_MAX_CAPACITY, best_fit_decreasing, bins_lower_bound,
                      first_fit_decreasing, next_fit)
from .chunking import expand_pieces
from .delay import schedule_lumps
from .pipeline import rank_step_times, simulate_1f1b
from .partition import balanced_equal, group_loads, kk, kk_equal, lpt_equal, refine_swaps
from .steppack import pack_step
from .stream import (StreamPlan, plan_balanced, plan_ffd_tokens, plan_kk_tokens,
                     plan_sequential)

#: Bin-packing algorithms by name: ``fn(sizes, capacity) -> (bin_of, n_bins)``.
BIN_PACKERS = {
    "next_fit": next_fit,
    "ffd": first_fit_decreasing,
    "bfd": best_fit_decreasing,
}

#: Equal-count multiway partitions by name: ``fn(costs, m) -> group_of``.
PARTITIONERS = {
    "lpt": lpt_equal,
    "kk": kk_equal,
    "balanced": balanced_equal,
}


def warmup() -> None:
    """Compile (or load from the disk cache) every kernel once, on tiny inputs, so that no
    later call pays compile time."""
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
