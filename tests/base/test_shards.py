"""Length shards (issue 31 item 2): a directory, glob or comma list of .npy files, or parquet
files' length column, read in sorted path order (exactly the concatenation), with errors naming
the file and row; ``precompute --lengths SHARDS`` plans them exactly as the one concatenated
file; a cached concatenation is reused while the shards are unchanged."""
from __future__ import annotations

import numpy as np
import pytest

from balancer.shards import is_sharded, read_shards, shard_paths


def _shards(tmp_path, sizes=(300, 1, 250), seed=0):
    rng = np.random.default_rng(seed)
    d = tmp_path / "shards"
    d.mkdir()
    parts = []
    for i, n in enumerate(sizes):
        a = rng.integers(1, 5000, n)
        parts.append(a)
        np.save(d / f"part-{i:03d}.npy", a.astype(np.int32 if i == 1 else np.int64))
    return d, np.concatenate(parts)


def test_npy_shards_directory_glob_and_list(tmp_path):
    d, want = _shards(tmp_path)
    for spec in (str(d), str(d / "part-*.npy"),
                 ",".join(str(d / f"part-{i:03d}.npy") for i in range(3))):
        assert is_sharded(spec)
        got = read_shards(spec)
        assert got.dtype == np.int64 and np.array_equal(got, want)
    assert not is_sharded(str(d / "part-000.npy"))


def test_parquet_shards_read_their_length_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rng = np.random.default_rng(1)
    want = []
    for i in range(3):
        a = rng.integers(1, 9000, 120 + i)
        want.append(a)
        pq.write_table(pa.table({"n_tokens": a, "x": np.zeros(a.shape[0])}),
                       tmp_path / f"p{i}.parquet", row_group_size=50)
    got = read_shards(str(tmp_path / "*.parquet"), column="n_tokens")
    assert np.array_equal(got, np.concatenate(want))
    with pytest.raises(ValueError, match="no column 'length'"):
        read_shards(str(tmp_path / "*.parquet"))


def test_errors_name_the_file_and_row(tmp_path):
    d, _ = _shards(tmp_path)
    np.save(d / "part-009.npy", np.array([5, 0, 7]))
    with pytest.raises(ValueError, match="part-009.npy.*sample 1: length 0"):
        read_shards(str(d))
    with pytest.raises(ValueError, match="matches no file"):
        shard_paths(str(tmp_path / "none-*.npy"))
    (tmp_path / "mixed").mkdir()
    np.save(tmp_path / "mixed" / "a.npy", np.array([1]))
    (tmp_path / "mixed" / "b.parquet").write_bytes(b"x")
    with pytest.raises(ValueError, match="all .npy or all .parquet"):
        shard_paths(str(tmp_path / "mixed"))


def test_cache_is_reused_until_a_shard_changes(tmp_path):
    d, want = _shards(tmp_path)
    cache = str(tmp_path / "all.npy")
    a = read_shards(str(d), cache=cache)
    assert np.array_equal(a, want) and isinstance(a, np.memmap)
    assert np.array_equal(read_shards(str(d), cache=cache), want)
    extra = np.array([3, 4])
    np.save(d / "part-100.npy", extra)
    assert np.array_equal(read_shards(str(d), cache=cache), np.concatenate([want, extra]))


def test_precompute_plans_shards_as_the_concatenated_file(tmp_path):
    from balancer.cli import main
    from balancer.store import plan_store as store
    d, want = _shards(tmp_path)
    np.save(tmp_path / "all.npy", want)
    flags = ["--capacity", "8192", "--dp", "2", "--microbatches", "2", "--window-samples",
             "200", "--no-progress"]
    assert main(["precompute", "--lengths", str(d), "--out", str(tmp_path / "a"), *flags]) == 0
    assert main(["precompute", "--lengths", str(tmp_path / "all.npy"), "--out",
                 str(tmp_path / "b"), *flags]) == 0
    pa, _ = store.load_plan(tmp_path / "a", 0)
    pb, _ = store.load_plan(tmp_path / "b", 0)
    assert pa.fingerprint() == pb.fingerprint()


def test_precompute_lengths_cache_flag(tmp_path):
    from balancer.cli import main
    d, want = _shards(tmp_path)
    cache = tmp_path / "all-cache.npy"
    assert main(["precompute", "--lengths", str(d), "--lengths-cache", str(cache), "--capacity",
                 "8192", "--dp", "2", "--microbatches", "2", "--out", str(tmp_path / "a"),
                 "--no-progress"]) == 0
    assert np.array_equal(np.load(cache), want)
