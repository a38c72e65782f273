"""Run-time failures and wrong arguments (issue 30 item 6): a stream source that raises (an
OSError or RuntimeError, not a refused row) on one rank makes every rank raise the same error
(before: that rank alone raised, the others got "Connection closed by peer" or hung in the
step's collective); a stream iterated in DataLoader workers is refused naming the workers
(before: "layout.dp 2 differs from the 1 ranks", or with dp=1 every worker trained the whole
stream); ``balance_rollout`` refuses a capacity or microbatch count that is not an integer
(before: ``capacity=10.5`` planned with 10)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from balancer import CostModel, Layout
from balancer.runtime import StreamingPackedDataset, balance_rollout

CAP = 64


class Rows(torch.utils.data.IterableDataset):
    """``n`` rows of 1..20 tokens; ``fail_at``: raise ``error`` instead of yielding that row
    (``-1``: when iteration starts)."""

    def __init__(self, n, fail_at=None, error=None):
        self.n, self.fail_at, self.error = n, fail_at, error

    def __iter__(self):
        if self.fail_at == -1:
            raise self.error
        for k in range(self.n):
            if k == self.fail_at:
                raise self.error
            yield {"input_ids": list(range(1, 2 + k % 20))}


# ---- balance_rollout's arguments ---------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"capacity": 10.5}, r"^input refused on rank 0: balance_rollout: capacity 10\.5 is not an integer"),
    ({"capacity": "64"}, r"^input refused on rank 0: balance_rollout: capacity '64' is not an integer"),
    ({"capacity": True}, r"^input refused on rank 0: balance_rollout: capacity True is not an integer"),
    ({"capacity": 0}, r"^input refused on rank 0: balance_rollout: capacity 0 must be >= 1"),
    ({"microbatches": 2.5}, r"^input refused on rank 0: balance_rollout: microbatches 2\.5 is not an integer"),
    ({"min_microbatches": 1.5}, r"^input refused on rank 0: balance_rollout: min_microbatches 1\.5 is not an integer"),
    ({"pp": 0}, r"^input refused on rank 0: balance_rollout: pp 0 must be >= 1"),
    ({"step": -1}, r"^input refused on rank 0: balance_rollout: step -1 must be >= 0"),
])
def test_balance_rollout_refuses_non_integer_sizes(kw, match):
    seqs = [torch.arange(1, n + 1) for n in (5, 9, 3)]
    args = {"capacity": 16, **kw}
    cap = args.pop("capacity")
    with pytest.raises(ValueError, match=match) as e:
        balance_rollout(seqs, CostModel.quadratic(128), cap, **args)
    assert "\n" not in str(e.value)


def test_balance_rollout_integral_sizes_still_plan():
    import numpy as np
    seqs = [torch.arange(1, n + 1) for n in (5, 9, 3)]
    for cap in (16, np.int64(16), 16.0):
        r = balance_rollout(seqs, CostModel.quadratic(128), cap)
        assert r.plan.layout.capacity == 16
        assert sorted(i for b in r.microbatches for i in b["sample_ids"].tolist()) == [0, 1, 2]


# ---- streams under DataLoader workers ----------------------------------------------------------

@pytest.mark.parametrize("dp", [1, 2])
def test_stream_in_dataloader_workers_is_refused_naming_them(dp):
    ds = StreamingPackedDataset(Rows(10), CostModel.quadratic(128),
                                Layout(dp=dp, microbatches=1, capacity=CAP))
    dl = DataLoader(ds, batch_size=None, num_workers=2)
    with pytest.raises(ValueError, match=r"DataLoader worker \d of 2") as e:
        list(dl)
    assert "num_workers=0" in str(e.value) and "differs from" not in str(e.value)


# ---- a source that fails on one rank: every rank raises the same error -------------------------

def _failing(rank, world, out, fail_at, kind):
    import torch.distributed as dist
    from torchdata.stateful_dataloader import StatefulDataLoader
    err = {"os": OSError(5, "Input/output error", "/data/shard-1.arrow"),
           "rt": RuntimeError("tokenizer worker died")}[kind]
    src = Rows(12, fail_at=fail_at, error=err) if rank == 1 else Rows(12)
    ds = StreamingPackedDataset(src, CostModel.quadratic(128),
                                Layout(dp=world, microbatches=1, capacity=CAP))
    got = {"type": None, "msg": None, "n": 0}
    try:
        for _ in StatefulDataLoader(ds, batch_size=None, num_workers=0):
            got["n"] += 1
    except Exception as e:  # noqa: BLE001 -- what each rank raises is the test's subject
        got.update(type=type(e).__name__, msg=str(e))
    dist.barrier()  # every rank is still in the group: nobody left, nobody hangs
    Path(out, f"{kind}{fail_at}_{rank}.json").write_text(json.dumps(got))


def _failures(rank, world, out):
    for fail_at, kind in ((7, "os"), (-1, "rt")):
        _failing(rank, world, out, fail_at, kind)


@pytest.mark.slow
def test_a_source_failing_on_one_rank_raises_on_every_rank(tmp_path):
    from tests.common.gloo import run_ranks
    run_ranks(_failures, 2, tmp_path, timeout_s=240)
    for fail_at, kind, want in (
            (7, "os", "failed on rank 1: its stream source raised OSError: [Errno 5] "
                      "Input/output error: '/data/shard-1.arrow'"),
            (-1, "rt", "failed on rank 1: its stream source raised RuntimeError: tokenizer "
                       "worker died")):
        got = [json.loads((tmp_path / f"{kind}{fail_at}_{r}.json").read_text()) for r in (0, 1)]
        for g in got:
            assert g["type"] == "RuntimeError" and g["msg"] == want, got
        assert got[0]["n"] == got[1]["n"]  # the same microbatches before it, on both ranks


def test_rollout_ids_and_token_shapes_are_checked():
    """Sample ids that are not integers were truncated (1.5 -> 1), a 2-D token tensor was
    flattened into one longer document: each is refused naming the sample."""
    cost = CostModel.quadratic(128)
    one = torch.ones(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input refused on rank 0: ids: sample 0's id 1\.5 "
                                         r"is not an integer"):
        balance_rollout([one, one], cost, 16, ids=[1.5, 2])
    with pytest.raises(ValueError, match=r"input refused on rank 0: .*sample 1: token ids of "
                                         r"shape \[3, 2\], not 1-D"):
        balance_rollout([one, torch.ones((3, 2), dtype=torch.long)], cost, 16)
    r = balance_rollout([one, one], cost, 16, ids=np.array([4.0, 7.0]))  # integral: the ids
    assert sorted(i for b in r.microbatches for i in b["sample_ids"].tolist()) == [4, 7]


@pytest.mark.parametrize("kw, match", [
    ({"tokens_per_rank": 1.5}, r"^tokens_per_rank 1\.5 must be an integer >= 1$"),
    ({"tokens_per_rank": True}, r"^tokens_per_rank True must be an integer >= 1$"),
    ({"max_carry": -1}, r"^max_carry -1 must be an integer >= 0$"),
    ({"max_carry": 0.5}, r"^max_carry 0\.5 must be an integer >= 0$"),
])
def test_stream_sizes_that_are_not_whole_are_refused(kw, match):
    """tokens_per_rank=1.5 and max_carry=-1 were taken (truncated, or pinning every sample
    at once): refused at construction, naming the value."""
    with pytest.raises(ValueError, match=match):
        StreamingPackedDataset([{"input_ids": [1, 2]}], CostModel.quadratic(128),
                               Layout(dp=1, microbatches=1, capacity=CAP), **kw)
