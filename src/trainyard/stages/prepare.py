"""DVC stage `prepare`: the data source -> uint8 [N,C,H,W] splits + card.json in data/prepared/."""

import argparse
import logging
from pathlib import Path

from trainyard.core.config import Params, pretrained_intent
from trainyard.data.sources import fingerprint_source
from trainyard.data.sources import prepare_source as prepare
from trainyard.stages.runner import stage_main

# By name: run as `python -m`, __name__ is "__main__", outside the trainyard logger whose
# INFO lines the stage shows (stages.common.configure_logging).
log = logging.getLogger("trainyard.stages.prepare")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--raw", default="data/raw")
    p.add_argument("--out", default="data/prepared")


def run(params: Params, args: argparse.Namespace) -> None:
    # The inputs as prepare finds them (stages run from the repository root): in the log,
    # not the card, which stays the same on every machine for the same content.
    found = fingerprint_source(params.data, Path.cwd())
    log.info("source fingerprint %s (%d files)", found.digest[:12], found.files)
    # The user's own images are training data, held only to a memory limit
    # (data.max_image_pixels); serve.max_image_pixels guards the service's untrusted uploads.
    card = prepare(
        args.raw,
        args.out,
        params.data,
        params.seed,
        params.data.max_image_pixels,
        pretrained_intent(params.train),
    )
    counts = {s: c["total"] for s, c in card.counts.items()}
    mean = ", ".join(f"{m:.4f}" for m in card.mean)
    std = ", ".join(f"{s:.4f}" for s in card.std)
    skipped = f", {len(card.skipped)} bad file(s) skipped" if card.skipped else ""
    log.info(
        "%s (%s), %s, mean [%s] std [%s]%s", card.summary(), card.resize, counts, mean, std, skipped
    )


if __name__ == "__main__":
    stage_main("prepare", run, add_args)
