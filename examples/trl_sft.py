"""TRL ``SFTTrainer`` on the packed loader, from raw conversations to training on the assistant's
tokens only (CPU, tiny random-init Llama, an in-memory tokenizer with a chat template):

    python examples/trl_sft.py
    python examples/trl_sft.py --resume   # checkpoint at step 3 (mid-epoch), stop, resume

1. tokenize the conversations with the tokenizer's chat template and
   ``return_assistant_tokens_mask=True`` (``input_ids`` + ``assistant_masks``; the template marks
   the assistant's turns with ``{% generation %}``);
2. plan the token lengths; the sampler gets the trained-token counts of the mask
   (``PackedDataset(...).loss_tokens()``) so ``step_loss_tokens`` counts assistant tokens only;
3. ``SFTConfig(assistant_only_loss=True, dataset_kwargs={"skip_prepare_dataset": True})``: the
   mixin reads ``assistant_masks`` (``completion_only_loss`` reads ``completion_mask``), the
   plan decides the microbatches, one optimizer step = one planned step, the loss normalised by
   the step's trained tokens (``num_items_in_batch``).

SFTConfig defaults to ``bf16=True`` (autocast, on the CPU too); it is off here so the run is
float32. Tested with torch 2.13.0 (CPU), transformers 5.24.0, trl 1.16.0.
"""
import argparse
import tempfile
from pathlib import Path

import datasets
import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TrainerCallback
from trl import SFTConfig, SFTTrainer

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig, SampleTable
from balancer.integrations.hf_trainer import PackedTrainerMixin
from balancer.loader.collate import PackedDataset

from _common import TESTED_WITH, VOCAB, check_exactly_once, pieces, report, tiny_llama


#: a chat template whose assistant turns (content and end-of-turn) are in {% generation %}
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<assistant> {% generation %}"
    "{{ m['content'] }} </s> {% endgeneration %}{% else %}<user> {{ m['content'] }} {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}")


class PackedSFTTrainer(PackedTrainerMixin, SFTTrainer):
    pass


def chat_tokenizer():
    """A word-level tokenizer with a chat template; a real run loads its model's own."""
    special = ["<pad>", "</s>", "<user>", "<assistant>"]
    words = [f"t{i}" for i in range(VOCAB - len(special))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words + special)},
                                     unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")
    t.chat_template = CHAT_TEMPLATE
    return t


def raw_conversations(n=96, seed=1):
    """Conversations as they come: lists of {"role", "content"} turns."""
    rng = np.random.default_rng(seed)
    say = lambda k: " ".join(f"t{i}" for i in rng.integers(0, VOCAB - 4, k))  # noqa: E731
    return [[turn for _ in range(rng.integers(1, 4))
             for turn in ({"role": "user", "content": say(rng.integers(2, 40))},
                          {"role": "assistant", "content": say(rng.integers(2, 60))})]
            for _ in range(n)]


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
    tokenizer = chat_tokenizer()
    # 1. raw conversations -> input_ids + assistant_masks
    rows = [tokenizer.apply_chat_template(c, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            for c in raw_conversations()]
    dataset = datasets.Dataset.from_dict({
        "messages": raw_conversations(),   # kept: TRL checks assistant_only_loss data is chat
        "input_ids": [list(r["input_ids"]) for r in rows],
        "assistant_masks": [list(r["assistant_masks"]) for r in rows]})
    lengths = np.array([len(r) for r in dataset["input_ids"]], np.int64)
    # 2. the trained-token counts of the mask, for the sampler's step_loss_tokens
    counts = PackedDataset(dataset, loss_mask_column="assistant_masks").loss_tokens()
    stop, out = 3, tempfile.mkdtemp()

    def build(callbacks=()):
        args = SFTConfig(output_dir=out, use_cpu=True, bf16=False, num_train_epochs=1,
                         gradient_accumulation_steps=2, learning_rate=1e-3, report_to=[],
                         save_strategy="steps" if resume else "no", save_steps=stop,
                         logging_steps=5, disable_tqdm=True,
                         assistant_only_loss=True,  # the mixin reads assistant_masks
                         dataset_kwargs={"skip_prepare_dataset": True})
        layout = Layout(dp=args.world_size, microbatches=2, capacity=512)
        sampler = PackedBatchSampler(SampleTable(lengths), CostModel.quadratic(4096), layout,
                                     PlannerConfig(seed=0), dp_rank=args.process_index,
                                     loss_tokens=counts)
        trainer = PackedSFTTrainer(model=tiny_llama(), args=args, train_dataset=dataset,
                                   processing_class=tokenizer, packed_sampler=sampler,
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
           documents=docs, tokens=int(lengths.sum()),
           trained_tokens=int(counts.per_sample.sum()), final_loss=trainer.state.log_history[-1].get("train_loss"),
           resumed=resume, **({"checkpoint_at_step": stop} if resume else {}),
           tested_with=TESTED_WITH)


if __name__ == "__main__":
    main()
