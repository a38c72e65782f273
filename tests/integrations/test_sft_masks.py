"""SFT loss masks through every stack (issue 24 item 3): a chat dataset tokenized by an offline
chat template (``assistant_masks``) and a prompt/completion dataset (``completion_mask``), packed
with documents cut into pieces; the torchtitan-style loop, Megatron's ``loss_mask``, the HF
Trainer (``num_items_in_batch`` = the step's trained tokens) and TRL's SFTTrainer
(``completion_only_loss``, ``assistant_only_loss``) give a float64 first-step gradient equal to
the unpacked reference (the step's documents one per row, padded, masked by the library's rule
computed here) to 1e-12 relative, on 1 process and on 2 gloo processes."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from integration_helpers import need  # noqa: E402

transformers = need("transformers")

from integration_helpers import doc_loss_sum, tiny_llama  # noqa: E402
from sft_helpers import (IGNORE, chat_dataset, chat_tokenizer, completion_dataset,  # noqa: E402
                         conversations, plan_parts, reference_labels,
                         reference_step, rel_grad_diff, step_pieces)

TOL = 1e-12
#: (dataset kind, its mask column)
KINDS = [("chat", "assistant_masks"), ("completion", "completion_mask")]


def _dataset(kind):
    tok = chat_tokenizer()
    return tok, (chat_dataset(tok) if kind == "chat" else completion_dataset(tok))


# ---- the harness itself ----------------------------------------------------------------------
def test_offline_chat_template_marks_the_assistant_tokens():
    tok = chat_tokenizer()
    ds = chat_dataset(tok)
    convs = conversations(seed=4)
    a_id = tok.convert_tokens_to_ids("<assistant>")
    eos = tok.convert_tokens_to_ids("</s>")
    for i, (ids, mask, msgs) in enumerate(zip(ds["input_ids"], ds["assistant_masks"], convs)):
        ids, mask = np.array(ids), np.array(mask)
        assert ids.max() < 64 and len(ids) == len(mask)
        want = sum(len(m["content"].split()) + 1 for m in msgs if m["role"] == "assistant")
        assert mask.sum() == want, i  # content and the end-of-turn token of every answer
        starts = np.flatnonzero(ids == a_id)
        assert (mask[starts] == 0).all() and (mask[ids == eos] == 1).all()
    assert sum(ds["assistant_masks"][5]) == 0  # the conversation without an answer
    lengths = np.array([len(r) for r in ds["input_ids"]])
    assert lengths.max() > 96  # some are cut into pieces by plan_parts' capacity


def test_completion_dataset_masks_the_prompt():
    tok = chat_tokenizer()
    ds = completion_dataset(tok)
    for p, c, ids, mask in zip(ds["prompt"], ds["completion"], ds["input_ids"],
                               ds["completion_mask"]):
        assert len(ids) == len(mask) == len(p.split()) + len(c.split())
        assert mask == [0] * len(p.split()) + [1] * len(c.split())
        assert tok.decode(ids) == f"{p} {c}"


@pytest.mark.parametrize("kind,col", KINDS)
def test_padded_reference_equals_documents_run_alone(kind, col):
    """The reference (one row per piece, right-padded) against every piece run alone: the
    same gradient, with and without the mask (without: the existing integration reference)."""
    tok, ds = _dataset(kind)
    samples, cost, layout, config = plan_parts(ds)
    pieces = step_pieces(samples, cost, layout, config)
    # the seeds make step 0 hold a later piece of a cut document (its own slice of the mask)
    assert any(a > 0 for _, a, _ in pieces)
    for mask_col in (None, col):
        model = tiny_llama()
        ref, trained = reference_step(model, ds, mask_col, pieces)
        model.zero_grad()
        n = 0
        for s, a, ln in pieces:
            doc = np.asarray(ds[s]["input_ids"][a:a + ln])
            lab = reference_labels(doc, None if mask_col is None else ds[s][mask_col][a:a + ln])
            n += int((lab != IGNORE).sum())
            if mask_col is None:
                loss = doc_loss_sum(model, doc)
            else:
                logits = model(input_ids=torch.as_tensor(doc)[None], use_cache=False).logits[0]
                loss = torch.nn.functional.cross_entropy(
                    logits[:-1], torch.as_tensor(lab[1:]), ignore_index=IGNORE, reduction="sum")
            (loss / trained).backward()
        alone = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        assert n == trained
        d = rel_grad_diff(alone, ref)
        assert d <= TOL, (mask_col, d)
    total = sum(ln for _, _, ln in pieces)
    assert 0 < trained < total - len(pieces)  # the mask really hides tokens


# ---- the stacks (run in one process here, in each of 2 gloo ranks below) --------------------
def titan_first_step(ds, col, samples, cost, layout, config, world=1):
    """The torchtitan-style loop (examples/torchtitan_loop.py): token-sum loss over the packed
    labels / step_loss_tokens, x world under DDP. Returns (grads, step_loss_tokens, the sum of
    this rank's num_loss_tokens over the step)."""
    from torch.utils.data import DataLoader

    from balancer import PackedBatchSampler
    from balancer.integrations.hf import model_inputs
    from balancer.loader.collate import PackedCollator, PackedDataset
    pds = PackedDataset(ds, loss_mask_column=col)
    sampler = PackedBatchSampler(samples, cost, layout, config, loss_tokens=pds.loss_tokens())
    loader = DataLoader(pds, batch_sampler=sampler, collate_fn=PackedCollator())
    model = tiny_llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    mine = 0
    for batch in loader:
        inputs = model_inputs(batch)
        labels = inputs.pop("labels")[0, 1:]
        mine += int(batch["num_loss_tokens"])
        with (ddp.no_sync() if world > 1 and not batch["last_in_step"] else torch.enable_grad()):
            logits = ddp(**inputs).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE,
                                                     reduction="sum")
            (loss / batch["step_loss_tokens"] * world).backward()
        if batch["last_in_step"]:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
            del ddp
            return grads, int(batch["step_loss_tokens"]), mine
    raise AssertionError("no step")


