"""torch.distributed.pipelining with the packed loader (issue 29 item 7): pipeline_steps stacks
each plan step into the rows a schedule splits, pads the short last step with empty rows, and
pipeline_loss scales each row so that the step's gradient equals the unpacked reference's under
ScheduleGPipe and Schedule1F1B, with scale_grads True (the default, which divides by the
microbatch count) and False. One stage in a one-process gloo group (the schedules' code path
for chunking, loss and gradient scaling); a per-token model, so the reference is exact."""
import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig, SampleTable
from balancer.integrations.pipelining import pipeline_loss, pipeline_steps
from balancer.loader.collate import FlatTokens, PackedCollator, PackedDataset

VOCAB, M, CAP = 32, 3, 128


class TokenModel(torch.nn.Module):
    """logits[b, t] from token t alone: packing cannot change a token's loss."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, 8, generator=g, dtype=torch.float64))
        self.out = torch.nn.Parameter(torch.randn(8, VOCAB, generator=g, dtype=torch.float64))

    def forward(self, input_ids):
        return torch.tanh(self.emb[input_ids]) @ self.out


def _setup():
    lengths = np.random.default_rng(3).integers(1, 60, 41)
    samples = SampleTable(lengths)
    sampler = PackedBatchSampler(samples, CostModel.quadratic(4096),
                                 Layout(dp=1, microbatches=M, capacity=CAP),
                                 PlannerConfig(seed=1), dp_rank=0)
    ds = FlatTokens.from_lengths(lengths, vocab=VOCAB, seed=2)
    return sampler, ds


def _reference(model, ds, refs):
    """Gradient of one step: every document alone, summed next-token loss / step_loss_tokens."""
    model.zero_grad()
    for ref in refs:
        for i, st, ln in zip(list(ref), ref.starts.tolist(), ref.lengths.tolist()):
            ids = torch.as_tensor(np.asarray(ds[i][st:st + ln]), dtype=torch.long)
            if ids.shape[0] > 1:
                loss = torch.nn.functional.cross_entropy(model(ids)[:-1], ids[1:],
                                                         reduction="sum")
                (loss / ref.step_loss_tokens).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def gloo_group(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    init = f"file://{tmp_path_factory.mktemp('pp') / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("scale_grads", [True, False])
@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_steps_give_the_reference_gradient(gloo_group, schedule, scale_grads):
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage
    sampler, ds = _setup()
    step_mbs = sampler.plan.step_mbs
    assert step_mbs[-1] < M  # the plan's last step is short: padded with empty rows
    loader = torch.utils.data.DataLoader(PackedDataset(ds), batch_sampler=sampler,
                                         collate_fn=PackedCollator())
    model, ref_model = TokenModel(), TokenModel()
    stage = PipelineStage(model, stage_index=0, num_stages=1, device=torch.device("cpu"))
    sched = getattr(pipelining, schedule)(stage, n_microbatches=M, loss_fn=pipeline_loss,
                                          scale_grads=scale_grads)
    refs = [sampler.ref(p) for p in range(len(sampler))]
    steps = 0
    for step in pipeline_steps(loader, M, CAP, scale_grads=scale_grads):
        assert step.input_ids.shape == step.target.shape == step.position_ids.shape == (M, CAP)
        assert step.microbatches == int(step_mbs[step.step])
        assert (step.target[step.microbatches:] == -100).all()
        model.zero_grad()
        sched.step(step.input_ids, target=step.target, loss_kwargs=step.loss_kwargs)
        want = _reference(ref_model, ds, [r for r in refs if r.step == step.step])
        for n, p in model.named_parameters():
            assert float((p.grad - want[n]).abs().max()) <= 1e-12, (step.step, n)
        steps += 1
    assert steps == sampler.plan.n_steps


def test_refusals():
    sampler, ds = _setup()
    batches = list(torch.utils.data.DataLoader(PackedDataset(ds), batch_sampler=sampler,
                                               collate_fn=PackedCollator()))
    with pytest.raises(ValueError, match=r"built for n_microbatches=2"):
        list(pipeline_steps(batches, 2, CAP))
    longest = max(int(b["input_ids"].shape[0]) for b in batches)
    with pytest.raises(ValueError, match=rf"holds {longest} tokens, more than seq_len=10"):
        list(pipeline_steps(batches, M, 10))
    with pytest.raises(ValueError, match=r"the loader ended inside step 0"):
        list(pipeline_steps(batches[:1], M, CAP))
    with pytest.raises(ValueError, match=r"step 0 ended without its last microbatch"):
        list(pipeline_steps(batches[:1] + batches[M:], M, CAP))
