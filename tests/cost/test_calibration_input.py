"""Measured microbatches that cannot calibrate a cost model are refused, naming what is wrong:
a document length that is not an integer (100.5 was truncated to 100, ``true`` read as 1) and
microbatches that all hold the same documents (every fit of them is as good as any other:
before, a preset with a = 0.226 s per squared token was written from 5 one-token microbatches)."""
import json

import pytest

from balancer.cli import main
from balancer.cost.calibration import to_csr

TIMES = {"forward": [0.1, 0.2, 0.1, 0.4, 0.1], "backward": [0.2, 0.4, 0.2, 0.8, 0.2]}


@pytest.mark.parametrize("bad", [100.5, True, "100", None, float("inf")])
def test_a_length_that_is_not_an_integer_is_refused(bad):
    with pytest.raises(ValueError, match=r"microbatch 0 document 1: length .* is not an integer"):
        to_csr([[5, bad], [3]])


def test_integral_floats_and_numpy_integers_pass():
    import numpy as np
    lens, offs = to_csr([[5, 100.0], [np.int32(3)]])
    assert lens.tolist() == [5, 100, 3] and offs.tolist() == [0, 2, 3]


def test_identical_microbatches_are_refused(tmp_path, capsys):
    (tmp_path / "o.json").write_text(json.dumps({"microbatches": [[1]] * 5, **TIMES}))
    rc = main(["calibrate", "--observations", str(tmp_path / "o.json"), "--out",
               str(tmp_path / "c.yaml")])
    err = capsys.readouterr().err
    assert rc == 2 and "same" in err and "vary" in err, err
    assert not (tmp_path / "c.yaml").exists()
