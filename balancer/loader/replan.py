"""Re-planning a :class:`~balancer.loader.sampler.PackedBatchSampler`'s epoch from a point on
with a new cost model: the closed loop's refit (issue #26, :mod:`balancer.loader.online`).

The sampler plans every epoch in windows (``PlannerConfig.window_samples``); a refit appends
``(epoch, first window, model)`` to its list, and window ``w`` of epoch ``e`` is planned with
the newest model at or before ``(e, w)`` (:func:`balancer.planning.planner.plan_epoch_windows`),
so the windows already handed out stay as they were and a resumed sampler, given the list from
the checkpoint, makes the same plan."""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..cost.model import CostModel


class Replanning:
    """The sampler's refit methods (mixed into
    :class:`~balancer.loader.sampler.PackedBatchSampler`, whose ``_refits``, ``_window_steps``,
    ``_source``, ``_carry``, ``cursor`` and ``plan`` they use)."""

    def _window_cost(self, epoch: int) -> Callable[[int], CostModel]:
        """Window -> the model it is planned with: the newest refit at or before it."""
        def cost(window: int) -> CostModel:
            model = self.cost
            for e, w, m in self._refits:
                if (e, w) <= (epoch, window):
                    model = m
            return model
        return cost

    def handed_out_steps(self) -> int:
        """Steps of the current epoch of which this rank has handed out a microbatch (a
        DataLoader's workers read ahead of the training loop: these are planned for good)."""
        pos = self.cursor.position
        self.plan
        return 0 if pos == 0 else int(self._my_step[pos - 1]) + 1

    def refit(self, model: CostModel, from_step: int) -> int:
        """Plan the current epoch's windows that start at or after step ``from_step`` (and
        every later epoch) with ``model``; returns the first re-planned step (the epoch's step
        count when no window is left: the model then starts with the next epoch). Every rank
        must call it with the same model and ``from_step`` (at least every rank's
        :meth:`handed_out_steps`); the model becomes part of :meth:`state_dict`. A sampler on a
        stored plan (``plan_dir=``, ``plan=``) switches to planning in memory, which needs
        ``samples`` and ``cost`` (the store's model) and a stored epoch equal to what the planner
        makes from them (checked by fingerprint)."""
        if not isinstance(model, CostModel):
            raise TypeError(f"refit takes a CostModel, got {type(model).__name__}")
        if self._source is not None:
            self._plan_in_memory()
        handed = self.handed_out_steps()
        if from_step < handed:
            raise ValueError(f"refit from step {from_step}: this rank has handed out "
                             f"microbatches of steps up to {handed - 1} already")
        ws, old = self._window_steps, self._plan
        first = int(np.searchsorted(ws[:-1], from_step, side="left"))
        later = {e: c for e, c in self._carry.items() if e > self.epoch}
        for e in later:  # later epochs' tails are re-planned
            del self._carry[e]
        while True:
            self._refits.append((self.epoch, first, model))
            self._plan = None
            try:
                self.plan
                break
            except ValueError:
                # a window the new costs cannot plan (a windowed tail the packer refuses): the
                # same on every rank, so every rank moves the refit one window on alike
                self._refits.pop()
                if first >= len(ws) - 1:
                    self._plan, self._window_steps = old, ws
                    self._carry.update(later)
                    self._index_plan(old)
                    raise
                first += 1
        self.cursor.resized()
        return int(ws[first])

    def _plan_in_memory(self) -> None:
        """Leave a stored plan for in-memory planning (a refit from a point on): the current
        epoch planned here must be the stored one, bit for bit."""
        if self.samples is None or self.cost is None:
            raise ValueError("a refit of a stored plan (plan=, plan_dir=) re-plans the rest in "
                             "memory: give the sampler samples and cost (the store's cost "
                             "model) too")
        stored, source, plan = self.plan_fingerprint, self._source, self._plan
        refits, self._refits = self._refits, []
        self._source, self._plan = None, None
        try:
            here = self.plan_fingerprint
        finally:
            self._refits = refits
        if here != stored:
            self._source, self._plan = source, plan
            self._index_plan(plan)
            raise ValueError(f"cannot refit the stored plan: epoch {self.epoch} planned here "
                             f"from the sampler's samples, cost {self.cost.name!r} and the "
                             f"store's config is {here}, the store holds {stored}")

    @property
    def refits(self) -> list[tuple[int, int, CostModel]]:
        """``(epoch, first window, model)`` of every refit applied, oldest first."""
        return list(self._refits)


__all__ = ["Replanning"]
