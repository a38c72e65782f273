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
the plain way.
"""
from __future__ import annotations


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
    prepared = prepare_data_loader(
        loader, accelerator.device, num_processes=1, process_index=0, split_batches=False,
        put_on_device=device_placement, rng_types=None, dispatch_batches=False,
        non_blocking=getattr(accelerator, "non_blocking", False),
        use_stateful_dataloader=getattr(accelerator, "use_stateful_dataloader", False))
    # DataLoaderShard calls batch_sampler.set_epoch(self.iteration) at every __iter__: start it at
    # the sampler's epoch so that a restored sampler is not sent back to epoch 0
    prepared.iteration = int(getattr(loader.batch_sampler, "epoch", 0))
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
