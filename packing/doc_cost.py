"""The per-document cost of one pass, ``a * L^2 + b * L + d``, over many documents in one
compiled loop. The values are those of the numpy expression ``a * lf * lf + b * lf`` (``lf`` the
lengths as float64) with ``d`` added when it is not zero, bit for bit: the same operations in
the same order (numba fuses no multiply-add without fastmath), without the expression's five
full-length temporaries, which made per-document costs a tenth of a 1M-sample plan. Also, for
``balancer.cost.blocks``, a cost model's forward plus backward per document and its forward and
backward sums per microbatch, each in one loop over the lengths with the same arithmetic."""
from __future__ import annotations

import numpy as np

from ._jit import kernel


@kernel
def _doc_pass(lf, a, b, d):
    """One pass's cost of a document of ``lf`` tokens (float64): the numpy expression's
    operations in its order (every kernel here computes a cost through this one)."""
    v = a * lf * lf + b * lf
    if d != 0.0:
        v += d
    return v


@kernel
def _doc_fwd_bwd(lf, fwd, bwd, recompute):
    """``(forward, backward)`` of a document of ``lf`` tokens (``fwd``, ``bwd``: float64[3], a
    pass's ``a, b, d``); with ``recompute`` the backward adds the forward, as
    ``CostModel.doc_costs`` does."""
    f = _doc_pass(lf, fwd[0], fwd[1], fwd[2])
    b = _doc_pass(lf, bwd[0], bwd[1], bwd[2])
    if recompute:
        b = b + f
    return f, b


@kernel
def _pass_costs(lengths, a, b, d, out):
    """``out[i] = a * L * L + b * L (+ d when d != 0)`` for ``L = float(lengths[i])``
    (``lengths`` int64[n], ``out`` float64[n]); an overflow gives inf, as numpy does."""
    for i in range(lengths.shape[0]):
        out[i] = _doc_pass(np.float64(lengths[i]), a, b, d)


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


@kernel
def _total_costs(lengths, fwd, bwd, recompute, limit, out):
    """``out[i]`` = forward + backward cost of ``lengths[i]`` (``fwd``, ``bwd``: float64[3],
    a pass's ``a, b, d``; with ``recompute`` the backward adds the forward first), the values
    of two :func:`_pass_costs` arrays, the recompute sum and their sum, bit for bit, in one
    pass and no temporaries. Returns False, with ``out`` partly written, where a length is
    outside ``[1, limit]`` or the sum of the costs is not finite: the caller then takes the
    checked path, which raises the error that names the sample."""
    total = 0.0
    for i in range(lengths.shape[0]):
        n = lengths[i]
        if n < 1 or n > limit:
            return False
        f, b = _doc_fwd_bwd(np.float64(n), fwd, bwd, recompute)
        v = f + b
        out[i] = v
        total += v
    return np.isfinite(total)


@kernel
def _microbatch_sums(lengths, offsets, fwd, bwd, recompute, limit, const_f, const_b, mb_f,
                     mb_b):
    """``mb_f[j]``, ``mb_b[j]``: the forward and backward costs of the entries
    ``lengths[offsets[j]:offsets[j + 1]]``, each summed in entry order from 0.0, plus the
    per-microbatch constants (``offsets`` int64[S + 1], ``mb_f``/``mb_b`` float64[S]); the
    sums of per-document arrays, bit for bit, without them. Returns False where an offset is
    out of order or range, a length outside ``[1, limit]`` or a sum not finite (the caller
    takes the checked path)."""
    n = lengths.shape[0]
    total = 0.0
    for j in range(offsets.shape[0] - 1):
        lo = offsets[j]
        hi = offsets[j + 1]
        if lo < 0 or hi < lo or hi > n:
            return False
        sf = 0.0
        sb = 0.0
        for e in range(lo, hi):
            k = lengths[e]
            if k < 1 or k > limit:
                return False
            f, b = _doc_fwd_bwd(np.float64(k), fwd, bwd, recompute)
            sf += f
            sb += b
        mb_f[j] = sf + const_f
        mb_b[j] = sb + const_b
        total += sf + sb
    return np.isfinite(total)
