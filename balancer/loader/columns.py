"""The user's per-token columns: labels or a loss mask, and other token-aligned fields.

A dataset row holds its token ids and, optionally,

* a **labels** column: token ids where the token is trained, -100 elsewhere (the Hugging Face
  convention), or a **loss mask** column: 1 where the token is trained, 0 elsewhere (TRL's
  ``completion_mask`` / ``assistant_masks``, or any name), at most one of the two;
* **token columns** (``token_columns=[...]``: RL advantages, old log-probs, rewards,
  ``token_type_ids``): any numeric values, one per token.

Both are checked against the row's tokens when the row is read (a clear error naming the sample,
the column and the value) and are cut to the same ``[start, start + length)`` range as the tokens.

**Trained tokens.** Token ``j`` of a document is a loss target when its label is not -100 (or its
mask is 1) and ``j`` is not the document's first token: a packed document never predicts its
first token from the previous document (the Hugging Face shift). A chunk piece of an over-long
sample is a document of its own, so its first token is not trained either. The loss normalisers
(``num_loss_tokens``, ``microbatch_loss_tokens``, ``step_loss_tokens``) count exactly these.

The samplers compute ``step_loss_tokens`` from the plan without a collective, so they need the
trained-token count of every planned document before any row is fetched: :class:`LossTokens`
holds one int64 per sample (one pass over the mask column,
:meth:`balancer.loader.collate.PackedDataset.loss_tokens`) and counts a chunk piece from its own
slice of the mask when the plan cuts a sample (pieces are rare: only over-long samples).
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

IGNORE = -100


def labels_row(values, sample: int, column: str) -> np.ndarray:
    """A labels row checked and as int64 (token ids >= 0, -100 where not trained)."""
    v = np.asarray(values)
    if v.ndim != 1:
        raise ValueError(f"sample {sample}: labels column {column!r} holds an array of shape "
                         f"{v.shape}; a labels row is one token id (or -100) per token")
    if v.dtype.kind not in "iu":
        raise ValueError(f"sample {sample}: labels column {column!r} has dtype {v.dtype}; labels "
                         f"are integer token ids with -100 where not trained (use "
                         f"loss_mask_column= for a 0/1 mask)")
    v = v.astype(np.int64, copy=False)
    bad = (v < 0) & (v != IGNORE)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(f"sample {sample}: labels column {column!r} holds {int(v[j])} at token "
                         f"{j}; a label is a token id >= 0, or -100 where not trained")
    return v


def mask_row(values, sample: int, column: str) -> np.ndarray:
    """A loss-mask row checked and as bool (values exactly 0 or 1)."""
    v = np.asarray(values)
    if v.ndim != 1:
        raise ValueError(f"sample {sample}: loss mask column {column!r} holds an array of shape "
                         f"{v.shape}; a loss mask is one 0/1 value per token")
    if v.dtype == bool:
        return v
    if v.dtype.kind not in "iuf":
        raise ValueError(f"sample {sample}: loss mask column {column!r} has dtype {v.dtype}; a "
                         f"loss mask is 0 (not trained) or 1 (trained) per token")
    bad = (v != 0) & (v != 1)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(f"sample {sample}: loss mask column {column!r} holds {v[j].item()!r} "
                         f"at token {j}; a loss mask is 0 (not trained) or 1 (trained) per token")
    return v == 1


def ids_row(values, sample: int, column: str) -> np.ndarray:
    """A row of token ids checked: one-dimensional, an integer dtype, every id >= 0 (a float
    id would be truncated silently, a negative one reach the embedding)."""
    v = np.asarray(values)
    if v.ndim != 1 or v.dtype.kind not in "iu":
        raise ValueError(f"sample {sample}: tokens column {column!r} holds {v.dtype} of shape "
                         f"{v.shape}; token ids are integers, one per token (tokenize the "
                         f"text, or cast an integral column to int)")
    if v.dtype.kind == "i" and v.size and v.min() < 0:
        j = int(np.flatnonzero(v < 0)[0])
        raise ValueError(f"sample {sample}: tokens column {column!r} holds {int(v[j])} at "
                         f"token {j}; a token id is >= 0 (-100 marks labels, not inputs)")
    return v


def token_row(values, sample: int, column: str) -> np.ndarray:
    """A per-token column's row as a one-dimensional numeric array (dtype kept)."""
    v = np.asarray(values)
    if v.ndim != 1 or v.dtype.kind not in "biuf":
        raise ValueError(f"sample {sample}: token column {column!r} holds {v.dtype} of shape "
                         f"{v.shape}; a token column is one number per token")
    return v


def check_length(row: np.ndarray, n: int, sample: int, column: str, tokens_column: str) -> None:
    """Refuse a column row whose length differs from its tokens'."""
    if row.shape[0] != n:
        raise ValueError(f"sample {sample}: column {column!r} has {row.shape[0]} values but its "
                         f"tokens ({tokens_column!r}) have {n}; a per-token column holds one "
                         f"value per token")


