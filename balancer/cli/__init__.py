"""Command line: ``python -m balancer <command>`` (the ``balancer`` script). Parses flags into
config models and calls the layers below; nothing below imports it."""
from .._moved import forward
from .commands import COMMANDS, command
from .app import main

# ``balancer.cli`` was one module before issue #12: its names still resolve here
__getattr__ = forward(__name__, "balancer.cli.app")

__all__ = ["COMMANDS", "command", "main"]
