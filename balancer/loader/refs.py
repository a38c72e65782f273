"""The sampler <-> collator contract: what a batch sampler yields for one microbatch.

A ref is a ``list`` of sample ids (so it honours the DataLoader's ``batch_sampler`` contract and
reaches ``dataset.__getitems__`` untouched, pickled with its fields to workers) plus a fixed
set of typed fields. The fields are slots: constructing a ref with a field the class does not
have, or assigning one, is an error, so a misspelt name can never drop a key of the batch
silently (the collators read the fields themselves, not names with ``getattr`` defaults).

A ref records when it leaves the process (pickled to a DataLoader worker): its sampler then
knows a worker reads ahead of the training loop (:mod:`balancer.loader.cursor`). Copies made
with :mod:`copy` do not count as leaving.

A ref also carries the pass of its sampler it was handed out by (a process-unique number,
pickled with it), so the process that fetches it (:func:`check_handed_in_order`, called by
``PackedDataset``) can tell when something between the sampler and the DataLoader hands it only
some of its sampler's refs -- ``accelerator.prepare(loader)`` does (accelerate's
``BatchSamplerShard`` gives process p every n-th batch of a sampler that is already per rank).
"""
from __future__ import annotations

import itertools
from typing import Callable, Optional

_PASSES = itertools.count(1)  # pass numbers of this process's samplers
_LAST: dict = {}  # pass number -> position of the last ref of that pass fetched here
_KEEP = 16  # passes remembered per process (a train and an eval loader interleave)


def next_pass() -> int:
    """A number for a new pass of a sampler, unique in this process."""
    return next(_PASSES)


def check_handed_in_order(ref) -> None:
    """Raise ValueError when ``ref`` is not the next ref of its pass this process should fetch:
    a DataLoader's process fetches every ref of a pass in order (in the main process), or every
    ``num_workers``-th (in a worker: the loader deals batches round-robin). A skipped prefix
    (accelerate's ``skip_first_batches``, a resume) is fine; a stride is not: a wrapper hands
    this process every n-th microbatch of a per-rank sampler (``accelerator.prepare``)."""
    pass_id = getattr(ref, "_pass", None)
    position = getattr(ref, "position", None)
    if pass_id is None or position is None:
        return
    from torch.utils.data import get_worker_info
    info = get_worker_info()
    stride = 1 if info is None else int(info.num_workers)
    last = _LAST.pop(pass_id, None)
    _LAST[pass_id] = int(position)
    while len(_LAST) > _KEEP:
        del _LAST[next(iter(_LAST))]
    if last is None or int(position) == last + stride:
        return
    where = "this process" if info is None else f"DataLoader worker {info.id} of {stride}"
    raise ValueError(
        f"{where} was handed microbatch {position} of epoch {ref.epoch} right after microbatch "
        f"{last} (expected {last + stride}): something between the batch sampler and the "
        f"DataLoader hands it only some of this rank's microbatches. accelerator.prepare(loader) "
        f"does that on n > 1 processes (accelerate's BatchSamplerShard gives process p every "
        f"n-th batch, but the packed sampler already yields only this rank's microbatches: the "
        f"others would never be trained and DDP would hang at the step's gradient sync). "
        f"Prepare the plain DataLoader with balancer.integrations.accelerate.prepare_loader("
        f"accelerator, loader) instead (the HF Trainer integration does so itself)")


def _rebuild(cls, samples, fields, pass_id=None):
    ref = cls.__new__(cls)
    list.__init__(ref, samples)
    ref._left = None
    ref._pass = pass_id
    for k, v in fields.items():
        object.__setattr__(ref, k, v)
    return ref


