"""transformers ``Trainer`` on the packed loader, 1 or 2 processes (CPU, tiny random-init Llama):

    python examples/hf_trainer.py
    python examples/hf_trainer.py --resume      # stop mid-epoch at a checkpoint, resume it
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py

(``accelerate launch --cpu`` starts one process, or MPI ranks; ``--multi_gpu`` is its torchrun
launcher, and ``use_cpu=True`` below keeps it on the CPU with gloo.)

One optimizer step = one planned global batch (gradient_accumulation_steps = the layout's
microbatches), the loss = token sum / the plan's step_loss_tokens (``num_items_in_batch``), the
loader prepared without accelerate's re-sharding (every rank trains all of its microbatches).
The corpus is SFT data (a prompt, then a completion: TRL's ``completion_mask``):
``loss_mask_column="completion_mask"`` trains the completions only, and the sampler counts
their tokens (``loss_tokens=``), so ``num_items_in_batch`` is the step's trained tokens.
With ``--resume`` the first run saves a checkpoint at optimizer step 3 (mid-epoch) and stops
there; a fresh Trainer resumes it with ``train(resume_from_checkpoint=...)``: over both runs every
token is trained exactly once and the optimizer steps add up to the plan's.
Tested with torch 2.13.0 (CPU), transformers 5.24.0, accelerate 1.16.0.
"""
import argparse
import tempfile
from pathlib import Path

from transformers import Trainer, TrainerCallback, TrainingArguments

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig, SampleTable
from balancer.integrations.hf_trainer import PackedTrainerMixin
from balancer.loader.collate import PackedDataset

from _common import TESTED_WITH, check_exactly_once, corpus, pieces, report, tiny_llama


class PackedTrainer(PackedTrainerMixin, Trainer):
    pass


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
    lengths, dataset = corpus(completion_mask=True)
    counts = PackedDataset(dataset, loss_mask_column="completion_mask").loss_tokens()
    microbatches, stop = 2, 3
    out = tempfile.mkdtemp()

    def build(callbacks=()):
        args = TrainingArguments(
            output_dir=out, use_cpu=True, num_train_epochs=1,
            gradient_accumulation_steps=microbatches,      # one optimizer step = one plan step
            learning_rate=1e-3, report_to=[], logging_steps=5, disable_tqdm=True,
            save_strategy="steps" if resume else "no", save_steps=stop)
        layout = Layout(dp=args.world_size, microbatches=microbatches, capacity=512)
        # epochs of different lengths are fine: the mixin tells the Trainer each epoch's steps
        sampler = PackedBatchSampler(SampleTable(lengths), CostModel.quadratic(4096), layout,
                                     PlannerConfig(seed=0), dp_rank=args.process_index,
                                     loss_tokens=counts)     # the step's trained tokens
        trainer = PackedTrainer(model=tiny_llama(), args=args, train_dataset=dataset,
                                packed_sampler=sampler, keep_history=True,
                                loss_mask_column="completion_mask",
                                callbacks=list(callbacks))
        return args, sampler, trainer

    args, sampler, trainer = build([StopAt(stop)] if resume else [])
    trainer.train()
    mine = [p for m in trainer.packed_history for p in pieces(m)]
    steps = trainer.state.global_step
    figures = {}
    if resume:  # a fresh Trainer (new model, sampler, loader) from the mid-epoch checkpoint
        assert steps == stop < sampler.plan.n_steps
        ckpt = Path(out) / f"checkpoint-{stop}"
        args, sampler, trainer = build()
        trainer.train(resume_from_checkpoint=str(ckpt))
        mine += [p for m in trainer.packed_history for p in pieces(m)]
        steps = trainer.state.global_step
        figures = {"checkpoint_at_step": stop}
    docs = check_exactly_once(mine, lengths)  # every token once over all ranks (and both runs)
    assert steps == sampler.plan.n_steps
    report(example="hf_trainer", processes=args.world_size, optimizer_steps=steps,
           planned_steps_per_epoch=sampler.plan.n_steps, documents=docs,
           microbatches_per_rank=len(sampler), resumed=resume, **figures,
           tested_with=TESTED_WITH)


if __name__ == "__main__":
    main()
