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
* the Trainer's epochs follow the plan's: ``train()`` plans the epochs it will run (all of
  ``num_train_epochs``, or as many as ``max_steps`` reaches) and tells the Trainer each epoch's
  own step count, so epochs of different lengths, ``max_steps`` crossing epochs and an lr
  schedule over the whole run are exact (``state.max_steps`` is the planned step total). A step
  with fewer than ``gradient_accumulation_steps`` microbatches (the last of an epoch, a window's
  end) is handed to the Trainer padded in front with placeholder batches that
  :meth:`~PackedTrainerMixin.training_step` skips (no forward, no gradient), so the Trainer's
  grouping and its one optimizer step per group stay on the plan's steps;
* ``resume_from_checkpoint`` resumes at the next planned step of the checkpoint's epoch, found
  from ``global_step`` and the plan (no batch is read to skip, with or without
  ``ignore_data_skip``: both resume the uninterrupted run's sample stream); the epochs and
  resuming live in :mod:`balancer.integrations.hf_epochs`;
* ``evaluate()`` packs the eval set with a plan of its own and reports ``eval_loss`` as the
  exact token mean over every eval document (:mod:`balancer.integrations.hf_eval`);
* at every epoch end it checks that the Trainer consumed every microbatch of the epoch (whole
  steps only when the run stopped early: ``max_steps``, ``should_training_stop``);
* ``packed_online=OnlineConfig(refit=False, every=K)`` times every microbatch's
  ``training_step`` (forward + backward; CUDA events on a GPU) and every K steps logs, per step,
  the predicted vs measured step time and DP imbalance through ``Trainer.log`` (keys
  ``balancer/...``: TensorBoard, W&B), and as JSON lines to ``packed_online_jsonl``
  (:mod:`balancer.loader.online`). Refitting is refused here: the Trainer fixes every epoch's
  step count when ``train()`` starts, and a refit re-plans them.

"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..loader.collate import PackedCollator, PackedDataset
from .accelerate import prepare_loader
from .hf import model_inputs
from .hf_epochs import _HOOKS, PackedEpochsMixin, _check_hooks  # noqa: F401 (importable here)
from .hf_eval import PackedEvalMixin

META = "balancer"
#: dataset columns that carry a training signal (which tokens are trained)
LOSS_COLUMNS = ("labels", "completion_mask", "assistant_masks")
class StepPad(dict):
    """A placeholder batch in front of a step with fewer microbatches than
    ``gradient_accumulation_steps``: :meth:`PackedTrainerMixin.training_step` skips it (no
    forward, no backward), so it changes no gradient; its empty ``input_ids`` count no token or
    FLOP."""


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


class PackedTrainerMixin(PackedEpochsMixin, PackedEvalMixin):
    """Mix in before ``Trainer`` (or ``SFTTrainer``); see the module docstring. The plan's
    epochs and resuming are :class:`~balancer.integrations.hf_epochs.PackedEpochsMixin`'s,
    ``evaluate()`` is :class:`~balancer.integrations.hf_eval.PackedEvalMixin`'s; this class
    builds the loader, groups each planned step for the Trainer and times it.
    ``packed_history`` (list of the consumed microbatches' metadata) is kept when
    ``keep_history=True``; ``packed_eval_sampler`` packs the eval set for ``evaluate()``
    (default: planned from ``packed_sampler``'s cost and layout, see
    :mod:`balancer.integrations.hf_eval`)."""

    def __init__(self, *args, packed_sampler, packed_collator: Optional[PackedCollator] = None,
                 tokens_column: str = "input_ids", labels_column: Optional[str] = None,
                 loss_mask_column: Optional[str] = None, token_columns=(),
                 keep_history: bool = False, packed_eval_sampler=None, packed_online=None,
                 packed_online_jsonl=None, **kwargs):
        self.packed_sampler = packed_sampler
        self._packed_eval_init(packed_eval_sampler)
        self.packed_tokens_column = tokens_column
        self.packed_columns = {"labels_column": labels_column,
                               "loss_mask_column": loss_mask_column,
                               "token_columns": tuple(token_columns)}
        self.packed_collate = HFPackedCollator(packed_collator)
        train = kwargs.get("train_dataset")
        if (kwargs.get("data_collator") is None and train is not None
                and set(_column_names(train)) & set(LOSS_COLUMNS)):
            # the packed collator is the one that batches the training data, and it honours
            # the masks: TRL refuses a mask column without labels for its own collator, which
            # would ignore it (skip_prepare_dataset=True)
            kwargs["data_collator"] = self.packed_collate
        self.packed_history = [] if keep_history else None
        self._packed_epochs_init()
        super().__init__(*args, **kwargs)
        layout = packed_sampler.layout
        ga = self.args.gradient_accumulation_steps
        if layout.cp != 1:
            raise ValueError(f"the layout has cp={layout.cp} (cp_mode={layout.cp_mode!r}); HF "
                             f"models take whole, unsharded microbatches, so the Trainer "
                             f"integration needs cp == 1: run CP in a loop that shards "
                             f"attention itself (torchtitan-style, Megatron; "
                             f"docs/integrations.md)")
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
        _check_hooks(Trainer)
        self.packed_online = None
        if packed_online is not None:
            self._packed_online_init(packed_online, packed_online_jsonl)

    # ---- the closed loop's measurement (balancer.loader.online) ----------------------------
    def _packed_online_init(self, config, jsonl) -> None:
        from collections import deque
        from transformers import TrainerCallback
        from ..loader.online import OnlineCalibrator
        from ..loader.timing import MicrobatchTimer
        if config.refit:
            raise ValueError("packed_online: the HF Trainer fixes every epoch's step count when "
                             "train() starts and a refit re-plans them; give "
                             "OnlineConfig(refit=False) to measure and log (or refit in a "
                             "plain loop, balancer.loader.online)")
        self.packed_online = OnlineCalibrator(self.packed_sampler,
                                              MicrobatchTimer(self.args.device), config,
                                              jsonl=jsonl)
        self._packed_timed: deque = deque()  # (step, document lengths) of the batches handed
        trainer = self

        class _Log(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                online = trainer.packed_online
                if state.global_step and online.steps_done == 0 and not online.obs.step:
                    # resumed from a checkpoint: its steps go on from the Trainer's (the
                    # refit cadence and the logged balancer/step), not from 0
                    online.steps_done = int(state.global_step)

            def on_step_end(self, args, state, control, **kw):
                for r in trainer.packed_online.step_done():
                    if r["type"] == "step":
                        trainer.log({"balancer/step": r["step"],
                                     "balancer/measured_step_s": max(r["measured_s"]),
                                     "balancer/predicted_step_s": max(r["predicted_s"]),
                                     "balancer/imbalance_measured": r["imbalance_measured"],
                                     "balancer/imbalance_predicted": r["imbalance_predicted"],
                                     "balancer/prediction_error": r["prediction_error"]})
        self.add_callback(_Log())

    # ---- data -----------------------------------------------------------------------------
    def get_train_dataloader(self):
        args = self.args
        kw = {}
        if args.dataloader_num_workers > 0:
            kw = {"prefetch_factor": args.dataloader_prefetch_factor,
                  "persistent_workers": args.dataloader_persistent_workers}
        ds = self.packed_dataset(self.train_dataset)
        trained = getattr(ds, "labels_column", None) or getattr(ds, "loss_mask_column", None)
        if trained and getattr(self.packed_sampler, "loss_tokens", None) is None:
            raise ValueError(
                f"the training set trains only some tokens (column {trained!r}) but "
                f"packed_sampler counts every token, so num_items_in_batch would be wrong: build "
                f"it with PackedBatchSampler(..., loss_tokens=PackedDataset(train_dataset, "
                f"{'labels_column' if ds.labels_column else 'loss_mask_column'}={trained!r})"
                f".loss_tokens())")
        loader = torch.utils.data.DataLoader(
            ds, batch_sampler=self.packed_sampler, collate_fn=self.packed_collate,
            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory, **kw)
        return prepare_loader(self.accelerator, loader)

    def packed_dataset(self, dataset) -> PackedDataset:
        """``dataset`` wrapped for the packed loader with the training signal it carries
        (:meth:`packed_loss_columns`); a :class:`PackedDataset` is used as it is."""
        if isinstance(dataset, PackedDataset):
            return dataset
        kw = {k: v for k, v in self.packed_loss_columns(dataset).items() if v}
        return PackedDataset(dataset, tokens_column=self.packed_tokens_column, **kw)

    def packed_loss_columns(self, dataset) -> dict:
        """``labels_column`` / ``loss_mask_column`` / ``token_columns`` for ``dataset``: the
        ones given to the mixin; else the dataset's ``labels`` column (token ids, -100 where
        not trained: the Hugging Face convention, which TRL also leaves as it is); else, for
        an ``SFTTrainer``, the mask its config asks for: ``completion_mask`` with
        ``completion_only_loss`` (``None``: when the column is there), ``assistant_masks``
        with ``assistant_only_loss`` (and whenever present, as TRL does). A flag whose column
        is missing is an error (``skip_prepare_dataset=True`` skips TRL's building of it),
        and so are both masks at once (give a ``labels`` column)."""
        cols = dict(self.packed_columns)
        if cols["labels_column"] or cols["loss_mask_column"]:
            return cols
        names = set(_column_names(dataset))
        if "labels" in names:
            return {**cols, "labels_column": "labels"}
        masks = []
        completion = getattr(self, "completion_only_loss", None)  # SFTTrainer resolves None
        if completion is None:
            completion = getattr(self.args, "completion_only_loss", False)
        if completion and "completion_mask" in names:
            masks.append("completion_mask")
        elif completion is True and getattr(self.args, "completion_only_loss", None) is True:
            raise ValueError("completion_only_loss=True but the dataset has no 'completion_mask' "
                             "column (0 on the prompt, 1 on the completion); "
                             "skip_prepare_dataset=True skips TRL's building of it")
        if getattr(self.args, "assistant_only_loss", False) or "assistant_masks" in names:
            if "assistant_masks" not in names:
                raise ValueError("assistant_only_loss=True but the dataset has no "
                                 "'assistant_masks' column: tokenize it with tokenizer."
                                 "apply_chat_template(messages, return_dict=True, "
                                 "return_assistant_tokens_mask=True)")
            masks.append("assistant_masks")
        if len(masks) > 1:
            raise ValueError(f"the dataset has {masks}, both of which the config applies; the "
                             f"packed loader takes one mask: give a 'labels' column (-100 "
                             f"where either mask is 0) or loss_mask_column=")
        return {**cols, "loss_mask_column": masks[0] if masks else None}

    # ---- steps ----------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The microbatches of the next planned step (``num_batches`` is the Trainer's guess),
        padded in front with :class:`StepPad` s to ``gradient_accumulation_steps``, and the
        plan's ``step_loss_tokens`` as ``num_items_in_batch``."""
        try:
            batches = [next(epoch_iterator)]
        except StopIteration:
            return [], None
        k = int(batches[0][META]["step_microbatches"])
        for _ in range(k - 1):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        metas = [b.pop(META) for b in batches]
        m0 = metas[0]
        steps = {(int(m["epoch"]), int(m["step"])) for m in metas}
        slots = [int(m["slot"]) for m in metas]
        if len(steps) != 1 or slots != list(range(k)):
            raise ValueError(
                f"the loader handed the Trainer microbatches of steps {sorted(steps)} (slots "
                f"{slots}) for one optimizer step; one step must be the {k} microbatches of one "
                "planned step (loader not re-sharded, sampler not moved during the epoch)")
        if self.packed_online is not None:
            for m in metas:  # the documents of each microbatch (cp is 1 here)
                self._packed_timed.append((int(m["step"]), np.asarray(m["lengths"], np.int64)))
        for m in metas:
            key = int(m["epoch"])
            self._packed_consumed[key] = self._packed_consumed.get(key, 0) + 1
            if self.packed_history is not None:
                self.packed_history.append(m)
        total = float(m0["step_loss_tokens"])
        if not self.args.average_tokens_across_devices:
            total /= self.accelerator.num_processes  # the Trainer then does not rescale the loss
        pads = [StepPad(input_ids=torch.zeros((1, 0), dtype=torch.long, device=device))
                for _ in range(self.args.gradient_accumulation_steps - k)]
        # pads first: the last batch of the group is a real one, which the Trainer runs outside
        # no_sync (the gradient all-reduce) and after which it steps the optimizer
        return pads + batches, torch.tensor(
            total, dtype=torch.float64 if total % 1 else torch.int64, device=device)

    def training_step(self, model, inputs, *args, **kwargs):
        if isinstance(inputs, StepPad):
            return torch.zeros((), device=self.args.device)
        if self.packed_online is None:
            return super().training_step(model, inputs, *args, **kwargs)
        step, lengths = self._packed_timed.popleft()
        timer = self.packed_online.timer
        timer.begin(lengths, step=step)
        out = super().training_step(model, inputs, *args, **kwargs)
        timer.end()
        return out


def _column_names(dataset) -> list:
    names = getattr(dataset, "column_names", None)
    return list(names) if isinstance(names, (list, tuple)) else []
