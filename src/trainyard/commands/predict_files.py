"""``trainyard predict SOURCE``: score a folder, CSV, list of paths or glob of images in bulk
(docs/predict.md), then record the job as an MLflow run (``--no-track``: not).

Named for what it does: ``trainyard.stages.predict`` is the DVC stage that runs the same job
for each of params.yaml's ``predict.sources``. The flags are bulk scoring's own
(trainyard.bulk.command_line, which ``python -m trainyard.bulk`` reads too); this command
adds registry models (``--model models:/NAME@ALIAS``) and the run, both MLflow's.
"""

from __future__ import annotations

import logging
from typing import Any

from trainyard.bulk.command_line import add_predict_arguments, predict_options, run_predict
from trainyard.bulk.predict_job import PredictOptions
from trainyard.commands import Command, RegistryOnDemand, Subparsers, command_parser
from trainyard.core.config import load_params
from trainyard.stages.runner import configure_logging

log = logging.getLogger("trainyard.commands.predict_files")
HELP = "score a folder, CSV, list of paths or glob of images in bulk (docs/predict.md)"


def add_parser(subparsers: Subparsers) -> None:
    p = add_predict_arguments(command_parser(subparsers, "predict", HELP, CmdPredict))
    p.add_argument("--no-track", action="store_true", help="do not record an MLflow run")


class CmdPredict(Command):
    def run(self) -> int:
        """Score, then record the MLflow run: 0; 1 with the reason; 130 on Ctrl-C."""
        configure_logging("predict")
        record = None if self.args.no_track else record_run
        return run_predict(predict_options(self.args), RegistryOnDemand(), record)


def record_run(options: PredictOptions, summary: dict[str, Any]) -> None:
    """The job's MLflow run. The table is the result: an unreachable tracking store is a
    warning after it is written, not a failure."""
    from trainyard.track.predict_run import record_predict_run

    try:
        record_predict_run(load_params(options.params), summary, "predict")
    except Exception as err:  # the table and its summary are written: say, go on
        log.warning("the table is written; its MLflow run was not recorded: %s", err)
