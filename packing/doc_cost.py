"""The per-document cost of one pass, ``a * L^2 + b * L + d``, over many documents in one
compiled loop. The values are those of the numpy expression ``a * lf * lf + b * lf`` (``lf`` the
lengths as float64) with ``d`` added when it is not zero, bit for bit: the same operations in
the same order (numba fuses no multiply-add without fastmath), without the expression's five
full-length temporaries, which made per-document costs a tenth of a 1M-sample plan."""
from __future__ import annotations

import numpy as np

from ._jit import kernel


@kernel
def _pass_costs(lengths, a, b, d, out):
    """``out[i] = a * L * L + b * L (+ d when d != 0)`` for ``L = float(lengths[i])``
    (``lengths`` int64[n], ``out`` float64[n]); an overflow gives inf, as numpy does."""
    for i in range(lengths.shape[0]):
        lf = np.float64(lengths[i])
        v = a * lf * lf + b * lf
        if d != 0.0:
            v += d
        out[i] = v


def pass_costs(lengths, a: float, b: float, d: float = 0.0) -> np.ndarray:
    """float64[n] costs ``a * L^2 + b * L + d`` of int64[n] document lengths (any integer
    dtype is converted; other dtypes are refused, not truncated)."""
    lengths = np.asarray(lengths)
    if lengths.dtype.kind not in "iu":
        raise ValueError(f"document lengths must be integers, got dtype {lengths.dtype}")
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    out = np.empty(lengths.shape[0], dtype=np.float64)
    _pass_costs(lengths, float(a), float(b), float(d), out)
    return out
