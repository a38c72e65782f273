"""Token ids that are not token ids are refused by the loader, naming the sample and the value:
before, float ids were truncated silently (1.5 trained as token 1), negative ids (-5, -100)
reached the model's embedding, and strings failed in int() without naming the sample."""
import datasets
import numpy as np
import pytest
import torch

from balancer import CostModel, Layout, PackedBatchSampler, PackedCollator, PackedDataset, \
    PlannerConfig


def _first_batch(rows, hf=True):
    data = datasets.Dataset.from_dict({"input_ids": rows}) if hf else \
        [np.asarray(r) for r in rows]
    s = PackedBatchSampler([len(r) for r in rows], CostModel.quadratic(64), Layout(capacity=16),
                           PlannerConfig(), dp_rank=0)
    loader = torch.utils.data.DataLoader(PackedDataset(data), batch_sampler=s,
                                         collate_fn=PackedCollator())
    return next(iter(loader))


@pytest.mark.parametrize("hf", [True, False])
@pytest.mark.parametrize("rows,match", [
    ([[1, 2, 3], [4.0, 5.5]], r"sample [01]: .*'input_ids'.*float"),  # HF: the column is float
    ([[1, 2, 3], [4, -5]], r"sample 1: .*'input_ids' holds -5 at token 1"),
    ([[1, 2, 3], [-100, 5]], r"sample 1: .*'input_ids' holds -100 at token 0"),
    ([["a", "b", "c"], ["d", "e"]], r"sample [01]: .*'input_ids'.*(<U1|str|string|object)"),
])
def test_bad_token_ids_are_refused(rows, match, hf):
    with pytest.raises(ValueError, match=match):
        _first_batch(rows, hf)


def test_integral_ids_of_any_integer_dtype_pass():
    b = _first_batch([np.array([1, 2, 3], np.int32), np.array([4, 5], np.uint16)], hf=False)
    assert b["input_ids"].dtype == torch.int64
    assert sorted(b["input_ids"].tolist()) == [1, 2, 3, 4, 5]
