"""The packed batch sampler: exact length, coverage over DP ranks, plan-derived loss-token
counts, exact mid-epoch resumption (plain DataLoader and StatefulDataLoader, 0 and 2 workers)
and refusal of mismatched resumes."""
import numpy as np
import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from balancer import CostModel, Layout, PlannerConfig, SampleTable, plan_epoch
from balancer.loader.collate import FlatTokens, PackedCollator, PackedDataset
from balancer.loader.sampler import MicrobatchRef, PackedBatchSampler, rank_coordinates

COST = CostModel.quadratic(65536)


def lengths(n=400, hi=700, seed=0):
    return np.random.default_rng(seed).integers(1, hi, n)


def make(L, dp=2, cp=1, m=2, cap=1024, rank=0, **cfg):
    cfg.setdefault("over_length", "chunk")
    return PackedBatchSampler(SampleTable(L), COST, Layout(dp=dp, cp=cp, microbatches=m,
                                                           capacity=cap),
                              PlannerConfig(**cfg), dp_rank=rank)


def triplets(refs):
    return [(s, int(a), int(b)) for r in refs for s, a, b in zip(r, r.starts, r.lengths)]


def test_launched_processes_without_a_process_group_are_refused_not_all_rank_0(monkeypatch):
    # under torchrun / accelerate launch (WORLD_SIZE > 1) a sampler built before
    # init_process_group used to serve DP rank 0's microbatches in every process: the other
    # ranks' samples were never trained, silently
    import torch.distributed as dist
    assert not dist.is_initialized()
    L, lay = lengths(), Layout(dp=2, microbatches=2, capacity=1024)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2.*not initialized.*dp_rank="):
        PackedBatchSampler(SampleTable(L), COST, lay, PlannerConfig(over_length="chunk"))
    # explicit ranks, and a one-rank layout (tensor parallelism only), need no process group
    assert PackedBatchSampler(SampleTable(L), COST, lay, PlannerConfig(over_length="chunk"),
                              dp_rank=1).dp_rank == 1
    one = Layout(dp=1, microbatches=2, capacity=1024)
    assert PackedBatchSampler(SampleTable(L), COST, one, PlannerConfig(over_length="chunk"),
                              tp=2).dp_rank == 0
    monkeypatch.delenv("WORLD_SIZE")  # one process, no launcher: rank 0 (simulation, tests)
    assert PackedBatchSampler(SampleTable(L), COST, lay,
                              PlannerConfig(over_length="chunk")).dp_rank == 0


def test_lengths_as_a_list_or_array_and_bad_epochs_or_states_are_clear():
    L, lay, cfg = lengths(), Layout(dp=2, microbatches=2, capacity=1024), \
        PlannerConfig(over_length="chunk")
    ref = [list(r) for r in PackedBatchSampler(SampleTable(L), COST, lay, cfg, dp_rank=1)]
    for given in (L, L.tolist(), L.astype(np.int32)):  # was AttributeError: no 'lengths'
        s = PackedBatchSampler(given, COST, lay, cfg, dp_rank=1)
        assert [list(r) for r in s] == ref
    with pytest.raises(ValueError, match=r"sample 1: length -2 is not positive"):
        PackedBatchSampler([3, -2, 4, 5], COST, lay, cfg, dp_rank=0)
    s = PackedBatchSampler(SampleTable(L), COST, lay, cfg, dp_rank=0)
    for bad in (1.5, -1, "x", None):  # 1.5 was truncated to epoch 1, -1 planned, silently
        with pytest.raises(ValueError, match=r"set_epoch\(.*\): the epoch must be an integer >= 0"):
            s.set_epoch(bad)
    s.set_epoch(np.int64(1))
    s.set_epoch(2.0)  # an integral float (a trainer's float epoch counter) is that epoch
    assert s.epoch == 2
    for bad in (None, [1], "state"):
        with pytest.raises(ValueError, match=r"load_state_dict takes the dict of state_dict\(\)"):
            s.load_state_dict(bad)


