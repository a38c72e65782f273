"""The ``blocks`` epoch order (issue 31 item 2): a permutation of [0, n) for every n, seed and
epoch, equal to the numpy reference (tests/naive/order.py), any window of it equal to the same
range of the whole order, the same in another process; plans with it are the same from
in-memory lengths, from lengths read on demand (shards), planned whole or by windows, and the
option is recorded (manifest, sampler state) while the default order dumps as before."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epochs
from balancer.planning import planner
from balancer.planning.order import BLOCK, GROUP, block_order, block_order_range
from balancer.planning.stream import EpochWindows, epoch_order
from balancer.shards import LengthFiles
from balancer.store import plan_store as store
from balancer.store.precompute import precompute
from tests.naive.order import block_order as naive_block_order

COST = load_cost_model("quadratic-64k")
SIZES = st.integers(1, 3 * BLOCK + 5)
#: around the group size, where the last (smaller) group and the tail block meet
BIG = [GROUP - 1, GROUP, GROUP + 1, 2 * GROUP + BLOCK + 3]


@settings(max_examples=30, deadline=None)
@given(n=SIZES, seed=st.integers(0, 2 ** 63 - 1), epoch=st.integers(0, 10 ** 6))
def test_block_order_is_a_permutation_equal_to_the_reference(n, seed, epoch):
    full = epoch_order(n, seed, epoch, order="blocks")
    assert full.dtype == np.int64 and full.shape == (n,)
    assert np.array_equal(np.sort(full), np.arange(n))
    assert np.array_equal(full, naive_block_order(n, seed, epoch, np.arange(n)))


@pytest.mark.parametrize("n", BIG)
def test_block_order_is_a_permutation_around_groups(n):
    full = epoch_order(n, 11, 2, order="blocks")
    assert np.array_equal(np.sort(full), np.arange(n))
    pos = np.random.default_rng(n).integers(0, n, 20000)
    assert np.array_equal(full[pos], naive_block_order(n, 11, 2, pos))


@settings(max_examples=20, deadline=None)
@given(n=st.one_of(SIZES, st.sampled_from(BIG)), seed=st.integers(0, 1000), data=st.data())
def test_windows_and_positions_match_the_full_order(n, seed, data):
    full = block_order_range(n, seed, 3, 0, n)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    assert np.array_equal(block_order_range(n, seed, 3, lo, hi), full[lo:hi])
    pos = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=50)), np.int64)
    assert np.array_equal(block_order(n, seed, 3, pos), full[pos])


def test_blocks_are_contiguous_runs_and_epochs_differ():
    n = 3 * GROUP + 777
    a, b = block_order_range(n, 0, 0, 0, n), block_order_range(n, 0, 1, 0, n)
    assert not np.array_equal(a, b) and not np.array_equal(a, block_order_range(n, 1, 0, 0, n))
    # a group of GROUP positions holds exactly GROUP_BLOCKS whole blocks of the corpus
    blocks = np.unique(a[:GROUP] // BLOCK)
    assert blocks.shape[0] == GROUP // BLOCK
    assert np.array_equal(np.sort(a[:GROUP]), (blocks[:, None] * BLOCK
                                               + np.arange(BLOCK)).ravel())
    assert set(a[-777:] // BLOCK) == {n // BLOCK} or n % BLOCK == 0  # the tail block: last group


def test_same_order_in_another_process():
    n = 2 * GROUP + 12345
    code = ("import sys, numpy as np; from balancer.planning.order import block_order_range;"
            "a = block_order_range(%d, 99, 7, 1000, 1000 + %d);"
            "sys.stdout.write(a.tobytes().hex())" % (n, 3 * BLOCK))
    env_out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={"PYTHONHASHSEED": "123", **__import__("os").environ})
    got = np.frombuffer(bytes.fromhex(env_out.stdout), np.int64)
    assert np.array_equal(got, block_order_range(n, 99, 7, 1000, 1000 + 3 * BLOCK))


# ---- plans ----------------------------------------------------------------------------------
def _lengths(n, seed=5, cap=8192):
    rng = np.random.default_rng(seed)
    return np.where(rng.random(n) < 0.01, rng.integers(cap, 4 * cap, n),
                    rng.integers(1, cap // 3, n))


LAYOUT = Layout(dp=2, microbatches=2, capacity=8192)
CONFIG = PlannerConfig(over_length="chunk", tail="carry", window_samples=1500, order="blocks")


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 9000), window=st.integers(1, 4000), seed=st.integers(0, 99),
       n_carry=st.integers(0, 5))
def test_window_items_equal_the_epoch_stream(n, window, seed, n_carry):
    lengths = _lengths(n, seed, cap=64)
    layout = Layout(dp=1, capacity=64)
    config = PlannerConfig(over_length="chunk", window_samples=window, seed=seed,
                           order="blocks")
    carry = planner.Items(np.arange(n_carry, dtype=np.int64), np.zeros(n_carry, np.int64),
                          np.full(n_carry, 5, np.int64))
    ref = planner.epoch_stream(SampleTable(lengths), COST, layout, config, 1, carry)
    order = epoch_order(n, seed, 1, order="blocks")
    assert np.array_equal(np.unique(ref.items.sample[n_carry:]), np.arange(n))
    firsts = ref.items.sample[n_carry:][ref.items.start[n_carry:] == 0]
    assert np.array_equal(firsts, order)  # the stream follows the blocks order
    ew = EpochWindows(lengths, layout, config, 1, carry, block=777)
    assert ew.order is None  # nothing of size n held
    for lo, hi in ew.windows:
        it = ew.items(lo, hi)
        for f in ("sample", "start", "length"):
            assert np.array_equal(getattr(it, f), getattr(ref.items, f)[lo:hi])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    want = _lengths(9000)
    for i, (lo, hi) in enumerate([(0, 4000), (4000, 4001), (4001, 9000)]):
        np.save(d / f"part-{i}.npy", want[lo:hi].astype(np.int32 if i == 1 else np.int64))
    return d, want


def test_precompute_from_files_equals_plan_epochs(shards, tmp_path):
    d, want = shards
    ref = plan_epochs(SampleTable(want), COST, LAYOUT, CONFIG, 2)
    files = LengthFiles(sorted(d.glob("*.npy")))
    assert files.fingerprint() == SampleTable(want).fingerprint()
    for workers in (1, 2):
        out = precompute(files, COST, LAYOUT, CONFIG, tmp_path / f"p{workers}", epochs=2,
                         workers=workers)
        m = store.load_manifest(out)
        assert m["config"]["order"] == "blocks"
        assert m["dataset"]["fingerprint"] == SampleTable(want).fingerprint()
        for p in ref:
            q, _ = store.load_plan(out, p.epoch)
            assert q.fingerprint() == p.fingerprint()


def test_cli_order_blocks_over_shards(shards, tmp_path):
    from balancer.cli import main
    d, want = shards
    flags = ["--capacity", "8192", "--dp", "2", "--microbatches", "2", "--window-samples",
             "1500", "--over-length", "chunk", "--tail", "carry", "--no-progress"]
    assert main(["precompute", "--lengths", str(d), "--order", "blocks", "--out",
                 str(tmp_path / "a"), *flags]) == 0
    ref = plan_epochs(SampleTable(want), COST, LAYOUT, CONFIG, 1)[0]
    q, _ = store.load_plan(tmp_path / "a", 0)
    assert q.fingerprint() == ref.fingerprint()
    np.save(tmp_path / "all.npy", want)
    assert main(["precompute", "--lengths", str(tmp_path / "all.npy"), "--order", "blocks",
                 "--out", str(tmp_path / "b"), *flags]) == 0
    q, _ = store.load_plan(tmp_path / "b", 0)
    assert q.fingerprint() == ref.fingerprint()


def test_default_order_dumps_as_before_and_blocks_is_recorded():
    assert "order" not in PlannerConfig().model_dump()
    assert "order" not in json.loads(PlannerConfig(seed=3).model_dump_json())
    assert PlannerConfig(order="blocks").model_dump()["order"] == "blocks"
    assert PlannerConfig.model_validate({"seed": 1}).order == "permutation"  # old manifests
    from balancer.config import mode_config
    with pytest.raises(ValueError, match="order='blocks'"):
        mode_config(PlannerConfig(order="blocks"), "hybrid", "hybrid_stream")


def test_sampler_state_records_the_order():
    from balancer.loader.sampler import PackedBatchSampler
    samples = SampleTable(_lengths(3000))
    cfg = CONFIG.model_copy(update={"window_samples": None})
    s = PackedBatchSampler(samples, COST, LAYOUT, cfg)
    state = s.state_dict()
    assert state["order"] == "blocks"
    other = PackedBatchSampler(samples, COST, LAYOUT, cfg.model_copy(update={"order":
                                                                          "permutation"}))
    assert "order" not in other.state_dict()  # the default: as before the option existed
    with pytest.raises(ValueError, match="order"):
        other.load_state_dict(state)
    s2 = PackedBatchSampler(samples, COST, LAYOUT, cfg)
    s2.load_state_dict(state)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_length_files_read_and_take_equal_the_array(shards, data):
    d, want = shards
    files = LengthFiles(sorted(d.glob("*.npy")))
    files._BATCH = data.draw(st.integers(1, 3))  # several batches of blocks
    idx = np.array(data.draw(st.lists(st.integers(0, want.shape[0] - 1), max_size=300)),
                   np.int64)
    assert np.array_equal(files.take(idx), want[idx])
    lo = data.draw(st.integers(0, want.shape[0]))
    hi = data.draw(st.integers(lo, want.shape[0]))
    assert np.array_equal(files.read(lo, hi), want[lo:hi])
    assert len(files) == want.shape[0] and files.total_tokens == int(want.sum())
