"""--lengths 'shards/*.npy' unquoted: the shell expands the glob into many arguments; the error
says to quote it (or give the directory) instead of only 'unrecognized arguments'."""
from __future__ import annotations

import numpy as np
import pytest

from balancer.cli.app import main


def test_an_expanded_glob_is_explained(tmp_path, capsys):
    files = []
    for i in range(3):
        files.append(str(tmp_path / f"part-{i}.npy"))
        np.save(files[-1], np.arange(1, 50))
    with pytest.raises(SystemExit) as e:  # what `--lengths shards/*.npy` hands the command
        main(["precompute", "--lengths", *files, "--dp", "1", "--microbatches", "1",
              "--capacity", "64", "--out", str(tmp_path / "plan")])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "--lengths takes one value" in err and "quote the glob" in err, err