def trained_targets(trained: np.ndarray) -> int:
    """Loss targets of one document given its per-token trained flags (its first token never)."""
    return int(np.count_nonzero(trained[1:]))


def block_targets(values: np.ndarray, offsets: np.ndarray, labels: bool, column: str,
                  first_sample: int) -> np.ndarray:
    """Loss targets (int64[rows]) of consecutive rows given as one flat ``values`` array and
    ``offsets`` int64[rows + 1] into it (Arrow's list layout), vectorised; a bad row is refused
    with the message of :func:`labels_row` / :func:`mask_row` naming its sample."""
    offsets = np.asarray(offsets, np.int64)
    v = np.asarray(values)[offsets[0]:offsets[-1]]
    offsets = offsets - offsets[0]

    def refuse(j: int):  # the row holding flat position j: checked alone for its message
        r = int(np.searchsorted(offsets, j, side="right") - 1)
        row = v[offsets[r]:offsets[r + 1]]
        (labels_row if labels else mask_row)(row, first_sample + r, column)
        raise AssertionError("unreachable: the row was refused above")  # pragma: no cover

    if labels:
        if v.dtype.kind not in "iu":
            refuse(0) if v.shape[0] else None
        bad = (v < 0) & (v != IGNORE)
        trained = v != IGNORE
    elif v.dtype == bool:
        bad, trained = np.zeros(0, bool), v
    else:
        if v.dtype.kind not in "iuf":
            refuse(0) if v.shape[0] else None
        bad = (v != 0) & (v != 1)
        trained = v == 1
    if bad.any():
        refuse(int(np.flatnonzero(bad)[0]))
    cs = np.zeros(v.shape[0] + 1, np.int64)
    np.cumsum(trained, out=cs[1:])
    lens = np.diff(offsets)
    out = cs[offsets[1:]] - cs[offsets[:-1]]
    some = lens > 0
    out[some] -= trained[offsets[:-1][some]]  # a document's first token is never a target
    return out


class LossTokens:
    """Trained-token counts for the samplers (see the module docstring).

    ``per_sample`` int64[n_samples]: loss targets of each whole sample (trained tokens after its
    first). ``piece(sample, start, length) -> int``: loss targets of the chunk piece
    ``[start, start + length)`` (trained tokens after the piece's first); None refuses pieces."""

    def __init__(self, per_sample, piece: Optional[Callable[[int, int, int], int]] = None):
        per_sample = np.asarray(per_sample)
        if per_sample.ndim != 1 or per_sample.dtype.kind not in "iu":
            raise ValueError(f"per-sample loss tokens must be one integer per sample, got "
                             f"{per_sample.dtype} of shape {per_sample.shape}")
        if per_sample.shape[0] and int(per_sample.min()) < 0:
            i = int(np.argmin(per_sample))
            raise ValueError(f"sample {i} has {int(per_sample[i])} loss tokens; counts are >= 0")
        self.per_sample = per_sample.astype(np.int64, copy=False)
        self.piece = piece

    def __len__(self) -> int:
        return int(self.per_sample.shape[0])

    def entries(self, sample: np.ndarray, start: np.ndarray, length: np.ndarray,
                sample_length: np.ndarray) -> np.ndarray:
        """Loss targets (int64[E]) of the plan's documents: sample ``sample[e]``, tokens
        ``[start[e], start[e] + length[e])``; ``sample_length`` int64[n_samples] tells whole
        samples from chunk pieces."""
        sample = np.asarray(sample, np.int64)
        if sample.shape[0] and int(sample.max()) >= len(self):
            raise ValueError(f"the plan holds sample {int(sample.max())} but the loss-token counts "
                             f"cover {len(self)} samples (a dataset other than the plan's?)")
        out = self.per_sample[sample].copy()
        whole = (np.asarray(start) == 0) & (np.asarray(length) == sample_length[sample])
        for e in np.flatnonzero(~whole).tolist():
            if self.piece is None:
                raise ValueError(f"the plan cuts sample {int(sample[e])} into pieces, and these "
                                 f"loss-token counts are per sample only: give the dataset's "
                                 f"(PackedDataset.loss_tokens()), which counts a piece's own mask")
            out[e] = int(self.piece(int(sample[e]), int(start[e]), int(length[e])))
        return out


def as_loss_tokens(loss_tokens) -> Optional[LossTokens]:
    """A sampler's ``loss_tokens=`` as a :class:`LossTokens` (None stays None; an array is
    per-sample counts)."""
    if loss_tokens is None or isinstance(loss_tokens, LossTokens):
        return loss_tokens
    return LossTokens(loss_tokens)


__all__ = ["IGNORE", "LossTokens", "as_loss_tokens", "block_targets", "check_length", "labels_row", "mask_row", "token_row",
           "trained_targets"]
