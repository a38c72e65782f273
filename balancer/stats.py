"""Summaries of a distribution of per-step (or per-microbatch) figures: mean, quantiles and
maximum (:func:`summarize`), the shape of every ``{"mean", "p50", "p90", "p99", "max"}`` block of
the reports, the multimodal planner's figures and ``tools/``. A base module: the figures of any
layer summarise with it without depending on the report layer."""
from __future__ import annotations

import numpy as np

#: the quantiles of a summary: key -> percentile
QUANTILES = {"p50": 50, "p90": 90, "p99": 99}


def summarize(x) -> dict:
    """``{"mean", "p50", "p90", "p99", "max"}`` of the values ``x`` (float64); NaN for each when
    ``x`` is empty."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"),
                "p99": float("nan"), "max": float("nan")}
    out = {"mean": float(x.mean())}
    for k, q in QUANTILES.items():
        out[k] = float(np.percentile(x, q))
    out["max"] = float(x.max())
    return out
