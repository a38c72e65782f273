"""accelerate's prepared loader in one process (the real library): the sampler's epoch wins over
the loader's own pass counter (``sampler.set_epoch(2)`` trains epoch 2, a restore made after
:func:`~balancer.integrations.accelerate.prepare_loader` resumes), the loader still advances by
itself when nobody sets an epoch, and the documented loss (:func:`step_loss`) gives the unpacked
reference's gradient with ``no_sync`` and with ``accelerator.accumulate``. Two processes:
tests/integrations/test_two_processes.py."""
import numpy as np
import pytest
import torch

from integration_helpers import need  # noqa: E402

need("accelerate")
need("transformers")

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig, SampleTable  # noqa: E402
from balancer.integrations.accelerate import prepare_loader, step_loss  # noqa: E402
from balancer.loader.collate import FlatTokens, PackedCollator, PackedDataset  # noqa: E402
from integration_helpers import (VOCAB, max_grad_diff, reference_step_grads,  # noqa: E402
                                 tiny_llama)


def _setup(seed=2, n=60, **cfg):
    lengths = np.random.default_rng(seed).integers(1, 60, n)
    layout = Layout(dp=1, microbatches=2, capacity=128)
    samples, cost = SampleTable(lengths), CostModel.quadratic(4096)
    config = PlannerConfig(seed=seed, **cfg)
    ds = FlatTokens.from_lengths(lengths, vocab=VOCAB, seed=seed + 1)
    return samples, cost, layout, config, ds


def _loader(acc, sampler, ds):
    return prepare_loader(acc, torch.utils.data.DataLoader(
        PackedDataset(ds), batch_sampler=sampler, collate_fn=PackedCollator()))


def _keys(dl):
    return [(int(b["epoch"]), int(b["position"])) for b in dl]


def test_set_epoch_and_restore_after_prepare():
    from accelerate import Accelerator
    samples, cost, layout, config, ds = _setup()
    acc = Accelerator(cpu=True)
    sampler = PackedBatchSampler(samples, cost, layout, config)
    dl = _loader(acc, sampler, ds)
    sampler.set_epoch(2)  # the DistributedSampler habit: was epoch 0's batches again
    got = _keys(dl)
    assert {e for e, _ in got} == {2} and len(got) == len(sampler)
    # nobody sets an epoch: accelerate's own counter moves on (epoch 3 after epoch 2)
    assert {e for e, _ in _keys(dl)} == {3}
    # a mid-epoch restore made after prepare_loader (was: "set_epoch(0) but the checkpoint...")
    fresh = PackedBatchSampler(samples, cost, layout, config)
    dl2 = _loader(acc, fresh, ds)
    ref = PackedBatchSampler(samples, cost, layout, config)
    ref.set_epoch(1)
    state = ref.state_dict()
    state["position"] = 5
    fresh.load_state_dict(state)
    got = _keys(dl2)
    assert got == [(1, p) for p in range(5, len(fresh))]
    fresh.set_epoch(2)
    assert {e for e, _ in _keys(dl2)} == {2}


@pytest.mark.parametrize("accumulate", [False, True])
def test_documented_loop_exact_gradient(accumulate):
    """The docs' loop: step_loss(loss_sum, batch, accelerator) backward, optimizer step at
    last_in_step; with accelerator.accumulate (gradient_accumulation_steps = microbatches) as
    well: the first step's gradient is the unpacked reference's (was 1/dp, 1/(dp x GA))."""
    from accelerate import Accelerator
    samples, cost, layout, config, ds = _setup(seed=4, global_batch_samples=8)
    ref = reference_step_grads(tiny_llama(), ds, samples, cost, layout, config, step=0)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=layout.microbatches if accumulate
                      else 1)
    sampler = PackedBatchSampler(samples, cost, layout, config)
    dl = _loader(acc, sampler, ds)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    grads = None
    for b in dl:
        from balancer.integrations.hf import model_inputs
        inputs = model_inputs(b)
        labels = inputs.pop("labels")
        ctx = acc.accumulate(model) if accumulate else (
            acc.no_sync(model) if not b["last_in_step"] else torch.enable_grad())
        with ctx:
            logits = model(**inputs).logits[0]
            loss_sum = torch.nn.functional.cross_entropy(
                logits[:-1], labels[0, 1:], ignore_index=-100, reduction="sum")
            acc.backward(step_loss(loss_sum, b, acc))
        if b["last_in_step"]:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            break
    d = max_grad_diff(grads, ref)
    assert d <= 1e-10, d


def _plain(sampler, ds, workers, **kw):
    return torch.utils.data.DataLoader(PackedDataset(ds), batch_sampler=sampler,
                                       collate_fn=PackedCollator(), num_workers=workers, **kw)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("process_index", [0, 1])
