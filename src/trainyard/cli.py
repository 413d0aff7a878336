"""The ``trainyard`` command: ``trainyard <command> ...`` (doctor, tune, report, exps)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from trainyard.doctor import command as doctor
from trainyard.experiments import exps, report, tune

# name -> (help, add_arguments(parser), run(args) -> exit code).
COMMANDS: dict[str, tuple[str, Callable[..., Any], Callable[[argparse.Namespace], int]]] = {
    "doctor": (
        "check this machine and what trainyard will do on it",
        doctor.add_arguments,
        doctor.run,
    ),
    "tune": (
        "hyperparameter search with Optuna over params.yaml's tune.space",
        tune.add_arguments,
        tune.run,
    ),
    "report": (
        "reports/report.md: this workspace against a baseline revision (main)",
        report.add_arguments,
        report.run,
    ),
    "exps": (
        "the DVC experiments table with only the columns people compare",
        exps.add_arguments,
        exps.run,
    ),
}


def main(argv: list[str] | None = None) -> int:
    """The ``trainyard`` console script; returns the exit code (2 for bad usage)."""
    parser = argparse.ArgumentParser(prog="trainyard", description="trainyard commands")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add, func) in COMMANDS.items():
        add(sub.add_parser(name, help=help_text, description=help_text)).set_defaults(func=func)
    args = doctor.parse(parser, argv)
    return args if isinstance(args, int) else args.func(args)


if __name__ == "__main__":
    sys.exit(main())
