"""DVC stage `train`: Lightning fit tracked in MLflow -> models/best.ckpt + models/train.json."""

import argparse

from trainyard.core.config import Params
from trainyard.stages.common import stage_main
from trainyard.train.fit import train


def add_args(p: argparse.ArgumentParser) -> None:
    """Where the train stage reads and writes (dvc.yaml passes the same)."""
    p.add_argument("--data", default="data/prepared")
    p.add_argument("--out", default="models")


def run(params: Params, args: argparse.Namespace) -> None:
    """Fit and track the model (train.fit.train)."""
    train(params, args.data, args.out, params_file=args.params)


if __name__ == "__main__":
    stage_main("train", run, add_args)
