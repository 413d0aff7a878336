"""DVC stage `train`: Lightning fit tracked in MLflow -> models/best.ckpt + models/train.json."""

import argparse

from trainyard.core.config import Params
from trainyard.stages.runner import stage_main
from trainyard.training.fit import train
from trainyard.training.job import TrainJob, Workspace


def add_args(p: argparse.ArgumentParser) -> None:
    """Where the train stage reads and writes (dvc.yaml passes the same)."""
    p.add_argument("--data", default="data/prepared")
    p.add_argument("--out", default="models")


def run(params: Params, args: argparse.Namespace) -> None:
    """Fit and track the model (training.fit.train), params read once into the job."""
    job = TrainJob.from_params(params)
    train(job, Workspace.at(args.data, args.out, params_file=args.params))


if __name__ == "__main__":
    stage_main("train", run, add_args)
