"""Fit a cost model's coefficients to measured forward and backward times.

An observation is one packed microbatch: the lengths of its documents and the measured seconds
of its forward and of its backward pass. The cost model (:mod:`balancer.cost`) predicts a pass
as ``a * sum L^2 + b * sum L + c``, linear in the coefficients, so each pass is a least-squares
fit on four features per microbatch: ``sum L^2``, ``sum L``, 1 and the number of documents.

Two choices make the fit match how it is used:

* **Relative residuals.** The planner compares microbatches whose times span orders of
  magnitude (a few short documents against one long one); an unweighted fit lets the longest
  microbatches decide everything and leaves the short ones tens of percent off. Rows are
  weighted by ``1 / seconds``, so the fit minimises squared *relative* error, the quantity the
  target (median relative error on held-out shapes) is stated in.
* **Non-negative coefficients.** :class:`balancer.cost.PassCost` requires ``a, b, c >= 0`` (a
  negative constant would make a small microbatch cost less than nothing). With three
  coefficients, exact non-negative least squares is the best of the 7 non-empty supports whose
  unconstrained solution is non-negative, so no iterative solver is needed.

Observations are held as CSR arrays (``doc_lengths`` int64[E], ``offsets`` int64[M+1]): every
microbatch ``m`` holds ``doc_lengths[offsets[m]:offsets[m+1]]``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import yaml

from .attention import AttentionTerm, doc_pairs
from .blocks import microbatch_costs
from .model import CostModel, PassCost

PASSES = ("forward", "backward")


# ---- observations -------------------------------------------------------------------------

def to_csr(microbatches: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of document lengths -> ``(doc_lengths int64[E], offsets int64[M+1])``. Raises a
    ValueError naming the microbatch and document of a length below 1 or an empty microbatch."""
    lens, offsets = [], [0]
    for m, raw in enumerate(microbatches):
        docs = [_length(x, m, d) for d, x in enumerate(raw)]
        if not docs:
            raise ValueError(f"microbatch {m} has no documents")
        for d, x in enumerate(docs):
            if x < 1:
                raise ValueError(f"microbatch {m} document {d}: length {x} is below 1")
        lens += docs
        offsets.append(len(lens))
    return np.asarray(lens, dtype=np.int64), np.asarray(offsets, dtype=np.int64)


