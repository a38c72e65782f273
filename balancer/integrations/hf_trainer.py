"""``transformers.Trainer`` / ``trl.SFTTrainer`` on the packed loader: one optimizer step per
planned global batch, the loss normalised by the plan's step token count.

::

    class PackedTrainer(PackedTrainerMixin, Trainer): ...          # or (PackedTrainerMixin, SFTTrainer)

    trainer = PackedTrainer(model=model, args=TrainingArguments(
                                gradient_accumulation_steps=layout.microbatches, ...),
                            train_dataset=ds, packed_sampler=sampler)   # ds: token ids per row
    trainer.train()

What the mixin changes, and why:

* ``get_train_dataloader`` builds ``DataLoader(PackedDataset(train_dataset),
  batch_sampler=packed_sampler, collate_fn=...)`` (a ``datasets.Dataset`` with an ``input_ids``
  column, or anything :class:`~balancer.loader.collate.PackedDataset` reads; for ``SFTTrainer`` pass
  ``SFTConfig(dataset_kwargs={"skip_prepare_dataset": True})``) and prepares it with :func:`balancer.integrations.accelerate.prepare_loader`
  (``accelerator.prepare`` would re-shard the per-rank sampler and drop microbatches); every
  batch is :func:`balancer.integrations.hf.model_inputs` (``use_cache=False``: exact per
  document) plus a ``"balancer"`` entry with the microbatch's place in the plan;
* ``get_batch_samples`` takes the Trainer's ``gradient_accumulation_steps`` batches, checks that
  they are exactly the microbatches of one planned step (raises otherwise: nothing is skipped or
  regrouped silently), and returns the plan's ``step_loss_tokens`` as ``num_items_in_batch``
  (no collective), so the loss is the token sum over the global batch divided by its labelled
  tokens on any number of processes;
* at every epoch end it checks that the Trainer consumed every microbatch of the epoch (the
  Trainer sizes epochs by ``len()`` of the first; a plan whose epochs differ is refused).

``gradient_accumulation_steps`` must equal ``layout.microbatches`` (steps shorter than that only
at the end of an epoch), ``layout.cp == 1`` and ``average_tokens_across_devices`` may be either.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..loader.collate import PackedCollator, PackedDataset
from .accelerate import prepare_loader
from .hf import model_inputs

META = "balancer"


class HFPackedCollator:
    """``collate_fn``: :class:`~balancer.loader.collate.PackedCollator` then
    :func:`balancer.integrations.hf.model_inputs` (positions route), with the plan metadata under
    ``"balancer"`` (epoch, position, step, slot, step_microbatches, step_loss_tokens,
    sample_ids, sample_starts, lengths)."""

    def __init__(self, collator: Optional[PackedCollator] = None):
        self.collator = collator or PackedCollator()

    def __call__(self, fetched) -> dict:
        b = self.collator(fetched)
        out = model_inputs(b)
        meta = {k: b[k] for k in ("epoch", "position", "step", "slot", "step_microbatches",
                                  "step_loss_tokens") if k in b}
        meta["sample_ids"] = b["sample_ids"]
        meta["sample_starts"] = b["sample_starts"]
        meta["lengths"] = torch.diff(torch.as_tensor(b["cu_seqlens"]).long())
        out[META] = meta
        return out


def causal_lm_loss(outputs, labels, num_items_in_batch=None):
    """``Trainer(compute_loss_func=causal_lm_loss)``: token-sum next-token cross entropy in the
    logits' own dtype divided by ``num_items_in_batch`` (transformers' loss computes in float32,
    which is ~1e-9 off a float64 reference; the value is the same otherwise)."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    lab = labels[..., 1:].reshape(-1)
    total = torch.nn.functional.cross_entropy(
        logits[..., :-1, :].reshape(lab.shape[0], -1), lab.to(logits.device), ignore_index=-100,
        reduction="sum")
    n = (lab != -100).sum() if num_items_in_batch is None else num_items_in_batch
    return total / torch.as_tensor(n, device=total.device).clamp(min=1)


