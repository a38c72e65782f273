"""A missing layout value of --cp-mode hybrid is named as the flag that gives it."""
from __future__ import annotations

from balancer.cli.app import main


def test_hybrid_without_rank_capacity_names_the_flag(tmp_path, capsys):
    # was: "error: cp_mode 'hybrid' needs rank_capacity (...)": no such flag to type
    rc = main(["precompute", "--lengths", "wikipedia", "--samples", "200", "--dp", "2",
               "--cp", "2", "--capacity", "8192", "--cp-mode", "hybrid", "--out", str(tmp_path / "plan")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--cp-mode hybrid needs --rank-capacity" in err, err
