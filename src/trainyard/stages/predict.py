"""DVC stage ``predict@NAME``: score ``predict.sources.NAME`` with the pipeline's model.

One stage per entry of params.yaml's ``predict.sources`` (a ``foreach`` in dvc.yaml: none
while it is empty), so ``dvc repro predict`` scores each source into
``predictions/NAME.parquet`` (+ ``.summary.json``) with the source, the model and the code
as its dependencies in dvc.lock, and an MLflow run in the model's experiment
(``trainyard.track.predict_run``). ``trainyard predict`` (trainyard.commands.predict_files)
is the same job by hand.
"""

import argparse

from trainyard.bulk.predict_job import PredictOptions, predict
from trainyard.core.config import Params
from trainyard.stages.runner import stage_main
from trainyard.track.model_refs import MlflowRegistry
from trainyard.track.predict_run import record_predict_run


def add_args(p: argparse.ArgumentParser) -> None:
    """What dvc.yaml passes: the source's name, the source and the table to write."""
    p.add_argument("--name", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--out", required=True)


def run(params: Params, args: argparse.Namespace) -> None:
    """Score the source with every other option from params.yaml (resuming an interrupted
    run's chunks), then record the run."""
    options = PredictOptions(source=args.source, out=args.out, params=args.params)
    summary = predict(options, MlflowRegistry())
    record_predict_run(params, summary, f"predict@{args.name}")


if __name__ == "__main__":
    stage_main("predict", run, add_args)
