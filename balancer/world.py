"""Which process this is in the training job: one :class:`World` (rank, world size, process
group) and the launcher checks, instead of every sampler, stream and command working ranks out
with its own rules.

The rules, in one place:

* a ``torch.distributed`` process group that is initialised is the truth (``rank`` and ``size``
  within ``group``, the default group when None);
* without one, the process is rank 0 of a world of 1 -- unless a launcher started several
  processes (``WORLD_SIZE > 1``: torchrun, accelerate, deepspeed set it): then the rank is
  unknown, and a consumer that needs it (:meth:`World.rank_in`) refuses rather than serving
  rank 0 on every process (the other ranks' samples would never train, silently);
* ``WORLD_SIZE`` is read by :func:`launched_processes` only (an unparsable value is an error
  naming it, never taken as 1).

``torch`` is imported when a world is asked for, so importing this module costs nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional


def launched_processes() -> int:
    """Processes a launcher started (``WORLD_SIZE``; 1 when unset or empty)."""
    raw = os.environ.get("WORLD_SIZE", "")
    if raw.strip() == "":
        return 1
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={raw!r} is not a number of processes") from None
    if n < 1:
        raise ValueError(f"WORLD_SIZE={raw!r}: a launcher starts at least 1 process")
    return n


@dataclass(frozen=True)
class World:
    """This process's place in the job.

    * ``rank``, ``size``: within ``group`` (0 and 1 without a process group);
    * ``group``: the ``torch.distributed`` group asked for (None: the default group);
    * ``distributed``: a process group is initialised;
    * ``launched``: processes the launcher started (``WORLD_SIZE``, 1 without a launcher).
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    distributed: bool = False
    launched: int = 1

    @classmethod
    def current(cls, group=None) -> "World":
        """The world as this process sees it now."""
        import torch.distributed as dist
        launched = launched_processes()
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(group), dist.get_world_size(group), group, True, launched)
        return cls(0, 1, group, False, launched)

    @property
    def multi(self) -> bool:
        """More than one process takes part (a collective is needed)."""
        return self.distributed and self.size > 1

    def rank_in(self, n_ranks: int, what: str, rank_args: str,
                data_ranks: Optional[int] = None) -> int:
        """This process's rank in a job of ``n_ranks`` ranks (``what`` names them in errors, e.g.
        ``"tp=1 x cp=2 x dp=2 x pp=1"``): the group's rank, whose size must be ``n_ranks``; or
        0 for a single process. A launched process without a process group is refused when the
        ranks are fed different data (``data_ranks``, default ``n_ranks``, > 1: tensor-parallel
        ranks share their data, so a launched tp-only job is rank 0 everywhere);
        ``rank_args`` names the keyword that gives the rank by hand."""
        if self.distributed:
            if self.size != n_ranks:  # ranks past the group would never be served, or not exist
                raise ValueError(f"process group has {self.size} ranks but {what} = {n_ranks}: "
                                 f"pass {rank_args} (this process's rank) or fix the layout")
            return self.rank
        if self.launched > 1 and (n_ranks if data_ranks is None else data_ranks) > 1:
            raise ValueError(
                f"WORLD_SIZE={self.launched} (a launcher started {self.launched} processes) but "
                f"torch.distributed is not initialized, so this process's rank is unknown: call "
                f"torch.distributed.init_process_group() (or create the Accelerator / "
                f"TrainingArguments) before the sampler, or pass {rank_args}")
        return 0


def current_world(group: Optional[Any] = None) -> World:
    """:meth:`World.current` (a function, for call sites that take one)."""
    return World.current(group)


__all__ = ["World", "current_world", "launched_processes"]
