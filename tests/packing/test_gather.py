"""take3 gathers three int64 arrays as np.take does, and refuses indices out of range."""
import numpy as np
import pytest

from packing.gather import take3


@pytest.mark.parametrize("seed", range(5))
def test_take3_equals_np_take(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    a, b, c = (rng.integers(-2 ** 40, 2 ** 40, n) for _ in range(3))
    idx = rng.integers(0, n, int(rng.integers(0, 5000)))
    got = take3(idx, a, b, c)
    for x, g in zip((a, b, c), got):
        assert g.dtype == np.int64 and (g == np.take(x, idx)).all()


def test_take3_refuses_indices_out_of_range_and_unequal_lengths():
    a = np.arange(4)
    with pytest.raises(ValueError, match=r"index 4 at position 1 outside 0..3 \(indices 0..4\)"):
        take3(np.array([0, 4]), a, a, a)
    with pytest.raises(ValueError, match=r"index -1 at position 2 outside 0..3 \(indices -1..3\)"):
        take3(np.array([3, 0, -1, 2]), a, a, a)
    with pytest.raises(ValueError, match="one length"):
        take3(np.array([0]), a, a[:3], a)
