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

With ``--calibrate-online`` the loop also runs the closed loop (docs/closed-loop.md): a
``MicrobatchTimer`` around every microbatch's forward and backward, and an
``OnlineCalibrator`` that every 2 steps exchanges the ranks' times, refits the cost model and
re-plans the windows not yet handed out (the sampler plans in windows of 24 samples). The
checkpoint then holds the calibrator's state beside the sampler's (whose ``refits`` are the
models). Refits follow a wall clock, so an uninterrupted run and an interrupted one plan the
windows after their first refit differently and their weights differ; the script checks what
resuming determines: the restored sampler has the checkpoint's refit models (same coefficients)
and plans the rest of the epoch as the interrupted run had planned it, the resumed run trains
those microbatches unchanged until its first refit re-plans, the restored calibrator goes on at
the checkpoint's step with its observations, and over both runs every token of every sample is
trained exactly once per epoch (re-planned windows included).

    torchrun --standalone --nproc-per-node 2 examples/torchtitan_loop.py --calibrate-online

Tested with torch 2.13.0 (CPU), transformers 5.24.0.
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig, SampleTable
from balancer.loader.collate import PackedCollator, PackedDataset
from balancer.integrations.hf import model_inputs
from balancer.loader.online import OnlineCalibrator, OnlineConfig, digest
from balancer.loader.timing import MicrobatchTimer

from _common import (TESTED_WITH, check_exactly_once, corpus, pieces, report, shutdown,
                     tiny_llama)

EPOCHS = 2
WINDOW = 24  # --calibrate-online: samples per planning window (a refit re-plans from the next)


def build(lengths, dataset, world, rank, online=False):
    layout = Layout(dp=world, microbatches=2, capacity=512)
    packed = PackedDataset(dataset, loss_mask_column="completion_mask")
    config = PlannerConfig(seed=0, window_samples=WINDOW if online else None)
    sampler = PackedBatchSampler(SampleTable(lengths), CostModel.quadratic(4096), layout,
                                 config, dp_rank=rank,
                                 loss_tokens=packed.loss_tokens())  # trained tokens per step
    loader = DataLoader(packed, batch_sampler=sampler, collate_fn=PackedCollator())
    model = tiny_llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the closed loop: time every microbatch, refit every 2 steps (the first left out)
    calib = OnlineCalibrator(sampler, MicrobatchTimer("cpu"),
                             OnlineConfig(every=2, skip_steps=1)) if online else None
    return sampler, loader, model, ddp, opt, calib


def train(state, world, stop_at=None, ckpt=None, seen=None):
    """Train from the sampler's position to the end of EPOCHS, or checkpoint after global step
    ``stop_at`` and return. ``seen``: epoch -> (step, piece) of every document trained."""
    sampler, loader, model, ddp, opt, calib, step = state
    timer = calib.timer if calib is not None else None
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)  # keeps a restored position inside its epoch
        for batch in loader:
            inputs = model_inputs(batch)
            labels = inputs.pop("labels")[0, 1:]
            sync = batch["last_in_step"] or world == 1
            if timer is not None:
                timer.begin(batch, step=step)  # the microbatch's document lengths
            with (ddp.no_sync() if not sync else torch.enable_grad()):
                logits = ddp(**inputs).logits[0, :-1]
                loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100,
                                                         reduction="sum")
                if timer is not None:
                    timer.split()  # forward ends, backward begins
                (loss / batch["step_loss_tokens"] * world).backward()
            if timer is not None:
                timer.end()
            if seen is not None:
                seen.setdefault(epoch, []).extend((int(batch["step"]), p) for p in pieces(batch))
            if batch["last_in_step"]:
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                if calib is not None:
                    calib.step_done()  # every 2 steps: exchange, refit, re-plan (collective)
                if step == stop_at:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                "data": sampler.state_dict(after=batch), "step": step,
                                "online": calib.state_dict() if calib else None}, ckpt)
                    return step
    return step


