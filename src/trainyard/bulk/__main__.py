"""``python -m trainyard.bulk SOURCE --out FILE --model model.onnx``: bulk scoring without
MLflow (a bento's or a Kubernetes Job's environment); ``python -m trainyard.bulk merge``
joins shard outputs. ``trainyard predict`` adds registry models and the MLflow run; both
read the same flags (trainyard.bulk.command_line)."""

from __future__ import annotations

import argparse
import logging
import sys

from trainyard.bulk import command_line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="[predict] %(message)s")
    logging.getLogger("trainyard").setLevel(logging.INFO)
    if argv[:1] == ["merge"]:
        parser = argparse.ArgumentParser(prog="python -m trainyard.bulk merge")
        args = command_line.add_merge_arguments(parser).parse_args(argv[1:])
        return command_line.run_merge(args.shards, args.out)
    parser = argparse.ArgumentParser(prog="python -m trainyard.bulk")
    args = command_line.add_predict_arguments(parser).parse_args(argv)
    return command_line.run_predict(command_line.predict_options(args))


if __name__ == "__main__":
    sys.exit(main())
