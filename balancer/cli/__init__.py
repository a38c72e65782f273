"""Command line: ``python -m balancer <command>`` (the ``balancer`` script). Parses flags into
config models and calls the layers below; nothing below imports it."""
from .commands import COMMANDS, command
from .app import main

__all__ = ["COMMANDS", "command", "main"]
