"""``trainyard report``: ``reports/report.md``, this workspace against a baseline revision,
for a pull-request comment (trainyard.experiments.baseline_report writes it)."""

from __future__ import annotations

import sys
from pathlib import Path

from trainyard.commands import Command, Subparsers, command_parser
from trainyard.core.errors import TrainyardError
from trainyard.experiments import DEFAULT_BASELINE, DEFAULT_OUT

HELP = "reports/report.md: this workspace against a baseline revision (main)"


def add_parser(subparsers: Subparsers) -> None:
    parser = command_parser(subparsers, "report", HELP, CmdReport)
    parser.add_argument(
        "--baseline",
        metavar="REV",
        default=None,
        help=f"git revision to compare with (default {DEFAULT_BASELINE}; HEAD if there is none)",
    )
    parser.add_argument(
        "--out",
        metavar="PATH",
        type=Path,
        default=None,
        help=f"the report's file (default {DEFAULT_OUT} of the repository); its pictures go "
        "to the folder of the same name beside it",
    )


class CmdReport(Command):
    def run(self) -> int:
        """0 written, 1 an error, 2 a baseline that does not exist."""
        from trainyard.experiments.baseline_report import NoSuchRevision, write_report

        try:
            path = write_report(Path.cwd(), self.args.baseline, self.args.out)
        except TrainyardError as err:
            print(f"trainyard report: error: {err}", file=sys.stderr)
            return 2 if isinstance(err, NoSuchRevision) else 1
        print(path)
        return 0
