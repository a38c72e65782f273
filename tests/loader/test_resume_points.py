"""Resumption from every point of a two-epoch run (issue #13 items 7 and 8): before and after
``set_epoch``, after every batch, after an epoch's loop has ended (saving either that epoch or
the next one as the trainer's epoch counter), with a plain DataLoader and torchdata's
StatefulDataLoader, 0 and 2 workers; the batches of the interrupted-and-resumed run must equal
an uninterrupted run's exactly. A plain DataLoader with workers reads ahead: ``state_dict()``
without ``after=`` is then an error that says what to pass."""
import copy

import numpy as np
import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from balancer import CostModel, Layout, PlannerConfig, SampleTable
from balancer.loader.collate import FlatTokens, PackedCollator, PackedDataset
from balancer.loader.sampler import PackedBatchSampler

COST = CostModel.quadratic(65536)
EPOCHS = 2
L = np.random.default_rng(11).integers(1, 400, 70)
DS = FlatTokens.from_lengths(L, vocab=50)


def sampler():
    # tail="carry": the delay queue crosses the epoch boundary, so epoch 1 depends on epoch 0
    return PackedBatchSampler(SampleTable(L), COST, Layout(dp=2, microbatches=2, capacity=512),
                              PlannerConfig(tail="carry", global_batch_tokens=1500,
                                            over_length="chunk"), dp_rank=1)


def loader(kind, s, workers):
    cls = StatefulDataLoader if kind == "stateful" else DataLoader
    return cls(PackedDataset(DS), batch_sampler=s, collate_fn=PackedCollator(),
               num_workers=workers)


def key(b):
    return (int(b["epoch"]), int(b["position"]), tuple(b["sample_ids"].tolist()),
            tuple(b["sample_starts"].tolist()), int(b["input_ids"].sum()))


def train(kind, workers, stop=None, resume=None, end_counter=0, plain_after=True):
    """A trainer's loop. ``stop``: (epoch, 'pre' | 'set' | k | 'end') where to checkpoint and
    quit; returns (batch keys, checkpoint) where a checkpoint is (state, epoch counter)."""
    s = sampler()
    dl = loader(kind, s, workers)
    start = 0
    if resume is not None:
        state, start = resume
        (dl if kind == "stateful" else s).load_state_dict(copy.deepcopy(state))
    got, last = [], None

    def checkpoint(counter):
        if kind == "stateful":
            state = dl.state_dict()
        elif workers and last is not None and plain_after:
            state = s.state_dict(after=last)
        else:
            state = s.state_dict()
        return copy.deepcopy(state), counter

    try:
        for e in range(start, EPOCHS):
            if stop == (e, "pre"):
                return got, checkpoint(e)
            s.set_epoch(e)
            if stop == (e, "set"):
                return got, checkpoint(e)
            for k, b in enumerate(dl):
                got.append(key(b))
                last = b
                if stop == (e, k):
                    return got, checkpoint(e)
            if stop == (e, "end"):
                return got, checkpoint(e + end_counter)
        return got, None
    finally:
        del dl


def points(expected):
    per_epoch = [sum(1 for k in expected if k[0] == e) for e in range(EPOCHS)]
    out = []
    for e, n in enumerate(per_epoch):
        out += [(e, "pre"), (e, "set")] + [(e, k) for k in range(n)] + [(e, "end")]
    return out


@pytest.fixture(scope="module")
def expected():
    exp = train("plain", 0)[0]
    assert len({k[0] for k in exp}) == EPOCHS and len(exp) >= 12
    return exp


@pytest.mark.parametrize("kind", ["plain", "stateful"])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_from_every_point_is_exact(kind, workers, expected):
    assert train(kind, workers)[0] == expected
    pts = points(expected)
    if workers:  # fewer points with workers (each start spawns processes): every boundary point
        n0 = sum(1 for k in expected if k[0] == 0)
        pts = [p for p in pts if not isinstance(p[1], int) or p[1] in (0, 1, n0 - 1)] + [(1, 2)]
    bad = []
    for p in pts:
        for end_counter in ((0, 1) if p[1] == "end" else (0,)):
            head, ck = train(kind, workers, stop=p, end_counter=end_counter)
            tail, _ = train(kind, workers, resume=ck)
            if head + tail != expected:
                bad.append((p, end_counter, len(head), len(tail)))
    assert not bad, bad


