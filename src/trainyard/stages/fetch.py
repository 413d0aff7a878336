"""DVC stage `fetch`: the four Fashion-MNIST IDX .gz files, verified, into data/raw/.

With ``data.source: folder`` there is nothing to download: the folder itself is the
prepare stage's dependency, so data/raw only records that.
"""

import argparse
import logging

from trainyard.core.config import Params
from trainyard.core.io import atomic_dir
from trainyard.data.sources.fashion_fetch import fetch_raw
from trainyard.stages.runner import stage_main

# By name: run as `python -m`, __name__ is "__main__", outside the trainyard logger whose
# INFO lines the stage shows (stages.common.configure_logging).
log = logging.getLogger("trainyard.stages.fetch")


def run(params: Params, args: argparse.Namespace) -> None:
    if params.data.source != "fashion-mnist":
        with atomic_dir(args.out) as tmp:
            (tmp / "SOURCE").write_text(f"{params.data.source}: nothing to fetch\n")
        log.info("data.source is %r; nothing to fetch", params.data.source)
        return

    for f in fetch_raw(params.data, args.out):
        log.info("%s from %s (content sha256 %s… ok)", f.name, f.origin, f.content_sha256[:12])


if __name__ == "__main__":
    stage_main("fetch", run, lambda p: p.add_argument("--out", default="data/raw"))
