"""Kernels compile once, cache to an overridable directory, and still work when no cache
location is writable (a read-only install)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = ("import warnings, packing; warnings.simplefilter('always'); packing.warmup(); "
           "print('cache', packing.CACHE_ENABLED); "
           "print(packing.first_fit_decreasing([3, 2, 2], 4)[1])")


def _run(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR",
                                                             "BALANCER_NUMBA_CACHE_DIR")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", SNIPPET], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cache_dir_override(tmp_path):
    r = _run({"BALANCER_NUMBA_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "cache True" in r.stdout and r.stdout.strip().endswith("2")
    assert list(tmp_path.rglob("*.nbi")), "no kernel was cached in the override directory"


def test_unwritable_cache_falls_back_to_memory():
    r = _run({"BALANCER_NUMBA_CACHE_DIR": "/proc/self/no-such-dir"})
    assert r.returncode == 0, r.stderr
    assert "cache False" in r.stdout and r.stdout.strip().endswith("2")
    assert "compile in memory" in r.stderr


def test_one_specialisation_for_planner_kernels():
    import packing
    from packing.balanced import _plan_balanced_kernel
    from packing.steppack import _pack_step
    packing.warmup()
    for dtype in (np.int32, np.int64):
        sizes = np.array([5, 3, 2, 2, 1, 7], dtype=dtype)
        packing.plan_balanced(sizes.astype(np.int64), sizes.astype(np.float64), 2, 1, 8, 16, 2)
    assert len(_plan_balanced_kernel.signatures) == 1
    assert len(_pack_step.signatures) == 1
