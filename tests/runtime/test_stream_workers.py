"""The README's streaming recipe on 2 gloo ranks: a Hugging Face IterableDataset split with
``split_dataset_by_node``, read through ``StatefulDataLoader(num_workers=2)`` and balanced by
``StreamingPackedDataset`` -- every sample of the stream trained exactly once per epoch, over two
epochs (issue 29 item 3: 510 of 511 trained, one counted 'unplanned'), and the end of each pass
logged with the counts. Two seeds that lost a sample read without workers (the order of the
rows decides where a stream ends), and the workers' read over two epochs."""
import logging

import numpy as np
import pytest

from runtime_ranks import read, run_ranks, write

N = 511


def _source(rank, world, seed, workers):
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader
    g = np.random.default_rng(seed)
    lengths = np.clip(g.lognormal(np.log(40), 1.0, N), 1, 256).astype(int)
    rows = {"input_ids": [g.integers(0, 100, n).tolist() for n in lengths], "id": list(range(N))}
    ds = Dataset.from_dict(rows).to_iterable_dataset(num_shards=4)
    ds = split_dataset_by_node(ds, rank=rank, world_size=world)
    return StatefulDataLoader(ds, batch_size=None, num_workers=workers)


def _ranks(rank, world, out, runs):
    from torchdata.stateful_dataloader import StatefulDataLoader
    from balancer import CostModel, Layout
    from balancer.runtime import StreamingPackedDataset
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    log = logging.getLogger("balancer.runtime.stream")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    res = {}
    for seed, workers, n_epochs in runs:
        ds = StreamingPackedDataset(_source(rank, world, seed, workers), CostModel.quadratic(1024),
                                    Layout(dp=world, microbatches=2, capacity=256),
                                    id_column="id")
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=0)
        epochs = []
        for epoch in range(n_epochs):
            ds.set_epoch(epoch)
            trained = [i for mb in loader for i in mb["sample_ids"].tolist()]
            epochs.append({"trained": trained, "stats": ds.stats})
        res[f"{seed}-{workers}"] = epochs
    write(out, f"workers_{rank}.json", {"runs": res, "log": records})


#: (seed, source workers, epochs): seeds 22 and 29 left one sample unplanned at the end of the
#: epoch before (ids 383 and 510: 510 of 511 trained); 2 workers is the README's way to read
RUNS = [(22, 0, 1), (29, 0, 1), (0, 2, 2)]


@pytest.mark.slow
def test_every_sample_once_per_epoch_with_workers(tmp_path):
    run_ranks(_ranks, 2, tmp_path, RUNS)
    res = [read(tmp_path, f"workers_{r}.json") for r in range(2)]
    for seed, workers, n_epochs in RUNS:
        for epoch in range(n_epochs):
            key = f"{seed}-{workers}"
            trained = sorted(i for r in res for i in r["runs"][key][epoch]["trained"])
            st = res[0]["runs"][key][epoch]["stats"]
            assert (st["unplanned"], st["unplanned_ids"]) == (0, []), (key, epoch)
            assert trained == list(range(N)), (key, epoch, len(trained))
            assert st["trained"] == N
    passes = sum(n for _, _, n in RUNS)
    for x in res:  # one line per pass, on every rank, with the counts
        assert len(x["log"]) == passes, x["log"]
        assert all(f"trained {N} of the {N} samples read" in line for line in x["log"]), x["log"]