def test_plain_prepare_is_refused_early(workers, process_index):
    """``accelerator.prepare(loader)`` on 2 processes wraps the packed sampler in accelerate's
    BatchSamplerShard, which hands process p every 2nd microbatch (half of this rank's own
    microbatches lost, DDP hangs at the step's gradient sync). The loader refuses it at this
    process's second microbatch (each worker's second, with workers), naming the fix; it used
    to train half the microbatches silently."""
    from accelerate.data_loader import prepare_data_loader
    samples, cost, layout, config, ds = _setup()
    sampler = PackedBatchSampler(samples, cost, layout, config)
    dl = prepare_data_loader(_plain(sampler, ds, workers), num_processes=2,
                             process_index=process_index, put_on_device=False)
    got = []
    with pytest.raises(ValueError, match=r"prepare_loader\(accelerator, loader\)"):
        for b in dl:
            got.append(int(b["position"]))
    assert got == ([] if workers == 0 else [process_index])


@pytest.mark.parametrize("workers", [0, 2])
def test_skipped_prefix_and_resume_are_not_refused(workers):
    """What the refusal must not catch: accelerate's skip_first_batches (the HF Trainer's resume,
    a skipped prefix), and a StatefulDataLoader restored mid-epoch with workers."""
    from accelerate import Accelerator
    from accelerate.data_loader import skip_first_batches
    from torchdata.stateful_dataloader import StatefulDataLoader
    samples, cost, layout, config, ds = _setup()
    acc = Accelerator(cpu=True)
    sampler = PackedBatchSampler(samples, cost, layout, config)
    dl = prepare_loader(acc, _plain(sampler, ds, workers))
    assert _keys(skip_first_batches(dl, 3)) == [(0, p) for p in range(3, len(sampler))]

    def stateful():
        return StatefulDataLoader(PackedDataset(ds), collate_fn=PackedCollator(),
                                  batch_sampler=PackedBatchSampler(samples, cost, layout, config),
                                  num_workers=workers)
    first = stateful()
    it = iter(first)
    head = [int(next(it)["position"]) for _ in range(5)]
    state = first.state_dict()
    again = stateful()
    again.load_state_dict(state)
    assert head == list(range(5))
    assert [int(b["position"]) for b in again] == list(range(5, len(sampler)))


def _set_epoch_and_restore_ranks(rank, world, out):
    """Each of 2 processes: set_epoch(2) after prepare_loader, the next pass without one, and a
    mid-epoch checkpoint (state_dict(after=batch), through JSON) restored in a fresh sampler
    after prepare_loader, with 0 and 2 workers."""
    import json
    from pathlib import Path

    from accelerate import Accelerator
    samples, cost, _, config, ds = _setup(n=80)
    layout = Layout(dp=world, microbatches=2, capacity=128)
    acc = Accelerator(cpu=True)
    res = {}
    for workers in (0, 2):
        def loader(s):
            return prepare_loader(acc, torch.utils.data.DataLoader(
                PackedDataset(ds), batch_sampler=s, collate_fn=PackedCollator(),
                num_workers=workers))

        def keys(batches):
            return [(int(b["epoch"]), int(b["position"]), b["sample_ids"].tolist())
                    for b in batches]
        ref = PackedBatchSampler(samples, cost, layout, config)

        def planned(epoch):
            ref.set_epoch(epoch)
            return [(epoch, p, list(map(int, ref.ref(p)))) for p in range(len(ref))]
        s = PackedBatchSampler(samples, cost, layout, config)
        dl = loader(s)
        s.set_epoch(2)
        epoch2, following = keys(dl), keys(dl)
        s1 = PackedBatchSampler(samples, cost, layout, config)
        dl1 = loader(s1)
        s1.set_epoch(1)
        head, state = [], None
        for b in dl1:
            head += keys([b])
            if len(head) == 3:
                state = json.loads(json.dumps(s1.state_dict(after=b)))
                break
        s2 = PackedBatchSampler(samples, cost, layout, config)
        dl2 = loader(s2)  # the restore comes after prepare_loader
        s2.load_state_dict(state)
        s2.set_epoch(1)
        res[workers] = {"epoch2": epoch2 == planned(2),
                        "following": sorted({k[0] for k in following}),
                        "resumed": head + keys(dl2) == planned(1)}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_set_epoch_and_restore_two_processes(tmp_path):
    """Issue 29 item 5 in 2 gloo processes with 0 and 2 workers: every rank trains epoch 2
    after set_epoch(2), moves on to epoch 3 when nobody sets one, and resumes a mid-epoch
    checkpoint restored after prepare_loader exactly (17 s on 2 cores)."""
    import json

    from tests.common.gloo import run_ranks
    run_ranks(_set_epoch_and_restore_ranks, 2, tmp_path, torchrun_env=True, timeout_s=300)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for workers in ("0", "2"):
            assert r[workers] == {"epoch2": True, "following": [3], "resumed": True}, \
                (rank, workers, r[workers])