def _length(x, m: int, d: int) -> int:
    """A document length as an int: an integer, or a float that is exactly one (a JSON 100.0);
    anything else (100.5, true, "100", null, inf) names the microbatch and document."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer,
                                                              np.floating)) \
            or (isinstance(x, (float, np.floating)) and not float(x).is_integer()):
        raise ValueError(f"microbatch {m} document {d}: length {x!r} is not an integer")
    return int(x)


def features(doc_lengths, offsets) -> np.ndarray:
    """float64[M, 4]: ``(sum L^2, sum L, 1, number of documents)`` of every microbatch (the cost
    formula's :meth:`~balancer.cost.protocol.CostFormula.calibration_features`)."""
    return CostModel.calibration_features(doc_lengths, offsets)


def predict(coef: PassCost, doc_lengths, offsets) -> np.ndarray:
    """Predicted seconds of every microbatch, float64[M]."""
    return features(doc_lengths, offsets) @ np.array([coef.a, coef.b, coef.c, coef.d])


# ---- the fit ------------------------------------------------------------------------------

def nnls3(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares ``min |x c - y|^2, c >= 0`` for a few columns (here 4):
    the best over every support whose unconstrained solution is non-negative."""
    k = x.shape[1]
    best, best_res = np.zeros(k), float(y @ y)
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            c = np.zeros(k)
            c[list(cols)] = sol
            res = float(((x @ c - y) ** 2).sum())
            if res < best_res:
                best, best_res = c, res
    return best


def fit_pass(doc_lengths, offsets, seconds, relative: bool = True) -> PassCost:
    """Coefficients ``(a, b, c, d)`` of one pass from microbatch times ``seconds`` (float64[M]).

    ``relative`` weights every row by ``1 / seconds`` (least squares on relative error). The
    columns are scaled to unit norm before solving so ``sum L^2`` (~1e7) and 1 are equally
    well conditioned."""
    y = np.asarray(seconds, dtype=np.float64)
    x = features(doc_lengths, offsets)
    if y.shape != (x.shape[0],):
        raise ValueError(f"{y.shape[0] if y.ndim == 1 else y.shape} times for {x.shape[0]} "
                         f"microbatches")
    bad = ~np.isfinite(y) | (y <= 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"microbatch {i}: measured time {y[i]!r} is not a positive number")
    if x.shape[0] < 4:
        raise ValueError(f"need at least 4 microbatches to fit 4 coefficients, got {x.shape[0]}")
    if np.unique(x, axis=0).shape[0] < 2:
        raise ValueError(f"the {x.shape[0]} microbatches all hold the same documents' lengths "
                         f"(sum L^2 {x[0, 0]:g}, sum L {x[0, 1]:g}, {x[0, 3]:g} documents): "
                         f"any coefficients fit them equally; vary the lengths measured")
    w = 1.0 / y if relative else np.ones_like(y)
    xw, yw = x * w[:, None], y * w
    scale = np.linalg.norm(xw, axis=0)
    scale[scale == 0] = 1.0
    c = nnls3(xw / scale, yw) / scale
    return PassCost(a=float(c[0]), b=float(c[1]), c=float(c[2]), d=float(c[3]))


def r_squared(pred: np.ndarray, y: np.ndarray) -> float:
    """Coefficient of determination of ``pred`` against ``y``."""
    y = np.asarray(y, dtype=np.float64)
    ss = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else float("nan")


def relative_errors(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``|pred - y| / y`` per microbatch, float64[M]."""
    y = np.asarray(y, dtype=np.float64)
    return np.abs(np.asarray(pred, dtype=np.float64) - y) / y


def error_summary(err: np.ndarray) -> dict:
    err = np.asarray(err, dtype=np.float64)
    if err.size == 0:
        return {"median": float("nan"), "p90": float("nan"), "max": float("nan")}
    return {"median": float(np.median(err)), "p90": float(np.percentile(err, 90)),
            "max": float(err.max())}


@dataclass
class Observations:
    """Measured microbatches: CSR document lengths and per-pass seconds (float64[M] each)."""

    doc_lengths: np.ndarray
    offsets: np.ndarray
    seconds: dict  # pass name -> float64[M]

    def __post_init__(self):
        self.doc_lengths = np.asarray(self.doc_lengths, dtype=np.int64)
        self.offsets = np.asarray(self.offsets, dtype=np.int64)
        features(self.doc_lengths, self.offsets)  # validates the CSR
        m = self.offsets.shape[0] - 1
        for k in PASSES:
            if k not in self.seconds:
                raise ValueError(f"observations lack {k!r} times")
            self.seconds[k] = np.asarray(self.seconds[k], dtype=np.float64)
            if self.seconds[k].shape != (m,):
                raise ValueError(f"{k}: {self.seconds[k].shape} times for {m} microbatches")

    @property
    def n(self) -> int:
        return self.offsets.shape[0] - 1

    def microbatches(self) -> list[list[int]]:
        o = self.offsets
        return [self.doc_lengths[o[i]:o[i + 1]].tolist() for i in range(self.n)]

    def to_json(self) -> dict:
        return {"microbatches": self.microbatches(),
                **{k: self.seconds[k].tolist() for k in PASSES}}

    @classmethod
    def from_json(cls, doc: dict) -> "Observations":
        lens, off = to_csr(doc["microbatches"])
        return cls(lens, off, {k: doc[k] for k in PASSES})


@dataclass
class Calibration:
    """Fitted coefficients of both passes and their quality on the fit and held-out sets."""

    forward: PassCost
    backward: PassCost
    quality: dict = field(default_factory=dict)

    def cost_model(self, name: str = "calibrated") -> CostModel:
        return CostModel(name=name, unit="seconds", forward=self.forward, backward=self.backward)

    def evaluate(self, obs: Observations) -> dict:
        """Per pass and for forward + backward: R^2, relative-error summary and the errors."""
        out = {}
        preds = {}
        for k in PASSES:
            p = predict(getattr(self, k), obs.doc_lengths, obs.offsets)
            preds[k] = p
            err = relative_errors(p, obs.seconds[k])
            out[k] = {"r2": r_squared(p, obs.seconds[k]), "rel_error": error_summary(err),
                      "errors": err.tolist()}
        tot_p = preds["forward"] + preds["backward"]
        tot_y = obs.seconds["forward"] + obs.seconds["backward"]
        err = relative_errors(tot_p, tot_y)
        out["total"] = {"r2": r_squared(tot_p, tot_y), "rel_error": error_summary(err),
                        "errors": err.tolist()}
        return out


def calibrate(fit: Observations, held_out: Optional[Observations] = None,
              relative: bool = True) -> Calibration:
    """Fit both passes on ``fit``; ``quality`` holds :meth:`Calibration.evaluate` on the fit
    set (``"fit"``) and, when given, on ``held_out`` (``"held_out"``)."""
    cal = Calibration(**{k: fit_pass(fit.doc_lengths, fit.offsets, fit.seconds[k], relative)
                         for k in PASSES})
    cal.quality["fit"] = cal.evaluate(fit)
    if held_out is not None:
        cal.quality["held_out"] = cal.evaluate(held_out)
    return cal


# ---- per layer type (issue #25) -------------------------------------------------------------

def layered_features(doc_lengths, offsets, kinds) -> np.ndarray:
    """float64[M, K + 3]: per microbatch, the query-key pairs of its documents under each of
    the ``K`` attention patterns ``kinds`` (``(kind, window)``, balancer.cost.attention), then
    ``sum L``, 1 and the number of documents: the columns of a model with one attention term
    per layer type (no ``a L^2`` column: a full term's pairs carry it)."""
    base = features(doc_lengths, offsets)  # validates the CSR
    lens = np.asarray(doc_lengths, dtype=np.int64)
    starts = np.asarray(offsets, dtype=np.int64)[:-1]
    cols = [np.add.reduceat(doc_pairs(lens, k, w), starts) for k, w in kinds]
    return np.column_stack(cols + [base[:, 1], base[:, 2], base[:, 3]])


def calibrate_layered(fit: Observations, template: CostModel,
                      held_out: Optional[Observations] = None, relative: bool = True,
                      name: str = "calibrated") -> tuple[CostModel, dict]:
    """Per-layer-type coefficients from measured times: for the attention patterns of
    ``template`` (a model from a Hugging Face config: its ``attention`` terms), one
    non-negative least-squares fit per pass of a cost per pair of each pattern, a cost per
    token, per microbatch and per document. Returns the fitted seconds-unit model and its
    quality (``"fit"``, ``"held_out"``: R^2 and relative errors per pass and in total)."""
    kinds = [(t.kind, t.window) for t in template.attention]
    if not kinds:
        raise ValueError(f"cost model {template.name!r} has no attention terms per layer type; "
                         f"give a model from a Hugging Face config (or use calibrate())")
    x = layered_features(fit.doc_lengths, fit.offsets, kinds)
    if fit.n < x.shape[1]:
        raise ValueError(f"need at least {x.shape[1]} microbatches to fit {x.shape[1]} "
                         f"coefficients, got {fit.n}")
    coef = {}
    for k in PASSES:
        y = fit.seconds[k]
        bad = ~np.isfinite(y) | (y <= 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"microbatch {i}: measured {k} time {y[i]!r} is not a positive "
                             f"number")
        w = 1.0 / y if relative else np.ones_like(y)
        xw, yw = x * w[:, None], y * w
        scale = np.linalg.norm(xw, axis=0)
        scale[scale == 0] = 1.0
        coef[k] = nnls3(xw / scale, yw) / scale
    nk = len(kinds)
    terms = tuple(AttentionTerm(kind=kd, window=wd, forward=float(coef["forward"][i]),
                                backward=float(coef["backward"][i]),
                                layers=template.attention[i].layers)
                  for i, (kd, wd) in enumerate(kinds))
    passes = {k: PassCost(b=float(coef[k][nk]), c=float(coef[k][nk + 1]),
                          d=float(coef[k][nk + 2])) for k in PASSES}
    model = CostModel(name=name, unit="seconds", forward=passes["forward"],
                      backward=passes["backward"], attention=terms)
    quality = {"fit": _evaluate_model(model, fit)}
    if held_out is not None:
        quality["held_out"] = _evaluate_model(model, held_out)
    return model, quality


def _evaluate_model(model: CostModel, obs: Observations) -> dict:
    """:meth:`Calibration.evaluate` for any cost model (its per-microbatch predictions)."""
    f, b = microbatch_costs(model, obs.doc_lengths, obs.offsets)
    out = {}
    for k, p in (("forward", f), ("backward", b)):
        err = relative_errors(p, obs.seconds[k])
        out[k] = {"r2": r_squared(p, obs.seconds[k]), "rel_error": error_summary(err),
                  "errors": err.tolist()}
    tot_y = obs.seconds["forward"] + obs.seconds["backward"]
    err = relative_errors(f + b, tot_y)
    out["total"] = {"r2": r_squared(f + b, tot_y), "rel_error": error_summary(err),
                    "errors": err.tolist()}
    return out


# ---- presets ------------------------------------------------------------------------------

def preset_yaml(cal: Calibration, description: str = "", comments: Sequence[str] = ()) -> str:
    """The YAML text of a seconds-unit preset that :meth:`CostModel.from_yaml` loads (fitted
    ``forward``/``backward`` coefficients; fit quality goes in comments, which the loader
    ignores, because unknown keys are errors there)."""
    head = "".join(f"# {c}\n" for c in comments)
    doc = {"description": description or "calibrated from measured forward/backward times",
           "unit": "seconds",
           "forward": {k: float(getattr(cal.forward, k)) for k in "abcd"},
           "backward": {k: float(getattr(cal.backward, k)) for k in "abcd"}}
    return head + yaml.safe_dump(doc, sort_keys=False)


def write_preset(cal: Calibration, path, description: str = "",
                 comments: Sequence[str] = ()) -> Path:
    """Write :func:`preset_yaml` to ``path`` (folders created) and check it loads back to the
    same coefficients."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(preset_yaml(cal, description, comments))
    back = CostModel.from_yaml(path)
    if back.forward != cal.forward or back.backward != cal.backward:
        raise ValueError(f"{path}: preset does not load back to the fitted coefficients")
    return path


def write_layered_preset(model: CostModel, path, description: str = "",
                         comments: Sequence[str] = ()) -> Path:
    """Write a per-layer-type fit (:func:`calibrate_layered`) as a seconds-unit preset
    (``forward``/``backward`` plus ``attention:`` terms) and check it loads back equal."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"description": description or "calibrated per layer type from measured times",
           "unit": "seconds",
           "forward": {k: float(getattr(model.forward, k)) for k in "abcd"},
           "backward": {k: float(getattr(model.backward, k)) for k in "abcd"},
           "attention": [t.model_dump(mode="json", exclude_none=True) for t in model.attention]}
    path.write_text("".join(f"# {c}\n" for c in comments) + yaml.safe_dump(doc, sort_keys=False))
    back = CostModel.from_yaml(path)
    if back.forward != model.forward or back.backward != model.backward \
            or back.attention != model.attention:
        raise ValueError(f"{path}: preset does not load back to the fitted coefficients")
    return path


# ---- shapes to measure --------------------------------------------------------------------

def sample_shapes(n: int, capacity: int, rng: np.random.Generator, max_docs: int = 16,
                  min_length: int = 16) -> list[list[int]]:
    """``n`` microbatches of varied document counts and lengths, each at most ``capacity``
    tokens: a third one document of any length (the attention-bound tail), the rest 2 to
    ``max_docs`` documents with log-uniform lengths cut to fit (the packed bulk). Totals range
    from near empty to full so ``c``, ``b`` and ``a`` are all identified."""
    if capacity < min_length:
        raise ValueError(f"capacity {capacity} is below the shortest document {min_length}")
    out = []
    lo, hi = np.log(min_length), np.log(capacity)
    for i in range(n):
        fill = int(np.exp(rng.uniform(lo, hi)))
        if i % 3 == 0:
            out.append([max(min_length, fill)])
            continue
        k = int(rng.integers(2, max_docs + 1))
        docs, left = [], fill
        for _ in range(k):
            if left < min_length:
                break
            x = int(np.exp(rng.uniform(lo, np.log(max(left, min_length)))))
            x = min(max(x, min_length), left)
            docs.append(x)
            left -= x
        out.append(docs or [min_length])
    return out


__all__ = ["Calibration", "Observations", "calibrate", "calibrate_layered", "error_summary",
           "features", "fit_pass", "layered_features", "nnls3", "predict", "preset_yaml",
           "r_squared", "relative_errors", "sample_shapes", "to_csr", "write_layered_preset",
           "write_preset"]
