"""One resume contract for every batch sampler of the loader: where an epoch stands, how a pass
over it goes, and what a checkpoint may say when DataLoader workers read ahead.

:class:`EpochCursor` holds the epoch, the ``position`` (refs of the epoch handed out: where a
checkpoint taken now resumes), where the next pass starts, and what has been restored.
:class:`PackedBatchSampler <balancer.loader.sampler.PackedBatchSampler>` and
:class:`HybridBatchSampler <balancer.loader.hybrid.HybridBatchSampler>` own one each and
differ only in what a ref is and what else their states record.

The contract:

* a pass (``iter(sampler)``) yields the epoch's refs from where the cursor stands; a pass that
  ran to the end makes the next one start the epoch over; a pass left unfinished does not move
  the next start; ``set_epoch`` to another epoch (or a restore) ends a pass still open;
* ``set_epoch(e)`` to another epoch starts it at its first ref; to the current one keeps the
  position (a finished epoch stays finished until another is selected), so a state taken after
  an epoch's loop resumes exactly whether the trainer saved that epoch or the next as its
  counter; after a restore, leaving an unfinished restored epoch, or going back, is refused;
* ``state(after=None)``: ``(epoch, position)`` after the last ref handed out, or after
  ``after`` (the last batch the loop consumed; its ``epoch``/``position`` locate it; the batch
  that ended epoch ``e`` gives the start of the selected epoch ``e + 1``).

**Read-ahead guard.** A DataLoader with workers takes refs ahead of the training loop, so
"handed out" is not "trained". The cursor learns that through two documented means, never by
inspecting its callers:

* a ref that leaves the process (pickled, on its way to a worker:
  :mod:`balancer.loader.refs`) marks its pass as read ahead; from then on ``state()`` without
  ``after`` is an error naming the fix -- unless the pass ran out and its reader let go of it
  (the DataLoader iterator finished and was released: at the end of the loop nothing is in
  flight), when the state is the finished epoch (the next epoch's start);
* torchdata's ``StatefulDataLoader`` snapshots the sampler's iterator together with the sampler
  (it serialises any iterator that has ``state_dict``/``load_state_dict``, then the sampler):
  :class:`Pass` has both, and its ``state_dict()`` permits the sampler's own ``state_dict()``
  that the loader makes next, at that position only. Its snapshot is exact; the user's own call
  between two snapshots is refused like the plain loader's.

A loop that ``break`` s out in its last ``prefetch_factor x num_workers`` batches cannot be told
from one that ran out (the loader has taken every ref either way): pass ``after=`` before
leaving such a loop. A loader with ``persistent_workers=True`` keeps its iterator (and the pass)
after the loop, so there ``state_dict()`` stays refused until ``set_epoch``: pass ``after=``.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

from .refs import next_pass


def epoch_number(epoch, what: str) -> int:
    """``epoch`` as an int >= 0 (an integral float counts); anything else is an error, never
    truncated."""
    try:
        e = int(epoch)
        ok = e == epoch and e >= 0 and not isinstance(epoch, (bool, str))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{what}({epoch!r}): the epoch must be an integer >= 0")
    return e


class EpochCursor:
    """Where a sampler stands (see the module docstring). ``length(epoch)`` is the number of
    refs of an epoch on this rank (plans are built on demand by the sampler); ``unit`` names a
    ref in messages ("microbatch", "round")."""

    def __init__(self, epoch: int, length: Callable[[int], int], unit: str):
        self.epoch = epoch
        self.position = 0  # refs of this epoch handed out (where a checkpoint resumes)
        self.next = 0  # where the next pass starts
        self.generation = 0  # bumped when set_epoch / restore move the cursor
        self._length, self.unit = length, unit
        self._asked: Optional[int] = None  # set_epoch since the last pass or restore
        self._restored: Optional[tuple] = None  # (epoch, position, n) restored, not iterated
        self._pass_id = 0  # the current pass (refs of older passes leaving are ignored)
        self.ahead = False  # a ref of the current pass left the process (a worker reads ahead)
        self.stateful = False  # the current pass is snapshotted by a StatefulDataLoader
        self.drained = False  # the current pass ran out and its reader let go of it
        self._permit: Optional[tuple] = None  # (generation, position) a loader snapshot allows
        self.lengths: dict[int, int] = {}  # refs of every epoch seen (after= of past epochs)
        self.resizes = 0  # bumped when the epoch's unhanded refs were re-planned (resized)

    def n(self) -> int:
        n = self.lengths[self.epoch] = int(self._length(self.epoch))
        return n

    # ---- moving ---------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        epoch = epoch_number(epoch, "set_epoch")
        self._select(epoch)
        self._asked = epoch

    def _select(self, epoch: int) -> None:
        if self._restored is not None and epoch != self._restored[0]:
            e, pos, n = self._restored
            u = self.unit
            if pos < n:
                raise ValueError(
                    f"set_epoch({epoch}) but the checkpoint restored into this sampler is in "
                    f"epoch {e} at {u} {pos} of {n}: call set_epoch({e}) to finish it first "
                    f"(its {n - pos} remaining {u}s would be skipped); to skip them on purpose, "
                    f"start epoch {epoch} with a sampler that restored nothing")
            if epoch < e:
                raise ValueError(
                    f"set_epoch({epoch}) but the checkpoint restored into this sampler has "
                    f"finished epoch {e}: the next epoch is {e + 1} (set_epoch({e}) yields "
                    f"nothing, then set_epoch({e + 1}))")
        if epoch != self.epoch:
            self.epoch, self.position, self.next = epoch, 0, 0
            self._moved()
            self._restored = None
        else:
            self.next = self.position

    def _moved(self) -> None:
        self.generation += 1
        self.ahead = self.stateful = self.drained = False
        self._permit = None

    def restore(self, epoch: int, position: int, check: Callable[[], None]) -> None:
        """Resume at ``(epoch, position)``; ``check()`` runs once the epoch is selected (the
        sampler compares its plan with the state's) and may raise."""
        self.epoch = epoch
        self._moved()
        check()
        n = self.n()
        if not 0 <= position <= n:
            raise ValueError(f"cannot resume: position {position} is outside 0..{n} ({self.unit}s "
                             f"of epoch {epoch})")
        self.position = self.next = position
        self._restored = (epoch, position, n)
        asked, self._asked = self._asked, None
        if asked is not None:  # set_epoch before a lazy restore (StatefulDataLoader)
            self._select(asked)

    def resized(self) -> None:
        """The current epoch's refs not yet handed out were re-planned (the closed loop): a
        pass in progress reads the new length and goes on from where it stands."""
        self.resizes += 1
        self.n()

    # ---- passes ---------------------------------------------------------------------------
    def iterate(self, ref: Callable[[int], object]) -> "Pass":
        """A pass over the epoch (lazy: it starts at its first ``next()``, as a
        StatefulDataLoader creates iterators it never advances)."""
        return Pass(self, ref)

    def _left(self, pass_id: int) -> None:
        if pass_id == self._pass_id:
            self.ahead = True

    def _released(self, pass_id: int) -> None:
        if pass_id == self._pass_id:
            self.drained = True

    # ---- checkpoints ----------------------------------------------------------------------
    def state(self, after=None) -> tuple[int, int]:
        """``(epoch, position)`` to resume at (see the module docstring)."""
        if after is not None:
            return self._after(after)
        permit, self._permit = self._permit, None
        if self.ahead and not self.drained and permit != (self.generation, self.position):
            raise ValueError(self._read_ahead_message())
        return self.epoch, self.position

    def _read_ahead_message(self) -> str:
        done = (f"{self.position} of epoch {self.epoch}'s {self.n()} {self.unit}s handed out, "
                f"some not yet trained on")
        if self.stateful:
            return (f"sampler.state_dict() without after=: this sampler feeds a "
                    f"StatefulDataLoader whose workers read ahead of the training loop "
                    f"({done}): checkpoint the loader with dl.state_dict() (exact), or pass "
                    f"the last batch the loop consumed: sampler.state_dict(after=batch)")
        return (f"sampler.state_dict() without after=: DataLoader workers read ahead of the "
                f"training loop ({done}), so the sampler cannot tell which batch the loop "
                f"consumed last. Pass that batch: sampler.state_dict(after=batch), or use "
                f"torchdata's StatefulDataLoader and checkpoint with dl.state_dict()")

    def _after(self, after) -> tuple[int, int]:
        """(epoch, position) to resume at once ``after`` has been trained on."""
        try:
            get = after.get if isinstance(after, dict) else (lambda k: getattr(after, k))
            epoch, pos = int(get("epoch")), int(get("position"))
        except (AttributeError, KeyError, TypeError, ValueError):
            raise ValueError(f"after= takes the last batch the training loop consumed (a "
                             f"collated batch or a ref, with 'epoch' and 'position'), got "
                             f"{type(after).__name__}") from None
        if epoch == self.epoch:
            n = self.n()
            if not 0 <= pos < n:
                raise ValueError(f"after= is {self.unit} {pos} of epoch {epoch}, which has {n} "
                                 f"on this rank (0..{n - 1})")
            return epoch, pos + 1
        if epoch > self.epoch:
            raise ValueError(f"after= is a batch of epoch {epoch} but the sampler is at epoch "
                             f"{self.epoch}")
        n = self.lengths.get(epoch)
        if n is None:
            raise ValueError(f"after= is a batch of epoch {epoch}, which this sampler never "
                             f"iterated, and the sampler is at epoch {self.epoch}")
        if pos + 1 != n:
            raise ValueError(
                f"after= is the batch of epoch {epoch} at position {pos} (of {n}) but the "
                f"sampler has moved on to epoch {self.epoch}: a checkpoint there would skip the "
                f"remaining {n - pos - 1} {self.unit}s of epoch {epoch}. Checkpoint before "
                f"set_epoch({self.epoch}), or pass a batch of epoch {self.epoch}")
        return self.epoch, 0  # that batch ended the epoch before: nothing of this one trained


class Pass:
    """One pass of a sampler over its epoch (the iterator ``iter(sampler)`` returns). It is
    ``Stateful`` in torchdata's sense so that a StatefulDataLoader snapshots it with the sampler
    (see the module docstring); its own state is only the position, for checking."""

    def __init__(self, cursor: EpochCursor, ref: Callable[[int], object]):
        self._cursor, self._ref = cursor, ref
        self._started = False
        self._ran_out = False

    def __iter__(self):
        return self

    def _start(self) -> None:
        c = self._cursor
        self._gen, self._pos, self._n, self._first = c.generation, c.next, c.n(), c.next
        self._resizes = c.resizes
        c._asked = c._restored = None
        c._pass_id += 1
        self._id = c._pass_id
        self._number = next_pass()
        c.ahead = c.stateful = c.drained = False
        c._permit = None
        cref, pid = weakref.ref(c), self._id

        def left():  # called from whatever thread pickles the ref (a queue's feeder)
            cur = cref()
            if cur is not None:
                cur._left(pid)
        self._on_leave = left

    def __next__(self):
        if not self._started:
            self._started = True
            self._start()
        c = self._cursor
        if c.resizes != self._resizes:
            self._n, self._resizes = c.n(), c.resizes
        if self._ran_out or c.generation != self._gen or self._pos >= self._n:
            if not self._ran_out:
                self._ran_out = True
                if c.generation == self._gen:
                    if self._first < self._n:
                        c.next = 0  # a pass that ran to the end: the next one starts over
                    # the reader lets go of a pass that ran out at the end of its loop (the
                    # DataLoader iterator finished and was released): nothing is in flight then
                    weakref.finalize(self, _released, weakref.ref(c), self._id)
            raise StopIteration
        pos = self._pos
        ref = self._ref(pos)
        ref._left = self._on_leave
        ref._pass = self._number  # PackedDataset checks it is fetched in order (refs.py)
        self._pos = pos + 1
        c.position = pos + 1  # state() now means "this one was handed out"
        return ref

    # torchdata's Stateful protocol ---------------------------------------------------------
    def state_dict(self) -> dict:
        c = self._cursor
        c.stateful = True
        c._permit = (c.generation, c.position)  # the loader's sampler snapshot comes next
        return {"position": c.position}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: the sampler's own state (restored first) placed the pass."""


def _released(cref, pass_id: int) -> None:
    c = cref()
    if c is not None:
        c._released(pass_id)


__all__ = ["EpochCursor", "Pass", "epoch_number"]
