"""transformers ``Trainer`` and TRL ``SFTTrainer`` in one process on the packed loader: every token
of every sample trained exactly once per epoch, one optimizer step per planned step, and the
first step's gradient equal to the unpacked reference (every document run alone, the token-sum
loss divided by the plan's step token count)."""
import numpy as np
import pytest
import torch

from integration_helpers import need  # noqa: E402

transformers = need("transformers")

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig, SampleTable  # noqa: E402
from balancer.loader.collate import FlatTokens  # noqa: E402
from balancer.integrations.hf_trainer import PackedTrainerMixin, causal_lm_loss  # noqa: E402
from integration_helpers import (VOCAB, coverage, max_grad_diff, reference_step_grads,  # noqa: E402
                                 tiny_llama)


def _workload(seed=4):
    lengths = np.random.default_rng(seed).integers(1, 60, 40)
    layout = Layout(dp=1, microbatches=3, capacity=256)
    # a sample budget: every epoch has as many steps (the Trainer sizes epochs by the first)
    config = PlannerConfig(seed=seed, global_batch_samples=8)
    return (SampleTable(lengths), CostModel.quadratic(4096), layout, config,
            FlatTokens.from_lengths(lengths, vocab=VOCAB, seed=seed + 1))


def _args(cls, tmp_path, layout, epochs=2, **kw):
    return cls(output_dir=str(tmp_path / "out"), use_cpu=True,
               gradient_accumulation_steps=layout.microbatches, num_train_epochs=epochs, optim="sgd",
               learning_rate=0.1, lr_scheduler_type="constant", max_grad_norm=0.0,
               weight_decay=0.0, report_to=[], save_strategy="no", logging_steps=1000,
               disable_tqdm=True, dataloader_num_workers=0, **kw)


def _first_grads_callback(store):
    from transformers import TrainerCallback

    class FirstGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            if state.global_step == 0:
                store.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return FirstGrads()


def _check(tr, sampler, samples, ref, grads, tol, epochs=2):
    by_epoch = {}
    for m in tr.packed_history:
        by_epoch.setdefault(int(m["epoch"]), []).extend(
            zip(m["sample_ids"].tolist(), m["sample_starts"].tolist(), m["lengths"].tolist()))
    assert sorted(by_epoch) == list(range(epochs))
    for pieces in by_epoch.values():
        assert (coverage(pieces, samples.lengths) == 1).all()
    assert tr.state.global_step == epochs * sampler.plan.n_steps
    d = max_grad_diff(grads, ref)
    assert d <= tol, d
    return d


def test_hf_trainer_one_process(tmp_path):
    from transformers import Trainer, TrainingArguments

    class PackedTrainer(PackedTrainerMixin, Trainer):
        pass

    samples, cost, layout, config, ds = _workload()
    ref = reference_step_grads(tiny_llama(), ds, samples, cost, layout, config, step=0)
    grads = {}
    sampler = PackedBatchSampler(samples, cost, layout, config)
    tr = PackedTrainer(model=tiny_llama(), args=_args(TrainingArguments, tmp_path, layout),
                       train_dataset=ds, packed_sampler=sampler, keep_history=True,
                       callbacks=[_first_grads_callback(grads)], compute_loss_func=causal_lm_loss)
    tr.train()
    d = _check(tr, sampler, samples, ref, grads, 1e-10)
    print(f"HF Trainer 1 process float64: first-step grad diff {d:.1e}")


