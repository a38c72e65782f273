"""Trained tokens: how much of each step is trained on when a loss mask (SFT: the assistant's
tokens only, TRL's ``completion_mask`` / ``assistant_masks``, labels with -100) hides part of
every document from the loss.

The cost model is unchanged by masks: a masked token runs the same forward and backward
compute as a trained one (its activations and gradients flow through every layer, only its
loss term is zero), so plans, imbalance and times never depend on which tokens are trained.
What a mask changes is how many tokens each step learns from, which this module reports:
given ``loss_tokens`` int64[n] (the trained tokens of every sample, e.g. ``sum(mask)`` per
row), the trained fraction of every step of a plan.

A document that the plan cut into pieces has one count for the whole document, not one per
piece: its count is shared among the pieces in proportion to their lengths (piece
``[s, s + l)`` of a document of length L with c trained tokens gets
``floor(c (s + l) / L) - floor(c s / L)``, so the pieces sum to c exactly). The figures of
steps holding such pieces are then an estimate; ``pieces_apportioned`` counts them.
"""
from __future__ import annotations

import numpy as np

from ..planning.planner import Plan
from ..stats import summarize

#: what report.json (``loss_tokens.cost_note``), report.md and the docs say about masks and cost
COST_NOTE = ("The cost model is unchanged by loss masks: a masked token costs the same forward "
             "and backward compute as a trained one (only its loss term is zero), so plans, "
             "imbalance and times do not depend on which tokens are trained.")


def check_loss_tokens(loss_tokens, lengths: np.ndarray) -> np.ndarray:
    """``loss_tokens`` as int64[n] after checking it against the samples' ``lengths`` int64[n]:
    one integer per sample, 0 <= count <= length. Bad input raises ValueError naming the first
    bad sample, its value and the limit."""
    a = np.asarray(loss_tokens)
    n = int(lengths.shape[0])
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"loss tokens: expected one count per sample, shape ({n},), got shape "
                         f"{a.shape}")
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"loss tokens: expected integer counts of trained tokens per sample "
                         f"(int64), got dtype {a.dtype}")
    a = a.astype(np.int64)
    neg = np.flatnonzero(a < 0)
    if neg.size:
        i = int(neg[0])
        raise ValueError(f"loss tokens: sample {i} has {int(a[i])} trained tokens, below 0 "
                         f"({neg.size} samples are negative)")
    over = np.flatnonzero(a > lengths)
    if over.size:
        i = int(over[0])
        raise ValueError(f"loss tokens: sample {i} has {int(a[i])} trained tokens, more than its "
                         f"length {int(lengths[i])} ({over.size} samples exceed their length)")
    return a


def entry_loss_tokens(plan: Plan, loss_tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Trained tokens of every plan entry, int64[E]: a whole document's count, or the share of
    a piece (see the module docstring). ``loss_tokens`` and ``lengths`` are int64[n], checked
    by :func:`check_loss_tokens`."""
    s = plan.entry_sample
    c = loss_tokens[s]
    full = lengths[s]
    start, ln = plan.entry_start.astype(np.int64), plan.entry_length.astype(np.int64)
    whole = (start == 0) & (ln == full)
    den = np.maximum(full, 1)
    # c * (start + ln) stays far below 2**63 for any real document (c, L < 2**31)
    part = c * (start + ln) // den - c * start // den
    return np.where(whole, c, part)


def loss_token_figures(plan: Plan, loss_tokens: np.ndarray, lengths: np.ndarray,
                       *, series: bool = True) -> dict:
    """The ``loss_tokens`` block of a strategy in report.json: trained and total tokens of the
    plan's steps (left-over samples are not in any step), the trained fraction overall and per
    step (``summarize``: mean, p50, p90, p99, max, plus ``min``), the steps with no trained
    token, the pieces whose count was apportioned and, with ``series``, the per-step fraction
    (float64[S] as a list)."""
    steps = plan.n_steps
    est = np.repeat(plan.mb_step, np.diff(plan.mb_offsets))
    per_entry = entry_loss_tokens(plan, loss_tokens, lengths)
    trained = np.bincount(est, weights=per_entry, minlength=steps).astype(np.int64)
    tokens = np.bincount(est, weights=plan.entry_length, minlength=steps).astype(np.int64)
    frac = trained / np.maximum(tokens, 1)
    s = plan.entry_sample
    cut = ~((plan.entry_start == 0) & (plan.entry_length == lengths[s]))
    out = {"trained_tokens": int(trained.sum()), "tokens": int(tokens.sum()),
           "trained_fraction": float(trained.sum() / max(int(tokens.sum()), 1)),
           "trained_fraction_per_step": {**summarize(frac),
                                         "min": float(frac.min()) if steps else float("nan")},
           "trained_tokens_per_step": summarize(trained.astype(np.float64)),
           "steps_without_trained_tokens": int((trained == 0).sum()),
           "pieces_apportioned": int(cut.sum()),
           "cost_note": COST_NOTE}
    if series:
        out["per_step_trained_fraction"] = frac.tolist()
    return out


def workload_loss_tokens(loss_tokens: np.ndarray, lengths: np.ndarray) -> dict:
    """The workload's trained tokens: ``{"trained_tokens", "trained_fraction",
    "samples_without_trained_tokens"}``."""
    total = int(lengths.sum())
    t = int(loss_tokens.sum())
    return {"trained_tokens": t, "trained_fraction": t / total if total else 0.0,
            "samples_without_trained_tokens": int((loss_tokens == 0).sum())}
