"""torch.distributed.pipelining with the packed loader (issue 29 item 7): pipeline_steps stacks
each plan step into the rows a schedule splits, pads the short last step with empty rows, and
pipeline_loss scales each row so that the step's gradient equals the unpacked reference's under
ScheduleGPipe and Schedule1F1B, with scale_grads True (the default, which divides by the
microbatch count) and False. One stage in a one-process gloo group (the schedules' code path
for chunking, loss and gradient scaling; a per-token model, so the reference is exact), then a
small attention model cut into two stages on two gloo processes, position_ids and document_ids
handed to the stage that uses them (6 s for both schedules on 2 cores)."""
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


# --- two stages on two processes ------------------------------------------------------------
# A tiny attention model cut in two: stage 0 embeds the tokens and their positions
# (position_ids), stage 1 attends causally within each document (document_ids) and projects to
# the vocabulary. Each stage lives in its own gloo process; the schedule sends the activations
# between them and each stage gets position_ids / document_ids from its own step() call. A token
# that attended across a document boundary, or a position that did not restart at a document,
# changes the gradient, so equality with the per-document reference proves both reached the
# stages.
D = 8


class EmbedStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(10)
        self.tok = torch.nn.Parameter(torch.randn(VOCAB, D, generator=g, dtype=torch.float64))
        self.pos = torch.nn.Parameter(torch.randn(CAP, D, generator=g, dtype=torch.float64))

    def forward(self, input_ids, position_ids):
        return torch.tanh(self.tok[input_ids] + 0.5 * self.pos[position_ids])


class AttendStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.q = torch.nn.Parameter(torch.randn(D, D, generator=g, dtype=torch.float64) / D)
        self.k = torch.nn.Parameter(torch.randn(D, D, generator=g, dtype=torch.float64) / D)
        self.out = torch.nn.Parameter(torch.randn(D, VOCAB, generator=g, dtype=torch.float64))

    def forward(self, h, document_ids):
        s = h.shape[-2]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        same = document_ids[..., :, None] == document_ids[..., None, :]
        scores = (h @ self.q) @ (h @ self.k).transpose(-1, -2)
        att = torch.softmax(scores.masked_fill(~(causal & same), float("-inf")), dim=-1)
        return (att @ h + h) @ self.out


def _two_stage_reference(ds, refs):
    """Both stages' gradients of one step: every document alone (positions from 0, one
    document), summed next-token loss / step_loss_tokens."""
    emb, att = EmbedStage(), AttendStage()
    for ref in refs:
        for i, st, ln in zip(list(ref), ref.starts.tolist(), ref.lengths.tolist()):
            ids = torch.as_tensor(np.asarray(ds[i][st:st + ln]), dtype=torch.long)[None]
            if ids.shape[1] < 2:
                continue
            pos = torch.arange(ids.shape[1])[None]
            logits = att(emb(ids, pos), torch.zeros_like(ids))[0]
            loss = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")
            (loss / ref.step_loss_tokens).backward()
    return [{n: p.grad.detach().clone() for n, p in m.named_parameters()} for m in (emb, att)]


def _two_stage_rank(rank, world, out):
    """Every schedule and scale_grads in one pair of processes (a fresh stage and schedule
    each; spawning the pair is most of the test's time)."""
    import json
    from pathlib import Path

    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage
    sampler, ds = _setup()
    loader = torch.utils.data.DataLoader(PackedDataset(ds), batch_sampler=sampler,
                                         collate_fn=PackedCollator())
    refs = [sampler.ref(p) for p in range(len(sampler))]
    wants = {s: _two_stage_reference(ds, [r for r in refs if r.step == s])[rank]
             for s in range(sampler.plan.n_steps)}
    res = {"n_steps": sampler.plan.n_steps, "step_mbs": [int(x) for x in sampler.plan.step_mbs]}
    for schedule in ("ScheduleGPipe", "Schedule1F1B"):
        for scale_grads in (True, False):
            module = EmbedStage() if rank == 0 else AttendStage()
            stage = PipelineStage(module, stage_index=rank, num_stages=world,
                                  device=torch.device("cpu"))
            sched = getattr(pipelining, schedule)(stage, n_microbatches=M,
                                                  loss_fn=pipeline_loss, scale_grads=scale_grads)
            diffs, rows, losses_seen = [], [], []
            for step in pipeline_steps(loader, M, CAP, scale_grads=scale_grads):
                module.zero_grad()
                if rank == 0:
                    sched.step(step.input_ids, position_ids=step.position_ids)
                else:
                    losses = []
                    sched.step(document_ids=step.document_ids, target=step.target,
                               losses=losses, loss_kwargs=step.loss_kwargs)
                    losses_seen.append(float(sum(float(x) for x in losses)))
                want = wants[step.step]
                diffs.append(max(float((p.grad - want[n]).abs().max())
                                 for n, p in module.named_parameters()))
                rows.append([step.step, step.microbatches])
            res[f"{schedule} scale_grads={scale_grads}"] = {
                "diffs": diffs, "rows": rows, "losses": losses_seen}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(res))


def test_two_stages_on_two_processes(tmp_path):
    """Schedule1F1B and ScheduleGPipe (scale_grads True and False) over pipeline_steps with
    each stage in its own process: every planned step once, the short last step through the
    schedule built for the full count, both stages' gradients equal to the reference."""
    import json

    from tests.common.gloo import run_ranks
    run_ranks(_two_stage_rank, 2, tmp_path, timeout_s=300)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["step_mbs"][-1] < M  # the plan's last step is short
    runs = [k for k in r0 if k.startswith("Schedule")]
    assert len(runs) == 4
    for k in runs:
        assert r0[k]["rows"] == r1[k]["rows"] == [[s, m] for s, m in enumerate(r0["step_mbs"])], k
        assert len(r1[k]["losses"]) == r0["n_steps"] and all(x > 0 for x in r1[k]["losses"]), k
        worst = max(r0[k]["diffs"] + r1[k]["diffs"])
        assert worst <= 1e-12, (k, r0[k]["diffs"], r1[k]["diffs"])
