"""The command table: name -> (help, add_arguments(parser), run(args) -> exit code). Command
modules add their rows with :func:`command`; :func:`balancer.cli.app.main` reads it."""
from __future__ import annotations

COMMANDS: dict = {}


def command(name: str, help: str):
    """Register ``(add_arguments, run)`` as command ``name``: ``command(name, help)((add, run))``."""
    def deco(fn_pair):
        if name in COMMANDS:
            raise ValueError(f"command {name!r} is already registered")
        COMMANDS[name] = (help, *fn_pair)
        return fn_pair
    return deco