def megatron_first_step(ds, col, samples, cost, layout, config, world=1):
    """Megatron's route: PaddedCollator + megatron_batch, loss = sum(CE * loss_mask) /
    step_loss_tokens (Megatron's masked token sum). Returns (grads, step_loss_tokens,
    this rank's loss_mask sum over the step)."""
    from torch.utils.data import DataLoader

    from balancer import PackedBatchSampler
    from balancer.integrations.megatron import PaddedCollator, megatron_batch
    from balancer.loader.collate import PackedDataset
    pds = PackedDataset(ds, loss_mask_column=col)
    sampler = PackedBatchSampler(samples, cost, layout, config, loss_tokens=pds.loss_tokens())
    loader = DataLoader(pds, batch_sampler=sampler, collate_fn=PaddedCollator())
    model = tiny_llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    mine = 0
    for batch in loader:
        mb = megatron_batch(batch)
        mask = mb["loss_mask"][0].to(torch.float64)
        mine += int(mask.sum())
        with (ddp.no_sync() if world > 1 and not batch["last_in_step"] else torch.enable_grad()):
            logits = ddp(input_ids=mb["tokens"], position_ids=mb["position_ids"],
                         use_cache=False).logits[0]
            per_token = torch.nn.functional.cross_entropy(logits, mb["labels"][0],
                                                          reduction="none")
            ((per_token * mask).sum() / batch["step_loss_tokens"] * world).backward()
        if batch["last_in_step"]:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
            del ddp
            return grads, int(batch["step_loss_tokens"]), mine
    raise AssertionError("no step")


