"""The plan's epochs in ``transformers.Trainer`` for
:class:`~balancer.integrations.hf_trainer.PackedTrainerMixin`: run size, epoch lengths and
resuming from a checkpoint, all read from the plan.

* ``train()`` plans the epochs it will run (all of ``num_train_epochs``, or as many as
  ``max_steps`` reaches) and tells the Trainer each epoch's own step count
  (:meth:`PackedEpochsMixin.set_initial_training_values`, :meth:`~PackedEpochsMixin._run_epoch`),
  so epochs of different lengths, ``max_steps`` crossing epochs and an lr schedule over the
  whole run are exact (``state.max_steps`` is the planned step total);
* ``resume_from_checkpoint`` locates the checkpoint's ``global_step`` in the plan's epochs and
  puts the sampler at that epoch's next planned step through its own state (no batch is read
  to be skipped, with or without ``ignore_data_skip``);
* at every epoch end it checks that the Trainer consumed every microbatch of the epoch (whole
  steps only when the run stopped early: ``max_steps``, ``should_training_stop``).

It wraps private methods of the Trainer (``_run_epoch``, ``_init_training_state``,
``set_initial_training_values``): :func:`_check_hooks` checks their signatures when the
trainer is built and names the transformers versions they were written for.
"""
from __future__ import annotations

import inspect
import math
from typing import Optional

import numpy as np

#: the Trainer's methods the epoch hooks wrap, with the parameters they pass on by name
_HOOKS = {"_run_epoch": ("epoch", "steps_in_epoch", "num_update_steps_per_epoch",
                         "resume_from_checkpoint", "epochs_trained"),
          "_init_training_state": ("max_steps", "num_update_steps_per_epoch", "num_train_epochs",
                                   "resume_from_checkpoint", "trial"),
          "set_initial_training_values": ("args", "dataloader")}


