"""Kernels compile once, cache to an overridable directory, and still work when no cache
location is writable (a read-only install)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
# one small kernel: enough to show where (and whether) kernels are cached
SNIPPET = ("import warnings, packing; warnings.simplefilter('always'); "
           "print('cache', packing.CACHE_ENABLED); "
           "print(packing.first_fit_decreasing([3, 2, 2], 4)[1])")
UNWRITABLE = "/proc/self/no-such-dir"


def _env(cache_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR",
                                                             "BALANCER_NUMBA_CACHE_DIR")}
    env["BALANCER_NUMBA_CACHE_DIR"] = str(cache_dir)
    return env


def test_unwritable_cache_falls_back_to_memory():
    r = subprocess.run([sys.executable, "-c", SNIPPET], cwd=ROOT, env=_env(UNWRITABLE),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "cache False" in r.stdout and r.stdout.strip().endswith("2")
    assert "compile in memory" in r.stderr


def test_compile_refuses_without_a_writable_cache():
    # compiling in memory would be thrown away at exit: refused before any kernel compiles
    r = subprocess.run([sys.executable, "-m", "balancer", "compile"], cwd=ROOT,
                       env=_env(UNWRITABLE), capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: compile: no writable numba cache location")
    assert UNWRITABLE in err and "BALANCER_NUMBA_CACHE_DIR" in err
    assert "kernels ready" not in r.stdout


def test_one_specialisation_for_planner_kernels():
    import packing
    from balancer.planning.warmup import warmup
    from packing.balanced import _plan_balanced_kernel
    from packing.steppack import _pack_step
    warmup(["fixed"])
    for dtype in (np.int32, np.int64):
        sizes = np.array([5, 3, 2, 2, 1, 7], dtype=dtype)
        packing.plan_balanced(sizes.astype(np.int64), sizes.astype(np.float64), 2, 1, 8, 16, 2)
    assert len(_plan_balanced_kernel.signatures) == 1
    assert len(_pack_step.signatures) == 1


def test_cache_dir_override(tmp_path):
    r = subprocess.run([sys.executable, "-c", SNIPPET], cwd=ROOT, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "cache True" in r.stdout and r.stdout.strip().endswith("2")
    assert list(tmp_path.rglob("*.nbi")), "no kernel was cached in the override directory"


def _callees(k, by_func) -> set:
    """The kernels ``k``'s Python source calls (global names that are kernels, nested code
    objects included)."""
    out, stack = set(), [k.py_func.__code__]
    while stack:
        code = stack.pop()
        stack += [c for c in code.co_consts if hasattr(c, "co_names")]
        for name in code.co_names:
            target = k.py_func.__globals__.get(name)
            if id(target) in by_func:
                out.add(id(target))
    return out


def test_warmup_reaches_every_kernel(compiled_kernels):
    """The one warm-up (the session fixture ran it) reaches every kernel of packing: each has a
    signature (compiled now or loaded from the cache) or is called by one that has (loaded
    from the cache, a caller brings its inlined callees with it). None is left to compile at a
    job's first plan."""
    from balancer.planning.warmup import kernels
    ks = kernels()
    assert len(ks) >= 60 and compiled_kernels["kernels"] == len(ks)
    by_func = {id(k): k for k in ks}
    reached = {id(k) for k in ks if k.signatures}
    todo = list(reached)
    while todo:
        for c in _callees(by_func[todo.pop()], by_func) - reached:
            reached.add(c)
            todo.append(c)
    assert [k.__module__ + "." + k.__name__ for k in ks if id(k) not in reached] == []


def test_compile_command_loads_every_kernel_from_the_cache(compiled_kernels):
    """After the warm-up filled the cache, ``python -m balancer compile`` in a new process loads
    every kernel and compiles none (the suite's only cold compile is the session fixture's, and
    only when the cache is cold)."""
    from packing._jit import CACHE_DIR
    if CACHE_DIR is None:
        pytest.skip("no writable numba cache on this machine: nothing can be loaded")
    r = subprocess.run([sys.executable, "-m", "balancer", "compile"], cwd=ROOT, env=_env(
        os.environ.get("BALANCER_NUMBA_CACHE_DIR") or os.path.dirname(CACHE_DIR)),
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"compile: {compiled_kernels['kernels']} kernels ready" in r.stdout
    assert "(0 compiled now," in r.stdout and CACHE_DIR in r.stdout


def test_compile_refuses_with_the_jit_disabled(tmp_path):
    """NUMBA_DISABLE_JIT turns every kernel into plain Python: ``compile`` compiled nothing,
    cached nothing and exited 0 (issue 30 item 10); now refused, naming the variable."""
    env = _env(tmp_path)
    env["NUMBA_DISABLE_JIT"] = "1"
    r = subprocess.run([sys.executable, "-m", "balancer", "compile"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: compile: NUMBA_DISABLE_JIT") and "kernels ready" not in r.stdout


_BROKEN = """
import shutil, sys, packing
from packing._jit import CACHE_DIR
from balancer.planning.warmup import kernels, uncached
if sys.argv[1] == "broken":  # the location was checked at import; numba then drops the writes
    shutil.rmtree(CACHE_DIR)
    open(CACHE_DIR, "w").close()
packing.first_fit_decreasing([3, 2, 2], 4)
print("uncached", sorted(uncached(kernels(), CACHE_DIR)))
"""


@pytest.mark.parametrize("case", ["intact", "broken"])
def test_uncached_names_kernels_numba_did_not_write(tmp_path, case):
    """numba drops a failed cache write silently (the kernel runs, nothing is kept): what
    ``compile`` checks after compiling, so that it fails instead of exiting 0 with nothing
    cached."""
    r = subprocess.run([sys.executable, "-c", _BROKEN, case], cwd=ROOT, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("uncached")][0]
    if case == "intact":
        assert line == "uncached []"
    else:
        assert "binpack." in line, line
