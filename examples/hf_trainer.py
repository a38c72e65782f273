"""transformers ``Trainer`` on the packed loader, 1 or 2 processes (CPU, tiny random-init Llama):

    python examples/hf_trainer.py
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py

(``accelerate launch --cpu`` starts one process, or MPI ranks; ``--multi_gpu`` is its torchrun
launcher, and ``use_cpu=True`` below keeps it on the CPU with gloo.)

One optimizer step = one planned global batch (gradient_accumulation_steps = the layout's
microbatches), the loss = token sum / the plan's step_loss_tokens (``num_items_in_batch``), the
loader prepared without accelerate's re-sharding (every rank trains all of its microbatches).
Tested with torch 2.13.0 (CPU), transformers 5.24.0, accelerate 1.16.0.
"""
import tempfile

from transformers import Trainer, TrainingArguments

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig, SampleTable
from balancer.integrations.hf_trainer import PackedTrainerMixin

from _common import TESTED_WITH, check_exactly_once, corpus, pieces, report, tiny_llama


class PackedTrainer(PackedTrainerMixin, Trainer):
    pass


def main():
    lengths, dataset = corpus()
    microbatches = 2
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), use_cpu=True, num_train_epochs=1,
        gradient_accumulation_steps=microbatches,          # one optimizer step = one plan step
        learning_rate=1e-3, report_to=[], save_strategy="no", logging_steps=5,
        disable_tqdm=True)
    layout = Layout(dp=args.world_size, microbatches=microbatches, capacity=512)
    # epochs of different lengths are fine: the mixin tells the Trainer each epoch's steps
    config = PlannerConfig(seed=0)
    sampler = PackedBatchSampler(SampleTable(lengths), CostModel.quadratic(4096), layout, config,
                                 dp_rank=args.process_index)
    trainer = PackedTrainer(model=tiny_llama(), args=args, train_dataset=dataset,
                            packed_sampler=sampler, keep_history=True)
    trainer.train()
    mine = [p for m in trainer.packed_history for p in pieces(m)]
    docs = check_exactly_once(mine, lengths)  # every token once over all ranks
    assert trainer.state.global_step == sampler.plan.n_steps
    report(example="hf_trainer", processes=args.world_size,
           optimizer_steps=trainer.state.global_step,
           planned_steps_per_epoch=sampler.plan.n_steps, documents=docs,
           microbatches_per_rank=len(sampler), tested_with=TESTED_WITH)


if __name__ == "__main__":
    main()
