"""A torchtitan-style explicit training loop on the packed loader, with checkpoint and resume of
the data position (CPU, tiny random-init Llama; DDP on gloo under torchrun):

    python examples/torchtitan_loop.py
    torchrun --standalone --nproc-per-node 2 examples/torchtitan_loop.py

Per step: this rank's planned microbatches, ``no_sync`` on all but the last, the loss = token sum
/ the whole step's trained tokens over every rank (``step_loss_tokens``, from the plan: no
collective), times the DP size because DDP averages gradients. The corpus is SFT data: a
prompt then a completion (TRL's ``completion_mask``); ``PackedDataset(loss_mask_column=)``
makes ``labels`` -100 on the prompts, and the sampler's ``loss_tokens=`` counts the completion
tokens only, so the loss is the completion-token mean of the step. The loop is the same as for
pretraining data. The script trains 2 epochs once
straight through, then again stopping mid-epoch 1 with a checkpoint (model, optimizer and
``sampler.state_dict(after=batch)``), and resumes from it in fresh objects: the final weights are
bit-identical and every token is trained exactly once per epoch.
Tested with torch 2.13.0 (CPU), transformers 5.24.0.
"""
import os
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig, SampleTable
from balancer.loader.collate import PackedCollator, PackedDataset
from balancer.integrations.hf import model_inputs

from _common import (TESTED_WITH, check_exactly_once, corpus, pieces, report, shutdown,
                     tiny_llama)

EPOCHS = 2


def build(lengths, dataset, world, rank):
    layout = Layout(dp=world, microbatches=2, capacity=512)
    packed = PackedDataset(dataset, loss_mask_column="completion_mask")
    sampler = PackedBatchSampler(SampleTable(lengths), CostModel.quadratic(4096), layout,
                                 PlannerConfig(seed=0), dp_rank=rank,
                                 loss_tokens=packed.loss_tokens())  # trained tokens per step
    loader = DataLoader(packed, batch_sampler=sampler, collate_fn=PackedCollator())
    model = tiny_llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return sampler, loader, model, ddp, opt


def train(state, world, stop_at=None, ckpt=None, seen=None):
    """Train from the sampler's position to the end of EPOCHS, or checkpoint after global step
    ``stop_at`` and return."""
    sampler, loader, model, ddp, opt, step = state
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)  # keeps a restored position inside its epoch
        for batch in loader:
            inputs = model_inputs(batch)
            labels = inputs.pop("labels")[0, 1:]
            sync = batch["last_in_step"] or world == 1
            with (ddp.no_sync() if not sync else torch.enable_grad()):
                logits = ddp(**inputs).logits[0, :-1]
                loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100,
                                                         reduction="sum")
                (loss / batch["step_loss_tokens"] * world).backward()
            if seen is not None:
                seen.setdefault(epoch, []).extend(pieces(batch))
            if batch["last_in_step"]:
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                if step == stop_at:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                "data": sampler.state_dict(after=batch), "step": step}, ckpt)
                    return step
    return step


def main():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    lengths, dataset = corpus(seed=2, completion_mask=True)

    straight = build(lengths, dataset, world, rank)
    steps = train((*straight, 0), world)

    ckpt = os.path.join(tempfile.gettempdir(), f"balancer-titan-{os.getpid()}-{rank}.pt")
    seen = {}
    first = build(lengths, dataset, world, rank)
    stop = steps * 3 // 4  # mid-epoch 1
    train((*first, 0), world, stop_at=stop, ckpt=ckpt, seen=seen)
    resumed = build(lengths, dataset, world, rank)
    state = torch.load(ckpt, weights_only=False)
    os.remove(ckpt)
    resumed[2].load_state_dict(state["model"])
    resumed[4].load_state_dict(state["opt"])
    resumed[0].load_state_dict(state["data"])
    end = train((*resumed, state["step"]), world, seen=seen)

    same = all(torch.equal(a, b) for a, b in zip(straight[2].parameters(),
                                                 resumed[2].parameters()))
    assert same and end == steps, "resumed run differs from the uninterrupted one"
    docs = [check_exactly_once(seen[e], lengths) for e in range(EPOCHS)]
    report(example="torchtitan_loop", processes=world, optimizer_steps=steps,
           checkpoint_at_step=stop, resumed_bit_identical=same, documents_per_epoch=docs,
           tested_with=TESTED_WITH)
    del straight, first, resumed  # the DDP reducers, before the process group goes
    shutdown()


if __name__ == "__main__":
    main()
