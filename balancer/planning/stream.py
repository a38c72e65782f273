"""The epoch stream, built in one place: the training order of an epoch (:func:`epoch_order`),
its items (carried-in ones first, over-long samples cut into pieces), their sizes (CP padding
included) and costs, the step budget, and the windows the planner plans independently.

:class:`EpochWindows` holds only the order (int64[n]) and the positions of the over-long
samples and makes any item range on demand, so the plan store's workers plan one window at a
time in little memory; :func:`epoch_stream` is the same stream whole, as the planner takes it
(``EpochWindows(...).stream(cost)``), so the two can never disagree."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from packing.chunking import expand_pieces

from ..config import MAX_COUNT, Layout, PlannerConfig, step_budget
from ..cost.blocks import doc_totals
from ..cost.model import CostModel
from ..samples import SampleTable
from ..zigzag import cp_pad_unit, padded_lengths
from .plan import Items


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True,
                order: str = "permutation") -> np.ndarray:
    """The training order of samples in an epoch (int64[n]): a permutation from (seed, epoch)
    alone; ``order='blocks'``: the block shuffle of :mod:`balancer.planning.order` (whole
    here; :class:`EpochWindows` computes it per window)."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    if order == "blocks":
        from .order import block_order_range
        return block_order_range(n, seed, epoch, 0, n)
    if order != "permutation":
        raise ValueError(f"order {order!r}: expected 'permutation' or 'blocks'")
    from .order import permutation_order
    return permutation_order(n, seed, epoch)


def gather_lengths(lengths, idx: np.ndarray) -> np.ndarray:
    """``lengths[idx]`` (int64[k]) of an array, or of a length source read on demand (an
    object with ``shape`` and ``take(idx)``, such as :class:`balancer.shards.LengthFiles`)."""
    if isinstance(lengths, np.ndarray):
        return np.take(lengths, idx)  # the same array as lengths[idx], faster
    return lengths.take(idx)


#: pieces one sample may be cut into (``over_length='chunk'``): the bound of every count
#: (:data:`balancer.config.MAX_COUNT`); a length that needs more is refused before its pieces
#: are made (2**40 tokens at capacity 8192 would be 2**27 pieces, 3 GiB of items)
MAX_PIECES = MAX_COUNT


def make_items(order: np.ndarray, lengths: np.ndarray, capacity: int, cp: int,
               over_length: str, ordered: Optional[np.ndarray] = None) -> tuple[Items, dict]:
    """Items in stream order. A sample whose padded size exceeds the capacity raises (policy
    ``error``) or is cut into pieces of the largest size that fits (``chunk``). ``lengths``:
    an array or a source read on demand (:func:`gather_lengths`); ``ordered``: the lengths of
    ``order`` when the caller has gathered them already (int64, not copied)."""
    if ordered is None:
        ordered = gather_lengths(lengths, order)
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
    long_at = np.flatnonzero(too_long)
    del too_long
    pieces = (ordered[long_at] - 1) // max_piece + 1
    over = np.flatnonzero(pieces > MAX_PIECES)
    if over.size:   # before a piece is made: a corrupt length would fill the memory first
        k = int(long_at[over[0]])
        raise ValueError(f"sample {int(order[k])}: length {int(ordered[k])} would be cut into "
                         f"{int(pieces[over[0]])} pieces of {max_piece} tokens, over the limit "
                         f"of {MAX_PIECES} (2**20) pieces per sample (over_length='chunk'); "
                         f"check that length, or raise the capacity")
    sample, start, length = expand_pieces(order, ordered, max_piece)
    stats = {"samples_chunked": n_chunked, "pieces_added": int(sample.shape[0] - order.shape[0])}
    return Items(sample, start, length), stats


def zeros_view(n: int) -> np.ndarray:
    """A read-only int64 array of n zeros that takes no memory (entry starts when nothing is
    chunked)."""
    return np.broadcast_to(np.int64(0), (int(n),))


def padded_sizes(length: np.ndarray, cp: int) -> np.ndarray:
    """Tokens an item occupies in a microbatch: padded to a multiple of 2*cp under CP."""
    return padded_lengths(length, cp)


