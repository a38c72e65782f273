"""``--strategies ''`` (an empty list, e.g. an unset shell variable) is the same error in every
command, the usual one-line 'error:' with exit status 2. Before: compare and precompute exited
1 through SystemExit without the 'error:' prefix, report ran every strategy as if the flag had
not been given."""
import numpy as np
import pytest

from balancer.cli import main


@pytest.mark.parametrize("cmd", ["compare", "report", "precompute"])
def test_an_empty_strategy_list_is_an_error(tmp_path, capsys, cmd):
    np.save(tmp_path / "l.npy", np.arange(1, 300))
    argv = [cmd, "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--microbatches", "2",
            "--capacity", "4096", "--strategies", ""]
    if cmd != "compare":
        argv += ["--out", str(tmp_path / "out")]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "error: --strategies" in err and "at least one" in err, (rc, err)
    assert not (tmp_path / "out").exists()
