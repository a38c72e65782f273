"""Command line: ``python -m balancer <command>``.

The command table is :data:`balancer.cli.commands.COMMANDS` (name -> (help, add_arguments,
run)); each command module fills its rows with :func:`~balancer.cli.commands.command`, and
:func:`main` imports the modules of :data:`COMMAND_MODULES`, in that order (the order of
``--help``), then builds one sub-parser per row."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from .commands import COMMANDS

#: modules that register commands when imported, in --help order (missing ones are skipped)
COMMAND_MODULES = ("balancer.cli.compare", "balancer.cli.report", "balancer.cli.store",
                   "balancer.cli.calibrate", "balancer.cli.compile", "balancer.cli.lengths")


def main(argv=None) -> int:
    # importing these registers their commands
    for mod in COMMAND_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
    p = argparse.ArgumentParser(prog="python -m balancer", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (help_, add, run) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        add(sp)
        sp.set_defaults(_run=run)
    args, extra = p.parse_known_args(argv)
    if extra:
        lengths = getattr(args, "lengths", None)
        if lengths and all(os.path.exists(x) for x in extra):
            # `--lengths shards/*.npy` unquoted: the shell expanded the glob into many files
            p.error(f"--lengths takes one value, got {lengths} and {len(extra)} more files "
                    f"({extra[0]}, ...): quote the glob (--lengths 'shards/*.npy') so the "
                    f"shell does not expand it, or give the directory or a comma list")
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args._run(args)
    except KeyboardInterrupt:  # Ctrl-C: what was half-written is removed on the way out
        print("interrupted", file=sys.stderr)
        return 130  # what a shell reports for a program ended by SIGINT (128 + 2)
    except BrokenPipeError:  # `... | head`: the reader wants no more output, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush
        return 141  # what a shell reports for a writer ended by SIGPIPE (128 + 13)
    except (ValueError, OSError) as e:  # bad input: one line naming the file / flag / sample
        from .args import as_flags  # the Python spelling of a config argument -> its flag
        msg = as_flags(" ".join(str(e).split("\n")))
        print(f"error: {msg}", file=sys.stderr)
        return 2

