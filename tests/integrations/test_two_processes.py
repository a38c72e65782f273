"""accelerate and the HF Trainer on 2 gloo processes (spawned as torchrun would start them by the
suite's harness, tests/common/gloo.py: the group on a file:// rendezvous, timeouts): every token
of every sample is trained exactly once per epoch, one optimizer step is one planned global batch,
and the gradient of the first step equals the single-process reference (every document run alone,
loss summed over both DP ranks divided by the plan's step token count)."""
import pytest
import json
from pathlib import Path

import torch

from integration_helpers import need  # noqa: E402

need("transformers")
need("accelerate")

import torch.distributed as dist  # noqa: E402

from integration_helpers import (coverage, max_grad_diff, reference_step_grads,  # noqa: E402
                                 tiny_llama, workload)
from tests.common.gloo import run_ranks  # noqa: E402

WORLD = 2


def _rank(rank, world, out):
    res = {"accelerate": _accelerate_loop(rank), "trainer": _hf_trainer(rank, out)}
    allr = [None] * world
    dist.all_gather_object(allr, res)
    if rank == 0:
        (Path(out) / "result.json").write_text(json.dumps(allr))


def _pieces(sample_ids, starts, lengths):
    return [list(map(int, t)) for t in zip(sample_ids, starts, lengths)]


def _grads(model):
    return {n.removeprefix("module."): p.grad.detach().clone().tolist()
            for n, p in model.named_parameters()}


def _accelerate_loop(rank):
    """An explicit accelerate loop: no_sync inside a step, token-sum loss / step_loss_tokens."""
    from accelerate import Accelerator

    from balancer import PackedBatchSampler
    from balancer.loader.collate import PackedCollator, PackedDataset
    from balancer.integrations.accelerate import check_not_resharded, prepare_loader, step_loss
    from balancer.integrations.hf import model_inputs

    samples, cost, layout, config, ds = workload()
    acc = Accelerator(cpu=True)
    assert acc.num_processes == WORLD
    sampler = PackedBatchSampler(samples, cost, layout, config)  # ranks from the group

    def loader(s):
        return torch.utils.data.DataLoader(PackedDataset(ds), batch_sampler=s,
                                           collate_fn=PackedCollator())
    # the plain call would train half of this rank's microbatches: check_not_resharded refuses
    # it, and iterating it is refused before the first batch reaches the loop (accelerate's
    # loader reads one batch ahead: the second microbatch fetched is refused), on every rank
    plain = acc.prepare(loader(PackedBatchSampler(samples, cost, layout, config)))
    try:
        check_not_resharded(plain)
        refused = False
    except ValueError:
        refused = True
    plain_count, plain_error = 0, None
    try:
        for _ in plain:
            plain_count += 1
    except ValueError as e:
        plain_error = str(e)
    dl = prepare_loader(acc, loader(sampler))
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    pieces, first = [], None
    for b in dl:
        pieces += _pieces(b["sample_ids"].tolist(), b["sample_starts"].tolist(),
                          torch.diff(b["cu_seqlens"]).tolist())
        inputs = model_inputs(b)
        labels = inputs.pop("labels")
        ctx = acc.no_sync(model) if not b["last_in_step"] else torch.enable_grad()
        with ctx:
            logits = model(**inputs).logits[0]
            loss = torch.nn.functional.cross_entropy(
                logits[:-1], labels[0, 1:], ignore_index=-100, reduction="sum")
            # the documented loss: DDP averages gradients over the DP ranks, step_loss scales
            acc.backward(step_loss(loss, b, acc))
        if b["last_in_step"]:
            if first is None:
                first = _grads(model)
            opt.step()
            opt.zero_grad()
    return {"len": len(sampler), "plain": plain_count, "plain_error": plain_error,
            "refused": refused, "pieces": pieces,
            "grads": first}


def _hf_trainer(rank, out):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from balancer import PackedBatchSampler
    from balancer.loader.collate import PackedDataset
    from balancer.integrations.hf_trainer import PackedTrainerMixin, causal_lm_loss

    samples, cost, layout, config, ds = workload()
    grads = {}

    class FirstGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            if state.global_step == 0:
                grads.update(_grads(model))

    class PackedTrainer(PackedTrainerMixin, Trainer):
        pass

    args = TrainingArguments(
        output_dir=str(Path(out) / "trainer"), use_cpu=True,
        gradient_accumulation_steps=layout.microbatches, num_train_epochs=2, optim="sgd",
        learning_rate=0.1, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        report_to=[], save_strategy="no", logging_steps=1000, disable_tqdm=True,
        dataloader_num_workers=0)
    sampler = PackedBatchSampler(samples, cost, layout, config)
    tr = PackedTrainer(model=tiny_llama(), args=args, train_dataset=PackedDataset(ds),
                       packed_sampler=sampler, keep_history=True, callbacks=[FirstGrads()],
                       compute_loss_func=causal_lm_loss)  # float64 loss: exact to 1e-10
    tr.train()
    by_epoch = {}
    for m in tr.packed_history:
        by_epoch.setdefault(int(m["epoch"]), []).extend(
            _pieces(m["sample_ids"].tolist(), m["sample_starts"].tolist(), m["lengths"].tolist()))
    return {"len": len(sampler), "global_steps": tr.state.global_step,
            "n_steps": sampler.plan.n_steps, "pieces": by_epoch, "grads": grads}


@pytest.mark.slow
def test_accelerate_and_trainer_two_processes(tmp_path):
    run_ranks(_rank, WORLD, tmp_path, torchrun_env=True)
    ranks = json.loads((tmp_path / "result.json").read_text())
    samples, cost, layout, config, ds = workload()
    ref = reference_step_grads(tiny_llama(), ds, samples, cost, layout, config, step=0)
    lengths = samples.lengths
    # accelerate: the plain prepare is refused before its first batch (it trained half of the
    # microbatches before, and hung under DDP); prepare_loader loses nothing
    acc = [r["accelerate"] for r in ranks]
    assert all(a["refused"] for a in acc)
    assert all(a["plain"] == 0 for a in acc), [(a["plain"], a["len"]) for a in acc]
    assert all("prepare_loader(accelerator, loader)" in a["plain_error"] for a in acc)
    assert (coverage([p for a in acc for p in a["pieces"]], lengths) == 1).all()
    for a in acc:
        got = {k: torch.tensor(v, dtype=torch.float64) for k, v in a["grads"].items()}
        d = max_grad_diff(got, ref)
        assert d <= 1e-10, d
    # HF Trainer: both epochs exactly once, one optimizer step per planned step
    trs = [r["trainer"] for r in ranks]
    for epoch in ("0", "1"):
        assert (coverage([p for t in trs for p in t["pieces"][epoch]], lengths) == 1).all()
    for t in trs:
        assert t["global_steps"] == 2 * t["n_steps"]
        got = {k: torch.tensor(v, dtype=torch.float64) for k, v in t["grads"].items()}
        d = max_grad_diff(got, ref)
        assert d <= 1e-10, d
    print(f"accelerate plain prepare: refused after {[a['plain'] for a in acc]} of "
          f"{[a['len'] for a in acc]} microbatches in the loop; prepare_loader grad diff {max_grad_diff(got, ref):.1e}")
