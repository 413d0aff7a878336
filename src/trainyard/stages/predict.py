"""DVC stage ``predict@NAME``: score ``predict.sources.NAME`` with the pipeline's model.

One stage per entry of params.yaml's ``predict.sources`` (a ``foreach`` in dvc.yaml: none
while it is empty), so ``dvc repro predict`` scores each source into
``predictions/NAME.parquet`` (+ ``.summary.json``) with the source, the model and the code
as its dependencies in dvc.lock, and an MLflow run in the model's experiment
(``trainyard.track.predict_run``). ``trainyard predict`` (``cli``) is the same job by hand.
"""

import argparse
import logging

from trainyard.bulk import job as command
from trainyard.core.config import Params, load_params
from trainyard.stages.runner import configure_logging, stage_main
from trainyard.track.predict_run import record_predict_run
from trainyard.track.registry import fetch_model

log = logging.getLogger("trainyard.stages.predict")


def add_args(p: argparse.ArgumentParser) -> None:
    """What dvc.yaml passes: the source's name, the source and the table to write."""
    p.add_argument("--name", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--out", required=True)


def job_args(source: str, out: str, params_file: str) -> argparse.Namespace:
    """``trainyard predict SOURCE --out OUT`` with every other option from params.yaml."""
    parser = command.add_arguments(argparse.ArgumentParser())
    return parser.parse_args([source, "--out", out, "--params", params_file])


def run(params: Params, args: argparse.Namespace) -> None:
    """Score the source (resuming an interrupted run's chunks), then record the run."""
    summary = command.predict(job_args(args.source, args.out, args.params), fetch_model)
    record_predict_run(params, summary, f"predict@{args.name}")


# ---------------------------------------------------------------- trainyard predict


def add_cli_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``trainyard predict``: bulk scoring's options, and ``--no-track``."""
    command.add_arguments(p)
    p.add_argument("--no-track", action="store_true", help="do not record an MLflow run")
    return p


def cli_run(args: argparse.Namespace) -> int:
    """``trainyard predict``: score, then record the MLflow run. The table is the result:
    an unreachable tracking store is a warning after it is written, not a failure."""
    configure_logging("predict")

    def record(job: argparse.Namespace, summary: dict) -> None:
        if args.no_track:
            return
        try:
            record_predict_run(load_params(job.params), summary, "predict")
        except Exception as err:  # the table and its summary are written: say, go on
            log.warning("the table is written; its MLflow run was not recorded: %s", err)

    return command.run_command(args, fetch_model, record)


def cli_merge(args: argparse.Namespace) -> int:
    """``trainyard predict-merge``."""
    configure_logging("predict")
    return command.run_merge(args)


if __name__ == "__main__":
    stage_main("predict", run, add_args)
