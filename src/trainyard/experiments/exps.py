"""``trainyard exps``: being written (issue 19)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The command's options on ``parser``."""
    return parser


def run(args: argparse.Namespace) -> int:
    """Not yet."""
    raise NotImplementedError("trainyard exps")
