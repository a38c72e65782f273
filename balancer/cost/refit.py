"""Refit a cost model from microbatch times measured while training (issue #26, the closed loop).

:mod:`.calibration` fits a preset offline from a dedicated timing run. Here the observations
come from the training run itself, so they are dirtier: the first steps include compilation and
allocator warm-up, a data-loader stall or a noisy neighbour inflates one microbatch now and
then. The fit is therefore

* **non-negative** (every coefficient ``>= 0``, as :class:`~.model.PassCost` requires), exact
  over every support of the few columns (:func:`.calibration.nnls3`);
* **relative** (rows weighted by ``1 / seconds``: the planner compares microbatches whose times
  span orders of magnitude);
* **robust**: iteratively reweighted with Huber weights on the relative residuals (scale from
  their median absolute value), so a stalled microbatch pulls the fit by a bounded amount, and
  every observation carries a caller's weight (0 drops it: the first steps).

The columns are those of the template model: ``(sum L^2, sum L, 1, documents)`` for an
``a L^2 + b L + c + d`` model, or one column of query-key pairs per attention pattern for a model
from a Hugging Face config (:func:`.calibration.layered_features`). The fit is a pure function
of its inputs: every rank that fits the same observations gets the same coefficients.

Observations are CSR arrays: ``doc_lengths`` int64[E], ``offsets`` int64[M+1] (microbatch ``m``
holds ``doc_lengths[offsets[m]:offsets[m+1]]``), times float64[M] in seconds."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .attention import AttentionTerm
from .blocks import microbatch_costs
from .calibration import features, layered_features, nnls3
from .model import CostModel, PassCost

#: Huber's constant (95% efficiency under Gaussian noise), in units of the residuals' scale
HUBER_K = 1.345


def kinds_of(template: CostModel) -> list[tuple[str, Optional[int]]]:
    """The attention patterns ``(kind, window)`` of a per-layer-type template (empty for an
    ``a L^2 + b L`` model)."""
    return [(t.kind, t.window) for t in template.attention]


def design(template: CostModel, doc_lengths, offsets) -> np.ndarray:
    """float64[M, K]: the fit's columns per microbatch for ``template``'s form (see the module
    docstring)."""
    kinds = kinds_of(template)
    if kinds:
        return layered_features(doc_lengths, offsets, kinds)
    return features(doc_lengths, offsets)


def robust_nnls(x: np.ndarray, y: np.ndarray, weight: Optional[np.ndarray] = None,
                iterations: int = 8) -> np.ndarray:
    """Non-negative ``c`` minimising the Huber loss of the relative residuals
    ``(x c - y) / y``, each row also weighted by ``weight`` (float64[M], >= 0; default ones).
    Rows of weight 0 are left out. Deterministic."""
    y = np.asarray(y, dtype=np.float64)
    w0 = np.ones_like(y) if weight is None else np.asarray(weight, dtype=np.float64)
    keep = w0 > 0
    x, y, w0 = x[keep], y[keep], w0[keep]
    if x.shape[0] < x.shape[1]:
        raise ValueError(f"need at least {x.shape[1]} weighted microbatches to fit "
                         f"{x.shape[1]} coefficients, got {x.shape[0]}")
    bad = ~np.isfinite(y) | (y <= 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"observation {i}: measured time {y[i]!r} is not a positive number")
    h = np.ones_like(y)
    c = np.zeros(x.shape[1])
    for _ in range(max(1, iterations)):
        w = np.sqrt(w0 * h) / y  # least squares on relative error, Huber- and caller-weighted
        xw, yw = x * w[:, None], y * w
        scale = np.linalg.norm(xw, axis=0)
        scale[scale == 0] = 1.0  # a column that is zero everywhere keeps coefficient 0
        new = nnls3(xw / scale, yw) / scale
        r = np.abs(x @ new - y) / y
        s = max(1.4826 * float(np.median(r)), 1e-9)
        h_new = np.where(r <= HUBER_K * s, 1.0, HUBER_K * s / np.maximum(r, 1e-300))
        done = np.allclose(new, c, rtol=1e-12, atol=0.0)
        c, h = new, h_new
        if done:
            break
    return c


def _shares(template: CostModel) -> np.ndarray:
    """Forward share of every column's coefficient (for a fit of forward + backward together):
    the template's own forward / (forward + backward), 1/3 where it has neither."""
    f, b = template.forward, template.backward
    kinds = kinds_of(template)
    pairs = [(t.forward, t.backward) for t in template.attention]
    cols = pairs + [(f.b, b.b), (f.c, b.c), (f.d, b.d)] if kinds else \
        [(f.a, b.a), (f.b, b.b), (f.c, b.c), (f.d, b.d)]
    return np.array([x / (x + y) if x + y > 0 else 1.0 / 3.0 for x, y in cols])


