"""DVC stage `train`: Lightning fit tracked in MLflow -> models/best.ckpt + models/train.json."""

import argparse

from trainyard.core.config import Params
from trainyard.stages.runner import stage_main
from trainyard.training.fit import train
from trainyard.training.job import TrainJob, Workspace
from trainyard.training.nodes import agree


def add_args(p: argparse.ArgumentParser) -> None:
    """Where the train stage reads and writes (dvc.yaml passes the same)."""
    p.add_argument("--data", default="data/prepared")
    p.add_argument("--out", default="models")


def run(params: Params, args: argparse.Namespace) -> None:
    """Fit and track the model (training.fit.train): params read once into the job, the
    job resolved once on this machine (hardware, data, plan: every rank agreeing)."""
    job = TrainJob.from_params(params)
    ws = Workspace.at(args.data, args.out, params_file=args.params)
    team = agree(job, ws)
    train(team, ws)


if __name__ == "__main__":
    stage_main("train", run, add_args)