class PackedEpochsMixin:
    """The epoch and resume bookkeeping (see the module docstring); the consumed microbatches
    are counted by :meth:`PackedTrainerMixin.get_batch_samples` into ``_packed_consumed``."""

    def _packed_epochs_init(self) -> None:
        self._packed_consumed: dict = {}  # epoch -> microbatches the Trainer consumed
        self._packed_start: dict = {}  # epoch -> this rank's position the epoch started at
        self._packed_steps: dict = {}  # epoch -> int64[n_steps] this rank's microbatches per step
        self._packed_resume: Optional[tuple] = None  # (epoch, step) a checkpoint resumes at

    def packed_epoch_steps(self, epoch: int) -> np.ndarray:
        """int64[n_steps]: this rank's microbatches in every planned step of ``epoch`` (equal
        on every DP rank); the plan is built once and cached (the sampler does not move)."""
        if epoch not in self._packed_steps:
            s = self.packed_sampler
            plan = s.plan if epoch == s.epoch else s._build(epoch)
            if plan.n_steps == 0:
                raise ValueError(f"epoch {epoch}'s plan has no step: nothing to train")
            self._packed_steps[epoch] = np.asarray(plan.step_mbs, np.int64)
        return self._packed_steps[epoch]

    def _packed_locate(self, global_step: int) -> tuple[int, int]:
        """(epoch, step in it) of the ``global_step``-th planned step (0-based)."""
        epoch = 0
        while global_step >= len(self.packed_epoch_steps(epoch)):
            global_step -= len(self.packed_epoch_steps(epoch))
            epoch += 1
        return epoch, global_step

    def set_initial_training_values(self, args, dataloader):
        """The Trainer's run size from the plan: ``max_steps`` is the planned steps of the
        epochs to run (``num_train_epochs``; a fraction takes that share of the last epoch's
        steps), or ``args.max_steps`` over as many epochs as it reaches."""
        (epochs, per_epoch, examples, train_samples, batch_size, steps_in_epoch,
         max_steps) = super().set_initial_training_values(args, dataloader)
        n = lambda e: len(self.packed_epoch_steps(e))  # noqa: E731
        if args.max_steps > 0:
            max_steps, total, epochs = args.max_steps, 0, 0
            while total < max_steps:
                total, epochs = total + n(epochs), epochs + 1
        else:
            whole = int(args.num_train_epochs)
            frac = args.num_train_epochs - whole
            max_steps = sum(n(e) for e in range(whole)) + (math.ceil(frac * n(whole)) if frac
                                                           else 0)
            epochs = math.ceil(args.num_train_epochs)
        ga = args.gradient_accumulation_steps
        return (epochs, n(0), examples, train_samples, batch_size, n(0) * ga, max_steps)

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs,
                             resume_from_checkpoint, trial):
        """A restored ``global_step`` is located in the plan's epochs (the Trainer would divide
        it by the first epoch's length)."""
        epochs_trained, skip = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
            trial)
        self._packed_resume = None
        if resume_from_checkpoint is not None and self.state.global_step > 0:
            epochs_trained, step = self._packed_locate(self.state.global_step)
            self._packed_resume = (epochs_trained, step)
            skip = 0 if self.args.ignore_data_skip else step * self.args.gradient_accumulation_steps
        return epochs_trained, skip

    def _run_epoch(self, **kw):
        """One epoch with its own step count; a resumed epoch starts at its checkpoint's step
        (the sampler is positioned there: nothing is read to be skipped)."""
        epoch, ga = kw["epoch"], self.args.gradient_accumulation_steps
        n = len(self.packed_epoch_steps(epoch))
        start = 0
        if (self._packed_resume is not None and self._packed_resume[0] == epoch
                and kw.get("resume_from_checkpoint") is not None
                and kw.get("epochs_trained") == epoch):
            start = self._packed_resume[1]
        self._packed_seek(epoch, start)
        # without ignore_data_skip the Trainer counts the skipped steps itself (its
        # get_resumed_dataloader is a no-op here); with it, it starts at 0: give it the rest
        left = n - start if self.args.ignore_data_skip else n
        kw.update(steps_in_epoch=left * ga, num_update_steps_per_epoch=left)
        super()._run_epoch(**kw)
        self._packed_check_epoch(epoch)

    def _packed_seek(self, epoch: int, step: int) -> None:
        """Put the sampler at ``epoch``'s ``step``-th planned step (through its own state, so
        the Trainer's ``set_epoch(epoch)`` keeps the position)."""
        s = self.packed_sampler
        position = int(self.packed_epoch_steps(epoch)[:step].sum())
        self._packed_start[epoch] = position
        self._packed_consumed[epoch] = 0
        if s.epoch != epoch or position:
            s.set_epoch(epoch)
            if position:
                state = s.state_dict()
                state["position"] = position
                s.load_state_dict(state)

    def get_resumed_dataloader(self, dataloader, num_batches):
        """The sampler already stands at the checkpoint's step (:meth:`_run_epoch`): reading
        ``num_batches`` batches to skip them would skip them twice."""
        return dataloader

    def _packed_check_epoch(self, epoch: int) -> None:
        c = self.control
        if c.should_training_stop or c.should_epoch_stop:
            return  # stopped early: whole steps only (get_batch_samples), none mixed
        got = self._packed_start.get(epoch, 0) + self._packed_consumed.get(epoch, 0)
        n = int(self.packed_epoch_steps(epoch).sum())
        if got != n:
            raise RuntimeError(f"epoch {epoch}: the Trainer trained {got} of this rank's {n} "
                               "microbatches")


def _check_hooks(trainer_cls) -> None:
    """The Trainer's private methods the epoch hooks wrap must take what they pass on."""
    for name, params in _HOOKS.items():
        fn = getattr(trainer_cls, name, None)
        have = set(inspect.signature(fn).parameters) if fn is not None else set()
        missing = [p for p in params if p not in have]
        if missing:
            import transformers
            raise RuntimeError(
                f"transformers {transformers.__version__}: Trainer.{name} "
                f"{'is missing' if fn is None else f'lacks {missing}'}; PackedTrainerMixin's "
                "epoch hooks were written for transformers 5.24-5.25")