def model_from_coefficients(template: CostModel, fwd: np.ndarray, bwd: np.ndarray,
                            name: str) -> CostModel:
    """A seconds-unit :class:`CostModel` of ``template``'s form with per-pass coefficients in
    :func:`design`'s column order (the memory model, which sets the capacity, is kept)."""
    fwd = [float(v) for v in fwd]
    bwd = [float(v) for v in bwd]
    kinds = kinds_of(template)
    if kinds:
        nk = len(kinds)
        terms = tuple(AttentionTerm(kind=k, window=w, forward=fwd[i], backward=bwd[i],
                                    layers=template.attention[i].layers)
                      for i, (k, w) in enumerate(kinds))
        fp = PassCost(b=fwd[nk], c=fwd[nk + 1], d=fwd[nk + 2])
        bp = PassCost(b=bwd[nk], c=bwd[nk + 1], d=bwd[nk + 2])
    else:
        terms = ()
        fp = PassCost(a=fwd[0], b=fwd[1], c=fwd[2], d=fwd[3])
        bp = PassCost(a=bwd[0], b=bwd[1], c=bwd[2], d=bwd[3])
    return CostModel(name=name, unit="seconds", forward=fp, backward=bp, attention=terms,
                     memory=template.memory)


def coefficients(model: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """``(forward, backward)`` coefficients of ``model`` in :func:`design`'s column order."""
    f, b = model.forward, model.backward
    if model.attention:
        fwd = [t.forward for t in model.attention] + [f.b, f.c, f.d]
        bwd = [t.backward for t in model.attention] + [b.b, b.c, b.d]
    else:
        fwd, bwd = [f.a, f.b, f.c, f.d], [b.a, b.b, b.c, b.d]
    return np.array(fwd, np.float64), np.array(bwd, np.float64)


def refit(template: CostModel, doc_lengths, offsets, *, forward=None, backward=None, total=None,
          weight=None, name: str = "refit", iterations: int = 8) -> CostModel:
    """A seconds-unit model of ``template``'s form fitted to measured microbatches.

    Give ``forward`` and ``backward`` seconds (float64[M] each: one robust fit per pass) or
    ``total`` (forward + backward, one fit, split between the passes in the template's own
    per-coefficient ratio). ``weight`` (float64[M], >= 0) scales each observation's say (0
    leaves it out). Raises a ValueError naming a non-positive time or too few observations."""
    x = design(template, doc_lengths, offsets)
    if total is not None:
        if forward is not None or backward is not None:
            raise ValueError("give forward and backward seconds, or total, not both")
        c = robust_nnls(x, _times(total, x, "total"), weight, iterations)
        share = _shares(template)
        return model_from_coefficients(template, c * share, c * (1 - share), name)
    if forward is None or backward is None:
        raise ValueError("give forward and backward seconds, or total")
    cf = robust_nnls(x, _times(forward, x, "forward"), weight, iterations)
    cb = robust_nnls(x, _times(backward, x, "backward"), weight, iterations)
    return model_from_coefficients(template, cf, cb, name)


def _times(t, x, what: str) -> np.ndarray:
    t = np.asarray(t, dtype=np.float64)
    if t.shape != (x.shape[0],):
        raise ValueError(f"{what}: {t.shape} times for {x.shape[0]} microbatches")
    return t


def predict_total(model: CostModel, doc_lengths, offsets) -> np.ndarray:
    """Predicted forward + backward of every microbatch (float64[M]) in the model's unit."""
    f, b = microbatch_costs(model, np.asarray(doc_lengths, np.int64),
                            np.asarray(offsets, np.int64))
    return f + b


__all__ = ["HUBER_K", "coefficients", "design", "kinds_of", "model_from_coefficients",
           "predict_total", "refit", "robust_nnls"]
