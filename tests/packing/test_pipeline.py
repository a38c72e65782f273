import numpy as np
from hypothesis import given, strategies as st

from packing.pipeline import rank_step_times, simulate_1f1b
from tests.naive import core as naive


def test_equal_microbatches_closed_form():
    for pp in (1, 2, 4, 8):
        for m in (1, 3, 8, 16):
            t, busy = simulate_1f1b(np.ones(m), 2 * np.ones(m), pp)
            assert t == (m + pp - 1) * 3.0
            assert np.allclose(busy, 3.0 * m)


def test_one_slow_microbatch_delays_by_its_extra_time():
    # 2 stages, 4 microbatches, microbatch 0 has a forward 1.0 longer: it sits on the critical
    # path twice (stage 0 and stage 1 forwards), the backward of others is unaffected
    pp, m = 2, 4
    f = np.ones(m)
    b = 2 * np.ones(m)
    base, _ = simulate_1f1b(f, b, pp)
    f2 = f.copy()
    f2[0] += 1.0
    slow, _ = simulate_1f1b(f2, b, pp)
    assert slow == base + 2.0
    assert slow == naive.simulate_1f1b(f2.tolist(), b.tolist(), pp)


@given(st.integers(1, 6), st.lists(st.tuples(st.floats(0, 10), st.floats(0, 10)),
                                   min_size=1, max_size=12))
def test_matches_reference(pp, ops):
    # the kernel replays the op order found once (it never depends on durations, zero ones
    # included) with the reference's arithmetic: the same makespan to the last bit
    f = np.array([a for a, _ in ops])
    b = np.array([c for _, c in ops])
    t, busy = simulate_1f1b(f, b, pp)
    assert t == naive.simulate_1f1b(f.tolist(), b.tolist(), pp)
    assert np.allclose(busy, f.sum() + b.sum())


def test_rank_step_times_layout():
    # 2 steps, dp=2, m=2 then m=1
    mb_f = np.array([1, 1, 2, 2, 5, 1.0])
    mb_b = 2 * mb_f
    times, bubble = rank_step_times(mb_f, mb_b, np.array([2, 1]), 2, 1)
    assert np.allclose(times, [[6, 12], [15, 3]])
    assert np.allclose(bubble, 0)


def test_no_microbatches_take_no_time():
    # a rank with no microbatch, alone or as a step of 0 between steps of 2 (the op order of
    # each count is made once and reused)
    t, busy = simulate_1f1b(np.zeros(0), np.zeros(0), 3)
    assert t == 0.0 and busy.tolist() == [0.0, 0.0, 0.0]
    mb_f = np.array([1, 2, 3, 4.0])
    times, bubble = rank_step_times(mb_f, 2 * mb_f, np.array([1, 0, 1]), 2, 2)
    assert times[1].tolist() == [0.0, 0.0] and bubble[1].tolist() == [0.0, 0.0]
    # one microbatch on 2 stages: forward c / 2 on each, then backward c on each: 3 c
    assert times[0].tolist() == [3.0, 6.0] and times[2].tolist() == [9.0, 12.0]


def test_pipeline_order_close_to_best_permutation():
    import itertools

    from packing.pipeline import pipeline_order
    rng = np.random.default_rng(1)
    ratios = []
    for _ in range(60):
        pp, m = int(rng.choice([2, 4])), int(rng.choice([4, 5, 6]))
        c = rng.lognormal(0, 0.6, m)

        def span(o):
            return simulate_1f1b(c[list(o)] / pp, 2 * c[list(o)] / pp, pp)[0]

        o = pipeline_order(c, pp)
        assert sorted(o.tolist()) == list(range(m))
        best = min(span(p) for p in itertools.permutations(range(m)))
        ratios.append(span(o) / best)
        assert span(o) <= min(span(np.argsort(c)), span(np.argsort(-c))) + 1e-9
    assert np.mean(ratios) < 1.02
