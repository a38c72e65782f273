"""A plan directory (--out) whose folder cannot be made is named with the reason, not the errno of a hidden
path: a parent that is a file, a parent the file system refuses (/proc)."""
import numpy as np
import pytest

from balancer.cli import main


@pytest.mark.parametrize("out,why", [("l.npy/plan", "is not a directory"),
                                     ("/proc/plan", "cannot")])
def test_an_out_that_cannot_be_made_is_named(tmp_path, capsys, monkeypatch, out, why):
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "l.npy", np.arange(1, 100))
    rc = main(["precompute", "--lengths", "l.npy", "--capacity", "4096", "--out", out])
    err = capsys.readouterr().err
    assert rc == 2 and out in err and why in err, err
    assert ".partial-" not in err, err
