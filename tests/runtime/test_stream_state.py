"""A StreamingPackedDataset checkpoint is checked before it is used (issue 30 item 3): it records
the rank and world size it was taken on and is refused on another (a state from another rank
duplicated 6 samples and lost 7; from another world size lost 65), a microbatch index past the
step or an unknown phase is refused instead of looping forever, negative counts are refused
instead of re-training samples, and a corrupted state is one ValueError naming the stream
checkpoint and the key, never a bare KeyError or int() error."""
import copy

import pytest

from balancer import CostModel, Layout
from balancer.runtime import StreamingPackedDataset
from tests.common.rows import ListRows

CAP = 64


def make():
    return StreamingPackedDataset(ListRows([5, 30, 12, 60, 7, 44, 9, 3, 50, 21, 8, 16]),
                                  CostModel.quadratic(128),
                                  Layout(dp=1, microbatches=2, capacity=CAP), id_column="id")


def state_after(k):
    ds = make()
    it = iter(ds)
    for _ in range(k):
        next(it)
    return ds.state_dict()


def test_state_records_rank_and_world_and_refuses_another():
    st = state_after(1)
    assert (st["rank"], st["world_size"]) == (0, 1)
    for key, value, match in (("rank", 1, r"rank 1 .* this process is rank 0"),
                              ("world_size", 2, r"world size 2 .* this job's world size is 1")):
        bad = copy.deepcopy(st)
        bad[key] = value
        ds = make()
        with pytest.raises(ValueError, match=match):
            ds.load_state_dict(bad)
            list(ds)


@pytest.mark.parametrize("change, match", [
    ({"mb": 10 ** 6}, r"mb 1000000"),
    ({"mb": -1}, r"mb -1"),
    ({"phase": "reed"}, r"phase 'reed'"),
    ({"source": {"consumed": -3}}, r"consumed -3"),
    ({"step": -1}, r"step -1"),
    ({"epoch": "x"}, r"epoch 'x'"),
])
def test_bad_values_are_refused_not_looped_on(change, match):
    st = state_after(1)
    st.update(change)
    ds = make()
    with pytest.raises(ValueError, match=r"StreamingPackedDataset checkpoint.*" + match):
        ds.load_state_dict(st)
        list(ds)


@pytest.mark.parametrize("drop", ["mb", "phase", "counters", "source", "epoch", "held"])
def test_a_corrupted_state_names_the_checkpoint_and_the_key(drop):
    st = state_after(2)
    del st[drop]
    with pytest.raises(ValueError, match=rf"StreamingPackedDataset checkpoint.*'{drop}'"):
        make().load_state_dict(st)
    with pytest.raises(ValueError, match=r"StreamingPackedDataset checkpoint.*dict"):
        make().load_state_dict([1, 2])


def test_a_good_state_still_resumes_exactly():
    full = [b["sample_ids"].tolist() for b in make()]
    for k in range(1, len(full)):
        st = state_after(k)
        ds = make()
        ds.load_state_dict(copy.deepcopy(st))
        assert [b["sample_ids"].tolist() for b in ds] == full[k:]


def _swapped_states(rank, world, out):
    """Each rank saves its state after one microbatch, then loads the other rank's."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    def mk():
        rows = ListRows([5 + 7 * rank, 30, 12, 60, 7, 44, 9, 3, 50, 21, 8, 16])
        return StreamingPackedDataset(rows, CostModel.quadratic(128),
                                      Layout(dp=world, microbatches=2, capacity=CAP),
                                      id_column="id")
    ds = mk()
    it = iter(ds)
    next(it)
    st = ds.state_dict()
    states = [None] * world
    dist.all_gather_object(states, st)
    r = mk()
    r.load_state_dict(copy.deepcopy(states[(rank + 1) % world]))
    try:
        list(r)
        msg = None
    except ValueError as e:
        msg = str(e)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rank": st["rank"], "msg": msg}))


@pytest.mark.slow
def test_ranks_loading_each_others_state_all_raise_none_hangs(tmp_path):
    import json

    from tests.common.gloo import run_ranks
    run_ranks(_swapped_states, 2, tmp_path, timeout_s=240)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [g["rank"] for g in got] == [0, 1]
    for r, g in enumerate(got):
        assert g["msg"] is not None and f"taken on rank {1 - r} of a world size 2 but this " \
            f"process is rank {r}" in g["msg"], g
