"""accelerate: prepare a packed loader without re-sharding it.

``accelerator.prepare(loader)`` wraps the loader's batch sampler in ``BatchSamplerShard``, which
hands process ``p`` every ``num_processes``-th batch. :class:`~balancer.PackedBatchSampler` is
already per rank (it yields this DP rank's microbatches of the shared plan), so with 2 processes
each rank silently trains half of its microbatches (measured: 7 of 14) and the steps no longer
line up. No ``DataLoaderConfiguration`` setting turns this off (``split_batches`` cuts every
microbatch's sample list, ``dispatch_batches`` iterates rank 0's loader and slices its tensors).

:func:`prepare_loader` is the replacement: the same ``DataLoaderShard`` (batches moved to
``accelerator.device``, registered with the accelerator for ``save_state``) built with one
process, so nothing is skipped. :func:`check_not_resharded` refuses a loader that was prepared
the plain way, and iterating such a loader is refused at each rank's second microbatch (each
DataLoader worker's second): ``PackedDataset`` sees the stride in the microbatch positions it is
handed (:func:`balancer.loader.refs.check_handed_in_order`), on every rank, before the first
step's gradient sync could hang (accelerate's loader reads one batch ahead: without workers
the loop never sees a batch).

The sampler's epoch wins over the prepared loader's pass counter (accelerate calls
``set_epoch(iteration)`` at every pass): ``sampler.set_epoch(e)`` and
``sampler.load_state_dict(state)`` made after :func:`prepare_loader` are what the next pass
yields; when nobody moves the sampler, accelerate's counter advances it one epoch per finished
pass, as for any sampler.

The loss: :func:`step_loss` turns a microbatch's summed token loss into what
``accelerator.backward`` needs for the step's gradient to be the global batch's token mean
(DDP averages over the processes, ``accelerator.backward`` divides by
``gradient_accumulation_steps``)::

    for batch in loader:
        ctx = accelerator.no_sync(model) if not batch["last_in_step"] else nullcontext()
        with ctx:
            loss_sum = cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
            accelerator.backward(step_loss(loss_sum, batch, accelerator))
        if batch["last_in_step"]:
            optimizer.step(); optimizer.zero_grad()

``with accelerator.accumulate(model)`` instead of ``no_sync`` (``gradient_accumulation_steps =
layout.microbatches``) is exact only when every step has that many microbatches (accelerate
counts calls, not plan steps: plan with ``global_batch_samples``).
"""
from __future__ import annotations

import copy


def _packed_sampler(batch_sampler):
    from ..loader.sampler import PackedBatchSampler
    return isinstance(batch_sampler, PackedBatchSampler)


def prepare_loader(accelerator, loader, device_placement=None):
    """``accelerator.prepare(loader)`` for a loader whose batch sampler is already per rank:
    every microbatch of this rank, in order, on ``accelerator.device``."""
    from accelerate.data_loader import prepare_data_loader

    check_not_resharded(loader)
    if device_placement is None:
        device_placement = accelerator.device_placement
    sampler = loader.batch_sampler
    follow = None
    if hasattr(sampler, "epoch") and callable(getattr(sampler, "set_epoch", None)):
        follow = _FollowSampler(sampler)
        # the same loader with the sampler behind a thin wrapper that decides which epoch a
        # pass serves (DataLoader refuses to set batch_sampler after construction: copy, set)
        loader = copy.copy(loader)
        object.__setattr__(loader, "batch_sampler", follow)
    prepared = prepare_data_loader(
        loader, accelerator.device, num_processes=1, process_index=0, split_batches=False,
        put_on_device=device_placement, rng_types=None, dispatch_batches=False,
        non_blocking=getattr(accelerator, "non_blocking", False),
        use_stateful_dataloader=getattr(accelerator, "use_stateful_dataloader", False))
    # DataLoaderShard calls batch_sampler.set_epoch(self.iteration) at every __iter__: start it at
    # the sampler's epoch; _FollowSampler keeps the two in step afterwards
    prepared.iteration = int(getattr(sampler, "epoch", 0))
    if follow is not None:
        follow.applied, follow.loader = prepared.iteration, prepared
    if hasattr(accelerator, "_dataloaders"):
        accelerator._dataloaders.append(prepared)
    return prepared


def check_not_resharded(loader) -> None:
    """Raise ValueError when an accelerate wrapper hands this process only every n-th microbatch
    of a :class:`~balancer.PackedBatchSampler` (``accelerator.prepare(loader)`` with n > 1)."""
    bs = getattr(loader, "batch_sampler", None)
    inner = getattr(bs, "batch_sampler", None)
    n = getattr(bs, "num_processes", 1)
    if inner is not None and n > 1 and _packed_sampler(inner):
        raise ValueError(
            f"this loader was re-sharded over {n} processes by accelerator.prepare: each rank "
            f"would train 1/{n} of its own microbatches; prepare the plain DataLoader with "
            "balancer.integrations.accelerate.prepare_loader(accelerator, loader)")


def step_loss(loss_sum, batch, accelerator):
    """What to pass to ``accelerator.backward`` for a microbatch whose summed token loss is
    ``loss_sum``: ``loss_sum / batch["step_loss_tokens"]`` times the process count (DDP averages
    gradients) and ``gradient_accumulation_steps`` (``accelerator.backward`` divides by it), so
    that the step's gradient is the global batch's token mean, on any number of processes."""
    scale = accelerator.num_processes * accelerator.gradient_accumulation_steps
    return loss_sum / batch["step_loss_tokens"] * scale


class _FollowSampler:
    """The batch sampler a prepared loader iterates: the packed sampler, except that the
    loader's per-pass ``set_epoch(iteration)`` does not override an epoch the user chose. When
    the sampler stands at another epoch than the loader last gave it (``set_epoch`` or
    ``load_state_dict`` since), the loader adopts the sampler's epoch; otherwise the loader's
    counter moves the sampler (one epoch per finished pass). Everything else is the sampler's."""

    def __init__(self, sampler):
        self.batch_sampler = sampler  # where the HF Trainer and accelerate look for it
        self.applied = int(getattr(sampler, "epoch", 0))
        self.loader = None

    def set_epoch(self, epoch: int) -> None:
        s = self.batch_sampler
        if int(s.epoch) != self.applied:  # moved by the user since: it wins
            epoch = int(s.epoch)
            if self.loader is not None:
                self.loader.iteration = epoch
        else:
            s.set_epoch(epoch)
        self.applied = epoch

    def __iter__(self):
        return iter(self.batch_sampler)

    def __len__(self):
        return len(self.batch_sampler)

    def state_dict(self, *args, **kwargs):
        return self.batch_sampler.state_dict(*args, **kwargs)

    def load_state_dict(self, state) -> None:
        self.batch_sampler.load_state_dict(state)

    def __getattr__(self, name):
        if name == "batch_sampler":
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)
