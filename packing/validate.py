"""Input checks shared by the public wrappers: convert to the one dtype each kernel is compiled
for, and reject bad values with a message that names the item, the value and the limit."""
from __future__ import annotations

import numpy as np


def as_sizes(sizes, name: str = "length") -> np.ndarray:
    """Return ``sizes`` as a contiguous int64 array of positive integers or raise ValueError."""
    arr = np.asarray(sizes)
    if arr.ndim != 1:
        raise ValueError(f"{name}s must be a 1-D array, got shape {arr.shape}")
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"sample {i}: {name} {float(arr[i])!r} is not an integer")
    elif arr.dtype.kind not in "iub":
        raise ValueError(f"{name}s must be integers, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.size:
        i = int(np.argmin(arr))
        if arr[i] <= 0:
            raise ValueError(f"sample {i}: {name} {int(arr[i])} is not positive (must be >= 1)")
    return arr


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
