"""A whole HF ``Trainer`` run on the packed loader (one process, the real library): epochs of
different lengths, ``max_steps`` crossing epochs, early stopping, a mid-epoch
``resume_from_checkpoint`` (with and without ``ignore_data_skip``, 0 and 2 workers) and
``trainer.evaluate()``. What is checked is the exact stream: the (epoch, step, slot) of every
microbatch trained, grouped by optimizer step, equals the plan's."""
import numpy as np
import pytest
import torch

from integration_helpers import need  # noqa: E402

transformers = need("transformers")

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig, SampleTable  # noqa: E402
from balancer.loader.collate import FlatTokens  # noqa: E402
from balancer.integrations.hf_trainer import PackedTrainerMixin, causal_lm_loss  # noqa: E402
from integration_helpers import VOCAB, doc_loss_sum, tiny_llama  # noqa: E402

#: planned with these, the epochs differ: default config seed 2 -> 17, 16, 16 microbatches in
#: 9, 8, 8 steps; windows of 20 samples, seed 0 -> 8, 9, 9 steps with short steps mid-epoch
WORKLOADS = {"default": (2, {}), "windows": (0, {"window_samples": 20})}


def _workload(name="default"):
    seed, extra = WORKLOADS[name]
    lengths = np.random.default_rng(seed).integers(1, 60, 60)
    layout = Layout(dp=1, microbatches=2, capacity=128)
    return (SampleTable(lengths), CostModel.quadratic(4096), layout,
            PlannerConfig(seed=seed, **extra),
            FlatTokens.from_lengths(lengths, vocab=VOCAB, seed=seed + 1))


def _planned(samples, cost, layout, config, epochs):
    """[(epoch, step, slot)] of every microbatch of this rank, per optimizer step."""
    s = PackedBatchSampler(samples, cost, layout, config)
    out = []
    for e in range(epochs):
        s.set_epoch(e)
        steps = {}
        for pos in range(len(s)):
            r = s.ref(pos)
            steps.setdefault(r.step, []).append((e, r.step, r.slot))
        out += [steps[k] for k in sorted(steps)]
    return out


def _trainer(tmp_path, name="default", keep=True, callbacks=(), **kw):
    from transformers import Trainer, TrainingArguments

    class PackedTrainer(PackedTrainerMixin, Trainer):
        pass

    samples, cost, layout, config, ds = _workload(name)
    base = dict(output_dir=str(tmp_path / "out"), use_cpu=True,
                gradient_accumulation_steps=layout.microbatches, num_train_epochs=3,
                optim="sgd", learning_rate=0.1, lr_scheduler_type="constant", max_grad_norm=0.0,
                weight_decay=0.0, report_to=[], save_strategy="no", logging_steps=1000,
                disable_tqdm=True, dataloader_num_workers=0)
    base.update(kw)
    sampler = PackedBatchSampler(samples, cost, layout, config)
    tr = PackedTrainer(model=tiny_llama(), args=TrainingArguments(**base), train_dataset=ds,
                       packed_sampler=sampler, keep_history=keep, callbacks=list(callbacks),
                       compute_loss_func=causal_lm_loss)
    return tr, (samples, cost, layout, config, ds)


def _step_recorder(tr):
    """Callback: the history's length at every optimizer step (where the steps were cut)."""
    from transformers import TrainerCallback
    cuts = []

    class Cuts(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            cuts.append(len(tr.packed_history))
    tr.add_callback(Cuts())
    return cuts


def _trained(tr, cuts):
    """[(epoch, step, slot)] per optimizer step, as the Trainer grouped them."""
    h = [(int(m["epoch"]), int(m["step"]), int(m["slot"])) for m in tr.packed_history]
    return [h[a:b] for a, b in zip([0] + cuts[:-1], cuts)]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_epochs_of_different_lengths(tmp_path, name):
    """num_train_epochs=3 over epochs of 9, 8, 8 steps (or with short steps mid-epoch): every
    planned step trained once, as one optimizer step, and the Trainer's max_steps is their sum
    (its lr schedule spans the run)."""
    tr, w = _trainer(tmp_path, name)
    cuts = _step_recorder(tr)
    tr.train()
    planned = _planned(*w[:4], epochs=3)
    assert _trained(tr, cuts) == planned
    assert tr.state.global_step == tr.state.max_steps == len(planned)


@pytest.mark.parametrize("extra", [-1, 0, 3])
def test_max_steps_crossing_epochs(tmp_path, extra):
    """max_steps past the first epoch: exactly the first max_steps planned steps, each once
    (the later epochs keep their last step; a max_steps at an epoch's end stops there)."""
    samples, cost, layout, config, _ = _workload()
    planned = _planned(samples, cost, layout, config, epochs=3)
    n0, n1 = (len(_planned(samples, cost, layout, config, epochs=k)) for k in (1, 2))
    assert (n0, n1 - n0) == (9, 8)
    max_steps = n1 + extra  # -1: inside epoch 1, 0: its end, 3: into epoch 2
    tr, w = _trainer(tmp_path, max_steps=max_steps)
    cuts = _step_recorder(tr)
    tr.train()
    assert tr.state.global_step == max_steps
    assert _trained(tr, cuts) == planned[:max_steps]


def test_early_stopping_ends_cleanly(tmp_path):
    """A callback setting should_training_stop mid-epoch ends the run (no coverage error): the
    steps trained are the plan's first ones, whole."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                control.should_training_stop = True

    tr, w = _trainer(tmp_path, callbacks=[StopAt()])
    cuts = _step_recorder(tr)
    tr.train()
    assert tr.state.global_step == 3
    assert _trained(tr, cuts) == _planned(*w[:4], epochs=1)[:3]
