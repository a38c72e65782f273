"""TRL ``SFTTrainer`` on the packed loader (CPU, tiny random-init Llama, in-memory tokenizer):

    python examples/trl_sft.py
    python examples/trl_sft.py --resume   # checkpoint at step 3 (mid-epoch), stop, resume

The dataset is tokenized already (``input_ids``), so TRL's preparation (its own truncation and
packing) is skipped and the plan decides the microbatches; one optimizer step = one planned
step, the loss normalised by the plan's step token count. SFTConfig defaults to ``bf16=True``
(autocast, on the CPU too); it is off here so the run is float32.
Tested with torch 2.13.0 (CPU), transformers 5.24.0, trl 1.16.0.
"""
import argparse
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TrainerCallback
from trl import SFTConfig, SFTTrainer

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig, SampleTable
from balancer.integrations.hf_trainer import PackedTrainerMixin

from _common import TESTED_WITH, VOCAB, check_exactly_once, corpus, pieces, report, tiny_llama


class PackedSFTTrainer(PackedTrainerMixin, SFTTrainer):
    pass


def word_tokenizer():
    """SFTTrainer needs a processing class with a pad token; a real run loads its own."""
    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "</s>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


class StopAt(TrainerCallback):
    """Stop after optimizer step ``at`` (its checkpoint is saved first: save_steps=at)."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            control.should_training_stop = True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--resume", action="store_true", help="checkpoint at step 3, stop, resume")
    resume = ap.parse_args(argv).resume
    lengths, dataset = corpus(seed=1)
    stop, out = 3, tempfile.mkdtemp()

    def build(callbacks=()):
        args = SFTConfig(output_dir=out, use_cpu=True, bf16=False, num_train_epochs=1,
                         gradient_accumulation_steps=2, learning_rate=1e-3, report_to=[],
                         save_strategy="steps" if resume else "no", save_steps=stop,
                         logging_steps=5, disable_tqdm=True,
                         dataset_kwargs={"skip_prepare_dataset": True})
        layout = Layout(dp=args.world_size, microbatches=2, capacity=512)
        sampler = PackedBatchSampler(SampleTable(lengths), CostModel.quadratic(4096), layout,
                                     PlannerConfig(seed=0), dp_rank=args.process_index)
        trainer = PackedSFTTrainer(model=tiny_llama(), args=args, train_dataset=dataset,
                                   processing_class=word_tokenizer(), packed_sampler=sampler,
                                   keep_history=True, callbacks=list(callbacks))
        return args, sampler, trainer

    args, sampler, trainer = build([StopAt(stop)] if resume else [])
    trainer.train()
    mine = [p for m in trainer.packed_history for p in pieces(m)]
    if resume:  # a fresh trainer from the mid-epoch checkpoint
        assert trainer.state.global_step == stop < sampler.plan.n_steps
        args, sampler, trainer = build()
        trainer.train(resume_from_checkpoint=str(Path(out) / f"checkpoint-{stop}"))
        mine += [p for m in trainer.packed_history for p in pieces(m)]
    docs = check_exactly_once(mine, lengths)  # every token once (over both runs)
    assert trainer.state.global_step == sampler.plan.n_steps
    report(example="trl_sft", processes=args.world_size, optimizer_steps=trainer.state.global_step,
           documents=docs, final_loss=trainer.state.log_history[-1].get("train_loss"),
           resumed=resume, **({"checkpoint_at_step": stop} if resume else {}),
           tested_with=TESTED_WITH)


if __name__ == "__main__":
    main()
