"""Token sequences passed where lengths are expected (``SampleTable(docs)`` instead of
``SampleTable([len(d) for d in docs])``) are refused by a message that says so. Before: numpy's
'setting an array element with a sequence. The requested array has an inhomogeneous shape ...'
(ragged) or 'lengths must be a 1-D array, got shape (2, 2)' (equal lengths)."""
import numpy as np
import pytest

from balancer import SampleTable


@pytest.mark.parametrize("docs", [[[1, 2], [3]], [[1, 2], [3, 4]],
                                  [np.arange(3), np.arange(5)]])
def test_token_sequences_are_not_lengths(docs):
    with pytest.raises(ValueError, match=r"sample 0: .*sequence.*len\(x\) for x in"):
        SampleTable(docs)


def test_a_2d_array_of_numbers_is_still_named_by_its_shape():
    with pytest.raises(ValueError, match=r"1-D array, got shape \(2, 2\)"):
        SampleTable(np.ones((2, 2), np.int64))
