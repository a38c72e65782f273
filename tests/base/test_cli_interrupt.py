"""Ctrl-C ends a command with one line and the status a shell gives an interrupted program
(130 = 128 + SIGINT), not a KeyboardInterrupt traceback out of whatever numpy call was running
(seen on precompute of 2,000,000 samples interrupted after 5 s; its partial directory was
already removed, as now)."""
from balancer.cli import main
from balancer.cli.commands import COMMANDS


def test_an_interrupted_command_ends_quietly(monkeypatch, capsys):
    from balancer.cli import store  # noqa: F401 (registers inspect)

    def interrupted(args):
        raise KeyboardInterrupt
    help_, add, _ = COMMANDS["inspect"]
    monkeypatch.setitem(COMMANDS, "inspect", (help_, add, interrupted))
    rc = main(["inspect", "somewhere"])
    err = capsys.readouterr().err
    assert rc == 130 and err.strip() == "interrupted", err