class Ref(list):
    """A ref of any sampler (the base of :class:`MicrobatchRef` and :class:`HybridRef`):
    typed slots with defaults, pickling that reports leaving the process,
    :meth:`replace` and :meth:`batch_meta`."""

    __slots__ = ("_left", "_pass")
    #: field -> default (None: not known for this ref)
    FIELDS: dict = {}
    #: the fields a collator copies into the batch as they are (when not None)
    BATCH_META: tuple = ()

    def __init__(self, samples=(), **fields):
        super().__init__(samples)
        unknown = sorted(set(fields) - set(self.FIELDS))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {', '.join(unknown)} (its "
                            f"fields: {', '.join(self.FIELDS)})")
        self._left: Optional[Callable[[], None]] = None
        self._pass: Optional[int] = None  # the sampler pass that handed it out
        for k, default in self.FIELDS.items():
            object.__setattr__(self, k, fields.get(k, default))

    def fields(self) -> dict:
        """Every field and its value."""
        return {k: getattr(self, k) for k in self.FIELDS}

    def replace(self, **changes) -> "Ref":
        """A copy with ``changes`` (field names checked)."""
        return type(self)(list(self), **{**self.fields(), **changes})

    def batch_meta(self) -> dict:
        """The :attr:`BATCH_META` fields that are set, for the collated batch."""
        return {k: getattr(self, k) for k in self.BATCH_META if getattr(self, k) is not None}

    def __reduce__(self):
        left = self._left
        if left is not None:  # pickled: on its way to a worker process
            left()
        return _rebuild, (type(self), list(self), self.fields(), self._pass)

    def __copy__(self):
        return _rebuild(type(self), list(self), self.fields())

    def __deepcopy__(self, memo):
        import copy
        return _rebuild(type(self), copy.deepcopy(list(self), memo),
                        copy.deepcopy(self.fields(), memo))


class MicrobatchRef(Ref):
    """Sample ids of one microbatch (``list[int]``) plus, as typed fields (None when unknown):

    * ``starts``/``lengths`` (int64[N]): token range of every document inside its sample
      (None: whole samples);
    * ``sample_lengths`` (int64[N]): the planned token count of each document's whole sample
      (the loader refuses a row of another length: the plan would cut or miss tokens);
    * ``epoch``, ``position`` (index among this rank's microbatches of the epoch), ``step``,
      ``slot`` (index inside this rank's step), ``step_microbatches`` (this rank's microbatches
      in the step, equal on every DP rank), ``mb`` (global microbatch id in the plan);
    * ``loss_tokens``: tokens with a label in this microbatch (each document's length minus 1, or
      its trained tokens when the sampler has ``loss_tokens=``; whole CP group); ``step_loss_tokens``: the same summed over every DP rank and microbatch
      of the step (the loss normaliser, from the plan, no collective);
    * ``cp`` (default 1), ``cp_rank`` (default 0), ``dp_rank``.
    """

    FIELDS = {"starts": None, "lengths": None, "sample_lengths": None, "epoch": None,
              "position": None, "step": None, "slot": None, "step_microbatches": None,
              "mb": None, "loss_tokens": None, "step_loss_tokens": None, "cp": 1,
              "cp_rank": 0, "dp_rank": None}
    __slots__ = tuple(FIELDS)
    BATCH_META = ("epoch", "position", "step", "slot", "step_microbatches", "mb",
                  "step_loss_tokens")

    def __repr__(self):
        return (f"MicrobatchRef(epoch={self.epoch}, step={self.step}, slot={self.slot}, "
                f"samples={list.__repr__(self)})")


class HybridRef(Ref):
    """Sample ids of one rank's items in one round of a hybrid plan (``list[int]``) plus, as
    typed fields: ``starts``/``lengths``/``sample_lengths`` int64[N] (token range of each item
    in its sample, planned sample length), ``sharded`` bool[N] (a zigzag shard of the group's
    document, else whole on this rank), ``group_offset``, ``group_size``, ``group_rank``,
    ``epoch``, ``step``, ``round``, ``step_rounds``, ``position``, ``step_loss_tokens``,
    ``loss_tokens`` (loss targets of these items as the sampler counts them, a sharded item's
    whole document's)."""

    FIELDS = {"starts": None, "lengths": None, "sample_lengths": None, "sharded": None,
              "group_offset": 0, "group_size": 1, "group_rank": 0, "epoch": None,
              "step": None, "round": None, "step_rounds": None, "position": None,
              "step_loss_tokens": None, "loss_tokens": None}
    __slots__ = tuple(FIELDS)
    BATCH_META = ("epoch", "step", "round", "step_rounds", "position", "step_loss_tokens")

    def __repr__(self):
        return (f"HybridRef(epoch={self.epoch}, step={self.step}, round={self.round}, group="
                f"{self.group_offset}+{self.group_size}, samples={list.__repr__(self)})")


__all__ = ["HybridRef", "MicrobatchRef", "Ref", "check_handed_in_order", "next_pass"]
