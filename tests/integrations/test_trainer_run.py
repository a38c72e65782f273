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


def _trainer(tmp_path, name="default", keep=True, callbacks=(), eval_dataset=None, **kw):
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
                       compute_loss_func=causal_lm_loss, eval_dataset=eval_dataset)
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("extra", [-1, 0, 3])
def test_max_steps_crossing_epochs(tmp_path, extra):
    """max_steps past the first epoch: exactly the first max_steps planned steps, each once
    (the later epochs keep their last step; a max_steps at an epoch's end stops there)."""
    samples, cost, layout, config, _ = _workload()
    planned = _planned(samples, cost, layout, config, epochs=3)
    n0, n1 = (len(_planned(samples, cost, layout, config, epochs=k)) for k in (1, 2))
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



# ---- evaluation ------------------------------------------------------------------------------
def _reference_eval_loss(ds, lengths):
    """Token-mean next-token loss over every document of ``ds`` run alone (the unpacked
    reference), with the weights of a fresh tiny_llama."""
    model = tiny_llama()
    with torch.no_grad():
        total = sum(float(doc_loss_sum(model, ds[i])) for i in range(len(ds)))
    return total / int(sum(int(n) - 1 for n in lengths))


def test_evaluate(tmp_path):
    """trainer.evaluate() on a packed eval set (its own plan, from the train sampler's cost and
    layout): eval_loss is the token mean over every eval document, equal to the unpacked
    reference; 2 workers and an eval_dataset dict work too."""
    lengths = np.random.default_rng(7).integers(1, 60, 23)
    ev = FlatTokens.from_lengths(lengths, vocab=VOCAB, seed=8)
    tr, _ = _trainer(tmp_path, eval_dataset={"a": ev, "b": ev}, dataloader_num_workers=0)
    ref = _reference_eval_loss(ev, lengths)
    metrics = tr.evaluate()
    for k in ("eval_a_loss", "eval_b_loss"):
        assert abs(metrics[k] - ref) <= 1e-10, (metrics[k], ref)
    metrics = tr.evaluate(ev)
    assert abs(metrics["eval_loss"] - ref) <= 1e-10


@pytest.mark.slow
def test_evaluate_during_training(tmp_path):
    """eval_strategy="steps" evaluates between steps without moving the training stream, with 2
    workers."""
    lengths = np.random.default_rng(7).integers(1, 60, 23)
    ev = FlatTokens.from_lengths(lengths, vocab=VOCAB, seed=8)
    tr, w = _trainer(tmp_path, eval_dataset=ev, eval_strategy="steps", eval_steps=4,
                     num_train_epochs=2, dataloader_num_workers=2)
    cuts = _step_recorder(tr)
    tr.train()
    assert _trained(tr, cuts) == _planned(*w[:4], epochs=2)
    evals = [h for h in tr.state.log_history if "eval_loss" in h]
    n = len(_planned(*w[:4], epochs=2))
    assert len(evals) == n // 4 + (n % 4 > 0)  # every 4 steps, and the run's last step


# ---- resume_from_checkpoint mid-epoch ---------------------------------------------------------
def _run(tmp_path, workers, resume=None, ignore=False):
    tr, _ = _trainer(tmp_path, num_train_epochs=2, save_strategy="steps", save_steps=4,
                     dataloader_num_workers=workers, ignore_data_skip=ignore)
    cuts = _step_recorder(tr)
    tr.train(resume_from_checkpoint=resume)
    return tr, _trained(tr, cuts)


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    """The uninterrupted run (2 epochs of 9 and 8 steps, a checkpoint every 4 steps), once per
    worker count."""
    cache = {}

    def get(workers):
        if workers not in cache:
            path = tmp_path_factory.mktemp(f"full{workers}")
            tr, stream = _run(path, workers)
            params = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
            cache[workers] = (path, stream, params)
        return cache[workers]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("at,ignore,workers", [  # at 4: step 4 of epoch 0's 9; 12: 3 of 8 of epoch 1
    (4, False, 0), (4, True, 0), (12, False, 0), (12, True, 0), (12, False, 2), (12, True, 2)])
