"""What every stage shares: arguments, params, logging, exit codes on errors and signals."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from trainyard.core.config import DEFAULT_PARAMS, Params, load_params
from trainyard.core.errors import Terminated, TrainyardError


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


# Libraries that install their own stderr handler at import ("lightning" and torchmetrics
# always, Lightning's subpackages when the root logger has none, which is before any stage
# configures logging; MLflow always, timestamped). Their lines go through the stage's
# handler instead: one format, and once (a line of lightning.pytorch's also reached
# "lightning"'s handler, and torchmetrics' propagates to the root's: twice).
ROUTED_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "torchmetrics", "mlflow")


class StageFormatter(logging.Formatter):
    """``[stage] message`` for INFO, ``[stage] WARNING message`` for other levels, and a
    library's own line names the library: ``[train] WARNING mlflow: ...``.

    One prefix for everything a stage says: `dvc repro` interleaves the stages' output, and
    a bare "training on cpu" or "Experiment ... not found" would not say whose it is.
    """

    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        top = record.name.partition(".")[0]
        if top not in ("trainyard", "py", "root"):  # py.warnings: the text names its source
            text = f"{top}: {text}"
        level = "" if record.levelno == logging.INFO else f"{record.levelname} "
        line = f"[{self.stage}] {level}{text}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line comes: a progress bar that redirects
    stderr while it draws (Lightning's Rich bar) then prints the line above itself instead
    of through it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always sys.stderr, as it is at the time


def _warning_source(filename: str) -> str:
    """A warning's file, short: from the package folder down (``lightning/pytorch/x.py``)."""
    parts = Path(filename).parts
    for anchor in ("site-packages", "dist-packages", "src"):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor) :])
    return filename


def _log_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    # One line in the stage's format instead of Python's two (path:line: Category: text,
    # then the source line); the category and place stay, for whoever acts on it.
    logging.getLogger("py.warnings").warning(
        "%s (%s, %s:%d)", message, category.__name__, _warning_source(filename), lineno
    )


def configure_logging(stage: str) -> None:
    """The stage's log: trainyard's INFO lines and other libraries' warnings, each once, in
    one format (StageFormatter) on stderr; Python warnings become such lines too.

    Which third-party lines are dropped is decided where they come from (train.builder for
    Lightning, the track package for MLflow, export.onnx_export for the ONNX exporter).
    """
    # Other libraries: warnings only (the ONNX exporter is chatty at INFO). force: a
    # handler someone installed at import would print every line a second time.
    logging.basicConfig(level=logging.WARNING, handlers=[_StderrHandler()], force=True)
    logging.getLogger().handlers[0].setFormatter(StageFormatter(stage))
    logging.getLogger("trainyard").setLevel(logging.INFO)
    for name in ROUTED_LOGGERS:
        routed = logging.getLogger(name)
        routed.handlers.clear()
        routed.propagate = True
    warnings.showwarning = _log_warning


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
    configure_logging(name)
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
