"""PackedBatchSampler.load_state_dict refuses a damaged or hand-edited state naming the key,
before resuming anywhere. Before: a carry_in without 'length' or a refit without 'window' was a
bare KeyError, a missing 'layout' a KeyError, epoch 1.5 was read as epoch 1 (then blamed on a
'different strategy, cost model, config or data'), position '3' (a string) was accepted."""
import numpy as np
import pytest

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig


def _sampler():
    return PackedBatchSampler(np.arange(1, 300), CostModel.quadratic(64),
                              Layout(dp=2, capacity=4096, microbatches=2), PlannerConfig(),
                              dp_rank=0)


@pytest.mark.parametrize("edit,match", [
    ({"epoch": 1.5}, r"'epoch' is 1.5"),
    ({"epoch": True}, r"'epoch' is True"),
    ({"position": "3"}, r"'position' is '3'"),
    ({"position": None}, r"'position' is None"),
    ({"carry_in": {"sample": [1], "start": [0]}}, r"'carry_in'.*'length'"),
    ({"carry_in": {"sample": [1], "start": [0], "length": [5, 6]}}, r"'carry_in'.*same length"),
    ({"carry_in": [1, 2]}, r"'carry_in'"),
    ({"refits": [{"epoch": 0}]}, r"'refits'.*'window'"),
    ({"refits": "none"}, r"'refits'"),
])
def test_a_damaged_state_names_the_key(edit, match):
    state = {**_sampler().state_dict(), **edit}
    with pytest.raises(ValueError, match=match):
        _sampler().load_state_dict(state)


def test_a_missing_key_is_named():
    state = _sampler().state_dict()
    del state["layout"]
    with pytest.raises(ValueError, match=r"missing.*'layout'"):
        _sampler().load_state_dict(state)


@pytest.mark.parametrize("make", ["packed", "hybrid"])
def test_a_good_state_still_resumes(make):
    make = {"packed": _sampler, "hybrid": _hybrid}[make]
    s = make()
    it = iter(s)
    next(it)
    state = s.state_dict()
    t = make()
    t.load_state_dict(state)
    assert [list(r) for r in t] == [list(r) for r in it]


def _hybrid():
    from balancer import SampleTable
    from balancer.cost.cp import CPCostModel
    from balancer.loader.hybrid import HybridBatchSampler
    lay = Layout(dp=2, cp=2, microbatches=2, capacity=128, cp_mode="hybrid", rank_capacity=64)
    return HybridBatchSampler(SampleTable(np.arange(2, 150)),
                              CPCostModel.from_preset("llama-7b", 64), lay, rank=0)


@pytest.mark.parametrize("edit,match", [
    ({"position": 1.5}, r"'position' is 1.5"),
    ({"position": "3"}, r"'position' is '3'"),
    ({"position": True}, r"'position' is True"),
    ({"position": -1}, r"'position' is -1"),
    ({"epoch": 1.5}, r"epoch"),
])
def test_a_damaged_hybrid_state_names_the_key(edit, match):
    """The hybrid sampler read position 1.5 as 1 and '3' as 3 (found by the probe)."""
    state = {**_hybrid().state_dict(), **edit}
    with pytest.raises(ValueError, match=match):
        _hybrid().load_state_dict(state)
