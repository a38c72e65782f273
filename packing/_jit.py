"""One place that decides how kernels are compiled and where their cache lives.

Every kernel in :mod:`packing` is decorated with :func:`kernel`: ``numba.njit`` with
``cache=True`` when a writable cache location exists. Kernels are cached under
``<base>/packing-<hash of this package's sources>``, where ``<base>`` is
``$BALANCER_NUMBA_CACHE_DIR`` (or numba's ``$NUMBA_CACHE_DIR``), else ``$XDG_CACHE_HOME/balancer``
(``~/.cache/balancer``). Keying the directory on every source file matters: numba invalidates a
cached kernel when *its own* file changes, not when a kernel it calls (in another file) does, so a
shared directory could serve a stale inlined callee after an upgrade. The variables must be set
before :mod:`packing` is imported. With no writable location (a read-only install and home) the
kernels compile in memory instead of failing at import time.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path

import numba  # noqa: E402
from numba.core import config as _numba_config  # noqa: E402

_HERE = Path(__file__).resolve().parent


def _source_hash() -> str:
    h = hashlib.sha256(numba.__version__.encode())
    for p in sorted(_HERE.glob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _dir_writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
        return True
    except OSError:
        return False


def cache_base() -> str:
    """The directory the kernel caches go under (the environment's choice, else the default)."""
    return (os.environ.get("BALANCER_NUMBA_CACHE_DIR") or os.environ.get("NUMBA_CACHE_DIR")
            or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                            "balancer"))


def _cache_dir() -> str | None:
    path = os.path.join(cache_base(), f"packing-{_source_hash()}")
    return path if _dir_writable(path) else None


CACHE_DIR = _cache_dir()
CACHE_ENABLED = CACHE_DIR is not None
if not CACHE_ENABLED:  # pragma: no cover - exercised by a subprocess test
    warnings.warn(
        "packing: no writable numba cache location; kernels compile in memory on every start. "
        "Set BALANCER_NUMBA_CACHE_DIR to a writable directory to cache them.",
        RuntimeWarning,
        stacklevel=2,
    )


def kernel(fn):
    """``numba.njit`` with disk caching when possible. One compiled signature per kernel
    (tests/packing/test_signatures.py): public wrappers convert every argument to the one dtype
    its kernel takes (int64, float64, bool, named tuples of those), and kernels call each other
    with typed scalars (``np.int64(0)``, ``np.bool_(True)``), since a Python literal argument
    compiles a ``Literal[int](0)`` specialisation of the callee beside the int64 one."""
    if not CACHE_ENABLED:
        return numba.njit(cache=False, nogil=True)(fn)
    # numba picks a kernel's cache location when it is decorated; point it at our directory for
    # that moment only, so other numba users in the process keep their own setting
    previous = _numba_config.CACHE_DIR
    _numba_config.CACHE_DIR = CACHE_DIR
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    finally:
        _numba_config.CACHE_DIR = previous
