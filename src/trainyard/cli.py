"""The ``trainyard`` command: ``trainyard <command> ...`` (doctor, tune, report, predict, exps,
drift, promote, rollback)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from trainyard.bulk import job as bulk
from trainyard.commands import doctor, exps, promote, tune
from trainyard.commands import drift_check as drift
from trainyard.experiments import baseline_report as report
from trainyard.stages import predict

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
    "predict": (
        "score a folder, CSV, list of paths or glob of images in bulk (docs/predict.md)",
        predict.add_cli_arguments,
        predict.cli_run,
    ),
    "predict-merge": (
        "merge the outputs of a job's --shard K/N runs into one table",
        bulk.add_merge_arguments,
        predict.cli_merge,
    ),
    "drift": (
        "a prediction log or predict table against the model's reference (docs/drift.md)",
        drift.add_cli_arguments,
        drift.cli_run,
    ),
    "promote": (
        "move a registered model's champion alias to a version that ran as the shadow",
        promote.add_promote_arguments,
        promote.run_promote,
    ),
    "rollback": (
        "move a registered model's champion alias back to the one it replaced",
        promote.add_rollback_arguments,
        promote.run_rollback,
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
