"""The closed loop's measurement in the HF Trainer (``packed_online=``): every microbatch's
training_step is timed and every K steps the per-step predicted vs measured step time and DP
imbalance go through ``Trainer.log`` (``balancer/...`` keys) and the JSON lines; a refit is
refused there (the Trainer fixes its step counts when train() starts). No wall-clock
thresholds: only that the figures exist, are positive and are per step."""
import json

import numpy as np
import pytest

from integration_helpers import need  # noqa: E402

transformers = need("transformers")

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig, SampleTable  # noqa: E402
from balancer.integrations.hf_trainer import PackedTrainerMixin, causal_lm_loss  # noqa: E402
from balancer.loader.collate import FlatTokens  # noqa: E402
from balancer.loader.online import OnlineConfig  # noqa: E402
from integration_helpers import VOCAB, tiny_llama  # noqa: E402


def _trainer(tmp_path, online, **kw):
    from transformers import Trainer, TrainingArguments

    class PackedTrainer(PackedTrainerMixin, Trainer):
        pass

    lengths = np.random.default_rng(2).integers(1, 60, 60)
    layout = Layout(dp=1, microbatches=2, capacity=128)
    sampler = PackedBatchSampler(SampleTable(lengths), CostModel.quadratic(4096), layout,
                                 PlannerConfig(seed=2))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True,
                             gradient_accumulation_steps=2, max_steps=6, optim="sgd",
                             learning_rate=0.1, report_to=[], logging_steps=1000,
                             disable_tqdm=True, dataloader_num_workers=0,
                             **{"save_strategy": "no", **kw})
    return PackedTrainer(model=tiny_llama(), args=args,
                         train_dataset=FlatTokens.from_lengths(lengths, vocab=VOCAB, seed=3),
                         packed_sampler=sampler, compute_loss_func=causal_lm_loss,
                         packed_online=online, packed_online_jsonl=tmp_path / "m.jsonl")


def test_trainer_logs_predicted_vs_measured(tmp_path):
    tr = _trainer(tmp_path, OnlineConfig(every=3, skip_steps=0, refit=False))
    fp = tr.packed_sampler.plan_fingerprint
    tr.train()
    logged = [h for h in tr.state.log_history if "balancer/step" in h]
    assert [h["balancer/step"] for h in logged] == list(range(6))
    for h in logged:
        assert h["balancer/measured_step_s"] > 0 and h["balancer/predicted_step_s"] > 0
        assert h["balancer/imbalance_measured"] == 1.0  # one rank
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(6))
    assert all(x["microbatches"] >= 1 for x in lines)
    assert tr.packed_sampler.plan_fingerprint == fp  # measured only: the plan stayed


def test_trainer_refuses_refit(tmp_path):
    with pytest.raises(ValueError, match="refit=False"):
        _trainer(tmp_path, OnlineConfig(every=3))


def test_resumed_trainer_logs_the_checkpoint_steps_on(tmp_path):
    # a run resumed from a checkpoint at step 3 logs steps 3, 4, 5 (the Trainer's), not 0, 1, 2
    tr = _trainer(tmp_path, OnlineConfig(every=3, skip_steps=0, refit=False),
                  save_strategy="steps", save_steps=3)
    tr.train()
    tr = _trainer(tmp_path, OnlineConfig(every=3, skip_steps=0, refit=False),
                  save_strategy="steps", save_steps=3)
    (tmp_path / "m.jsonl").unlink()
    tr.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    logged = [h["balancer/step"] for h in tr.state.log_history if "balancer/step" in h]
    assert logged[-3:] == [3, 4, 5]
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [3, 4, 5]
