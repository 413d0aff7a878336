"""``trainyard doctor``: what this machine is, and what trainyard will do on it.

    trainyard doctor            # a readable table (also: make doctor)
    trainyard doctor --json     # one JSON document
    python -m trainyard.commands.doctor  # the same, without the console script

What it reports and why: docs/performance.md, "Before a long run: make doctor". Its
verdicts are the pipeline's own decisions: placement is
``training.placement.choose_placement``, precision ``training.device.resolve_device``, the ONNX
Runtime providers ``runtime.sessions.choose_providers``, the folder's images ``data.walk``.
Exit status: 0 fine (warnings allowed), 1 a broken setup (the message says what is broken
and what to do), 2 bad usage. Never imports mlflow, dvc or bentoml (it runs on a bare GPU
machine: tests/bench/test_gpu_bare.py).

Layout: ``trainyard.doctor.collect`` gathers facts (reads the machine: ``machine`` for CPU,
RAM, GPUs, torch and ONNX Runtime, ``dataset`` for the disk and the dataset); ``verdicts``
(with ``report``) are pure functions of those facts, so they are tested on crafted facts for
machines we do not have; ``render`` prints them; this module is the command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainyard.commands import Command, Subparsers, command_parser, parse
from trainyard.core.card import CARD_FILE
from trainyard.core.config import DEFAULT_PARAMS
from trainyard.doctor.terms import DEFAULT_DATA

HELP = "check this machine and what trainyard will do on it"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The doctor's options on ``parser`` (``trainyard doctor``'s, or ``main``'s own)."""
    parser.add_argument(
        "--params", default=None, help=f"params file (default: ./{DEFAULT_PARAMS}, if present)"
    )
    parser.add_argument(
        "--data",
        default=str(DEFAULT_DATA),
        help=f"prepared data folder with {CARD_FILE} (default: {DEFAULT_DATA})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def add_parser(subparsers: Subparsers) -> None:
    add_arguments(command_parser(subparsers, "doctor", HELP, CmdDoctor))


class CmdDoctor(Command):
    def run(self) -> int:
        """0 fine, 1 broken, 2 bad usage."""
        params = self.args.params
        if params is not None and not Path(params).is_file():
            print(f"trainyard doctor: error: --params {params}: no such file", file=sys.stderr)
            return 2
        # Here, not at the top: the CLI imports every command module, and collect loads the
        # data sources' libraries that `trainyard predict` never needs.
        from trainyard.doctor.collect import collect
        from trainyard.doctor.render import emit
        from trainyard.doctor.verdicts import report

        return emit(report(collect(params, self.args.data)), self.args.json)


def main(argv: list[str] | None = None) -> int:
    """``python -m trainyard.commands.doctor [--json] [--params P] [--data D]``."""
    parser = add_arguments(
        argparse.ArgumentParser(prog="trainyard doctor", description=__doc__.splitlines()[0])
    )
    args = parse(parser, argv)
    return args if isinstance(args, int) else CmdDoctor(args).run()


if __name__ == "__main__":
    sys.exit(main())
