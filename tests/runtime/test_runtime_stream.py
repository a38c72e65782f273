"""StreamingPackedDataset in a one-process world (no process group; the gloo tests cover 2 and
4 ranks): every non-empty row trained exactly once and resume exact from any microbatch, as a
hypothesis property over row lengths (empty rows and rows as long as the capacity included),
and a source read with workers (a StatefulDataLoader over a Hugging Face IterableDataset)."""
import numpy as np
from hypothesis import given, settings, strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from balancer import CostModel, Layout
from balancer.runtime import StreamingPackedDataset
from tests.common.rows import ListRows

CAP = 64


def _run(make, state=None, stop=None):
    ds = make()
    dl = StatefulDataLoader(ds, batch_size=None, num_workers=0)
    if state is not None:
        dl.load_state_dict(state)
    got, saved = [], None
    for i, b in enumerate(dl):
        assert int(b["cu_seqlens"][-1]) <= CAP
        got.append((b["step"], b["slot"], b["sample_ids"].tolist()))
        if stop is not None and i + 1 == stop:
            saved = dl.state_dict()
            break
    return got, saved, ds.stats


@given(st.lists(st.one_of(st.integers(0, CAP), st.just(CAP), st.just(0)), max_size=40),
       st.integers(1, 3), st.data())
@settings(max_examples=40, deadline=None)
def test_every_row_once_and_resume_anywhere(lengths, m, data):
    def make():
        return StreamingPackedDataset(ListRows(lengths), CostModel.quadratic(128),
                                      Layout(dp=1, microbatches=m, capacity=CAP), id_column="id")
    full, _, stats = _run(make)
    trained = [i for _, _, ids in full for i in ids]
    want = [k for k, n in enumerate(lengths) if n > 0]
    assert sorted(trained) == want  # every non-empty row exactly once, carried ones included
    assert stats["read"] == len(lengths) and stats["empty"] == len(lengths) - len(want)
    assert stats["unplanned"] == 0 and stats["trained"] == len(want)
    if len(full) > 1:
        k = data.draw(st.integers(1, len(full) - 1))
        head, state, _ = _run(make, stop=k)
        tail, _, _ = _run(make, state=state)
        assert head == full[:k] and tail == full[k:]


def test_source_read_with_workers():
    """The source may be a StatefulDataLoader with workers (here 2 over a 4-shard HF
    IterableDataset): its state is the wrapper's source position."""
    from datasets import Dataset
    g = np.random.default_rng(5)
    rows = {"input_ids": [g.integers(0, 100, int(g.integers(1, CAP + 1))).tolist()
                          for _ in range(120)], "id": list(range(120))}
    hf = Dataset.from_dict(rows).to_iterable_dataset(num_shards=4)

    def make():
        src = StatefulDataLoader(hf, batch_size=None, num_workers=2)
        return StreamingPackedDataset(src, CostModel.quadratic(128),
                                      Layout(dp=1, microbatches=2, capacity=CAP), id_column="id")
    full, _, _ = _run(make)
    assert sorted(i for _, _, ids in full for i in ids) == list(range(120))
    for k in (1, len(full) // 2):
        head, state, _ = _run(make, stop=k)
        tail, _, _ = _run(make, state=state)
        assert head == full[:k] and tail == full[k:]


def test_bad_rows_are_named():
    """Token ids that are not integers, or a row without the tokens or id column: a ValueError
    naming the row (raised on every rank through the step's collective; 1 rank here)."""
    import pytest
    lay = Layout(dp=1, microbatches=1, capacity=CAP)
    for rows, match in (([{"input_ids": [1.5, 2.0], "id": 0}], r"row 0 .*dtype torch.float64"),
                        ([{"input_ids": [1], "id": 0}, {"ids": [2], "id": 1}],
                         r"row 1 of this rank's stream has no 'input_ids'"),
                        ([{"input_ids": [1]}], r"row 0 .* no id column 'id'")):
        ds = StreamingPackedDataset(rows, CostModel.quadratic(128), lay, id_column="id")
        with pytest.raises(ValueError, match="input refused on rank 0: " + match):
            list(StatefulDataLoader(ds, batch_size=None, num_workers=0))
