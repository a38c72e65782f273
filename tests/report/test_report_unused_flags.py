"""``report`` refuses a flag its input does not read instead of ignoring it: ``--epoch`` without
``--plan``, and the dataset's ``--split``, ``--length-column``, ``--tokens-column`` with
``--lengths`` (before: the report was written as if the flag were not there)."""
import numpy as np
import pytest

from balancer.cli import main


@pytest.mark.parametrize("extra,flag", [(["--epoch", "3"], "--epoch"),
                                        (["--epoch", "-1"], "--epoch"),
                                        (["--split", "test"], "--split"),
                                        (["--length-column", "n"], "--length-column"),
                                        (["--tokens-column", "input_ids"], "--tokens-column")])
def test_a_flag_the_input_does_not_read_is_refused(tmp_path, capsys, extra, flag):
    np.save(tmp_path / "l.npy", np.arange(1, 300))
    rc = main(["report", "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--microbatches",
               "2", "--capacity", "4096", "--out", str(tmp_path / "r"), "--no-plots", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and flag in err, err
    assert not (tmp_path / "r" / "report.json").exists()
