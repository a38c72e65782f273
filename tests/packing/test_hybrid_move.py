"""The compiled movement of tall documents (``packing.hybrid_move``, issue #15) against the
Python rule it replaced (``tests/naive/hybrid_stream.py``), on hypothesis-generated streams:
identical steps, every document inside its window, deterministic."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from balancer.cost.cp import CPCostModel
from balancer.planning.hybrid import plan_hybrid_stream
from packing.hybrid_cp import check_plan, shelf_cost
from packing.hybrid_move import move_tall
from tests.naive import hybrid_stream as ref


@st.composite
def stream(draw):
    P = draw(st.sampled_from([2, 4, 8, 16]))
    cap = draw(st.sampled_from([256, 1024]))
    n = draw(st.integers(0, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    limit = P * cap // 2
    lengths = rng.integers(cap // 2, max(cap, limit), n).astype(np.int64)
    # non-decreasing home steps with gaps and crowded steps (more than 4 and 8 tall ones)
    steps = np.sort(rng.integers(0, draw(st.integers(1, 12)), n)).astype(np.int64)
    delay = draw(st.integers(0, 3))
    advance = draw(st.integers(0, 3))
    rho = draw(st.sampled_from([0.0, 1e-9, 1e-7, 1e-5]))
    return lengths, P, cap, steps, delay, advance, rho


@given(stream())
def test_kernel_equals_python_rule(s):
    lengths, P, cap, home, delay, advance, rho = s
    tab = CPCostModel.from_preset("llama-7b", cap).table(lengths, P)
    tall = np.arange(lengths.shape[0], dtype=np.int64)

    def cost(key):
        return shelf_cost(tab.time, tab.tokens, cap, P, tall[list(key)], rho)

    want = ref.move_tall(home, cost, delay, advance)
    got = move_tall(tab.time, tab.tokens, cap, P, tall, home, rho, delay, advance)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert (got >= 0).all() and (got <= home + delay).all() and (got >= home - advance).all()
    assert np.array_equal(got, move_tall(tab.time, tab.tokens, cap, P, tall, home, rho, delay,
                                         advance))


def test_kernel_equals_python_rule_on_real_lengths():
    from balancer import workloads
    L = workloads.load("prolong")[:20000]
    m = CPCostModel.from_preset("llama-7b", 32768)
    P, budget = 64, 64 * 2 * 32768
    tab = m.table(L, P)
    cap = m.rank_capacity
    short = L * 2 <= cap
    rho = tab.work[short].sum() / L[short].sum()
    tall = np.flatnonzero(np.where(tab.tokens <= cap, tab.time, np.inf).min(axis=1) > rho * cap)
    home = ((np.cumsum(L) - L) // budget)[tall]
    assert tall.shape[0] >= 5

    def cost(key):
        return shelf_cost(tab.time, tab.tokens, cap, P, tall[list(key)], rho)

    got = move_tall(tab.time, tab.tokens, cap, P, tall, home, rho, 2, 2)
    assert np.array_equal(got, ref.move_tall(home, cost, 2, 2))
    assert (got != home).any()  # something moved


def test_input_errors():
    tab = CPCostModel.from_preset("llama-7b", 256).table(np.array([300, 400]), 4)
    args = (tab.time, tab.tokens, 256, 4)
    with pytest.raises(ValueError, match="non-decreasing"):
        move_tall(*args, np.array([0, 1]), np.array([2, 1]), 1e-7, 1, 1)
    with pytest.raises(ValueError, match="rows must lie"):
        move_tall(*args, np.array([0, 2]), np.array([0, 1]), 1e-7, 1, 1)
    with pytest.raises(ValueError, match="one length"):
        move_tall(*args, np.array([0, 1]), np.array([0]), 1e-7, 1, 1)
    with pytest.raises(ValueError, match="max_delay"):
        move_tall(*args, np.array([0, 1]), np.array([0, 1]), 1e-7, -1, 1)
    assert move_tall(*args, np.zeros(0, np.int64), np.zeros(0, np.int64), 1e-7, 2, 2).shape == (0,)


def test_stream_table_and_step_seconds():
    """A table passed in (built apart) gives the same plan; step_seconds gets one figure per
    step."""
    from balancer import workloads
    L = workloads.load("prolong")[:12000]
    m = CPCostModel.from_preset("llama-7b", 32768)
    budget = 64 * 2 * 32768
    secs: list = []
    a = plan_hybrid_stream(L, m, 64, budget, table=m.table(L, 64), step_seconds=secs)
    b = plan_hybrid_stream(L, m, 64, budget)
    check_plan(a.plan)
    assert len(secs) == a.plan.n_steps and all(x >= 0 for x in secs)
    for x, y in zip(a, b):
        assert all(np.array_equal(u, v) for u, v in zip(x, y)) if isinstance(x, tuple) \
            else np.array_equal(x, y)
    with pytest.raises(ValueError, match="table of"):
        plan_hybrid_stream(L, m, 64, budget, table=m.table(L[:10], 64))
