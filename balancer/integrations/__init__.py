"""Using the packed loader inside the stacks people train with (each module imports its library
only when called, so ``balancer`` never needs them installed):

* :mod:`balancer.integrations.hf` — Hugging Face transformers model inputs that keep attention
  inside each packed document with the model's defaults (``use_cache=False`` with
  ``position_ids``, an additive float 4D mask, a FlexAttention ``BlockMask``) and
  :func:`~balancer.integrations.hf.check_inputs`, which refuses combinations known to leak;
* :mod:`balancer.integrations.accelerate` — :func:`~balancer.integrations.accelerate.prepare_loader`:
  ``accelerator.prepare`` for a loader whose batch sampler is already per rank (plain
  ``prepare`` re-shards it and every rank loses ``(n - 1) / n`` of its microbatches);
* :mod:`balancer.integrations.hf_trainer` — :class:`~balancer.integrations.hf_trainer.PackedTrainerMixin`
  for ``transformers.Trainer`` and ``trl.SFTTrainer``: one optimizer step per planned global
  batch, the loss normalised by the plan's step token count;
* :mod:`balancer.integrations.hf_epochs` — the mixin's epochs from the plan (run size, each
  epoch's step count, ``resume_from_checkpoint`` mid-epoch);
* :mod:`balancer.integrations.hf_eval` — ``trainer.evaluate()`` for the mixin: the eval set
  packed by a plan of its own, ``eval_loss`` the exact token mean;
* :mod:`balancer.integrations.sync` — which ``Layout.sync`` a trainer needs (``step`` for DDP with
  ``no_sync`` accumulation, ``microbatch`` for FSDP/ZeRO-3) and the lockstep imbalance it implies;
* :mod:`balancer.integrations.megatron` — the padded-but-unsharded microbatch
  (:class:`~balancer.integrations.megatron.PaddedCollator`) and the batch dict Megatron-core's
  ``get_thd_batch_on_this_cp_rank`` takes (:func:`~balancer.integrations.megatron.megatron_batch`).
"""
