"""commands: one module per ``trainyard`` command, listed in trainyard.cli's ``COMMANDS``.

The shape of each, as DVC's ``dvc/commands/<name>.py``: ``add_parser(subparsers)`` adds the
command's subparser and sets its ``func`` to the module's one ``Command`` class;
``Cmd(args).run()`` is the exit status. A command module turns its arguments into typed
values and calls the library, which never sees an ``argparse.Namespace``.

Nothing heavy is imported here, so one command module can run alone: ``python -m
trainyard.commands.doctor`` on a machine that has torch and none of the others' libraries.
A command imports the library it runs inside its ``run`` (as dvc/commands/ do): the CLI
imports every command module to build its parser, and ``trainyard predict`` must not start
by loading tune's torch and Optuna or drift's matplotlib (tests/house/test_cli.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trainyard.core.config import Params
from trainyard.core.errors import TrainyardError
from trainyard.core.model_ref import FetchedModel, ModelRef, ModelRegistry

Subparsers = argparse._SubParsersAction  # what ArgumentParser.add_subparsers returns


class Command:
    """A command with its parsed arguments: ``run()`` does it and returns the exit status."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def run(self) -> int:
        raise NotImplementedError


def command_parser(
    subparsers: Subparsers, name: str, help_text: str, command: type[Command]
) -> argparse.ArgumentParser:
    """``trainyard NAME``'s subparser, its help also its description, running ``command``."""
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(func=command)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status argparse chose (usage error, ``--help``)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 2 for bad usage, 0 for --help
        return exc.code if isinstance(exc.code, int) else 2


class RegistryOnDemand:
    """trainyard.core.model_ref's ``ModelRegistry`` on MLflow, imported when a ``models:/``
    or ``runs:/`` model is first fetched: a model file scores without MLflow's second of
    start-up."""

    def __init__(self) -> None:
        self._registry: ModelRegistry | None = None

    def _mlflow(self) -> ModelRegistry:
        if self._registry is None:
            from trainyard.track.model_refs import MlflowRegistry

            self._registry = MlflowRegistry()
        return self._registry

    def fetch(self, ref: ModelRef, cache_dir: Path) -> FetchedModel:
        return self._mlflow().fetch(ref, cache_dir)

    def fetch_int8(self, ref: ModelRef, cache_dir: Path) -> Path | None:
        return self._mlflow().fetch_int8(ref, cache_dir)

    def fetch_reference(self, ref: ModelRef, cache_dir: Path) -> Path:
        return self._mlflow().fetch_reference(ref, cache_dir)

    def fetch_card(self, ref: ModelRef, cache_dir: Path, kind: str) -> Path:
        return self._mlflow().fetch_card(ref, cache_dir, kind)

    def follow(self, ref: ModelRef, current: str, cache_dir: Path) -> FetchedModel | None:
        return self._mlflow().follow(ref, current, cache_dir)


def target_folder(given: str | None, params: Params, params_file: Path) -> Path:
    """DIR, else data.folder as prepare reads it (relative to the params file's folder);
    TrainyardError when neither names a folder (``trainyard audit`` and ``label``)."""
    from trainyard.data.sources.folder import folder_path

    if not given and not params.data.folder:
        raise TrainyardError(f"no DIR given and data.folder is not set in {params_file}")
    folder = Path(given) if given else folder_path(params.data, params_file.parent)
    if not folder.is_dir():
        raise TrainyardError(f"{folder} is not a folder (a class-per-folder tree)")
    return folder


def serve_log_dir(params: Params, params_file: Path) -> Path:
    """serve.log_dir, relative to the params file's folder as the service reads it (the
    prediction log ``promote`` and ``label push`` read)."""
    folder = Path(params.serve.log_dir)
    return folder if folder.is_absolute() else params_file.resolve().parent / folder
