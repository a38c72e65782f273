"""The package's one warm-up: compile every Numba kernel of :mod:`packing` (or load it from the
disk cache) before anything is timed, trained or spawned.

A fresh install compiles its kernels on first use: about a minute of CPU for all of them, per
process, unless numba's disk cache already holds them (:mod:`packing._jit` says where it lives;
a warm cache loads everything in about a second). Everything that must not pay that inside a
measurement or in every spawned rank calls :func:`warmup` once first: ``python -m balancer
compile`` (all parts, into the cache, ahead of a job), the report, compare and precompute
commands, the tools, the examples that spawn ranks, and the test suite (a session fixture).

The kernels are reached through the same public functions a job calls, on tiny inputs of the
dtypes the wrappers produce, so a job finds every signature it needs already compiled.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Optional

import numpy as np

#: what :func:`warmup` can compile, in order: ``fixed`` (the fixed-CP strategies, the step
#: packer and the run-time planner's kernels), ``hybrid`` (per-document CP degree planners and
#: the CP cost table), ``multimodal`` (the media balancer)
PARTS = ("fixed", "hybrid", "multimodal")


def _packing_kernels() -> None:
    # every building block once, as the strategies call them
    from packing.binpack import best_fit_decreasing, first_fit_decreasing, next_fit
    from packing.chunking import expand_pieces
    from packing.delay import schedule_lumps
    from packing.doc_cost import pass_costs
    from packing.gather import take3
    from packing.partition import balanced_equal, kk, kk_equal, lpt_equal
    from packing.pipeline import rank_step_times
    from packing.segments import add_segment_sums
    from packing.steppack import pack_step
    from packing.stream import plan_balanced
    sizes = np.array([3, 1, 2, 2], dtype=np.int64)
    costs = sizes.astype(np.float64)
    for fn in (next_fit, first_fit_decreasing, best_fit_decreasing):
        fn(sizes, 4)
    for fn in (lpt_equal, kk_equal, balanced_equal):
        fn(costs, 2)
    kk(costs, 3)
    pack_step(np.arange(4), sizes, costs, 2, 1, 4)
    schedule_lumps(costs, sizes, np.zeros(4, np.int64), np.ones(4, np.int64), 2, 2, 4, 1.0)
    expand_pieces(np.arange(4), sizes, 2)
    take3(np.arange(4), sizes, sizes, sizes)  # a chunked plan's entries
    pass_costs(sizes, 1.0, 1.0, 1.0)
    # microbatch sums of a cost model with attention terms or a formula of the protocol (a
    # plain CostModel's take packing.doc_cost's one pass, which the plans below compile)
    add_segment_sums(costs, np.array([0, 2, 4], dtype=np.int64), 0, np.zeros(2))
    rank_step_times(costs, costs, np.array([2, 2]), 1, 2)
    from .order import block_order, permutation_order
    block_order(5000, 0, 0, np.arange(5000, dtype=np.int64))  # PlannerConfig.order='blocks'
    permutation_order(64, 0, 0)  # the default order alone (a plan carries its lengths along)
    permutation_order(64, 0, 0, values=sizes[np.arange(64) % 4])
    for ru in (False, True):
        plan_balanced(sizes, costs, 2, 1, 4, 8, 2, rank_units=ru, max_advance=1)


def _fixed() -> None:
    from ..config import Layout, PlannerConfig
    from ..cost.model import CostModel
    from ..samples import SampleTable
    from ..strategies import registry
    from .planner import plan_epoch
    _packing_kernels()
    cost = CostModel.quadratic(4096)
    small = SampleTable(np.random.default_rng(0).integers(1, 1024, 64))
    for layout in (Layout(dp=2, microbatches=2, capacity=4096),
                   Layout(dp=2, pp=2, cp=2, microbatches=2, capacity=4096),
                   Layout(dp=2, microbatches=2, capacity=4096, sync="microbatch")):
        for over_length in ("error", "chunk"):
            for name in registry.names():
                plan_epoch(small, cost, layout,
                           PlannerConfig(strategy=name, over_length=over_length))
        # a token budget below the step's microbatches: next fit splits its runs
        plan_epoch(small, cost, layout,
                   PlannerConfig(strategy="sequential", global_batch_tokens=2 * 4096))


def _hybrid() -> None:
    from ..cost.cp import CPCostModel
    from .hybrid import plan_fixed_cp, plan_hybrid, plan_hybrid_stream
    n_ranks = 8
    model = CPCostModel.from_preset("llama-7b", 4096)
    cap, tall = model.rank_capacity, model.doc_limit(n_ranks)
    docs = np.array([3, cap // 2, min(2 * cap, tall), 5], dtype=np.int64)
    plan_hybrid(docs, model, n_ranks)
    # the movement kernel runs only when some document is tall: the longest the pool holds,
    # in every step, beside short ones
    stream = np.tile(np.array([tall, 3, cap // 2, 5], dtype=np.int64), 3)
    plan_hybrid_stream(stream, model, n_ranks, tall + cap)
    for cp in (1, 2):
        plan_fixed_cp(docs, model, n_ranks, cp)


def _multimodal() -> None:
    from packing.mm_partition import post_balance
    post_balance(np.array([1.0, 2.0, 3.0]), np.array([0, 1, 0]), np.array([0, 3]), 2)


_STAGES = {"fixed": _fixed, "hybrid": _hybrid, "multimodal": _multimodal}


def kernels() -> list:
    """Every Numba dispatcher defined in :mod:`packing` (imports all its modules)."""
    import importlib
    import pkgutil

    import packing
    from numba.core.registry import CPUDispatcher
    out = []
    for m in pkgutil.iter_modules(packing.__path__):
        mod = importlib.import_module(f"packing.{m.name}")
        out += [v for v in vars(mod).values()
                if isinstance(v, CPUDispatcher) and v.__module__ == mod.__name__]
    return out


def uncached(ks: list, cache_dir: Optional[str]) -> list[str]:
    """Names (``module.function``) of the kernels of ``ks`` that have a compiled signature but
    no index file of theirs under ``cache_dir`` (all of them when ``cache_dir`` is None): numba
    drops a failed cache write silently, the kernel runs and nothing is kept for the next
    process."""
    import os
    root = os.path.join(os.path.abspath(cache_dir), "") if cache_dir else None
    out = []
    for k in ks:
        if not k.signatures:
            continue
        index = getattr(getattr(getattr(k, "_cache", None), "_cache_file", None),
                        "_index_path", None)  # numba's FunctionCache; absent: not cached
        if root is None or index is None or not os.path.abspath(index).startswith(root) or \
                not os.path.isfile(index):
            out.append(f"{k.__module__}.{k.__name__}")
    return out


def warmup(parts: Iterable[str] = PARTS, *,
           progress: Optional[Callable[[str], None]] = None) -> dict:
    """Compile (or load from the disk cache) the kernels of ``parts`` (see :data:`PARTS`; all
    by default). ``progress(part)`` is called before each part. Returns ``{"parts", "seconds",
    "kernels", "compiled", "loaded", "cache_dir"}`` (``cache_dir`` None: kernels compile in
    memory, nothing is kept for the next process)."""
    parts = list(parts)
    unknown = [p for p in parts if p not in _STAGES]
    if unknown:
        raise ValueError(f"warmup: unknown part(s) {unknown}; known: {list(PARTS)}")
    from packing._jit import CACHE_DIR
    t0 = time.perf_counter()
    for part in PARTS:  # always in dependency order, whatever order was asked
        if part in parts:
            if progress is not None:
                progress(part)
            _STAGES[part]()
    ks = kernels()
    return {"parts": [p for p in PARTS if p in parts], "seconds": time.perf_counter() - t0,
            "kernels": len(ks),
            "compiled": sum(sum(k.stats.cache_misses.values()) for k in ks),
            "loaded": sum(sum(k.stats.cache_hits.values()) for k in ks),
            "cache_dir": CACHE_DIR}


__all__ = ["PARTS", "kernels", "uncached", "warmup"]
