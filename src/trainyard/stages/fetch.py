"""DVC stage `fetch`: the four Fashion-MNIST IDX .gz files, verified, into data/raw/.

With ``data.source: folder`` there is nothing to download: the folder itself is the
prepare stage's dependency, so data/raw only records that.
"""

import argparse

from trainyard.core.config import Params
from trainyard.core.io import atomic_dir
from trainyard.data.sources.fashion_fetch import fetch_raw
from trainyard.stages.common import stage_main


def run(params: Params, args: argparse.Namespace) -> None:
    if params.data.source != "fashion-mnist":
        with atomic_dir(args.out) as tmp:
            (tmp / "SOURCE").write_text(f"{params.data.source}: nothing to fetch\n")
        print(f"fetch: data.source is {params.data.source!r}; nothing to fetch")
        return

    for f in fetch_raw(params.data, args.out):
        print(f"fetch: {f.name} from {f.origin} (content sha256 {f.content_sha256[:12]}… ok)")


if __name__ == "__main__":
    stage_main("fetch", run, lambda p: p.add_argument("--out", default="data/raw"))