@pytest.mark.parametrize("strategy", ["balanced", "sequential"])
def test_ranks_cover_plan_exactly_once_with_exact_len(strategy):
    L = lengths(hi=1500)
    dp = 3
    per_rank = [list(make(L, dp=dp, rank=r, strategy=strategy)) for r in range(dp)]
    s0 = make(L, dp=dp, strategy=strategy)
    plan = s0.plan
    for r, refs in enumerate(per_rank):
        assert len(refs) == len(make(L, dp=dp, rank=r, strategy=strategy)) == plan.step_mbs.sum()
        assert all(isinstance(x, MicrobatchRef) for x in refs)
        # the same number of microbatches per step on every rank, in step order
        steps = [x.step for x in refs]
        assert steps == sorted(steps)
        assert np.array_equal(np.bincount(steps, minlength=plan.n_steps), plan.step_mbs)
    # every token of every sample exactly once over all ranks (pieces included)
    cover = np.zeros(L.sum(), np.int64)
    off = np.concatenate([[0], np.cumsum(L)])
    for s, a, b in sum((triplets(x) for x in per_rank), []):
        assert a + b <= L[s]
        cover[off[s] + a: off[s] + a + b] += 1
    assert (cover == 1).all()


def test_loss_token_counts_come_from_the_plan():
    L = lengths()
    dp = 2
    refs = [list(make(L, dp=dp, rank=r)) for r in range(dp)]
    by_step = {}
    for x in sum(refs, []):
        assert x.loss_tokens == int(np.sum(x.lengths) - len(x))
        by_step.setdefault(x.step, []).append(x)
    for step, xs in by_step.items():
        total = sum(x.loss_tokens for x in xs)
        assert all(x.step_loss_tokens == total for x in xs)
        assert sum(1 for x in xs if x.slot == x.step_microbatches - 1) == dp


def test_epochs_differ_and_repeat():
    L = lengths()
    s = make(L)
    a = triplets(list(s))
    assert triplets(list(s)) == a  # a finished epoch iterates again, like DistributedSampler
    s.set_epoch(1)
    b = triplets(list(s))
    assert a and b and a != b
    s.set_epoch(0)
    assert triplets(list(s)) == a


def test_rank_coordinates_megatron_order():
    lay = Layout(dp=2, cp=2, pp=2, capacity=64)
    seen = set()
    for r in range(16):
        c = rank_coordinates(r, lay, tp=2)
        assert r == c["tp_rank"] + 2 * (c["cp_rank"] + 2 * (c["dp_rank"] + 2 * c["pp_rank"]))
        seen.add(tuple(c.values()))
    assert len(seen) == 16
    with pytest.raises(ValueError, match="rank 16 is outside"):
        rank_coordinates(16, lay, tp=2)


def test_prebuilt_plan_and_callable_source():
    L = lengths()
    s = make(L)
    lay, cfg = s.layout, s.config
    plans = {e: plan_epoch(SampleTable(L), COST, lay, cfg, e) for e in range(2)}
    p = PackedBatchSampler(plan=plans[0], dp_rank=0)
    assert triplets(list(p)) == triplets(list(s))
    with pytest.raises(ValueError, match="epoch 0 only"):
        p.set_epoch(1)
        len(p)
    c = PackedBatchSampler(plan=plans.__getitem__, dp_rank=0)
    c.set_epoch(1)
    s.set_epoch(1)
    assert triplets(list(c)) == triplets(list(s))
    with pytest.raises(ValueError, match="num_replicas 3 differs"):
        PackedBatchSampler(plan=plans[0], num_replicas=3, rank=0)


# ---- resumption -------------------------------------------------------------------------------

