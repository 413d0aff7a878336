"""What every stage shares: arguments, params, logging, exit codes on errors and signals."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from trainyard.core.config import DEFAULT_PARAMS, Params, load_params
from trainyard.core.errors import Terminated, TrainyardError


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


def stage_main(
    name: str,
    body: Callable[[Params, argparse.Namespace], None],
    add_args: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Parse args, validate params, run ``body``; a TrainyardError exits 1 with its message.

    Ctrl-C exits 130 and SIGTERM 143, both after the same clean-up: SIGTERM is raised as
    ``Terminated``, a KeyboardInterrupt, instead of killing the process where it stands
    (which left the MLflow run RUNNING and a temp file behind). train installs its own
    handlers around the fit (resume.interruptions) and restores these after it.
    """
    parser = argparse.ArgumentParser(prog=f"{name} stage", description=f"trainyard {name} stage")
    parser.add_argument("--params", default=str(DEFAULT_PARAMS), help="params file")
    add_args(parser)
    args = parser.parse_args()
    # Our INFO lines, other libraries' warnings only (the ONNX exporter is chatty at INFO).
    logging.basicConfig(level=logging.WARNING, format=f"[{name}] %(levelname)s %(message)s")
    logging.getLogger("trainyard").setLevel(logging.INFO)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        params = load_params(args.params)
        body(params, args)
    except TrainyardError as err:
        print(f"trainyard {name}: error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as err:
        term = isinstance(err, Terminated)
        print(
            f"trainyard {name}: {'terminated (SIGTERM)' if term else 'interrupted'}",
            file=sys.stderr,
        )
        sys.exit(143 if term else 130)
