"""The sampler <-> collator contract: what a batch sampler yields for one microbatch.

A ref is a ``list`` of sample ids (so it honours the DataLoader's ``batch_sampler`` contract and
reaches ``dataset.__getitems__`` untouched, pickled with its fields to workers) plus a fixed
set of typed fields. The fields are slots: constructing a ref with a field the class does not
have, or assigning one, is an error, so a misspelt name can never drop a key of the batch
silently (the collators read the fields themselves, not names with ``getattr`` defaults).

A ref records when it leaves the process (pickled to a DataLoader worker): its sampler then
knows a worker reads ahead of the training loop (:mod:`balancer.loader.cursor`). Copies made
with :mod:`copy` do not count as leaving.
"""
from __future__ import annotations

from typing import Callable, Optional


def _rebuild(cls, samples, fields):
    ref = cls.__new__(cls)
    list.__init__(ref, samples)
    ref._left = None
    for k, v in fields.items():
        object.__setattr__(ref, k, v)
    return ref


class Ref(list):
    """A ref of any sampler (the base of :class:`MicrobatchRef` and :class:`HybridRef`):
    typed slots with defaults, pickling that reports leaving the process,
    :meth:`replace` and :meth:`batch_meta`."""

    __slots__ = ("_left",)
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
        return _rebuild, (type(self), list(self), self.fields())

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


__all__ = ["HybridRef", "MicrobatchRef", "Ref"]