@dataclass
class EpochStream:
    """Items ``[lo, hi)`` of an epoch in training order with their sizes and costs: what a
    strategy plans. ``costs`` (float64[k]) is what the planner balances (forward plus backward,
    plus any per-sample extra, see :meth:`EpochWindows.stream`); ``sizes`` int64[k] include
    the CP padding; ``weights`` are ones under a sample budget, else None."""

    items: Items
    sizes: np.ndarray
    budget: int
    weights: Optional[np.ndarray]
    stats: dict
    costs: np.ndarray

    def windows(self, config: PlannerConfig, dp: int = 1) -> list[tuple[int, int]]:
        """``[lo, hi)`` item ranges planned independently (one range unless windowed)."""
        return window_ranges(len(self.items), config, dp)


def window_ranges(k: int, config: PlannerConfig, dp: int = 1) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` ranges of ``config.window_samples`` items (one range unless windowed)
    that cut a stream of ``k`` items. A last range of fewer items than the ``dp`` ranks (which
    no step can spread over them) joins the range before it (issue 26 item 3)."""
    w = config.window_samples or k
    out = [(lo, min(lo + w, k)) for lo in range(0, k, w)] or [(0, 0)]
    if len(out) > 1 and out[-1][1] - out[-1][0] < dp:
        out[-2:] = [(out[-2][0], out[-1][1])]
    return out


class EpochWindows:
    """An epoch's item stream, produced window by window (:meth:`stream`).

    Items are the carried-in ones, then every sample in epoch order, over-long ones cut into
    pieces (``over_length='chunk'``). Only the positions of the over-long samples and, under
    ``order='permutation'``, the order (int64[n]) are held (``order='blocks'`` computes any
    range of it); ``items(lo, hi)`` rebuilds any item range with ``planner.make_items`` on the
    few samples that cover it. ``lengths``: int64[n], or a source read on demand
    (:func:`gather_lengths`)."""

    def __init__(self, lengths: np.ndarray, layout: Layout, config: PlannerConfig, epoch: int,
                 carry_in: Optional[Items] = None, block: int = 1 << 20,
                 keep_ordered: bool = False):
        self.lengths, self.layout, self.config = lengths, layout, config
        self.epoch = epoch
        n = lengths.shape[0]
        # computed per range under 'blocks' (and without shuffle: the identity)
        self.lazy = config.order == "blocks" or not config.shuffle
        # ``keep_ordered`` (the planner's whole-epoch stream, :func:`epoch_stream`): the order's
        # lengths gathered at once and kept for the one items() call that covers them, which
        # would gather the same array again; else a block at a time
        self._ordered = None
        whole = keep_ordered and not self.lazy and not config.window_samples
        carried = None
        if self.lazy:
            self.order = None
        elif whole and isinstance(lengths, np.ndarray) and lengths.dtype == np.int64:
            # the lengths carried through the shuffle: read in corpus order, not gathered at
            # a million scattered places after it
            from .order import permutation_order
            self.order, carried = permutation_order(n, config.seed, epoch, values=lengths)
        else:
            self.order = epoch_order(n, config.seed, epoch, config.shuffle)
        unit = cp_pad_unit(layout.cp)
        self.max_piece = (layout.capacity // unit) * unit
        make_items(self.order_range(0, 0), lengths, layout.capacity, layout.cp,
                   config.over_length)
        tl, tl_len = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for lo in range(0, n, max(n, 1) if whole else block):  # one pass over the order
            ordered = (carried if carried is not None else
                       gather_lengths(lengths, self.order_range(lo, lo + (n if whole else block))))
            carried = None
            hit = np.flatnonzero(ordered > self.max_piece)
            tl.append(lo + hit)
            tl_len.append(ordered[hit])  # kept: a second gather would read scattered blocks
            if whole:
                self._ordered = ordered
        self.tl_pos = np.concatenate(tl)
        if self.tl_pos.size:  # raises the planner's own error under over_length='error'
            p = int(self.tl_pos[0])
            make_items(self.order_range(p, p + 1), lengths, layout.capacity, layout.cp,
                       config.over_length)
        extra = -(-np.concatenate(tl_len) // self.max_piece) - 1
        del tl, tl_len
        self.extra_before = np.concatenate([[0], np.cumsum(extra)]).astype(np.int64)
        self.carry = carry_in if carry_in is not None and len(carry_in) else None
        self.n_carry = 0 if self.carry is None else len(self.carry)
        self.n_items = self.n_carry + n + int(self.extra_before[-1])
        self.stats = {"samples_chunked": int(self.tl_pos.size),
                      "pieces_added": int(self.extra_before[-1]), "carried_in": self.n_carry}
        self.windows = window_ranges(self.n_items, config, layout.dp)

    def order_range(self, lo: int, hi: int) -> np.ndarray:
        """The samples at order positions ``[lo, hi)`` (int64[hi - lo])."""
        if not self.lazy:
            return self.order[lo:hi]
        hi = min(max(lo, hi), self.lengths.shape[0])
        if not self.config.shuffle:
            return np.arange(lo, hi, dtype=np.int64)
        from .order import block_order_range
        return block_order_range(self.lengths.shape[0], self.config.seed, self.epoch, lo, hi)

    def _start(self, p: int) -> int:
        """Index (after the carried-in items) of the first item of order position ``p``."""
        return p + int(self.extra_before[np.searchsorted(self.tl_pos, p, side="left")])

    def _position(self, k: int) -> int:
        """The last order position whose first item is at or before item ``k``."""
        lo, hi = 0, self.lengths.shape[0]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._start(mid) <= k:
                lo = mid
            else:
                hi = mid
        return lo

    def items(self, lo: int, hi: int) -> Items:
        parts = []
        if lo < self.n_carry:
            c, e = self.carry, min(hi, self.n_carry)
            parts.append(Items(c.sample[lo:e], c.start[lo:e], c.length[lo:e]))
        k0, k1 = max(lo, self.n_carry) - self.n_carry, hi - self.n_carry
        if k1 > k0:
            p0 = self._position(k0)
            p1 = self._position(k1 - 1) + 1
            ordered = None
            if self._ordered is not None and p0 == 0 and p1 == self.lengths.shape[0]:
                ordered, self._ordered = self._ordered, None  # used once: the stream's items
            it, _ = make_items(self.order_range(p0, p1), self.lengths, self.layout.capacity,
                               self.layout.cp, self.config.over_length, ordered)
            del ordered
            if (not self.lazy and lo == 0 and hi == self.n_items
                    and it.sample.base is not self.order):
                self.order = None  # a one-window epoch: the order is not needed again
            s = k0 - self._start(p0)
            parts.append(Items(it.sample[s:s + k1 - k0], it.start[s:s + k1 - k0],
                               it.length[s:s + k1 - k0]))
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return Items(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        return Items(*(np.concatenate([getattr(p, f) for p in parts])
                       for f in ("sample", "start", "length")))

    def stream(self, cost: CostModel, lo: int = 0, hi: Optional[int] = None,
               sample_extra_cost: Optional[np.ndarray] = None) -> EpochStream:
        """Items ``[lo, hi)`` (all by default) with sizes, costs, budget and weights.
        ``sample_extra_cost`` (float64[n], optional) is added to the cost of every sample's
        first item (its piece at offset 0), e.g. the encoder cost of a multimodal sample's
        media."""
        hi = self.n_items if hi is None else hi
        items = self.items(lo, hi)
        budget, by_samples = step_budget(self.layout, self.config)
        weights = np.ones(len(items), np.int64) if by_samples else None
        costs = doc_totals(cost, items.length)
        if sample_extra_cost is not None:
            costs = costs + sample_extra_cost[items.sample] * (items.start == 0)
        whole = lo == 0 and hi == self.n_items
        return EpochStream(items, padded_sizes(items.length, self.layout.cp), budget, weights,
                           dict(self.stats) if whole else {}, costs)


def epoch_stream(samples: SampleTable, cost: CostModel, layout: Layout, config: PlannerConfig,
                 epoch: int = 0, carry_in: Optional[Items] = None,
                 sample_extra_cost: Optional[np.ndarray] = None) -> EpochStream:
    """The whole epoch's stream (see :class:`EpochWindows`)."""
    return EpochWindows(samples.lengths, layout, config, epoch, carry_in,
                        keep_ordered=True).stream(
        cost, sample_extra_cost=sample_extra_cost)
