"""The compiled per-document cost of one pass equals the numpy expression it replaced, bit for
bit (plans and their stored costs must not change with it), overflow included."""
import numpy as np
import pytest

from packing.doc_cost import pass_costs


def _numpy(lengths, a, b, d):
    lf = lengths.astype(np.float64)
    with np.errstate(over="ignore"):
        out = a * lf * lf + b * lf
    if d:
        out += d
    return out


@pytest.mark.parametrize("seed", range(20))
def test_pass_costs_equal_the_numpy_expression_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 5000))
    lengths = rng.integers(1, [2 ** 10, 2 ** 20, 2 ** 40][seed % 3], n).astype(np.int64)
    a, b = (float(x) for x in rng.random(2) * 10.0 ** rng.integers(-12, 3, 2))
    d = 0.0 if seed % 2 else float(rng.random() * 1e3)
    if seed % 5 == 0:
        a = 0.0
    got = pass_costs(lengths, a, b, d)
    assert got.dtype == np.float64 and got.tobytes() == _numpy(lengths, a, b, d).tobytes()


def test_an_overflow_gives_inf_as_numpy_does():
    lengths = np.array([1, 2 ** 40], dtype=np.int64)
    got = pass_costs(lengths, 1e300, 1.0, 0.0)
    assert got[0] == 1e300 + 1.0 and np.isinf(got[1])
    assert got.tobytes() == _numpy(lengths, 1e300, 1.0, 0.0).tobytes()


def test_lengths_that_are_not_integers_are_refused_not_truncated():
    with pytest.raises(ValueError, match="must be integers, got dtype float64"):
        pass_costs(np.array([1.5, 2.0]), 1.0, 1.0)
    assert pass_costs(np.array([3], dtype=np.int32), 0.0, 2.0).tolist() == [6.0]