@pytest.mark.parametrize("kind", ["plain", "stateful"])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_twice_across_the_epoch_boundary(kind, workers, expected):
    n0 = sum(1 for k in expected if k[0] == 0)
    head, ck = train(kind, workers, stop=(0, n0 - 2))
    mid, ck = train(kind, workers, resume=ck, stop=(0, "end"), end_counter=1)
    mid2, ck = train(kind, workers, resume=ck, stop=(1, "set"))
    tail, _ = train(kind, workers, resume=ck)
    assert head + mid + mid2 + tail == expected


def test_plain_state_dict_after_set_epoch_needs_no_batch(expected):
    head, ck = train("plain", 2, stop=(1, "set"), plain_after=False)
    assert ck[0]["epoch"] == 1 and ck[0]["position"] == 0
    assert head + train("plain", 2, resume=ck)[0] == expected


# ---- item 8: read-ahead by workers is never silently lost ------------------------------------

def test_plain_loader_with_workers_refuses_state_dict_without_after():
    s = sampler()
    dl = loader("plain", s, 2)
    for b in dl:
        with pytest.raises(ValueError, match=r"state_dict\(after=batch\)") as e:
            s.state_dict()
        assert "read ahead" in str(e.value) and "StatefulDataLoader" in str(e.value)
        st = s.state_dict(after=b)
        assert (st["epoch"], st["position"]) == (0, 1)
        break
    del dl
    # once the loop has finished the epoch nothing is in flight (issue 29 item 4: this raised):
    # the state is the finished epoch, as without workers
    s = sampler()
    dl = loader("plain", s, 2)
    for b in dl:
        pass
    assert s.state_dict() == s.state_dict(after=b)
    assert s.state_dict()["position"] == len(s)
    s.set_epoch(1)  # a new epoch: nothing of it handed out yet, exact without after=
    assert (s.state_dict()["epoch"], s.state_dict()["position"]) == (1, 0)


def test_stateful_loader_with_workers_refuses_the_samplers_own_state_dict():
    s = sampler()
    dl = loader("stateful", s, 2)
    for _ in dl:
        with pytest.raises(ValueError, match=r"dl.state_dict\(\)|StatefulDataLoader"):
            s.state_dict()
        dl.state_dict()  # the loader's snapshot is exact
        break
    del dl


def test_direct_iteration_and_zero_workers_stay_exact_without_after():
    s = sampler()
    it = iter(s)
    next(it)
    next(it)
    assert s.state_dict()["position"] == 2
    s = sampler()
    for i, b in enumerate(loader("plain", s, 0)):
        assert s.state_dict()["position"] == i + 1


def test_after_a_batch_of_an_unfinished_earlier_epoch_is_refused():
    s = sampler()
    b = next(iter(loader("plain", s, 0)))
    s.set_epoch(1)
    with pytest.raises(ValueError, match=r"epoch 0 .*position 0.*would skip"):
        s.state_dict(after=b)


# ---- a loaded checkpoint and set_epoch disagree ----------------------------------------------

def test_set_epoch_away_from_an_unfinished_loaded_epoch_is_refused():
    s = sampler()
    it = iter(s)
    next(it)
    state = s.state_dict()
    r = sampler()
    r.load_state_dict(state)
    with pytest.raises(ValueError, match=r"set_epoch\(1\).*epoch 0 at microbatch 1 of \d+"):
        r.set_epoch(1)
    r.set_epoch(0)  # the same epoch resumes
    assert next(iter(r)).position == 1


def test_stateful_loader_set_epoch_before_lazy_restore_of_unfinished_epoch_is_refused():
    s = sampler()
    dl = loader("stateful", s, 0)
    for _ in dl:
        state = dl.state_dict()
        break
    r = sampler()
    dl = loader("stateful", r, 0)
    dl.load_state_dict(state)
    r.set_epoch(1)  # the loader restores the sampler only when iterated
    with pytest.raises(ValueError, match=r"set_epoch\(1\).*epoch 0 at microbatch 1"):
        next(iter(dl))
