"""Input checks shared by the public wrappers: convert to the one dtype each kernel is compiled
for, and reject bad values with a message that names the item, the value and the limit.

:func:`as_sizes` is the one validation path for arrays of lengths: the API (``SampleTable``, the
packing wrappers, cost models) and the CLI (``--lengths`` files) both go through it, and it checks
the array *as given* (dtype, finiteness, integrality, range) before any cast, so nothing is
truncated or wrapped silently."""
from __future__ import annotations

import math
import numbers

import numpy as np

#: the longest sample, and the largest microbatch capacity, in tokens (about 1.1e12): far above
#: any real sequence, and low enough that sums and products of lengths stay inside int64
MAX_LENGTH = 2 ** 40
#: the most tokens one step may take (dp x microbatches x capacity, or a token budget)
MAX_STEP_TOKENS = 2 ** 52
#: the most tokens a whole dataset may hold (sums of lengths are int64)
MAX_TOTAL = 2 ** 62


def _pow2(v: int) -> str:
    e = int(v).bit_length() - 1
    return f"2**{e}" if v == 1 << e else str(v)


def _where(source) -> str:
    return f"{source}: " if source else ""


def _holds_sequences(sizes) -> bool:
    """Whether a list / tuple holds sequences (token lists, arrays) where numbers belong."""
    if not isinstance(sizes, (list, tuple)) or not sizes:
        return False
    first = sizes[0]
    return hasattr(first, "__len__") and not isinstance(first, (str, bytes)) and \
        getattr(first, "ndim", 1) != 0


def as_sizes(sizes, name: str = "length", *, source=None, limit: int = MAX_LENGTH) -> np.ndarray:
    """Return ``sizes`` as a contiguous int64 array of integers in ``[1, limit]`` or raise
    ValueError naming ``source`` (a file, when given), the first bad sample, its value and the
    limit. Integer dtypes and floats that are exactly integral are accepted; bool, complex,
    strings and other dtypes are refused, as are NaN and infinities."""
    w = _where(source)
    if not isinstance(sizes, np.ndarray) and _holds_sequences(sizes):
        first = sizes[0]
        raise ValueError(f"{w}sample 0: {name} is a sequence of {len(first)} values, not a "
                         f"number: pass one {name} per sample, e.g. [len(x) for x in docs], "
                         f"not the samples themselves")
    arr = np.asarray(sizes)
    if arr.ndim != 1:
        raise ValueError(f"{w}{name}s must be a 1-D array, got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind == "O":
        arr = _object_sizes(arr, name, w, limit)
    elif kind == "f":
        finite = np.isfinite(arr)
        if not finite.all():
            i = int(np.flatnonzero(~finite)[0])
            raise ValueError(f"{w}sample {i}: {name} {float(arr[i])!r} is not an integer "
                             f"(not a finite number)")
        frac = np.flatnonzero(arr != np.floor(arr))
        if frac.size:
            i = int(frac[0])
            raise ValueError(f"{w}sample {i}: {name} {float(arr[i])!r} is not an integer")
    elif kind not in "iu":
        first = f" (sample 0: {arr[0].item()!r})" if arr.size else ""
        hint = "; a boolean mask is not a length" if kind == "b" else \
            "; convert the column to integers first" if kind in "USc" else ""
        raise ValueError(f"{w}{name}s must be integers, got dtype {arr.dtype}{first}{hint}")
    if arr.size:
        i = int(np.argmax(arr))
        if arr[i] > limit:
            v = arr[i].item()
            v = int(v) if isinstance(v, float) and v < 1e18 else v
            raise ValueError(f"{w}sample {i}: {name} {v!r} exceeds the largest supported "
                             f"{name} {_pow2(limit)} ({limit})")
        j = int(np.argmin(arr))
        if arr[j] <= 0:
            v = arr[j].item()
            raise ValueError(f"{w}sample {j}: {name} {int(v)} is not positive (must be >= 1)")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    n = arr.shape[0]
    if n and n * int(arr[i]) > MAX_TOTAL:
        total = int(arr.sum(dtype=np.float64))
        if total > MAX_TOTAL:
            raise ValueError(f"{w}the total of the {name}s ({total:.4g} over {n} samples) "
                             f"exceeds {_pow2(MAX_TOTAL)}: split the dataset")
    return arr


def _object_sizes(arr: np.ndarray, name: str, w: str, limit: int) -> np.ndarray:
    """An object array (e.g. from a list holding a huge number or a None), checked element by
    element before any cast."""
    out = np.empty(arr.shape[0], np.int64)
    for i, v in enumerate(arr):
        integral = not isinstance(v, (bool, np.bool_)) and (
            isinstance(v, numbers.Integral)
            or (isinstance(v, numbers.Real) and math.isfinite(v) and float(v).is_integer()))
        if not integral:
            raise ValueError(f"{w}sample {i}: {name} {v!r} is not an integer")
        if v > limit:
            raise ValueError(f"{w}sample {i}: {name} {int(v)} exceeds the largest supported "
                             f"{name} {_pow2(limit)} ({limit})")
        if v <= 0:
            raise ValueError(f"{w}sample {i}: {name} {int(v)} is not positive (must be >= 1)")
        out[i] = int(v)
    return out


def as_costs(costs, n: int | None = None, name: str = "cost") -> np.ndarray:
    """Return ``costs`` as contiguous float64, rejecting NaN, infinite or negative values."""
    arr = np.ascontiguousarray(np.asarray(costs, dtype=np.float64))
    if arr.ndim != 1:
        raise ValueError(f"{name}s must be a 1-D array, got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name}s has {arr.shape[0]} entries, expected {n}")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sample {i}: {name} {float(arr[i])!r} is not a finite non-negative number")
    return arr


def check_capacity(sizes: np.ndarray, capacity) -> int:
    capacity = int(capacity)
    if capacity <= 0:
        raise ValueError(f"capacity {capacity} must be positive")
    if capacity > MAX_LENGTH:
        raise ValueError(f"capacity {capacity} exceeds the largest supported capacity "
                         f"{_pow2(MAX_LENGTH)} ({MAX_LENGTH}) tokens")
    if sizes.size:
        i = int(np.argmax(sizes))
        if sizes[i] > capacity:
            raise ValueError(
                f"sample {i}: length {int(sizes[i])} exceeds the capacity {capacity}"
            )
    return capacity


def check_groups(n_items: int, n_groups: int) -> None:
    if n_groups <= 0:
        raise ValueError(f"number of groups {n_groups} must be positive")
    if n_items % n_groups:
        raise ValueError(
            f"{n_items} items cannot be split into {n_groups} groups of equal count "
            f"({n_items} % {n_groups} = {n_items % n_groups})"
        )
