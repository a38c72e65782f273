"""``trainer.evaluate()`` for :class:`~balancer.integrations.hf_trainer.PackedTrainerMixin`: the
eval set packed like the training set, and ``eval_loss`` the exact token mean.

The Trainer's own eval loader batches rows with its default collator, which cannot stack token
lists of different lengths (a raw torch error). Here every eval dataset gets a
:class:`~balancer.PackedBatchSampler` of its own: ``packed_eval_sampler=`` when given, else one
planned from the training sampler's cost model, layout and config over the eval rows' lengths
(``tail='partial'``: no eval document is dropped or carried). Every DP rank evaluates its
microbatches of that plan (as many on every rank, so the Trainer's per-batch gathers line up),
each document exactly once over the ranks, documents never attending to each other.

``eval_loss`` is the summed next-token loss over every eval document divided by their labelled
tokens (all ranks; the unpacked reference's value), not the Trainer's mean of per-batch means.
"""
from __future__ import annotations

import numpy as np
import torch

from ..loader.collate import PackedDataset

META = "balancer"


def row_lengths(dataset, tokens_column: str = "input_ids") -> np.ndarray:
    """int64[n]: the token count of every row (Arrow list lengths for a ``datasets.Dataset``)."""
    offsets = getattr(dataset, "offsets", None)
    if offsets is not None:  # FlatTokens
        return np.diff(np.asarray(offsets, np.int64))
    if hasattr(dataset, "with_format") and hasattr(dataset, "column_names"):
        import pyarrow.compute as pc
        col = dataset.select_columns([tokens_column]).with_format("arrow")[:][tokens_column]
        return np.asarray(pc.list_value_length(col).to_numpy(zero_copy_only=False), np.int64)
    packed = dataset if isinstance(dataset, PackedDataset) else PackedDataset(dataset,
                                                                              tokens_column)
    return np.array([len(packed[i]) for i in range(len(packed))], np.int64)


class PackedEvalMixin:
    """The evaluation half of :class:`~balancer.integrations.hf_trainer.PackedTrainerMixin`."""

    def _packed_eval_init(self, packed_eval_sampler) -> None:
        self.packed_eval_sampler = packed_eval_sampler
        self._packed_eval_samplers: dict = {}  # id(eval dataset) -> (dataset, sampler)
        self._packed_eval_sum = None  # [token loss sum, labelled tokens] of the running eval

    def packed_eval_sampler_for(self, dataset):
        """The sampler packing ``dataset`` (built once per dataset)."""
        if self.packed_eval_sampler is not None:
            return self.packed_eval_sampler
        key = id(dataset)
        if key not in self._packed_eval_samplers:
            from ..loader.sampler import PackedBatchSampler
            from ..samples import SampleTable
            s = self.packed_sampler
            if s.cost is None:
                raise ValueError(
                    "trainer.evaluate(): the training sampler reads a precomputed plan, so the "
                    "eval set cannot be planned from it; give PackedTrainer(..., "
                    "packed_eval_sampler=PackedBatchSampler(eval_lengths, cost, layout, "
                    "PlannerConfig(tail='partial'), dp_rank=...))")
            config = s.config.model_copy(update={"tail": "partial"})
            # the eval set's trained tokens (a labels / loss-mask column), as for training
            counts = getattr(self.packed_dataset(dataset), "loss_tokens", lambda: None)()
            sampler = PackedBatchSampler(
                SampleTable(row_lengths(dataset, self.packed_tokens_column)), s.cost, s.layout,
                config, dp_rank=s.dp_rank, cp_rank=s.cp_rank, pp_rank=s.pp_rank,
                **({} if counts is None else {"loss_tokens": counts}))
            self._packed_eval_samplers[key] = (dataset, sampler)  # the dataset keeps id() unique
        return self._packed_eval_samplers[key][1]

    def get_eval_dataloader(self, eval_dataset=None):
        from .accelerate import prepare_loader
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        sampler = self.packed_eval_sampler_for(eval_dataset)
        sampler.set_epoch(0)
        ds = self.packed_dataset(eval_dataset)  # the training signal of the training set
        loader = torch.utils.data.DataLoader(
            ds, batch_sampler=_Restarting(sampler), collate_fn=self.packed_collate,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory)
        return prepare_loader(self.accelerator, loader)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None,
                        ignore_keys=None, metric_key_prefix="eval"):
        self._packed_eval_sum = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        # each batch's loss is then its own token mean (the Trainer would divide by the tokens
        # of every rank's batch and multiply by the process count): prediction_step turns it
        # back into the token sum
        averaged = self.args.average_tokens_across_devices
        self.args.average_tokens_across_devices = False
        try:
            out = super().evaluation_loop(dataloader, description, prediction_loss_only,
                                          ignore_keys, metric_key_prefix)
            total = self._packed_eval_sum
            if self.accelerator.num_processes > 1:
                total = self.accelerator.reduce(total, reduction="sum")
        finally:
            self._packed_eval_sum = None
            self.args.average_tokens_across_devices = averaged
        key = f"{metric_key_prefix}_loss"
        if key in out.metrics and float(total[1]) > 0:
            out.metrics[key] = float(total[0] / total[1])
        return out

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = dict(inputs)
        inputs.pop(META, None)
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only,
                                                       ignore_keys)
        if loss is not None and self._packed_eval_sum is not None and "labels" in inputs:
            n = (inputs["labels"][..., 1:] != -100).sum()  # the model shifts
            self._packed_eval_sum[0] += loss.detach().double() * n
            self._packed_eval_sum[1] += n
        return loss, logits, labels


class _Restarting:
    """The eval sampler, restarted at its first microbatch on every pass (evaluate() runs many
    times in a run; a finished pass would otherwise yield nothing)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __len__(self):
        return len(self.sampler)

    def __iter__(self):
        s = self.sampler
        for pos in range(len(s)):
            yield s.ref(pos)
