import numpy as np
import pytest

from balancer.samples import SampleTable


def test_from_npy(tmp_path):
    p = tmp_path / "l.npy"
    np.save(p, np.array([3, 4, 5], dtype=np.int32))
    t = SampleTable.from_npy(p)
    assert t.lengths.dtype == np.int64 and t.total_tokens == 12
    assert t.fingerprint() == SampleTable.from_array([3, 4, 5]).fingerprint()


def test_from_dataset_length_column_and_tokens():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"length": [5, 7, 9], "x": ["a", "b", "c"]})
    assert SampleTable.from_dataset(ds).lengths.tolist() == [5, 7, 9]
    ds2 = datasets.Dataset.from_dict({"input_ids": [[1, 2], [1, 2, 3, 4], [9]]})
    assert SampleTable.from_dataset(ds2, num_proc=2).lengths.tolist() == [2, 4, 1]
    # a selected / shuffled view reads through its indices
    sel = ds.select([2, 0])
    assert SampleTable.from_dataset(sel).lengths.tolist() == [9, 5]


def test_dataset_errors():
    datasets = pytest.importorskip("datasets")
    with pytest.raises(ValueError, match="neither a length column"):
        SampleTable.from_dataset(datasets.Dataset.from_dict({"text": ["a"]}))
    with pytest.raises(ValueError, match="sample 1: length 0"):
        SampleTable.from_dataset(datasets.Dataset.from_dict({"input_ids": [[1], []]}))


def test_fingerprint_is_the_sha256_of_the_int64_bytes(tmp_path):
    import hashlib
    a = np.random.default_rng(4).integers(1, 10**6, (1 << 22) + 17)
    want = hashlib.sha256(a.astype("<i8").tobytes()).hexdigest()[:16]
    assert SampleTable(a).fingerprint() == want  # hashed in blocks: the same digest
    np.save(tmp_path / "a.npy", a)
    assert SampleTable.from_npy(tmp_path / "a.npy").fingerprint() == want


def test_fingerprint_is_kept_only_for_lengths_the_table_owns(tmp_path):
    a = np.arange(1, 101, dtype=np.int64)
    t = SampleTable(a)  # a copy the table owns: hashed once, the same digest after
    assert t.fingerprint() == t.fingerprint() == SampleTable(a.copy()).fingerprint()
    a[0] = 7  # the caller's array: not the table's
    assert t.fingerprint() == SampleTable(np.arange(1, 101)).fingerprint()
    # a read-only memory map is shared, not copied: hashed every time, so a file rewritten in
    # place is seen
    p = tmp_path / "l.npy"
    np.save(p, np.arange(1, 101, dtype=np.int64))
    m = SampleTable(np.load(p, mmap_mode="r"))
    before = m.fingerprint()
    w = np.load(p, mmap_mode="r+")
    w[0] = 9
    w.flush()
    assert m.fingerprint() != before


def test_a_named_length_column_that_is_missing_is_an_error():
    # Found by review: from_dataset(ds, "nope") read input_ids instead, silently. A column the
    # caller names must exist; only the default ("length") falls back to a token column.
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [1, 2, 3]]})
    with pytest.raises(ValueError, match=r"no length column 'nope'.*input_ids"):
        SampleTable.from_dataset(ds, "nope")
    with pytest.raises(ValueError, match=r"no length column 'nope'"):
        SampleTable.from_dataset(ds, length_column="nope")
    assert SampleTable.from_dataset(ds).lengths.tolist() == [2, 3]  # the default falls back
    # a named length column and a named token column: the token column is the fallback asked for
    assert SampleTable.from_dataset(ds, "nope", "input_ids").lengths.tolist() == [2, 3]
    assert SampleTable.from_dataset(ds, None).lengths.tolist() == [2, 3]  # None: no length column


def test_report_length_column_flag_is_checked(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    from balancer.cli.app import main
    d = tmp_path / "ds"
    datasets.Dataset.from_dict({"input_ids": [[1] * 5] * 40}).save_to_disk(str(d))
    args = ["report", "--dataset", str(d), "--capacity", "64", "--dp", "2"]
    assert main(args + ["--length-column", "nope"]) != 0
    assert "no length column 'nope'" in capsys.readouterr().err


def test_precompute_length_column_flag_is_checked(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    from balancer.cli.app import main
    d = tmp_path / "ds"
    datasets.Dataset.from_dict({"input_ids": [[1] * 5] * 40}).save_to_disk(str(d))
    base = ["precompute", "--dataset", str(d), "--capacity", "64", "--dp", "2", "--microbatches",
            "1"]
    assert main(base + ["--out", str(tmp_path / "a"), "--length-column", "nope"]) != 0
    assert "no length column 'nope'" in capsys.readouterr().err
    assert main(base + ["--out", str(tmp_path / "b")]) == 0  # the default falls back
