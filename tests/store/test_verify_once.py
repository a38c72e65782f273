"""A stored epoch is verified once, not by every process that opens it (issue 31 item 3):
``verify="once"`` (the sampler's and ``plan_source``'s default) hashes the arrays and checks
the O(entries) invariants only when no stamp records that these exact files (same inode, size,
mtime, ctime, same sealed manifest) already passed; any change to a file or the manifest makes
the next reader verify again, so an edited plan is still refused."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epochs
from balancer.loader.sampler import PackedBatchSampler
from balancer.store import load as store_load
from balancer.store import plan_store as store
from balancer.store import verified

from test_store import assert_same_plan


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 3000, 3000)
    cost = load_cost_model("quadratic-64k")
    layout = Layout(dp=2, microbatches=2, capacity=8192)
    config = PlannerConfig(over_length="chunk")
    return SampleTable(lengths), cost, layout, config, plan_epochs(SampleTable(lengths), cost,
                                                                   layout, config, 2)


@pytest.fixture
def saved(setup, tmp_path):
    return store.save_plan(setup[4], tmp_path / "plan", cost=setup[1])


@pytest.fixture
def hashes(monkeypatch):
    """How many array files were hashed (wraps the store's own digest function)."""
    calls = []
    real = store_load.fd_digest   # arrays are hashed through the descriptors a load opened

    def counting(fd):
        calls.append(fd)
        return real(fd)
    monkeypatch.setattr(store_load, "fd_digest", counting)
    return calls


def test_once_hashes_the_first_time_only(setup, saved, hashes):
    plan, _ = store.load_plan(saved, 0, verify="once")
    assert_same_plan(plan, setup[4][0])
    first = len(hashes)
    assert first > 0 and (saved / "epoch-0000" / verified.STAMP).is_file()
    for _ in range(3):
        assert_same_plan(store.load_plan(saved, 0, verify="once")[0], setup[4][0])
    assert len(hashes) == first
    # another epoch has its own stamp
    store.load_plan(saved, 1, verify="once")
    assert len(hashes) > first
    # verify=True always hashes
    n = len(hashes)
    store.load_plan(saved, 0, verify=True)
    assert len(hashes) > n


def test_an_edited_array_is_refused_after_the_stamp(setup, saved):
    store.load_plan(saved, 0, verify="once")
    f = saved / "epoch-0000" / "mb_fwd.npy"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256 of 'mb_fwd'"):
        store.load_plan(saved, 0, verify="once")


def test_a_copied_plan_is_verified_again(setup, saved, tmp_path, hashes):
    import shutil
    store.load_plan(saved, 0, verify="once")
    n = len(hashes)
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)  # new inodes: the stamp copied along does not vouch for them
    store.load_plan(copy, 0, verify="once")
    assert len(hashes) > n


@pytest.mark.parametrize("edit", ["garbage", "other-seal", "missing-array"])
def test_a_stamp_that_does_not_match_means_verify(setup, saved, hashes, edit):
    store.load_plan(saved, 0, verify="once")
    n = len(hashes)
    stamp = saved / "epoch-0000" / verified.STAMP
    if edit == "garbage":
        stamp.write_text("{not json")
    else:
        doc = json.loads(stamp.read_text())
        if edit == "other-seal":
            doc["manifest_sha256"] = "0" * 64
        else:
            del doc["arrays"]["mb_bwd"]
        stamp.write_text(json.dumps(doc))
    store.load_plan(saved, 0, verify="once")
    assert len(hashes) > n


def test_check_plan_false_writes_no_stamp_and_false_hashes_nothing(setup, saved, hashes):
    store.load_plan(saved, 0, verify=True, check_plan=False)
    assert not (saved / "epoch-0000" / verified.STAMP).exists()
    n = len(hashes)
    store.load_plan(saved, 0, verify=False)
    assert len(hashes) == n and not (saved / "epoch-0000" / verified.STAMP).exists()


def test_bad_verify_value_is_an_error(saved):
    with pytest.raises(ValueError, match="verify"):
        store.load_plan(saved, 0, verify="sometimes")


def test_overwrite_replaces_a_plan_holding_stamps(setup, saved):
    store.load_plan(saved, 0, verify="once")
    assert (saved / "epoch-0000" / verified.LOCK).exists()
    assert store.foreign_entry(saved) is None
    store.save_plan(setup[4], saved, cost=setup[1], overwrite=True)
    assert not (saved / "epoch-0000" / verified.STAMP).exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_plan_is_verified_every_time(setup, saved, hashes):
    for d in (saved / "epoch-0000", saved):
        os.chmod(d, 0o555)
    try:
        store.load_plan(saved, 0, verify="once")
        n = len(hashes)
        store.load_plan(saved, 0, verify="once")
        assert len(hashes) == 2 * n
    finally:
        for d in (saved, saved / "epoch-0000"):
            os.chmod(d, 0o755)


def test_the_sampler_verifies_once_by_default(setup, saved, hashes):
    samples, cost, layout, config, plans = setup
    counts = []
    for r in range(layout.dp):
        s = PackedBatchSampler(samples, plan_dir=saved, layout=layout, dp_rank=r)
        assert sum(len(m) for m in s) > 0
        counts.append(len(hashes))
    assert counts[0] > 0 and counts[1] == counts[0]  # the first rank hashed, the second did not
