"""Kernels compile once, cache to an overridable directory, and still work when no cache
location is writable (a read-only install)."""
import json
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


COMPILE_CHECK = (
    "import json; from balancer.cli.compile import compile_all, kernels; compile_all(); "
    "ks = kernels(); print(json.dumps({'kernels': len(ks), "
    "'never': [k.__module__ + '.' + k.__name__ for k in ks if not k.signatures], "
    "'misses': sum(sum(k.stats.cache_misses.values()) for k in ks), "
    "'hits': sum(sum(k.stats.cache_hits.values()) for k in ks)}))")


def test_compile_command_fills_the_cache_with_every_kernel(tmp_path):
    """``python -m balancer compile`` in an empty cache compiles every kernel of packing (none
    left for a job's first plan: a kernel only a caller inlines still gets its signature); a
    second process then loads all of them from the cache and compiles none."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR",
                                                             "BALANCER_NUMBA_CACHE_DIR")}
    env["BALANCER_NUMBA_CACHE_DIR"] = str(tmp_path)
    cold = subprocess.run([sys.executable, "-c", COMPILE_CHECK], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert cold.returncode == 0, cold.stderr[-3000:]
    first = json.loads(cold.stdout.strip().splitlines()[-1])
    assert first["kernels"] >= 60 and first["never"] == [] and first["misses"] > 0
    warm = subprocess.run([sys.executable, "-m", "balancer", "compile"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert f"compile: {first['kernels']} kernels ready" in warm.stdout
    assert "(0 compiled now," in warm.stdout and str(tmp_path) in warm.stdout
