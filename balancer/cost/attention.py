"""Attention work per layer type: the query-key pairs a document's attention computes (issue #25).

A document of ``L`` tokens attends within itself (never across documents of a packed
microbatch). Query ``i`` (0-based) sees the keys

* ``full`` (causal): ``0..i``: ``i + 1`` keys, ``L (L + 1) / 2`` pairs in all;
* ``sliding`` window ``w`` (Mistral, Gemma 2/3, GPT-OSS; Hugging Face's
  ``kv_idx > q_idx - sliding_window``): ``min(i + 1, w)`` keys;
* ``chunked`` size ``c`` (Llama 4's local layers): the keys of its own chunk ``i // c`` up to
  ``i``: ``i mod c + 1`` keys.

:func:`prefix_pairs` counts the pairs of the first ``n`` queries in closed form, so the pairs
of any query range (a zigzag CP chunk) are a difference of two prefixes. An
:class:`AttentionTerm` is one such layer type's cost per pair, per pass; a
:class:`~balancer.cost.CostModel` sums its terms next to its ``a L^2 + b L`` coefficients."""
from __future__ import annotations

from typing import Literal, Optional

import numpy as np
from pydantic import BaseModel, Field, model_validator

from packing.validate import MAX_LENGTH

from ..frozen import FROZEN_FINITE

#: the attention patterns a term can have
KINDS = ("full", "sliding", "chunked")


def prefix_pairs(n: np.ndarray, kind: str, window: Optional[int]) -> np.ndarray:
    """Query-key pairs of the first ``n`` queries of a document (float64, same shape as
    ``n``): ``sum_{i < n}`` of the keys query ``i`` sees under ``kind``/``window``."""
    x = np.asarray(n, dtype=np.float64)
    if kind == "full":
        return x * (x + 1) / 2
    w = float(window)
    if kind == "sliding":
        head = np.minimum(x, w)  # queries 0..w-1 see i + 1 keys, later ones w
        return head * (head + 1) / 2 + (x - head) * w
    if kind == "chunked":
        full_chunks = np.floor(x / w)
        rest = x - full_chunks * w
        return full_chunks * (w * (w + 1) / 2) + rest * (rest + 1) / 2
    raise ValueError(f"unknown attention kind {kind!r}; supported: {list(KINDS)}")


def doc_pairs(lengths: np.ndarray, kind: str, window: Optional[int]) -> np.ndarray:
    """Query-key pairs of whole documents: float64[n] for int64[n] lengths."""
    return prefix_pairs(lengths, kind, window)


def zigzag_pairs(lengths: np.ndarray, cp: int, kind: str, window: Optional[int]) -> np.ndarray:
    """Query-key pairs of every CP rank's zigzag shard (rank ``r`` holds chunks ``r`` and
    ``2 cp - 1 - r`` of a document padded to a multiple of ``2 cp``; padding carries no
    work): float64[n, cp]. ``kind="full"`` is :func:`balancer.zigzag.zigzag_attention`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if cp == 1:
        return doc_pairs(lengths, kind, window)[:, None]
    c = -(-lengths // (2 * cp))
    out = np.zeros((lengths.shape[0], cp))
    for r in range(cp):
        for j in (r, 2 * cp - 1 - r):
            lo = np.minimum(j * c, lengths)
            hi = np.minimum((j + 1) * c, lengths)
            out[:, r] += prefix_pairs(hi, kind, window) - prefix_pairs(lo, kind, window)
    return out


def busiest_share(lengths: np.ndarray, sizes: np.ndarray, weighted) -> np.ndarray:
    """float64[n, K]: the busiest zigzag rank's share of each document's attention work on
    each group size, the work being ``sum_k weight_k x pairs_k`` over ``weighted`` ``(kind,
    window, weight)`` (the layer types of a model, each with its cost per pair). Ranks are
    visited one at a time, so the scratch is O(n), whatever the group size."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = np.zeros(lengths.shape[0])
    for kind, window, w in weighted:
        total += w * doc_pairs(lengths, kind, window)
    safe = np.where(total > 0, total, 1.0)
    out = np.ones((lengths.shape[0], sizes.shape[0]))
    for j, g in enumerate(sizes.tolist()):
        if g == 1:
            continue
        c = -(-lengths // (2 * g))
        best = np.zeros(lengths.shape[0])
        for r in range(g):
            work = np.zeros(lengths.shape[0])
            for kind, window, w in weighted:
                for q in (r, 2 * g - 1 - r):
                    lo = np.minimum(q * c, lengths)
                    hi = np.minimum((q + 1) * c, lengths)
                    work += w * (prefix_pairs(hi, kind, window) - prefix_pairs(lo, kind, window))
            np.maximum(best, work, out=best)
        out[:, j] = np.where(total > 0, best / safe, 0.0)
    return out


class AttentionTerm(BaseModel):
    """One attention pattern's cost: ``forward`` / ``backward`` per query-key pair of every
    document (all layers of that pattern together)."""

    model_config = FROZEN_FINITE
    kind: Literal["full", "sliding", "chunked"] = Field(
        description="full causal, sliding window (each query sees the last `window` keys, "
                    "itself included) or chunked local (keys of the query's own chunk of "
                    "`window` tokens)")
    window: Optional[int] = Field(None, gt=0, le=MAX_LENGTH,
                                  description="window or chunk size in tokens (sliding, chunked)")
    forward: float = Field(ge=0, description="forward cost per query-key pair")
    backward: float = Field(ge=0, description="backward cost per query-key pair (no recompute)")
    layers: Optional[int] = Field(None, ge=0, description="layers of this pattern (a note for "
                                                          "reports; the costs already sum them)")

    @model_validator(mode="after")
    def _window(self):
        if (self.kind == "full") != (self.window is None):
            raise ValueError(f"attention kind {self.kind!r}: "
                             + ("takes no window" if self.kind == "full"
                                else "needs a window (tokens)"))
        return self

    def pairs(self, lengths: np.ndarray) -> np.ndarray:
        """Query-key pairs of every document: float64[n]."""
        return doc_pairs(lengths, self.kind, self.window)

    def shard_pairs(self, lengths: np.ndarray, cp: int) -> np.ndarray:
        """Query-key pairs of every zigzag CP shard: float64[n, cp]."""
        return zigzag_pairs(lengths, cp, self.kind, self.window)


__all__ = ["AttentionTerm", "KINDS", "busiest_share", "doc_pairs", "prefix_pairs",
           "zigzag_pairs"]
