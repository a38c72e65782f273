"""The one small collective of a step: every rank's offers (ids, lengths, ages) and a header,
all-gathered, so that every rank plans the same step.

Each rank sends ``(header, int64[3, n])`` (ids, lengths, ages) through
``torch.distributed.all_gather_object``: about 24 bytes per sample plus ~0.3 KB of pickle and
header, i.e. ~1.6 KB per rank for 64 samples (gloo moves it as two all-gathers: sizes, then the
padded bytes). The header carries the step number (ranks at different steps is an error, not a
hang later), the payload :data:`~balancer.runtime.payload.Schema` (an empty rank adopts the
others'; ranks with samples must agree) and the caller's flags (e.g. "my stream ended").
"""
from __future__ import annotations

import pickle
import time
from typing import Optional

import numpy as np
import torch.distributed as dist

from .plan import Offers
from ..world import World


def world_of(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without a process group
    (:class:`balancer.world.World`)."""
    w = World.current(group)
    return w.rank, w.size


def gather_object(obj, group=None) -> list:
    """``dist.all_gather_object`` over ``group`` (a one-process world needs no collective)."""
    _, world = world_of(group)
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_offers(ids: np.ndarray, lengths: np.ndarray, ages: np.ndarray, header: dict,
                  group=None) -> tuple[Offers, list, dict]:
    """All-gather this rank's offers; returns (the step's :class:`Offers`, every rank's header,
    stats: bytes this rank sent, bytes every rank received, seconds)."""
    t0 = time.perf_counter()
    arr = np.stack([np.asarray(ids, np.int64), np.asarray(lengths, np.int64),
                    np.asarray(ages, np.int64)]) if len(ids) else np.zeros((3, 0), np.int64)
    obj = (header, arr)
    parts = gather_object(obj, group)
    seconds = time.perf_counter() - t0
    offers = Offers.from_ranks([(a[0], a[1], a[2]) for _, a in parts])
    size = [len(pickle.dumps(p)) for p in parts]  # what all_gather_object pickles
    r, _ = world_of(group)
    return offers, [h for h, _ in parts], {
        "bytes_sent": size[r] if len(parts) > 1 else 0, "seconds": seconds,
        # every rank's bytes are padded to the largest before the all-gather
        "bytes_received": len(parts) * max(size) if len(parts) > 1 else 0}


def agree(headers: list, key: str, what: Optional[str] = None):
    """The value of ``headers[r][key]`` shared by every rank, or a ValueError naming the ranks
    that differ (the same error on every rank: no rank is left waiting in a collective)."""
    vals = [h.get(key) for h in headers]
    if any(v != vals[0] for v in vals):
        raise ValueError(f"ranks disagree on {what or key}: " +
                         ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(vals)))
    return vals[0]
