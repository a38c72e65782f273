"""Costs of many documents at once, in blocks: the one place per-document totals (what the
planner balances) and per-microbatch ``(forward, backward)`` are computed from a cost model.

The planner, the plan store's windows, the metrics and the multimodal planner all call these,
so a microbatch's cost is the same sum of its documents' costs everywhere. Blocks bound the
temporaries (``_BLOCK`` elements), and every microbatch is summed on its own, in entry order,
so the result does not depend on where the entries sit in a larger plan (a window of the
store equals the whole-epoch result bit for bit)."""
from __future__ import annotations

import numpy as np

from packing.doc_cost import _microbatch_sums, _total_costs
from packing.segments import add_segment_sums
from packing.validate import MAX_LENGTH

from .model import CostModel

_BLOCK = 1 << 20  # elements per block when a full-length temporary would cost memory


def _pass_coefficients(cost: CostModel):
    """``(forward, backward)`` ``a, b, d`` as float64[3] each, or None where ``cost`` is not
    exactly a CostModel (a formula of the protocol, or a subclass, defines its own costs) or
    has attention terms: those take ``cost.doc_costs``."""
    if type(cost) is not CostModel or cost.attention:
        return None
    return tuple(np.array([p.a, p.b, p.d], dtype=np.float64) for p in (cost.forward, cost.backward))


def _int64_lengths(length):
    """``length`` as contiguous int64 when it already is integer, else None."""
    length = np.asarray(length)
    if length.ndim != 1 or length.dtype.kind not in "iu":
        return None
    return np.ascontiguousarray(length, dtype=np.int64)


def doc_totals(cost: CostModel, length: np.ndarray) -> np.ndarray:
    """Forward plus backward cost of every document: float64[k] for int64[k] lengths."""
    out = np.empty(length.shape[0], dtype=np.float64)
    # one compiled pass where the model is a pass's a L^2 + b L + d (every preset without
    # attention terms): the same values, bit for bit, without the two per-pass arrays and the
    # checks' reductions (1M documents: ~7 -> ~2 ms). Anything it refuses goes the checked way
    coef, lengths = _pass_coefficients(cost), _int64_lengths(length)
    if coef is not None and lengths is not None and _total_costs(
            lengths, coef[0], coef[1], bool(cost.recompute), np.int64(MAX_LENGTH), out):
        return out
    for lo in range(0, length.shape[0], _BLOCK):
        out[lo:lo + _BLOCK] = cost.doc_total(length[lo:lo + _BLOCK])
    return out


def microbatch_costs(cost: CostModel, entry_length: np.ndarray, mb_offsets: np.ndarray):
    """Predicted ``(forward, backward)`` of every microbatch (float64[M] each) for entries
    int64[E] grouped by ``mb_offsets`` (int64[M + 1]): each one the sum of its documents'
    costs in entry order plus the per-microbatch constant. Computed in blocks cut at microbatch
    boundaries, so no full-length temporary is held."""
    n_mb = mb_offsets.shape[0] - 1
    mb_f = np.zeros(n_mb)
    mb_b = np.zeros(n_mb)
    if n_mb == 0:
        return mb_f, mb_b
    cf, cb = cost.microbatch_constant
    # one compiled pass (see doc_totals): the same sums, bit for bit (1M entries: ~11 -> ~3 ms)
    coef, lengths = _pass_coefficients(cost), _int64_lengths(entry_length)
    offsets = np.asarray(mb_offsets)
    if coef is not None and lengths is not None and offsets.dtype.kind in "iu" and \
            _microbatch_sums(lengths, np.ascontiguousarray(offsets, dtype=np.int64), coef[0],
                             coef[1], bool(cost.recompute), np.int64(MAX_LENGTH), float(cf),
                             float(cb), mb_f, mb_b):
        return mb_f, mb_b
    mb_f[:] = 0.0
    mb_b[:] = 0.0
    n = entry_length.shape[0]
    lo = int(mb_offsets[0])
    while lo < n:
        j = int(np.searchsorted(mb_offsets, lo + _BLOCK, side="left"))
        hi = int(mb_offsets[min(j, n_mb)])
        hi = max(hi, int(mb_offsets[np.searchsorted(mb_offsets, lo, side="right")]))
        f, b = cost.doc_costs(entry_length[lo:hi])
        # the microbatches whose entries are [lo, hi): each summed in entry order from 0.0
        # (the sums np.bincount gave, without a binary search per entry)
        m0 = int(np.searchsorted(mb_offsets, lo, side="right")) - 1
        m1 = int(np.searchsorted(mb_offsets, hi, side="left"))
        add_segment_sums(f, mb_offsets[m0:m1 + 1], lo, mb_f[m0:m1])
        add_segment_sums(b, mb_offsets[m0:m1 + 1], lo, mb_b[m0:m1])
        lo = hi
    return mb_f + cf, mb_b + cb