class PackedTrainerMixin:
    """Mix in before ``Trainer`` (or ``SFTTrainer``); see the module docstring.
    ``packed_history`` (list of the consumed microbatches' metadata) is kept when
    ``keep_history=True``."""

    def __init__(self, *args, packed_sampler, packed_collator: Optional[PackedCollator] = None,
                 tokens_column: str = "input_ids", keep_history: bool = False, **kwargs):
        self.packed_sampler = packed_sampler
        self.packed_tokens_column = tokens_column
        self.packed_collate = HFPackedCollator(packed_collator)
        self.packed_history = [] if keep_history else None
        self._packed_consumed: dict = {}
        super().__init__(*args, **kwargs)
        layout = packed_sampler.layout
        ga = self.args.gradient_accumulation_steps
        if layout.cp != 1:
            raise ValueError("HF models take unsharded microbatches: the layout needs cp == 1")
        if ga != layout.microbatches:
            raise ValueError(f"gradient_accumulation_steps is {ga} but the plan has "
                             f"{layout.microbatches} microbatches per rank and step: set "
                             f"TrainingArguments(gradient_accumulation_steps={layout.microbatches})")
        if self.args.world_size != layout.dp:
            raise ValueError(f"the Trainer runs {self.args.world_size} processes but the layout "
                             f"has dp={layout.dp}")
        from transformers import Trainer
        own_loss = type(self).compute_loss is not Trainer.compute_loss
        if not (getattr(self, "model_accepts_loss_kwargs", False) or own_loss
                or self.compute_loss_func is not None):
            raise ValueError("the model does not take num_items_in_batch, so the Trainer would "
                             "average the loss per microbatch; give compute_loss_func=")
        self.add_callback(_EpochCoverage(self))

    # ---- data -----------------------------------------------------------------------------
    def get_train_dataloader(self):
        args = self.args
        self._check_epoch_lengths()
        kw = {}
        if args.dataloader_num_workers > 0:
            kw = {"prefetch_factor": args.dataloader_prefetch_factor,
                  "persistent_workers": args.dataloader_persistent_workers}
        ds = self.train_dataset
        if not isinstance(ds, PackedDataset):  # e.g. a tokenized datasets.Dataset (TRL wants one)
            ds = PackedDataset(ds, tokens_column=self.packed_tokens_column)
        loader = torch.utils.data.DataLoader(
            ds, batch_sampler=self.packed_sampler, collate_fn=self.packed_collate,
            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory, **kw)
        return prepare_loader(self.accelerator, loader)

    def _check_epoch_lengths(self):
        """The Trainer sizes every epoch by ``len()`` of the first and steps the optimizer every
        ``gradient_accumulation_steps`` batches: refuse plans it would cut wrongly."""
        s = self.packed_sampler
        epochs = 1 if self.args.max_steps > 0 else max(1, math.ceil(self.args.num_train_epochs))
        first, position, lengths = s.epoch, s._position, []
        for e in range(first, first + epochs):
            if e != s.epoch:
                s.set_epoch(e)
            plan = s.plan
            short = [int(x) for x in plan.short_steps if x != plan.n_steps - 1]
            if short:
                raise ValueError(f"epoch {e}: steps {short[:5]} have fewer than "
                                 f"{s.layout.microbatches} microbatches per rank; the Trainer "
                                 "groups batches by gradient_accumulation_steps and would mix "
                                 "steps (plan without windows, or train with an explicit loop)")
            lengths.append(len(s))
        if first != s.epoch:
            s.set_epoch(first)
            s._position = position  # keep a restored position
        if len(set(lengths)) > 1:
            raise ValueError(f"the plan's epochs have {lengths} microbatches per rank but the "
                             "Trainer sizes every epoch by the first; give PlannerConfig("
                             "global_batch_samples=...) so every epoch has as many steps, or "
                             "call trainer.train() per epoch")

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batches:
            return batches, None
        metas = [b.pop(META) for b in batches]
        m0 = metas[0]
        steps = {int(m["step"]) for m in metas}
        slots = [int(m["slot"]) for m in metas]
        if len(steps) != 1 or slots != list(range(int(m0["step_microbatches"]))):
            raise ValueError(
                f"the Trainer grouped microbatches of steps {sorted(steps)} (slots {slots}) into one "
                f"optimizer step; one step must be the {int(m0['step_microbatches'])} microbatches "
                "of one planned step (gradient_accumulation_steps = layout.microbatches, loader "
                "not re-sharded)")
        for m in metas:
            key = int(m["epoch"])
            self._packed_consumed[key] = self._packed_consumed.get(key, 0) + 1
            if self.packed_history is not None:
                self.packed_history.append(m)
        total = float(m0["step_loss_tokens"])
        if not self.args.average_tokens_across_devices:
            total /= self.accelerator.num_processes  # the Trainer then does not rescale the loss
        return batches, torch.tensor(total, dtype=torch.float64 if total % 1 else torch.int64,
                                     device=device)


def _epoch_coverage_check(trainer, epoch: int) -> None:
    s = trainer.packed_sampler
    got = trainer._packed_consumed.get(epoch, 0)
    if trainer.args.max_steps > 0:
        return  # a step count was asked for, not whole epochs
    if s.epoch == epoch and got != len(s):
        raise RuntimeError(f"epoch {epoch}: the Trainer trained {got} of this rank's {len(s)} "
                           "microbatches")


def _make_callback():
    from transformers import TrainerCallback

    class EpochCoverage(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_epoch_end(self, args, state, control, **kwargs):
            epoch = self.trainer.packed_sampler.epoch
            _epoch_coverage_check(self.trainer, epoch)

    return EpochCoverage


def _EpochCoverage(trainer):
    return _make_callback()(trainer)