def trainer_first_step(ds, col, samples, cost, layout, config, out_dir, trl_flag=None,
                       **mixin):
    """HF Trainer (``trl_flag`` None) or TRL SFTTrainer with ``trl_flag`` (completion_only_loss
    / assistant_only_loss) set, one optimizer step, float64 loss (causal_lm_loss). Returns
    (grads before the optimizer step, num_items_in_batch the loss got, the args'
    average_tokens_across_devices)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from balancer import PackedBatchSampler
    from balancer.integrations.hf_trainer import PackedTrainerMixin, causal_lm_loss
    grads, items = {}, []

    class FirstGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            if state.global_step == 0:
                grads.update({n.removeprefix("module."): p.grad.detach().clone()
                              for n, p in model.named_parameters()})

    def loss_fn(outputs, labels, num_items_in_batch=None):
        items.append(num_items_in_batch)
        return causal_lm_loss(outputs, labels, num_items_in_batch)

    kw = dict(output_dir=str(Path(out_dir) / "trainer"), use_cpu=True,
              gradient_accumulation_steps=layout.microbatches, max_steps=1, optim="sgd",
              learning_rate=0.1, lr_scheduler_type="constant", max_grad_norm=0.0,
              weight_decay=0.0, report_to=[], save_strategy="no", logging_steps=1000,
              disable_tqdm=True, dataloader_num_workers=0)
    extra = {}
    if trl_flag is None:
        base, args = Trainer, TrainingArguments(**kw)
    else:
        from trl import SFTConfig, SFTTrainer
        base = SFTTrainer
        args = SFTConfig(**kw, bf16=False, dataset_kwargs={"skip_prepare_dataset": True},
                         **{trl_flag: True})
        extra["processing_class"] = chat_tokenizer()

    class PackedTrainer(PackedTrainerMixin, base):
        pass

    from balancer.loader.collate import PackedDataset
    # the sampler counts the trained tokens of the mask the trainer reads (col)
    counts = PackedDataset(ds, loss_mask_column=col).loss_tokens()
    sampler = PackedBatchSampler(samples, cost, layout, config, loss_tokens=counts)
    tr = PackedTrainer(model=tiny_llama(), args=args, train_dataset=ds, packed_sampler=sampler,
                       callbacks=[FirstGrads()], compute_loss_func=loss_fn, **extra, **mixin)
    tr.train()
    assert items and all(int(x) == int(items[0]) for x in items)
    return grads, int(items[0]), bool(args.average_tokens_across_devices)


@pytest.mark.parametrize("kind,col", KINDS)
def test_titan_and_megatron_loops_one_process(kind, col):
    tok, ds = _dataset(kind)
    parts = plan_parts(ds)
    ref, trained = reference_step(tiny_llama(), ds, col, step_pieces(*parts))
    for name, fn in (("titan", titan_first_step), ("megatron", megatron_first_step)):
        grads, step_tokens, mine = fn(ds, col, *parts)
        assert step_tokens == mine == trained, (name, step_tokens, mine, trained)
        d = rel_grad_diff(grads, ref)
        assert d <= TOL, (name, d)
        print(f"{name} {kind}: {trained} trained tokens, first-step grad rel diff {d:.1e}")


@pytest.mark.parametrize("kind,col", KINDS)
def test_hf_trainer_one_process(tmp_path, kind, col):
    tok, ds = _dataset(kind)
    parts = plan_parts(ds)
    ref, trained = reference_step(tiny_llama(), ds, col, step_pieces(*parts))
    grads, items, _ = trainer_first_step(ds, col, *parts, tmp_path, loss_mask_column=col)
    assert items == trained
    d = rel_grad_diff(grads, ref)
    assert d <= TOL, d
    print(f"HF Trainer {kind}: num_items_in_batch {items}, first-step grad rel diff {d:.1e}")


@pytest.mark.parametrize("kind,col,flag", [("chat", "assistant_masks", "assistant_only_loss"),
                                           ("completion", "completion_mask",
                                            "completion_only_loss")])
def test_trl_sft_trainer_one_process(tmp_path, kind, col, flag):
    need("trl")
    tok, ds = _dataset(kind)
    parts = plan_parts(ds)
    ref, trained = reference_step(tiny_llama(), ds, col, step_pieces(*parts))
    grads, items, _ = trainer_first_step(ds, col, *parts, tmp_path, trl_flag=flag)
    assert items == trained
    d = rel_grad_diff(grads, ref)
    assert d <= TOL, d
    print(f"TRL SFTTrainer {flag}: num_items_in_batch {items}, grad rel diff {d:.1e}")


def test_trl_flags_pick_the_mask_column(tmp_path):
    """Which column the mixin reads, from TRL's flags and the dataset (no training)."""
    need("trl")
    import datasets
    from trl import SFTConfig, SFTTrainer

    from balancer import PackedBatchSampler
    from balancer.integrations.hf_trainer import PackedTrainerMixin

    class PackedSFTTrainer(PackedTrainerMixin, SFTTrainer):
        pass

    tok, ds = _dataset("completion")
    parts = plan_parts(ds)

    def columns(data, **flags):
        args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False,
                         gradient_accumulation_steps=parts[2].microbatches,
                         dataset_kwargs={"skip_prepare_dataset": True}, **flags)
        tr = PackedSFTTrainer(model=tiny_llama(), args=args, train_dataset=data,
                              processing_class=tok,
                              packed_sampler=PackedBatchSampler(*parts))
        return tr.packed_loss_columns(data)

    assert columns(ds, completion_only_loss=True)["loss_mask_column"] == "completion_mask"
    assert columns(ds)["loss_mask_column"] == "completion_mask"  # None: TRL's prompt/completion
    assert columns(ds, completion_only_loss=False)["loss_mask_column"] is None
    labelled = ds.add_column("labels", [[IGNORE] * len(r) for r in ds["input_ids"]])
    assert columns(labelled, completion_only_loss=True)["labels_column"] == "labels"
    with pytest.raises(ValueError, match="no 'completion_mask'"):
        columns(ds.remove_columns("completion_mask"), completion_only_loss=True)
    both = ds.add_column("assistant_masks", ds["completion_mask"])
    with pytest.raises(ValueError, match="one mask"):
        columns(both, completion_only_loss=True)
    assert isinstance(ds, datasets.Dataset)


