"""Costs of many documents at once, in blocks: the one place per-document totals (what the
planner balances) and per-microbatch ``(forward, backward)`` are computed from a cost model.

The planner, the plan store's windows, the metrics and the multimodal planner all call these,
so a microbatch's cost is the same sum of its documents' costs everywhere. Blocks bound the
temporaries (``_BLOCK`` elements), and every microbatch is summed on its own, in entry order,
so the result does not depend on where the entries sit in a larger plan (a window of the
store equals the whole-epoch result bit for bit)."""
from __future__ import annotations

import numpy as np

from packing.segments import add_segment_sums

from .model import CostModel

_BLOCK = 1 << 20  # elements per block when a full-length temporary would cost memory


def doc_totals(cost: CostModel, length: np.ndarray) -> np.ndarray:
    """Forward plus backward cost of every document: float64[k] for int64[k] lengths."""
    out = np.empty(length.shape[0], dtype=np.float64)
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
    cf, cb = cost.microbatch_constant
    return mb_f + cf, mb_b + cb
