"""``trainyard drift SOURCE``: a prediction-log folder or a ``trainyard predict`` table
against the model's reference (docs/drift.md).

Prints one line (what drifted, or that nothing did), writes ``report.md`` + ``report.json``
+ pictures into ``--out``, and exits 0 (no drift), 1 (drift) or 2 (bad input: the message
names the file or option), for a cron job or a CI step.
"""

from __future__ import annotations

import logging
import sys
from datetime import datetime
from pathlib import Path

from trainyard.commands import Command, RegistryOnDemand, Subparsers, command_parser
from trainyard.core.config import DEFAULT_PARAMS, load_params
from trainyard.core.errors import TrainyardError
from trainyard.core.model_ref import ModelRegistry, parse_model_ref
from trainyard.stages.runner import configure_logging
from trainyard.watch.reference import DEFAULT_PATH, Reference, load_reference

log = logging.getLogger("trainyard.commands.drift_check")
NO_DRIFT, DRIFT, BAD_INPUT = 0, 1, 2
HELP = "a prediction log or predict table against the model's reference (docs/drift.md)"


def add_parser(subparsers: Subparsers) -> None:
    p = command_parser(subparsers, "drift", HELP, CmdDrift)
    p.add_argument("source", help="a prediction-log folder, or a `trainyard predict` table")
    p.add_argument(
        "--reference",
        default=str(DEFAULT_PATH),
        help="the model's reference: a .npz (default %(default)s, written by evaluate) or "
        "models:/NAME@ALIAS, models:/NAME/N, runs:/RUN_ID (the registered version's)",
    )
    p.add_argument("--out", default="reports/drift", help="report folder (default %(default)s)")
    window = p.add_mutually_exclusive_group()
    window.add_argument("--last", help="a log folder's last DURATION (90m, 24h, 7d)")
    window.add_argument("--since", help="a log folder's rows from this ISO time (UTC default)")
    p.add_argument("--until", help="... up to this ISO time (default: now)")
    p.add_argument("--params", default=str(DEFAULT_PARAMS), help="params file (its drift: keys)")


class CmdDrift(Command):
    def run(self) -> int:
        """0 no drift, 1 drift; bad input of any kind exits 2 with a message naming it."""
        configure_logging("drift")
        a = self.args
        try:
            window = time_window(a.last, a.since, a.until)
            return drift(a.source, a.reference, a.out, Path(a.params), window, RegistryOnDemand())
        except TrainyardError as err:
            print(f"trainyard drift: error: {err}", file=sys.stderr)
            return BAD_INPUT


def time_window(
    last: str | None, since: str | None, until: str | None
) -> tuple[datetime | None, datetime | None]:
    """(since, until) from --last, or --since/--until; (None, None) for everything."""
    # Here, not at the top: the CLI imports every command module, and watch.current loads
    # pyarrow.compute and the drift scores that `trainyard predict` never needs.
    from trainyard.watch.current import parse_duration, parse_time
    from trainyard.watch.log import utc_now

    end = parse_time(until, "--until") if until else None
    if last:
        if end is not None:
            raise TrainyardError("--last and --until: give --since/--until for a past window")
        return utc_now() - parse_duration(last), None
    start = parse_time(since, "--since") if since else None
    if start is not None and end is not None and start >= end:
        raise TrainyardError(f"--since {since} is not before --until {until}")
    return start, end


def reference_of(spec: str, params_file: Path, registry: ModelRegistry | None) -> Reference:
    """The reference a ``--reference`` names: a file, or a registered version's."""
    ref = parse_model_ref(spec, "--reference")
    if not ref.from_registry:
        return load_reference(spec)  # as written: its errors name the file so
    if registry is None:
        raise TrainyardError(f"--reference {spec}: a registry model needs MLflow")
    return load_reference(registry.fetch_reference(ref, params_file.parent / ".cache" / "registry"))


def drift(
    source: str,
    reference_spec: str,
    out: str,
    params_file: Path,
    time: tuple[datetime | None, datetime | None] = (None, None),
    registry: ModelRegistry | None = None,
) -> int:
    """Compare ``source`` (rows in the ``time`` window: since, until) with the reference
    (a file, or with ``registry`` a registered version's), report into ``out``, print the
    line; the exit code (0 or 1). Raises TrainyardError."""
    from trainyard.evaluation.drift_report import write_report  # matplotlib: not at start-up
    from trainyard.watch.current import read_window
    from trainyard.watch.drift_score import compare

    params = load_params(params_file)
    since, until = time
    reference = reference_of(reference_spec, params_file, registry)
    window = read_window(source, model_sha256=reference.model_sha256, since=since, until=until)
    result = compare(reference, window, params.drift)
    paths = write_report(result, reference, window, out)
    log.info("report: %s", paths["report.md"])
    print(result.summary)
    return DRIFT if result.drifted else NO_DRIFT
