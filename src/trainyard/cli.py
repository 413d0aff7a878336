"""Shared plumbing for the thin stage scripts in pipelines/."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from trainyard.config import DEFAULT_PARAMS, Params, load_params
from trainyard.errors import TrainyardError


def stage_main(
    name: str,
    body: Callable[[Params, argparse.Namespace], None],
    add_args: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Parse args, validate params, run ``body``; a TrainyardError exits 1 with its message."""
    parser = argparse.ArgumentParser(prog=f"{name} stage", description=f"trainyard {name} stage")
    parser.add_argument("--params", default=str(DEFAULT_PARAMS), help="params file")
    add_args(parser)
    args = parser.parse_args()
    # Our INFO lines, other libraries' warnings only (the ONNX exporter is chatty at INFO).
    logging.basicConfig(level=logging.WARNING, format=f"[{name}] %(levelname)s %(message)s")
    logging.getLogger("trainyard").setLevel(logging.INFO)
    try:
        params = load_params(args.params)
        body(params, args)
    except TrainyardError as err:
        print(f"trainyard {name}: error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"trainyard {name}: interrupted", file=sys.stderr)
        sys.exit(130)
