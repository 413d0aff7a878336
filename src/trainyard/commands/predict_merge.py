"""``trainyard predict-merge SHARD... --out FILE``: the outputs of a job's ``--shard K/N``
runs as the one table (and summary) a single run writes (docs/predict.md)."""

from __future__ import annotations

from trainyard.bulk.command_line import add_merge_arguments, run_merge
from trainyard.commands import Command, Subparsers, command_parser
from trainyard.stages.runner import configure_logging

HELP = "merge the outputs of a job's --shard K/N runs into one table"


def add_parser(subparsers: Subparsers) -> None:
    add_merge_arguments(command_parser(subparsers, "predict-merge", HELP, CmdPredictMerge))


class CmdPredictMerge(Command):
    def run(self) -> int:
        """0 merged; 1 with the reason (a shard missing, repeated or of another job)."""
        configure_logging("predict")
        return run_merge(self.args.shards, self.args.out)