# ---- 2 gloo processes ------------------------------------------------------------------------
def _rank(rank, world, out):
    import torch.distributed as dist
    res = {}
    for kind, col in KINDS:
        tok, ds = _dataset(kind)
        parts = plan_parts(ds, dp=world)
        for name, fn in (("titan", titan_first_step), ("megatron", megatron_first_step)):
            g, st, mine = fn(ds, col, *parts, world=world)
            res[f"{name}-{kind}"] = {"grads": {k: v.tolist() for k, v in g.items()},
                                     "step_tokens": st, "mine": mine}
        flag = "assistant_only_loss" if kind == "chat" else "completion_only_loss"
        for name, kw in (("trainer", {"loss_mask_column": col}), ("trl", {"trl_flag": flag})):
            g, items, avg = trainer_first_step(ds, col, *parts,
                                               Path(out) / f"{name}{kind}{rank}", **kw)
            res[f"{name}-{kind}"] = {"grads": {k: v.tolist() for k, v in g.items()},
                                     "items": items, "average": avg}
    allr = [None] * world
    dist.all_gather_object(allr, res)
    if rank == 0:
        (Path(out) / "result.json").write_text(json.dumps(allr))


@pytest.mark.slow
def test_every_stack_two_processes(tmp_path):
    need("trl")
    from tests.common.gloo import run_ranks
    run_ranks(_rank, 2, tmp_path, torchrun_env=True)
    ranks = json.loads((tmp_path / "result.json").read_text())
    for kind, col in KINDS:
        tok, ds = _dataset(kind)
        parts = plan_parts(ds, dp=2)
        ref, trained = reference_step(tiny_llama(), ds, col, step_pieces(*parts))
        for name in ("titan", "megatron", "trainer", "trl"):
            got = [r[f"{name}-{kind}"] for r in ranks]
            if name in ("titan", "megatron"):
                assert all(g["step_tokens"] == trained for g in got), name
                assert sum(g["mine"] for g in got) == trained, name  # over DP ranks
            else:  # the whole step's, or its share per process when not averaged
                assert all(g["items"] == (trained if g["average"] else trained / 2)
                           for g in got), (name, [g["items"] for g in got], trained)
            for g in got:
                d = rel_grad_diff({k: torch.tensor(v, dtype=torch.float64)
                                   for k, v in g["grads"].items()}, ref)
                assert d <= TOL, (name, kind, d)
            print(f"2 processes {name} {kind}: {trained} trained tokens, grad rel diff {d:.1e}")