@pytest.mark.parametrize("cp_mode", ["fixed", "hybrid"])
def test_hf_trainer_refuses_a_cp_layout_naming_it(tmp_path, cp_mode):
    """A CP layout (fixed, or the hybrid sampler's) under the Trainer is refused at
    construction with the layout's cp and mode, not trained wrongly: HF models take whole
    microbatches."""
    from transformers import Trainer, TrainingArguments

    from balancer.cost.cp import CPCostModel
    from balancer.loader.hybrid import HybridBatchSampler

    class PackedTrainer(PackedTrainerMixin, Trainer):
        pass

    samples, cost, _, config, ds = _workload()
    if cp_mode == "fixed":
        layout = Layout(dp=1, cp=2, microbatches=3, capacity=256)
        sampler = PackedBatchSampler(samples, cost, layout, config)
    else:
        layout = Layout(dp=1, cp=2, microbatches=3, capacity=256, cp_mode="hybrid",
                        rank_capacity=128)
        sampler = HybridBatchSampler(samples, CPCostModel.from_preset("llama-7b", 128), layout)
    with pytest.raises(ValueError, match=rf"cp=2 \(cp_mode='{cp_mode}'\).*needs cp == 1"):
        PackedTrainer(model=tiny_llama(), args=_args(TrainingArguments, tmp_path, layout),
                      train_dataset=ds, packed_sampler=sampler, compute_loss_func=causal_lm_loss)


def test_hf_trainer_model_loss_float32_inside(tmp_path):
    """Without compute_loss_func the model's own loss (float32 cross entropy inside
    transformers): the same gradient to float32 precision."""
    from transformers import Trainer, TrainingArguments

    class PackedTrainer(PackedTrainerMixin, Trainer):
        pass

    samples, cost, layout, config, ds = _workload(seed=4)
    ref = reference_step_grads(tiny_llama(), ds, samples, cost, layout, config, step=0)
    grads = {}
    sampler = PackedBatchSampler(samples, cost, layout, config)
    tr = PackedTrainer(model=tiny_llama(), args=_args(TrainingArguments, tmp_path, layout, 1),
                       train_dataset=ds, packed_sampler=sampler, keep_history=True,
                       callbacks=[_first_grads_callback(grads)])
    tr.train()
    d = _check(tr, sampler, samples, ref, grads, 1e-5, epochs=1)
    print(f"HF Trainer 1 process, model loss: first-step grad diff {d:.1e}")


def _word_tokenizer():
    """A word-level tokenizer over the test vocabulary, built in memory (nothing downloaded):
    SFTTrainer needs a processing class with a pad token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "</s>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


@pytest.mark.parametrize("own_loss", [False, True])
def test_trl_sft_trainer(tmp_path, own_loss):
    need("trl")
    import datasets
    from trl import SFTConfig, SFTTrainer

    class PackedSFTTrainer(PackedTrainerMixin, SFTTrainer):
        pass

    samples, cost, layout, config, flat = _workload(seed=4)
    ds = datasets.Dataset.from_dict({"input_ids": [flat[i].tolist() for i in range(len(flat))]})
    ref = reference_step_grads(tiny_llama(), flat, samples, cost, layout, config, step=0)
    grads = {}
    sampler = PackedBatchSampler(samples, cost, layout, config)
    # SFTConfig defaults to bf16=True (autocast, also on CPU: the gradient is then off by
    # ~1e-4, bf16 precision); gradient_checkpointing=True (its default) is kept
    epochs = 1  # two epochs: test_hf_trainer_one_process
    args = _args(SFTConfig, tmp_path, layout, epochs,
                 dataset_kwargs={"skip_prepare_dataset": True}, bf16=False)
    assert args.gradient_checkpointing
    tr = PackedSFTTrainer(model=tiny_llama(), args=args, train_dataset=ds,
                          processing_class=_word_tokenizer(), packed_sampler=sampler,
                          keep_history=True, callbacks=[_first_grads_callback(grads)],
                          compute_loss_func=causal_lm_loss if own_loss else None)
    tr.train()
    # TRL's own loss (its chunked log-prob kernel) computes in float32 whatever the model dtype
    d = _check(tr, sampler, samples, ref, grads, 1e-10 if own_loss else 1e-5, epochs)
    print(f"TRL SFTTrainer {'causal_lm_loss' if own_loss else 'own loss'}: "
          f"first-step grad diff {d:.1e}")
