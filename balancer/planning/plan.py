"""What the planner produces: :class:`Items` (the units it places) and :class:`Plan` (one
epoch's packing in CSR arrays, with the step and DP rank of every microbatch computed once).

Numpy only (no numba, no planner): the loader, the plan store and the reports import it."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..config import Layout, PlannerConfig


def step_offsets(step_mbs: np.ndarray, dp: int) -> np.ndarray:
    """int64[S + 1]: the first microbatch of every step (and the total) when step ``s`` holds
    ``dp x step_mbs[s]`` microbatches."""
    step_mbs = np.asarray(step_mbs, dtype=np.int64)
    out = np.zeros(step_mbs.shape[0] + 1, dtype=np.int64)
    np.cumsum(step_mbs * dp, out=out[1:])
    return out


def microbatch_step_rank(step_mbs: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """``(mb_step, mb_rank)``, int64[M] each: the step and the DP rank of every microbatch of a
    plan whose microbatches are step-major, then rank-major, step ``s`` holding ``step_mbs[s]``
    per rank (int64[S]). The one derivation: plans, the plan store (what it writes and what it
    checks), precompute windows, metrics and the multimodal planner use it."""
    step_mbs = np.asarray(step_mbs, dtype=np.int64)
    n_mb = step_mbs * dp
    mb_step = np.repeat(np.arange(step_mbs.shape[0], dtype=np.int64), n_mb)
    first = step_offsets(step_mbs, dp)[:-1]
    mb_rank = (np.arange(mb_step.shape[0], dtype=np.int64) - first[mb_step]) // step_mbs[mb_step]
    return mb_step, mb_rank


@dataclass(frozen=True)
class Items:
    """Units the packer places: whole samples, or capacity-sized pieces of over-long ones.
    ``start`` is the token offset of the piece inside its sample."""

    sample: np.ndarray  # int64[k]
    start: np.ndarray   # int64[k]
    length: np.ndarray  # int64[k]

    def __len__(self):
        return int(self.sample.shape[0])


@dataclass(frozen=True)
class Plan:
    """One epoch's packing, in CSR arrays (see ``packing.stream``):

    * ``entry_sample``/``entry_start``/``entry_length`` (int64[E]): the documents of every
      microbatch, grouped by microbatch; ``entry_start`` is non-zero only for chunk pieces;
    * ``entry_delay`` (int32[E]): steps each document waited after the planner read it, or,
      negative, how many steps before its turn a heavy document was read ahead (``balanced``
      with ``max_advance``);
    * ``mb_offsets`` (int64[M + 1]) and ``step_mbs`` (int64[S]): the microbatches per DP rank of
      every step, equal on every rank. A full step has ``layout.microbatches``; a short step --
      the last of the epoch (and of every window), when what is left fills fewer -- has fewer,
      only as many as it needs (see :meth:`microbatch_ids`; the sampler's refs carry it as
      ``step_microbatches``). Microbatches are step-major, then rank-major, then in pipeline
      order; every one holds at least one document;
    * ``mb_fwd``/``mb_bwd`` (float64[M]): predicted cost of every microbatch (whole model, whole
      CP group; divide by pp for a stage and by cp for a CP rank);
    * ``leftover`` (:class:`Items`): pieces not placed (``tail`` carry or drop).
    """

    layout: Layout
    config: PlannerConfig
    cost_model: str
    epoch: int
    n_samples: int
    dataset_fingerprint: str
    entry_sample: np.ndarray
    entry_start: np.ndarray
    entry_length: np.ndarray
    entry_delay: np.ndarray
    mb_offsets: np.ndarray
    step_mbs: np.ndarray
    mb_fwd: np.ndarray
    mb_bwd: np.ndarray
    leftover: Items
    stats: dict = field(default_factory=dict)

    # ---- shape ----------------------------------------------------------------------------
    @cached_property
    def _step_rank(self) -> tuple[np.ndarray, np.ndarray]:
        # computed on first use and kept (cached_property writes the instance dict, which a
        # frozen dataclass allows); fingerprint() and equality do not see it
        return microbatch_step_rank(self.step_mbs, self.layout.dp)

    @property
    def mb_step(self) -> np.ndarray:
        """int64[M]: the step of every microbatch (:func:`microbatch_step_rank`, once)."""
        return self._step_rank[0]

    @property
    def mb_rank(self) -> np.ndarray:
        """int64[M]: the DP rank of every microbatch (:func:`microbatch_step_rank`, once)."""
        return self._step_rank[1]

    @property
    def n_steps(self) -> int:
        return int(self.step_mbs.shape[0])

    @property
    def n_microbatches(self) -> int:
        return int(self.mb_offsets.shape[0] - 1)

    @property
    def step_offsets(self) -> np.ndarray:
        """int64[S + 1]: microbatches of step s are ``step_offsets[s]:step_offsets[s + 1]``."""
        return step_offsets(self.step_mbs, self.layout.dp)

    @property
    def short_steps(self) -> np.ndarray:
        """int64[k]: the steps with fewer microbatches per rank than ``layout.microbatches``."""
        return np.flatnonzero(self.step_mbs < self.layout.microbatches)

    def lockstep_times(self, mb_cost: np.ndarray) -> np.ndarray:
        """float64[S]: every step's ``sum_k max_r cost[r, k]``, the time of DP ranks that wait
        for each other after every microbatch (microbatch ``k`` of every rank in lockstep),
        from the microbatch costs ``mb_cost`` (float64[M], this plan's order)."""
        mb_cost = np.asarray(mb_cost, dtype=np.float64)
        so = self.step_offsets
        first = so[self.mb_step]
        # microbatch k of its rank, as a slot so[s] + k of its step's range (k < step_mbs[s])
        slot = first + (np.arange(mb_cost.shape[0]) - first) % self.step_mbs[self.mb_step]
        top = np.full(mb_cost.shape[0], -np.inf)
        np.maximum.at(top, slot, mb_cost)
        used = np.isfinite(top)
        return np.bincount(self.mb_step[used], weights=top[used], minlength=self.n_steps)

    def microbatch_ids(self, step: int, rank: int) -> np.ndarray:
        """Microbatch indices of DP ``rank`` in ``step``, in pipeline order (``step_mbs[step]``
        of them)."""
        if not 0 <= rank < self.layout.dp:
            raise ValueError(f"rank {rank} is outside 0..{self.layout.dp - 1}")
        start = int(self.step_offsets[step])
        m = int(self.step_mbs[step])
        return np.arange(start + rank * m, start + (rank + 1) * m)

    def entries(self, mb: int) -> slice:
        return slice(int(self.mb_offsets[mb]), int(self.mb_offsets[mb + 1]))

    def microbatch_samples(self, mb: int) -> np.ndarray:
        return self.entry_sample[self.entries(mb)]

    def mb_tokens(self) -> np.ndarray:
        """Tokens (unpadded) per microbatch, int64[M]."""
        if self.n_microbatches == 0:
            return np.zeros(0, np.int64)
        return np.add.reduceat(self.entry_length, self.mb_offsets[:-1])

    def fingerprint(self) -> str:
        """SHA-256 over the layout, config and every array: equal on every rank or the ranks
        are training on different plans."""
        h = hashlib.sha256()
        h.update(self.layout.model_dump_json().encode())
        h.update(self.config.model_dump_json().encode())
        h.update(f"{self.cost_model}|{self.epoch}|{self.n_samples}|{self.dataset_fingerprint}".encode())
        for a in (self.entry_sample, self.entry_start, self.entry_length, self.mb_offsets,
                  self.step_mbs, self.leftover.sample, self.leftover.start, self.leftover.length):
            h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
        return h.hexdigest()[:16]
