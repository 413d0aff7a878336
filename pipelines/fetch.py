"""DVC stage `fetch`: the four Fashion-MNIST IDX .gz files, verified, into data/raw/."""

import argparse

from trainyard.cli import stage_main
from trainyard.config import Params
from trainyard.fetch import fetch_raw


def run(params: Params, args: argparse.Namespace) -> None:
    for f in fetch_raw(params.data, args.out):
        print(f"fetch: {f.name} from {f.origin} (content sha256 {f.content_sha256[:12]}… ok)")


if __name__ == "__main__":
    stage_main("fetch", run, lambda p: p.add_argument("--out", default="data/raw"))
