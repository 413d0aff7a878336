"""commands: one module per ``trainyard`` command, listed in trainyard.cli's ``COMMANDS``.

The shape of each, as DVC's ``dvc/commands/<name>.py``: ``add_parser(subparsers)`` adds the
command's subparser and sets its ``func`` to the module's one ``Command`` class;
``Cmd(args).run()`` is the exit status. A command module turns its arguments into typed
values and calls the library, which never sees an ``argparse.Namespace``.

Nothing is imported here but argparse, so one command module can run alone: ``python -m
trainyard.commands.doctor`` on a machine that has torch and none of the others' libraries.
"""

from __future__ import annotations

import argparse

Subparsers = argparse._SubParsersAction  # what ArgumentParser.add_subparsers returns


class Command:
    """A command with its parsed arguments: ``run()`` does it and returns the exit status."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def run(self) -> int:
        raise NotImplementedError


def command_parser(
    subparsers: Subparsers, name: str, help_text: str, command: type[Command]
) -> argparse.ArgumentParser:
    """``trainyard NAME``'s subparser, its help also its description, running ``command``."""
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(func=command)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status argparse chose (usage error, ``--help``)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 2 for bad usage, 0 for --help
        return exc.code if isinstance(exc.code, int) else 2