def test_resume_mid_epoch(tmp_path, full_runs, at, ignore, workers):
    """resume_from_checkpoint at a step inside an epoch: the resumed run trains exactly the
    uninterrupted run's remaining steps, grouped the same, and ends with the same weights
    (before: 'epoch 0: the Trainer trained 9 of this rank's 17 microbatches')."""
    path, stream, params = full_runs(workers)
    tr, resumed = _run(tmp_path, workers, resume=str(path / "out" / f"checkpoint-{at}"),
                       ignore=ignore)
    assert resumed == stream[at:]
    assert tr.state.global_step == len(stream)
    for n, p in tr.model.named_parameters():
        torch.testing.assert_close(p.detach(), params[n], rtol=0, atol=1e-12)


def _two_rank_resume(rank, world, out):
    """Each rank: evaluate() with fresh weights, the uninterrupted 2-epoch run (a checkpoint
    every step), then two resumed runs: inside epoch 0 with ignore_data_skip, inside epoch 1
    without."""
    import json
    from pathlib import Path

    from transformers import Trainer, TrainingArguments

    from integration_helpers import workload

    class PackedTrainer(PackedTrainerMixin, Trainer):
        pass

    samples, cost, layout, config, ds = workload()

    eval_lengths = np.random.default_rng(7).integers(1, 60, 23)
    ev = FlatTokens.from_lengths(eval_lengths, vocab=VOCAB, seed=8)

    def run(resume=None, ignore=False, evaluate=False):
        args = TrainingArguments(
            output_dir=str(Path(out) / "full"), use_cpu=True,
            gradient_accumulation_steps=layout.microbatches, num_train_epochs=2, optim="sgd",
            learning_rate=0.1, lr_scheduler_type="constant", max_grad_norm=0.0,
            weight_decay=0.0, report_to=[], save_strategy="steps" if resume is None else "no",
            save_steps=1, logging_steps=1000, disable_tqdm=True, ignore_data_skip=ignore)
        tr = PackedTrainer(model=tiny_llama(), args=args, train_dataset=ds,
                           packed_sampler=PackedBatchSampler(samples, cost, layout, config),
                           keep_history=True, compute_loss_func=causal_lm_loss,
                           eval_dataset=ev)
        if evaluate:
            return tr.evaluate()["eval_loss"]
        cuts = _step_recorder(tr)
        tr.train(resume_from_checkpoint=resume)
        params = {n.removeprefix("module."): p.detach().tolist()
                  for n, p in tr.model.named_parameters()}
        return {"stream": _trained(tr, cuts), "params": params,
                "n0": len(tr.packed_epoch_steps(0))}

    # evaluate() in a trainer of its own: with evaluate() before train() in the same trainer,
    # the 2-process run's weights differed from the resumed runs' (seen once, not investigated)
    res = {"eval_loss": run(evaluate=True), "full": run()}
    n0 = res["full"]["n0"]
    res["resumes"] = [(at, run(str(Path(out) / "full" / f"checkpoint-{at}"), ignore))
                      for at, ignore in ((3, True), (n0 + 2, False))]
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_resume_mid_epoch_two_processes(tmp_path):
    """2 gloo processes (DDP): resuming inside epoch 0 (ignore_data_skip) and inside epoch 1
    gives every rank the uninterrupted run's remaining steps and weights; evaluate() over both
    ranks is the unpacked reference's token mean."""
    import json

    need("accelerate")
    from tests.common.gloo import run_ranks
    run_ranks(_two_rank_resume, 2, tmp_path, torchrun_env=True)
    eval_lengths = np.random.default_rng(7).integers(1, 60, 23)
    ref = _reference_eval_loss(FlatTokens.from_lengths(eval_lengths, vocab=VOCAB, seed=8),
                               eval_lengths)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        full = r["full"]
        assert abs(r["eval_loss"] - ref) <= 1e-10, (r["eval_loss"], ref)
        for at, res in r["resumes"]:
            assert res["stream"] == full["stream"][at:], (rank, at)
            for n, v in res["params"].items():
                torch.testing.assert_close(torch.tensor(v), torch.tensor(full["params"][n]),
                                           rtol=0, atol=1e-12)
