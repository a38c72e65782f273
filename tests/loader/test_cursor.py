"""One resume contract for both samplers (issue 28 item 1, issue 30 item 2, issue 29 item 4):
the packed and the hybrid sampler share :class:`balancer.loader.cursor.EpochCursor`, so what one
refuses the other refuses and what one resumes exactly the other does too. A DataLoader with
workers reads ahead of the training loop: a state without ``after=`` taken mid-epoch is refused
(the hybrid sampler used to report position 5 of 76 after one trained batch and silently skip 4
rounds on resume); a checkpoint taken after ``set_epoch(e + 1)`` resumes at epoch e + 1 (the
hybrid sampler resumed at e + 2); after the loop has finished an epoch nothing is in flight and
the state is the next epoch's start (it raised)."""
import ast
import copy
import pickle
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from balancer import CostModel, Layout, PlannerConfig, SampleTable
from balancer.cost.cp import CPCostModel
from balancer.loader.collate import FlatTokens, PackedCollator, PackedDataset
from balancer.loader.hybrid import HybridBatchSampler, HybridCollator
from balancer.loader.refs import HybridRef, MicrobatchRef
from balancer.loader.sampler import PackedBatchSampler

CAP = 64
L = np.random.default_rng(5).integers(2, 3 * CAP, 160).astype(np.int64)
DS = FlatTokens.from_lengths(L, vocab=50)


def packed():
    return PackedBatchSampler(SampleTable(L), CostModel.quadratic(4096),
                              Layout(dp=2, microbatches=2, capacity=4 * CAP),
                              PlannerConfig(global_batch_tokens=1500, over_length="chunk"),
                              dp_rank=1)


def hybrid():
    return HybridBatchSampler(SampleTable(L), CPCostModel.from_preset("llama-7b", CAP),
                              Layout(dp=2, cp=2, microbatches=2, capacity=2 * CAP,
                                     cp_mode="hybrid", rank_capacity=CAP),
                              seed=7, rank=2)


KINDS = {"packed": (packed, PackedCollator), "hybrid": (hybrid, HybridCollator)}


def loader(kind, s, workers):
    return DataLoader(PackedDataset(DS), batch_sampler=s, collate_fn=KINDS[kind][1](),
                      num_workers=workers)


def keys(sampler_state_pairs):
    return [(r.epoch, r.position, list(r)) for r in sampler_state_pairs]


@pytest.mark.parametrize("kind", ["packed", "hybrid"])
def test_state_without_after_mid_epoch_with_workers_is_refused(kind):
    make = KINDS[kind][0]
    s = make()
    dl = loader(kind, s, 2)
    for b in dl:  # one trained batch: the workers have been handed several more
        with pytest.raises(ValueError, match=r"read ahead.*state_dict\(after=batch\)"):
            s.state_dict()
        st = s.state_dict(after=b)
        assert (st["epoch"], st["position"]) == (0, 1)
        break
    del dl
    r = make()
    r.load_state_dict(st)
    assert [x.position for x in r] == list(range(1, len(r)))


@pytest.mark.parametrize("kind", ["packed", "hybrid"])
def test_checkpoint_after_set_epoch_resumes_that_epoch(kind):
    make = KINDS[kind][0]
    s = make()
    list(s)
    s.set_epoch(1)
    st = s.state_dict()
    assert (st["epoch"], st["position"]) == (1, 0)
    r = make()
    r.load_state_dict(copy.deepcopy(st))
    r.set_epoch(1)
    s1 = make()
    s1.set_epoch(1)
    assert keys(r) == keys(s1) and len(s1) > 0
    # the same with workers and after= the batch that ended epoch 0
    s = make()
    for b in loader(kind, s, 2):
        pass
    s.set_epoch(1)
    assert s.state_dict(after=b)["epoch"] == 1 and s.state_dict(after=b)["position"] == 0


@pytest.mark.parametrize("kind", ["packed", "hybrid"])
def test_state_after_the_loop_finished_an_epoch_with_workers_is_the_next_start(kind):
    make = KINDS[kind][0]
    s0 = make()
    list(s0)
    exact = s0.state_dict()  # no workers: the finished epoch 0, i.e. epoch 1 starts next
    s = make()
    for b in loader(kind, s, 2):
        pass
    st = s.state_dict()
    assert (st["epoch"], st["position"]) == (exact["epoch"], exact["position"])
    assert st == s.state_dict(after=b)
    for counter in (0, 1):  # whichever epoch counter the trainer saved
        r = make()
        r.load_state_dict(copy.deepcopy(st))
        r.set_epoch(counter)
        got = keys(r)
        if counter == 0:
            assert got == []
            r.set_epoch(1)
            got = keys(r)
        s1 = make()
        s1.set_epoch(1)
        assert got == keys(s1)


def test_refs_are_typed_a_misspelt_field_is_an_error():
    with pytest.raises(TypeError, match="cp_rnak"):
        MicrobatchRef([0, 1], cp=2, cp_rnak=1)
    with pytest.raises(TypeError, match="grup_size"):
        HybridRef([0], grup_size=2)
    r = MicrobatchRef([3, 4], cp=2, cp_rank=1, epoch=0, position=5)
    with pytest.raises(AttributeError):
        r.postion = 3
    back = pickle.loads(pickle.dumps(r))
    assert back == [3, 4] and (back.cp, back.cp_rank, back.position) == (2, 1, 5)
    assert type(back) is MicrobatchRef
    c = copy.deepcopy(r)
    assert c.position == 5 and c.replace(cp=1).cp == 1 and c.cp == 2
    assert r.batch_meta() == {"epoch": 0, "position": 5}


def test_no_frame_inspection_in_the_loader():
    """The loader learns how it is read through documented means (refs leaving the process,
    torchdata's Stateful iterator), never by reading its callers' frames."""
    root = Path(__file__).resolve().parents[2] / "balancer"
    bad = []
    for p in sorted(root.rglob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Attribute) and n.attr in ("_getframe", "f_back", "f_locals"):
                bad.append(f"{p.relative_to(root)}:{n.lineno}: {n.attr}")
    assert not bad, bad


def test_hybrid_stateful_loader_with_workers_resumes_exactly():
    """The hybrid sampler is snapshotted by a StatefulDataLoader as the packed one is (its pass
    is torchdata-Stateful): stop after 3 batches, resume in fresh objects, same rounds."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def run(state=None, stop=None):
        s = hybrid()
        dl = StatefulDataLoader(PackedDataset(DS), batch_sampler=s, collate_fn=HybridCollator(),
                                num_workers=2)
        if state is not None:
            dl.load_state_dict(state)
        got = []
        for b in dl:
            got.append(int(b["position"]))
            if stop is not None and len(got) == stop:
                with pytest.raises(ValueError, match="dl.state_dict"):
                    s.state_dict()  # the user's own call between two snapshots is refused
                return got, dl.state_dict()
        return got, None

    full, _ = run()
    head, st = run(stop=3)
    tail, _ = run(state=st)
    assert head + tail == full == list(range(len(hybrid())))
