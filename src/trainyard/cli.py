"""The ``trainyard`` command: ``trainyard <command> ...``, one module of trainyard.commands
per command (as DVC's dvc/cli/parser.py lists dvc/commands/). A new command: its module,
and one line in ``COMMANDS`` (the README's command table lists it too: tests/house/test_cli.py)."""

from __future__ import annotations

import argparse
import sys

from trainyard.commands import (
    audit,
    doctor,
    drift_check,
    exps,
    label,
    parse,
    pr_report,
    predict_files,
    predict_merge,
    promote,
    rollback,
    show_card,
    tune,
)

# In the order `trainyard --help` lists them.
COMMANDS = [
    doctor,
    tune,
    pr_report,
    audit,
    label,
    predict_files,
    predict_merge,
    drift_check,
    promote,
    rollback,
    show_card,
    exps,
]


def get_parser() -> argparse.ArgumentParser:
    """``trainyard``'s parser: each command's subparser, whose ``func`` is its command."""
    parser = argparse.ArgumentParser(prog="trainyard", description="trainyard commands")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``trainyard`` console script; returns the exit code (2 for bad usage)."""
    args = parse(get_parser(), argv)
    return args if isinstance(args, int) else args.func(args).run()


if __name__ == "__main__":
    sys.exit(main())
