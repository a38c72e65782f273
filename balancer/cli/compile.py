"""``python -m balancer compile``: compile every Numba kernel into the disk cache ahead of time.

A fresh install compiles its kernels on first use (about 30-50 s of CPU on the first plan of a
job, per process). Run this once where the cache lives (``BALANCER_NUMBA_CACHE_DIR``, else
``~/.cache/balancer``): in a container image build, or on a shared file system before launching
the ranks, so that no rank of the job pays it. The cache is keyed by the package's sources and
numba's version (:mod:`packing._jit`), so an upgrade recompiles instead of loading stale code.
"""
from __future__ import annotations

import importlib
import pkgutil
import time

import numpy as np

from .commands import command


def compile_all() -> None:
    """Run every kernel of the package once on small inputs (fixed and hybrid CP planners,
    every strategy, the multimodal media balancer, the CP cost table)."""
    import packing
    from packing.mm_partition import post_balance
    from ..config import Layout, PlannerConfig
    from ..cost.cp import CPCostModel
    from ..cost.model import CostModel
    from ..planning.hybrid_eval import warmup as hybrid_warmup
    from ..planning.warmup import warmup
    packing.warmup()
    cost = CostModel.quadratic(4096)
    for layout in (Layout(dp=2, microbatches=2, capacity=4096),
                   Layout(dp=2, pp=2, cp=2, microbatches=2, capacity=4096),
                   Layout(dp=2, microbatches=2, capacity=4096, sync="microbatch")):
        for chunk in ("error", "chunk"):
            warmup(None, cost, layout, PlannerConfig(over_length=chunk))
        # a token budget below the step's microbatches: next fit splits its runs
        warmup(["sequential"], cost, layout, PlannerConfig(global_batch_tokens=2 * 4096))
    hybrid_warmup(CPCostModel.from_preset("llama-7b", 4096), 8)
    post_balance(np.array([1.0, 2.0, 3.0]), np.array([0, 1, 0]), np.array([0, 3]), 2)


def kernels() -> list:
    """Every Numba dispatcher defined in :mod:`packing` (imports all its modules)."""
    import packing
    from numba.core.registry import CPUDispatcher
    out = []
    for m in pkgutil.iter_modules(packing.__path__):
        mod = importlib.import_module(f"packing.{m.name}")
        out += [v for k, v in vars(mod).items()
                if isinstance(v, CPUDispatcher) and v.__module__ == mod.__name__]
    return out


def _args(p) -> None:
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")


def _run(args) -> int:
    from packing._jit import CACHE_DIR, CACHE_ENABLED
    t0 = time.perf_counter()
    compile_all()
    ks = kernels()
    hits = sum(sum(k.stats.cache_hits.values()) for k in ks)
    misses = sum(sum(k.stats.cache_misses.values()) for k in ks)
    if not args.quiet:
        where = CACHE_DIR if CACHE_ENABLED else "nowhere (no writable cache location: set " \
                                                "BALANCER_NUMBA_CACHE_DIR)"
        print(f"compile: {len(ks)} kernels ready in {time.perf_counter() - t0:.1f} s "
              f"({misses} compiled now, {hits} loaded from the cache); cache: {where}")
    return 0


command("compile", "compile every Numba kernel into the disk cache ahead of the job "
                   "(container image build, shared file system)")((_args, _run))
