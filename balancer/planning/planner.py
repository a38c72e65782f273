"""The step planner: samples -> deterministic epoch order -> items (chunks of over-long samples)
-> costs -> a strategy's packing -> a :class:`Plan` (step -> DP rank -> microbatch -> samples).

Everything is a pure function of (lengths, cost model, layout, config, epoch, carried-in items):
every process that calls :func:`plan_epoch` with the same inputs gets a bit-identical plan, with
no communication.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from packing.chunking import expand_pieces

from ..strategies import registry as strategies
from ..config import Layout, PlannerConfig, check_budget, step_budget
from ..cost.model import CostModel
from ..samples import SampleTable
from ..zigzag import cp_pad_unit


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
    @property
    def n_steps(self) -> int:
        return int(self.step_mbs.shape[0])

    @property
    def n_microbatches(self) -> int:
        return int(self.mb_offsets.shape[0] - 1)

    @property
    def step_offsets(self) -> np.ndarray:
        """int64[S + 1]: microbatches of step s are ``step_offsets[s]:step_offsets[s + 1]``."""
        out = np.zeros(self.n_steps + 1, dtype=np.int64)
        np.cumsum(self.step_mbs * self.layout.dp, out=out[1:])
        return out

    @property
    def short_steps(self) -> np.ndarray:
        """int64[k]: the steps with fewer microbatches per rank than ``layout.microbatches``."""
        return np.flatnonzero(self.step_mbs < self.layout.microbatches)

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


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The training order of samples in an epoch: a permutation from (seed, epoch) alone."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    perm = np.random.default_rng([int(seed), int(epoch)]).permutation(n)
    return perm.astype(np.int64, copy=False)  # already int64 on 64-bit: no copy


def make_items(order: np.ndarray, lengths: np.ndarray, capacity: int, cp: int,
               over_length: str) -> tuple[Items, dict]:
    """Items in stream order. A sample whose padded size exceeds the capacity raises (policy
    ``error``) or is cut into pieces of the largest size that fits (``chunk``)."""
    ordered = lengths[order]
    unit = cp_pad_unit(cp)
    max_piece = (capacity // unit) * unit  # padded pieces must still fit
    if max_piece <= 0:
        raise ValueError(f"capacity {capacity} is smaller than one CP chunk ({unit} tokens)")
    too_long = ordered > max_piece
    stats = {"samples_chunked": 0, "pieces_added": 0}
    if not too_long.any():
        return Items(order, zeros_view(order.shape[0]), ordered.astype(np.int64, copy=False)), stats
    if over_length == "error":
        k = int(np.flatnonzero(too_long)[0])
        limit = f"the capacity {capacity}" + (f" (padded to a multiple of {unit} for cp={cp})"
                                              if cp > 1 else "")
        raise ValueError(f"sample {int(order[k])}: length {int(ordered[k])} exceeds {limit}; "
                         f"use over_length='chunk' to cut it into pieces")
    n_chunked = int(too_long.sum())
    del too_long
    sample, start, length = expand_pieces(order, ordered, max_piece)
    stats = {"samples_chunked": n_chunked, "pieces_added": int(sample.shape[0] - order.shape[0])}
    return Items(sample, start, length), stats


def zeros_view(n: int) -> np.ndarray:
    """A read-only int64 array of n zeros that takes no memory (entry starts when nothing is
    chunked)."""
    return np.broadcast_to(np.int64(0), (int(n),))


def padded_sizes(length: np.ndarray, cp: int) -> np.ndarray:
    """Tokens an item occupies in a microbatch: padded to a multiple of 2*cp under CP."""
    if cp <= 1:
        return length
    unit = 2 * cp
    return -(-length // unit) * unit


@dataclass
class EpochStream:
    """The epoch's items in training order with their sizes and costs: the input every window
    of the epoch is planned from. ``costs`` (float64[k]) is what the planner balances (forward
    plus backward); ``fwd``/``bwd`` may be given instead (then ``costs = fwd + bwd``)."""

    items: Items
    sizes: np.ndarray   # int64[k], CP padding included
    fwd: Optional[np.ndarray]
    bwd: Optional[np.ndarray]
    budget: int
    weights: Optional[np.ndarray]
    stats: dict
    costs: Optional[np.ndarray] = None

    def __post_init__(self):
        if self.costs is None:
            self.costs = self.fwd + self.bwd

    def windows(self, config: PlannerConfig) -> list[tuple[int, int]]:
        """``[lo, hi)`` item ranges planned independently (one range unless windowed)."""
        k = len(self.items)
        w = config.window_samples or k
        return [(lo, min(lo + w, k)) for lo in range(0, k, w)] or [(0, 0)]


_BLOCK = 1 << 20  # elements per block when a full-length temporary would cost memory


def _doc_totals(cost: CostModel, length: np.ndarray) -> np.ndarray:
    out = np.empty(length.shape[0], dtype=np.float64)
    for lo in range(0, length.shape[0], _BLOCK):
        out[lo:lo + _BLOCK] = cost.doc_total(length[lo:lo + _BLOCK])
    return out


def epoch_stream(samples: SampleTable, cost: CostModel, layout: Layout, config: PlannerConfig,
                 epoch: int = 0, carry_in: Optional[Items] = None) -> EpochStream:
    order = epoch_order(len(samples), config.seed, epoch, config.shuffle)
    items, stats = make_items(order, samples.lengths, layout.capacity, layout.cp,
                              config.over_length)
    del order
    if carry_in is not None and len(carry_in):
        items = Items(np.concatenate([carry_in.sample, items.sample]),
                      np.concatenate([carry_in.start, items.start]),
                      np.concatenate([carry_in.length, items.length]))
    stats["carried_in"] = 0 if carry_in is None else len(carry_in)
    sizes = padded_sizes(items.length, layout.cp)
    budget, by_samples = step_budget(layout, config)
    weights = np.ones(len(items), np.int64) if by_samples else None
    return EpochStream(items, sizes, None, None, budget, weights, stats,
                       costs=_doc_totals(cost, items.length))


def plan_window(stream: EpochStream, layout: Layout, config: PlannerConfig, lo: int, hi: int,
                last: bool):
    """Plan items ``[lo, hi)`` of the stream on their own (a ``packing.StreamPlan`` whose item
    ids are absolute). Windows other than the last end with a partial step, never a carry."""
    import packing
    fn = strategies.get(config.strategy)
    cfg = config if last or config.tail == "partial" else config.model_copy(update={"tail": "partial"})
    w = None if stream.weights is None else stream.weights[lo:hi]
    sp = fn(stream.sizes[lo:hi], stream.costs[lo:hi], layout, cfg, stream.budget, w)
    if lo == 0:
        return sp
    return packing.StreamPlan(sp.entry_item + lo, sp.entry_delay, sp.mb_offsets, sp.step_mbs,
                              sp.leftover + lo)


def merge_windows(parts):
    """Concatenate window plans in order into one StreamPlan."""
    import packing
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    offs, base = [], 0
    for p in parts:
        offs.append(p.mb_offsets[:-1] + base)
        base += int(p.mb_offsets[-1])
    offs.append(np.array([base], np.int64))
    return packing.StreamPlan(np.concatenate([p.entry_item for p in parts]),
                              np.concatenate([p.entry_delay for p in parts]),
                              np.concatenate(offs),
                              np.concatenate([p.step_mbs for p in parts]),
                              np.concatenate([p.leftover for p in parts]))


def microbatch_costs(cost: CostModel, entry_length: np.ndarray, mb_offsets: np.ndarray):
    """Predicted ``(forward, backward)`` of every microbatch (float64[M] each): each one the sum
    of its documents' costs in entry order, so the result does not depend on where the entries
    sit in a larger plan. Computed in blocks cut at microbatch boundaries, so no full-length
    temporary is held."""
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
        mb_of = np.searchsorted(mb_offsets, np.arange(lo, hi), side="right") - 1
        mb_f += np.bincount(mb_of, weights=f, minlength=n_mb)
        mb_b += np.bincount(mb_of, weights=b, minlength=n_mb)
        lo = hi
    cf, cb = cost.microbatch_constant
    return mb_f + cf, mb_b + cb


def build_plan(samples: SampleTable, cost: CostModel, layout: Layout, config: PlannerConfig,
               epoch: int, stream: EpochStream, sp) -> Plan:
    """Wrap a (merged) StreamPlan into a :class:`Plan` with per-microbatch costs. The stream's
    arrays are released as they are gathered (the stream is consumed)."""
    items = stream.items
    stream.costs = stream.sizes = stream.fwd = stream.bwd = None
    e = sp.entry_item
    left = sp.leftover
    leftover = Items(items.sample[left], items.start[left], items.length[left])
    entry_sample = items.sample[e]
    entry_start = zeros_view(e.shape[0]) if items.start.strides == (0,) else items.start[e]
    entry_length = items.length[e]
    stream.items = items = None
    del e
    mb_fwd, mb_bwd = microbatch_costs(cost, entry_length, sp.mb_offsets)
    stats = dict(stream.stats)
    stats["dropped"] = len(leftover) if config.tail == "drop" else 0
    stats["carried_out"] = len(leftover) if config.tail == "carry" else 0
    # a sample waits longer than max_delay only when the items due in a step cannot all fit it
    stats["delay_bound_exceeded"] = int((sp.entry_delay > config.max_delay).sum())
    return Plan(layout=layout, config=config, cost_model=cost.name, epoch=epoch,
                n_samples=len(samples), dataset_fingerprint=samples.fingerprint(),
                entry_sample=entry_sample, entry_start=entry_start, entry_length=entry_length,
                entry_delay=sp.entry_delay, mb_offsets=sp.mb_offsets, step_mbs=sp.step_mbs,
                mb_fwd=mb_fwd, mb_bwd=mb_bwd, leftover=leftover, stats=stats)


def plan_epoch(samples: SampleTable, cost: CostModel, layout: Layout,
               config: Optional[PlannerConfig] = None, epoch: int = 0,
               carry_in: Optional[Items] = None) -> Plan:
    """Plan one epoch. ``carry_in`` are items left over by the previous epoch (tail='carry');
    they go first."""
    config = config or PlannerConfig()
    strategies.get(config.strategy)
    check_budget(layout, *step_budget(layout, config))  # before anything is built
    t0 = time.perf_counter()
    stream = epoch_stream(samples, cost, layout, config, epoch, carry_in)
    wins = stream.windows(config)
    sp = merge_windows(plan_window(stream, layout, config, lo, hi, i == len(wins) - 1)
                       for i, (lo, hi) in enumerate(wins))
    plan = build_plan(samples, cost, layout, config, epoch, stream, sp)
    plan.stats["plan_seconds"] = time.perf_counter() - t0
    return plan


def plan_epochs(samples: SampleTable, cost: CostModel, layout: Layout,
                config: Optional[PlannerConfig] = None, epochs: int = 1) -> list[Plan]:
    """Plans for epochs ``0..epochs-1``, threading the carried tail from one to the next."""
    plans, carry = [], None
    for e in range(epochs):
        p = plan_epoch(samples, cost, layout, config, e, carry)
        carry = p.leftover if (config or PlannerConfig()).tail == "carry" else None
        plans.append(p)
    return plans
