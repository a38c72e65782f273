"""TRL ``SFTTrainer`` on the packed loader (CPU, tiny random-init Llama, in-memory tokenizer):

    python examples/trl_sft.py

The dataset is tokenized already (``input_ids``), so TRL's preparation (its own truncation and
packing) is skipped and the plan decides the microbatches; one optimizer step = one planned
step, the loss normalised by the plan's step token count. SFTConfig defaults to ``bf16=True``
(autocast, on the CPU too); it is off here so the run is float32.
Tested with torch 2.13.0 (CPU), transformers 5.24.0, trl 1.16.0.
"""
import tempfile

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
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


def main():
    lengths, dataset = corpus(seed=1)
    args = SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, num_train_epochs=1,
                     gradient_accumulation_steps=2, learning_rate=1e-3, report_to=[],
                     save_strategy="no", logging_steps=5, disable_tqdm=True,
                     dataset_kwargs={"skip_prepare_dataset": True})
    layout = Layout(dp=args.world_size, microbatches=2, capacity=512)
    sampler = PackedBatchSampler(SampleTable(lengths), CostModel.quadratic(4096), layout,
                                 PlannerConfig(seed=0), dp_rank=args.process_index)
    trainer = PackedSFTTrainer(model=tiny_llama(), args=args, train_dataset=dataset,
                               processing_class=word_tokenizer(), packed_sampler=sampler,
                               keep_history=True)
    trainer.train()
    docs = check_exactly_once([p for m in trainer.packed_history for p in pieces(m)], lengths)
    assert trainer.state.global_step == sampler.plan.n_steps
    report(example="trl_sft", processes=args.world_size, optimizer_steps=trainer.state.global_step,
           documents=docs, final_loss=trainer.state.log_history[-1].get("train_loss"),
           tested_with=TESTED_WITH)


if __name__ == "__main__":
    main()
