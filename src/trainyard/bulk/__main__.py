"""``python -m trainyard.bulk SOURCE --out FILE --model model.onnx``: bulk scoring without
MLflow (a bento's or a Kubernetes Job's environment); ``python -m trainyard.bulk merge``
joins shard outputs. ``trainyard predict`` adds registry models and the MLflow run."""

from __future__ import annotations

import argparse
import logging
import sys

from trainyard.bulk import job as command


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="[predict] %(message)s")
    logging.getLogger("trainyard").setLevel(logging.INFO)
    if argv[:1] == ["merge"]:
        parser = argparse.ArgumentParser(prog="python -m trainyard.bulk merge")
        return command.run_merge(command.add_merge_arguments(parser).parse_args(argv[1:]))
    parser = argparse.ArgumentParser(prog="python -m trainyard.bulk")
    return command.run_command(command.add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