def test_resume_positions_and_twice_in_a_row():
    L = lengths()
    ref = make(L, rank=1)
    full = triplets(list(ref))
    n = len(ref)
    for cut in (0, n // 2, n - 1, n):
        s = make(L, rank=1)
        it = iter(s)
        head = [next(it) for _ in range(cut)]
        state = s.state_dict()
        r = make(L, rank=1)
        r.load_state_dict(state)
        assert triplets(head) + triplets(list(r)) == full
    # resume twice in a row
    s = make(L, rank=1)
    it = iter(s)
    a = [next(it) for _ in range(3)]
    r1 = make(L, rank=1)
    r1.load_state_dict(s.state_dict())
    it = iter(r1)
    b = [next(it) for _ in range(4)]
    r2 = make(L, rank=1)
    r2.load_state_dict(r1.state_dict())
    assert triplets(a + b + list(r2)) == full


def test_resume_across_epoch_boundary_with_carried_tail():
    L = lengths(n=328)  # an epoch 0 that leaves a tail to carry (under the default order)
    kw = dict(tail="carry", global_batch_tokens=3000)
    ref = make(L, **kw)
    e0 = triplets(list(ref))
    assert len(ref.plan.leftover) > 0  # the carry (delay queue across epochs) is exercised
    ref.set_epoch(1)
    e1 = triplets(list(ref))
    s = make(L, **kw)
    list(s)
    s.set_epoch(1)
    it = iter(s)
    head = [next(it) for _ in range(3)]
    state = s.state_dict()
    assert state["carry_in"] is not None and len(state["carry_in"]["sample"]) > 0
    r = make(L, **kw)
    r.load_state_dict(state)  # a fresh process: epoch 1's carry-in comes from the state
    assert triplets(head) + triplets(list(r)) == e1
    # saved after the last batch of epoch 0: nothing left, then epoch 1 whole
    s = make(L, **kw)
    list(s)
    r = make(L, **kw)
    r.load_state_dict(s.state_dict())
    assert list(r) == []
    r.set_epoch(1)
    assert triplets(list(r)) == e1 and e0 != e1


def test_pass_semantics_break_stale_iterators_and_going_back():
    L = lengths()
    s = make(L)
    full = triplets(list(s))
    it = iter(s)
    head = [next(it) for _ in range(3)]
    assert triplets(list(s)) == full  # a pass left unfinished does not move the next start
    assert s.state_dict()["position"] == len(s)
    # a pass still open when the sampler moves to another epoch ends instead of handing out
    # the new epoch's microbatches at the old pass's positions
    it = iter(s)
    next(it)
    s.set_epoch(1)
    assert list(it) == []
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["position"] == 0
    # a restored finished epoch: set_epoch going back is refused, the next epoch is fine
    s = make(L)
    s.set_epoch(2)
    list(s)
    r = make(L)
    r.load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match=r"set_epoch\(1\) .*finished epoch 2.*next epoch is 3"):
        r.set_epoch(1)
    r.set_epoch(3)
    s.set_epoch(3)
    assert triplets(list(r)) == triplets(list(s)) and len(head) == 3


@pytest.mark.parametrize("change, match", [
    (dict(dp=3), "layout"), (dict(seed=5), "seed"), (dict(strategy="sequential"), "plan is"),
])
def test_mismatched_resume_is_refused(change, match):
    L = lengths()
    s = make(L)
    next(iter(s))
    state = s.state_dict()
    r = make(L, **change)
    with pytest.raises(ValueError, match=match):
        r.load_state_dict(state)


def test_a_layout_mismatch_names_the_field():
    """A checkpoint of a sync="step" (DDP) job loaded by a sync="microbatch" (FSDP) sampler is
    refused naming the field that differs and both values (the message showed the two layout
    dicts, the default sync left out of one of them)."""
    L = lengths()
    s = PackedBatchSampler(SampleTable(L), COST, Layout(dp=2, microbatches=2, capacity=1024),
                           PlannerConfig(over_length="chunk"), dp_rank=0)
    next(iter(s))
    r = PackedBatchSampler(SampleTable(L), COST,
                           Layout(dp=2, microbatches=2, capacity=1024, sync="microbatch"),
                           PlannerConfig(over_length="chunk"), dp_rank=0)
    with pytest.raises(ValueError, match=r"layout.*differs in sync: 'step' in the checkpoint, "
                                         r"'microbatch' here"):
        r.load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match=r"differs in dp: 2 in the checkpoint, 3 here"):
        make(L, dp=3).load_state_dict(make(L).state_dict())


