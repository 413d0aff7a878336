"""DVC stage `prepare`: IDX -> uint8 .npy splits + stats.json in data/prepared/."""

import argparse

from trainyard.cli import stage_main
from trainyard.config import Params
from trainyard.prepare import prepare


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--raw", default="data/raw")
    p.add_argument("--out", default="data/prepared")


def run(params: Params, args: argparse.Namespace) -> None:
    stats = prepare(args.raw, args.out, params.data, params.seed)
    counts = {s: c["total"] for s, c in stats["counts"].items()}
    print(f"prepare: {counts}, pixel mean {stats['pixel_mean']:.4f} std {stats['pixel_std']:.4f}")


if __name__ == "__main__":
    stage_main("prepare", run, add_args)
