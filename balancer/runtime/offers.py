"""What a step's plan is made of: the samples every rank offers (:class:`Offers`, the gathered
input of the planner) and the plan of the step (:class:`StepPlan`, its output), as flat int64 /
float64 arrays that every rank holds identically."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..config import Layout, PlannerConfig
from ..planning.planner import padded_sizes

I64 = np.int64


@dataclass(frozen=True)
class Offers:
    """The samples offered for one step by all DP ranks, in canonical order: carried ones first
    (oldest first), then by rank, then by position on that rank. All arrays have length K:

    * ``rank`` int64[K]: the rank holding the sample; ``index`` int64[K]: its position in what
      that rank offered (carried samples first, then new ones, as the rank listed them);
    * ``sample_id`` int64[K]: the caller's id; ``length`` int64[K]: tokens; ``age`` int64[K]:
      steps it has already been carried (0 for a new sample).
    """

    rank: np.ndarray
    index: np.ndarray
    sample_id: np.ndarray
    length: np.ndarray
    age: np.ndarray

    def __len__(self) -> int:
        return int(self.rank.shape[0])

    @classmethod
    def from_ranks(cls, per_rank: Sequence) -> "Offers":
        """``per_rank[r]`` is ``(ids, lengths)`` or ``(ids, lengths, ages)`` of rank r (1-D
        integer arrays, equal length; ages default 0)."""
        ids_l, len_l, age_l = [], [], []
        for r, part in enumerate(per_rank):
            ids = np.asarray(part[0], I64).reshape(-1)
            lengths = np.asarray(part[1]).reshape(-1)
            if lengths.dtype.kind not in "iu":
                raise ValueError(f"rank {r}: lengths must be integers, got dtype {lengths.dtype}")
            lengths = lengths.astype(I64, copy=False)
            ages = np.zeros(ids.shape[0], I64) if len(part) < 3 or part[2] is None else \
                np.asarray(part[2], I64).reshape(-1)
            if not ids.shape[0] == lengths.shape[0] == ages.shape[0]:
                raise ValueError(f"rank {r}: {ids.shape[0]} ids, {lengths.shape[0]} lengths and "
                                 f"{ages.shape[0]} ages differ")
            ids_l.append(ids)
            len_l.append(lengths)
            age_l.append(ages)
        counts = np.array([a.shape[0] for a in ids_l], I64)
        total = int(counts.sum())
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, I64)  # noqa: E731
        rank = np.repeat(np.arange(counts.shape[0], dtype=I64), counts)
        starts = np.cumsum(counts) - counts
        index = np.arange(total, dtype=I64) - np.repeat(starts, counts)
        arrs = [rank, index, cat(ids_l), cat(len_l), cat(age_l)]
        if total and arrs[4].any():
            # concatenated in (rank, position) order already: a stable sort on age (oldest
            # first) gives the canonical order (= lexsort((index, rank, -age)))
            order = np.argsort(-arrs[4], kind="stable")
            arrs = [a[order] for a in arrs]
        return cls(*arrs)

    def describe(self, k: int) -> str:
        return f"rank {int(self.rank[k])} sample {int(self.sample_id[k])}"


@dataclass(frozen=True)
class StepPlan:
    """One step over ``layout.dp`` ranks. ``layout``/``config`` are what the step was planned
    with (``layout.microbatches`` the count tried); :attr:`microbatches` is the step's count
    per rank (fewer at the end of a stream, 0 when nothing is trained).

    * ``offers`` (:class:`Offers`, K samples); ``stream`` int64[P]: the offers planned, in the
      order given to the planner (``plan_epoch`` on ``offers.length[stream]`` with
      ``layout``/``config`` reproduces this step as its first step);
    * ``entry`` int64[E]: offer indices grouped by microbatch; ``mb_offsets`` int64[M + 1] with
      M = dp x microbatches, rank-major: rank r slot j is microbatch ``r * microbatches + j``
      (slots in the planner's order: by cost, 1F1B-friendly with pp > 1);
    * ``carried`` int64[C]: offers kept for a later step; ``unplanned`` int64[U]: offers that
      cannot make a step (fewer than dp at the end of a stream); ``skipped`` int64[S]: over-long
      offers under ``over_length="skip"``;
    * ``mb_fwd``/``mb_bwd`` float64[M]: predicted cost of every microbatch (constant included).
    """

    offers: Offers
    layout: Layout
    config: PlannerConfig
    stream: np.ndarray
    entry: np.ndarray
    mb_offsets: np.ndarray
    carried: np.ndarray
    unplanned: np.ndarray
    skipped: np.ndarray
    mb_fwd: np.ndarray
    mb_bwd: np.ndarray
    stats: dict = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def microbatches(self) -> int:
        """Microbatches per rank in this step (0 when nothing is trained)."""
        return (self.mb_offsets.shape[0] - 1) // self.layout.dp

    @property
    def entry_rank(self) -> np.ndarray:
        """int64[E]: the rank that trains every entry."""
        m = max(self.microbatches, 1)
        mb = np.repeat(np.arange(self.mb_offsets.shape[0] - 1), np.diff(self.mb_offsets))
        return mb // m

    def dest(self) -> np.ndarray:
        """int64[K]: the rank training every offer, -1 when it is not trained this step."""
        out = np.full(len(self.offers), -1, I64)
        out[self.entry] = self.entry_rank
        return out

    def rank_entries(self, rank: int) -> slice:
        """Entries of ``rank``'s microbatches (a slice of ``entry``, microbatch by microbatch)."""
        m = self.microbatches
        return slice(int(self.mb_offsets[rank * m]), int(self.mb_offsets[(rank + 1) * m]))

    def microbatch(self, rank: int, slot: int) -> np.ndarray:
        """Offer indices of ``rank``'s microbatch ``slot``, in planner order."""
        mb = rank * self.microbatches + slot
        return self.entry[self.mb_offsets[mb]:self.mb_offsets[mb + 1]]

    def transfers(self, src: int, dst: int) -> np.ndarray:
        """Offer indices rank ``src`` holds that rank ``dst`` trains, in ``dst``'s entry order:
        the order of the samples in the exchange, the same on both sides."""
        e = self.entry[self.rank_entries(dst)]
        return e[self.offers.rank[e] == src]

    def mb_tokens(self) -> np.ndarray:
        """int64[M]: tokens of every microbatch (CP padding included)."""
        sizes = padded_sizes(self.offers.length[self.entry], self.layout.cp)
        if self.entry.shape[0] == 0:
            return np.zeros(self.mb_offsets.shape[0] - 1, I64)
        return np.add.reduceat(sizes, self.mb_offsets[:-1])

    def rank_costs(self) -> np.ndarray:
        """float64[dp]: predicted forward + backward cost of every rank's microbatches."""
        m = self.microbatches
        if m == 0:
            return np.zeros(self.dp)
        return (self.mb_fwd + self.mb_bwd).reshape(self.dp, m).sum(1)

    @property
    def step_loss_tokens(self) -> int:
        """Labelled tokens of the whole step over every rank (each sample's length - 1)."""
        return int((self.offers.length[self.entry] - 1).sum())

    def fingerprint(self) -> str:
        """SHA-256 over the plan's arrays: equal on every rank."""
        h = hashlib.sha256(self.layout.model_dump_json().encode())
        h.update(self.config.model_dump_json().encode())
        for a in (self.offers.rank, self.offers.index, self.offers.sample_id, self.offers.length,
                  self.offers.age, self.stream, self.entry, self.mb_offsets, self.carried,
                  self.unplanned, self.skipped):
            h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
        return h.hexdigest()[:16]
