"""The linear-time building blocks of the ``balanced`` planner give exactly the results of the
plain numpy operations they replace: the priority order (``np.lexsort`` by class, then cost
descending, then input order), the top-up's merge (the priority order of the whole set) and the
per-microbatch sums (``np.bincount`` over each entry's microbatch)."""
import numpy as np
from hypothesis import given, strategies as st

from packing.balanced_step import _with_fresh
from packing.segments import add_segment_sums
from packing.steppack import _priority_order


def _costs(draw, n):
    kind = draw(st.sampled_from(["uniform", "lengths", "few", "low bits", "zeros"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if kind == "uniform":
        return rng.random(n) * 1e5
    if kind == "lengths":  # a quadratic cost model of integer lengths
        L = rng.integers(1, 40000, n).astype(np.float64)
        return 3 * (L + L * L / 65536)
    if kind == "few":  # many equal costs
        return rng.integers(0, 5, n).astype(np.float64)
    if kind == "low bits":  # equal in their high 32 bits, different in the low ones
        bits = np.float64(12345.678).view(np.uint64) + rng.integers(0, 1000, n).astype(np.uint64)
        return bits.view(np.float64)
    return np.concatenate([rng.random(n // 2), np.zeros(n - n // 2)])


@given(st.data(), st.integers(0, 400))
def test_priority_order_equals_lexsort(data, n):
    cost = _costs(data.draw, n)
    cls = np.random.default_rng(n).integers(0, 4, n).astype(np.int64)
    out = np.empty(n, dtype=np.int64)
    _priority_order(cls, cost, out)
    assert (out == np.lexsort((np.arange(n), -cost, cls))).all()


@given(st.data(), st.sampled_from([600, 5000, 20000]))
def test_priority_order_of_a_large_step_equals_lexsort(data, n):
    """Steps of 512 and 4096 items or more sort on wider digits (fewer passes)."""
    cost = _costs(data.draw, n)
    cls = np.random.default_rng(n).integers(0, 4, n).astype(np.int64)
    out = np.empty(n, dtype=np.int64)
    _priority_order(cls, cost, out)
    assert (out == np.lexsort((np.arange(n), -cost, cls))).all()


@given(st.data(), st.integers(1, 300), st.integers(0, 60))
def test_top_up_merge_equals_sorting_everything(data, n_old, n_new):
    """The first round's candidates (some pool slots, classes 0-3) and the light items read by
    the top-up (pool slots after them; lumps among them are left out) in the order a full sort
    gives."""
    cost = _costs(data.draw, n_old + n_new)
    rng = np.random.default_rng(n_old * 61 + n_new)
    sizes = rng.integers(1, 100, n_old + n_new).astype(np.int64)
    cpt, thr = 1.0, 1e300 if data.draw(st.booleans()) else float(np.median(cost))
    pool = rng.permutation(n_old + n_new).astype(np.int64)  # slot -> stream item
    cand = np.flatnonzero(rng.random(n_old) < 0.8).astype(np.int64)  # round 1's candidates
    cls = rng.integers(0, 4, cand.shape[0]).astype(np.int64)
    o = np.empty(cand.shape[0], dtype=np.int64)
    _priority_order(cls, cost[pool[cand]], o)
    order, ocls = _with_fresh(cand[o], cls[o], pool, np.int64(n_old), np.int64(n_old + n_new),
                              sizes, cost, cpt, thr)
    fresh = np.arange(n_old, n_old + n_new)
    fresh = fresh[~(cost[pool[fresh]] - sizes[pool[fresh]] * cpt > thr)]
    slots = np.concatenate([cand, fresh])
    all_cls = np.concatenate([cls, np.full(fresh.shape[0], 3)])
    ref = np.lexsort((slots, -cost[pool[slots]], all_cls))
    assert (order == slots[ref]).all()
    assert (ocls == all_cls[ref]).all()


@given(st.integers(0, 50), st.integers(0, 2**16), st.integers(0, 5))
def test_segment_sums_equal_bincount(n_seg, seed, base):
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 20, n_seg)
    offsets = base + np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    values = rng.random(int(counts.sum())) * 10.0 ** rng.integers(-3, 6)
    out = np.zeros(n_seg)
    add_segment_sums(values, offsets, base, out)
    seg = np.repeat(np.arange(n_seg), counts)
    assert out.tobytes() == np.bincount(seg, weights=values, minlength=n_seg).tobytes()