def planned_rest(sampler) -> list:
    """(step, piece) of every document of this rank's microbatches of the current epoch not
    yet handed out, as the sampler's plan holds them now."""
    out = []
    for pos in range(sampler.cursor.position, len(sampler)):
        ref = sampler.ref(pos)
        out += [(ref.step, (int(i), int(a), int(n)))
                for i, a, n in zip(ref, ref.starts, ref.lengths)]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibrate-online", action="store_true",
                   help="time every microbatch, refit the cost model every 2 steps and re-plan "
                        "the windows not yet handed out (balancer.loader.online)")
    online = p.parse_args().calibrate_online
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    lengths, dataset = corpus(seed=2, completion_mask=True)

    straight = build(lengths, dataset, world, rank, online)
    steps = train((*straight, 0), world)

    ckpt = os.path.join(tempfile.gettempdir(), f"balancer-titan-{os.getpid()}-{rank}.pt")
    seen = {}
    first = build(lengths, dataset, world, rank, online)
    stop = steps * 3 // 4  # mid-epoch 1
    train((*first, 0), world, stop_at=stop, ckpt=ckpt, seen=seen)
    resumed = build(lengths, dataset, world, rank, online)
    state = torch.load(ckpt, weights_only=False)
    os.remove(ckpt)
    resumed[2].load_state_dict(state["model"])
    resumed[4].load_state_dict(state["opt"])
    resumed[0].load_state_dict(state["data"])  # re-plans the epoch from the checkpoint's refits
    figures = {}
    if online:
        old, new = first[0], resumed[0]
        resumed[5].load_state_dict(state["online"])  # after the sampler: it holds the model
        assert new.epoch == old.epoch and new.cursor.position == old.cursor.position
        coefficients = [(e, w, digest(m)) for e, w, m in new.refits]
        assert coefficients == [(e, w, digest(m)) for e, w, m in old.refits], \
            "the restored refit models differ from the checkpoint's"
        assert new.plan_fingerprint == old.plan_fingerprint
        planned = planned_rest(old)  # what the interrupted run had planned after the checkpoint
        assert planned_rest(new) == planned, "the resumed plan differs from the interrupted one"
        assert resumed[5].steps_done == stop == first[5].steps_done
        assert resumed[5].observations() == first[5].observations()
        refits_before = len(resumed[5].refit_records)
        epoch, trained = new.epoch, len(seen.get(new.epoch, []))
    end = train((*resumed, state["step"]), world, seen=seen)
    docs = [check_exactly_once([p for _, p in seen[e]], lengths) for e in range(EPOCHS)]
    if online:
        # the resumed run trains the interrupted run's plan until its first refit re-plans
        later = resumed[5].refit_records[refits_before:]
        replanned = [r["first_replanned_step"] for r in later if r["epoch"] == epoch]
        upto = min(replanned, default=10 ** 9)
        got = [x for x in seen[epoch][trained:] if x[0] < upto]
        assert got == [x for x in planned if x[0] < upto] and got, \
            "the resumed run did not train the planned microbatches"
        figures = {"refits": len(resumed[5].refit_records),
                   "restored_refit_models": len(coefficients),
                   "resumed_plan_identical": True, "replanned_after_resume_from_step": upto
                   if replanned else None,
                   "pieces_trained_as_planned_after_resume": len(got)}
        same = None  # refits follow the clock: the straight run's weights are another run's
    else:
        same = all(torch.equal(a, b) for a, b in zip(straight[2].parameters(),
                                                     resumed[2].parameters()))
        assert same and end == steps, "resumed run differs from the uninterrupted one"
    report(example="torchtitan_loop", processes=world, optimizer_steps=steps,
           checkpoint_at_step=stop, resumed_bit_identical=same, documents_per_epoch=docs,
           calibrate_online=online, **figures, tested_with=TESTED_WITH)
    del straight, first, resumed  # the DDP reducers, before the process group goes
    shutdown()


if __name__ == "__main__":
    main()
