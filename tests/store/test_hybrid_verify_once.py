"""Stored hybrid plans are verified once per epoch too (issue 31 item 3, as ea90ac9 did for the
fixed mode): ``HybridBatchSampler(plan=DIR)`` and ``hybrid_plan_source`` default to
``verify="once"``: the first reader hashes the arrays and checks the O(items) invariants, then
stamps the epoch; later readers of the same files trust the stamp; an edited array is still
refused; a stamp written without the job's lengths does not vouch for them."""
from __future__ import annotations

import pytest

from balancer.loader.hybrid import HybridBatchSampler
from balancer.store import load as store_load
from balancer.store import verified
from balancer.store.hybrid import hybrid_plan_source, load_hybrid_plan, precompute_hybrid

from test_hybrid_store import LAYOUT, MODEL, SAMPLES, refs


@pytest.fixture
def hashes(monkeypatch):
    """How many array files were hashed (wraps the store's own digest function)."""
    calls = []
    real = store_load.fd_digest

    def counting(fd):
        calls.append(fd)
        return real(fd)
    monkeypatch.setattr(store_load, "fd_digest", counting)
    return calls


@pytest.fixture
def out(tmp_path):
    return precompute_hybrid(SAMPLES, MODEL, LAYOUT, tmp_path / "plan", seed=7)


def test_the_hybrid_sampler_verifies_once_by_default(out, hashes):
    counts = []
    for rank in range(4):
        own = HybridBatchSampler(SAMPLES, MODEL, LAYOUT, seed=7, rank=rank)
        stored = HybridBatchSampler(SAMPLES, MODEL, LAYOUT, seed=7, rank=rank, plan=out)
        assert refs(stored) == refs(own)
        counts.append(len(hashes))
    assert counts[0] > 0 and counts[1:] == [counts[0]] * 3  # the first rank hashed, no other
    assert (out / "epoch-0000" / verified.STAMP).is_file()
    s = HybridBatchSampler(SAMPLES, MODEL, LAYOUT, seed=7, rank=0, plan=out, verify_plan=True)
    refs(s)
    assert len(hashes) > counts[-1]  # True: every process, every time
    n = len(hashes)
    load_hybrid_plan(out, 0, verify=False)
    assert len(hashes) == n


def test_an_edited_array_is_refused_after_the_stamp(out):
    load_hybrid_plan(out, 0, lengths=SAMPLES.lengths, verify="once")
    f = out / "epoch-0000" / "item_length.npy"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256 of 'item_length'"):
        load_hybrid_plan(out, 0, lengths=SAMPLES.lengths, verify="once")


def test_a_stamp_without_lengths_does_not_vouch_for_them(out, hashes):
    load_hybrid_plan(out, 0, verify="once")
    first = len(hashes)
    assert first > 0
    load_hybrid_plan(out, 0, verify="once")
    assert len(hashes) == first
    load_hybrid_plan(out, 0, lengths=SAMPLES.lengths, verify="once")  # lengths never checked
    second = len(hashes)
    assert second > first
    load_hybrid_plan(out, 0, lengths=SAMPLES.lengths, verify="once")
    load_hybrid_plan(out, 0, verify="once")  # a stamp with lengths vouches for less too
    assert len(hashes) == second


def test_source_default_is_once_and_bad_values_refused(out, hashes):
    src = hybrid_plan_source(out, samples=SAMPLES)
    src(0)
    n = len(hashes)
    src(0)
    assert len(hashes) == n > 0
    with pytest.raises(ValueError, match="verify='sometimes'"):
        load_hybrid_plan(out, 0, verify="sometimes")


def test_the_lengths_fingerprint_is_the_sample_tables():
    from balancer.store.hybrid.plan_dir import _lengths_fingerprint
    assert _lengths_fingerprint(SAMPLES.lengths) == SAMPLES.fingerprint()
