"""One place that decides how kernels are compiled and where their cache lives.

Every kernel in :mod:`packing` is decorated with :func:`kernel`, which is ``numba.njit`` with
``cache=True`` when a writable cache location exists. The cache directory can be overridden with
``BALANCER_NUMBA_CACHE_DIR`` (or numba's own ``NUMBA_CACHE_DIR``), which must be set before
:mod:`packing` is imported. On a read-only install with no writable cache location the kernels
are compiled in memory instead of failing at import time.
"""
from __future__ import annotations

import os
import tempfile
import warnings

_override = os.environ.get("BALANCER_NUMBA_CACHE_DIR")
if _override:
    os.environ["NUMBA_CACHE_DIR"] = _override

import numba  # noqa: E402
from numba.core import config as _numba_config  # noqa: E402

if _override:
    _numba_config.CACHE_DIR = _override


def _dir_writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
        return True
    except OSError:
        return False


def _cache_usable() -> bool:
    """True when numba can persist compiled kernels somewhere."""
    if _numba_config.CACHE_DIR:
        return _dir_writable(_numba_config.CACHE_DIR)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")
    if _dir_writable(here):
        return True
    # numba's user-wide fallback locator (~/.cache/numba or $XDG_CACHE_HOME)
    home_cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "numba")
    return _dir_writable(home_cache)


CACHE_ENABLED = _cache_usable()
if not CACHE_ENABLED:  # pragma: no cover - exercised by a subprocess test
    warnings.warn(
        "packing: no writable numba cache location; kernels compile in memory on every start. "
        "Set BALANCER_NUMBA_CACHE_DIR to a writable directory to cache them.",
        RuntimeWarning,
        stacklevel=2,
    )


def kernel(fn):
    """``numba.njit`` with disk caching when possible; one compiled specialisation per kernel is
    expected because public wrappers convert every argument to a fixed dtype first."""
    return numba.njit(cache=CACHE_ENABLED, nogil=True)(fn)