def test_resume_on_other_dataset_is_refused():
    s = make(lengths())
    r = make(lengths(seed=1))
    with pytest.raises(ValueError, match="dataset_fingerprint"):
        r.load_state_dict(s.state_dict())


def _loader(kind, ds, sampler, workers):
    cls = StatefulDataLoader if kind == "stateful" else DataLoader
    return cls(PackedDataset(ds), batch_sampler=sampler, collate_fn=PackedCollator(),
               num_workers=workers)


def _key(b):
    return (int(b["epoch"]), int(b["position"]), b["input_ids"].tolist(),
            b["sample_ids"].tolist())


@pytest.mark.parametrize("kind", ["plain", "stateful"])
@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_resume_is_exact(kind, workers):
    L = lengths(n=240, hi=400)
    ds = FlatTokens.from_lengths(L, vocab=50)
    kw = dict(dp=2, rank=1, cap=512, tail="carry", global_batch_tokens=1500)
    sampler = make(L, **kw)
    expected = []
    for e in range(2):
        sampler.set_epoch(e)
        expected += [_key(b) for b in _loader(kind, ds, sampler, 0)]
    n0 = len(make(L, **kw))

    # interrupt at 0, mid epoch 0, at epoch 0's last batch and mid epoch 1; resume twice
    for cuts in ([0], [n0 // 2], [n0 - 1], [n0 + 2], [2, n0 + 1]):
        got, state, done = [], None, 0
        for cut in cuts + [None]:
            s = make(L, **kw)
            dl = _loader(kind, ds, s, workers)
            if state is not None:
                (dl if kind == "stateful" else s).load_state_dict(state)
            start_epoch = s.epoch if kind == "plain" else (state or {}).get("epoch", 0)
            if kind == "stateful" and state is not None:
                start_epoch = state["sampler_epoch"]
            stop = False
            for e in range(start_epoch, 2):
                s.set_epoch(e)
                for b in dl:
                    got.append(_key(b))
                    done += 1
                    if cut is not None and done == cut + 1:
                        state = (dl.state_dict() if kind == "stateful"
                                 else s.state_dict(after=b))
                        if kind == "stateful":
                            state["sampler_epoch"] = e
                        stop = True
                        break
                if stop:
                    break
            del dl
        assert got == expected, (kind, workers, cuts)


@pytest.mark.parametrize("kw, shown", [({"dp_rank": 0.5}, "0.5"), ({"dp_rank": True}, "True"),
                                       ({"dp_rank": "1"}, "'1'"), ({"rank": 1.5}, "1.5"),
                                       ({"dp_rank": 0, "cp_rank": 0.5}, "0.5")])
def test_ranks_that_are_not_integers_are_refused(kw, shown):
    """A rank that is not an integer is one ValueError naming it (before: dp_rank=0.5 and
    True were served as ranks, '1' was a TypeError of a comparison)."""
    lay = Layout(dp=2, cp=2, microbatches=2, capacity=1024)
    with pytest.raises(ValueError, match=r"rank " + shown.replace(".", r"\.") +
                       r" is not an integer") as e:
        PackedBatchSampler(SampleTable(lengths()), COST, lay, PlannerConfig(), **kw)
    assert "\n" not in str(e.value)
    s = PackedBatchSampler(SampleTable(lengths()), COST, lay, PlannerConfig(),
                           dp_rank=np.int64(1), cp_rank=1.0)  # integral values still serve
    assert (s.dp_rank, s.cp_rank) == (1, 1) and type(s.dp_rank) is int


def test_resume_refuses_a_checkpoint_of_another_plan():
    """A checkpoint whose plan differs from the one planned here (e.g. written by a version
    that ordered or packed the epoch differently) is refused, not resumed in another order."""
    L = lengths()
    s = make(L)
    it = iter(s)
    next(it)
    state = s.state_dict()
    state["plan_fingerprint"] = "0" * len(state["plan_fingerprint"])
    r = make(L)
    with pytest.raises(ValueError, match="cannot resume: epoch 0's plan .*balancer version"):
        r.load_state_dict(state)
        list(r)
