"""``trainyard audit [DIR]``: likely label errors, duplicates (above all across splits),
outliers and class imbalance in a class-per-folder tree (docs/audit.md).

DIR defaults to the workspace's ``data.folder``. Writes ``suspects.csv``, ``report.html``
and ``summary.json`` into ``--out``, and records the counts as an MLflow run
(``--no-track``: not); exits 0, or 2 with a message naming the folder or file at fault.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from trainyard.commands import Command, Subparsers, command_parser, target_folder
from trainyard.core.config import DEFAULT_PARAMS, Params, load_params
from trainyard.core.errors import TrainyardError
from trainyard.stages.runner import configure_logging

log = logging.getLogger("trainyard.commands.audit")
BAD_INPUT = 2
HELP = "find likely label errors, duplicates across splits and outliers in a folder (docs/audit.md)"


def add_parser(subparsers: Subparsers) -> None:
    p = command_parser(subparsers, "audit", HELP, CmdAudit)
    p.add_argument("dir", nargs="?", help="a class-per-folder tree (default: data.folder)")
    p.add_argument("--out", default="reports/audit", help="report folder (default %(default)s)")
    p.add_argument(
        "--cache", default=".cache/audit", help="embedding cache folder (default %(default)s)"
    )
    p.add_argument("--params", default=str(DEFAULT_PARAMS), help="params file (data: keys, seed)")
    p.add_argument("--no-track", action="store_true", help="do not record an MLflow run")


class CmdAudit(Command):
    def run(self) -> int:
        """0 when the audit is written (suspects or not); 2 on bad input, named."""
        from trainyard.stages.label_audit import AuditJob, audit_folder

        configure_logging("audit")
        a = self.args
        try:
            params = load_params(Path(a.params))
            folder = target_folder(a.dir, params, Path(a.params))
            job = AuditJob(folder, Path(a.out), Path(a.cache))
            summary = audit_folder(params, job)
        except TrainyardError as err:
            print(f"trainyard audit: error: {err}", file=sys.stderr)
            return BAD_INPUT
        if not a.no_track:
            record_run(params, summary, job.out)
        print(f"{job.out / 'suspects.csv'}: {_line(summary)}")
        return 0


def _line(summary: dict) -> str:
    across = summary["exact_duplicates_across_splits"] + summary["near_duplicates_across_splits"]
    return (
        f"{summary['images']} images, {summary['label_issues']} likely label error(s), "
        f"{across} duplicate(s) across splits, {summary['outliers']} outlier(s), "
        f"{summary['imbalanced_classes']} imbalanced class(es)"
        + (f", {summary['unreadable']} unreadable file(s)" if summary["unreadable"] else "")
    )


def record_run(params: Params, summary: dict, out: Path) -> None:
    """The audit's MLflow run; the files are written, so an unreachable store only warns."""
    from trainyard.track.audit_run import record_audit_run

    try:
        record_audit_run(params, summary, out)
    except Exception as err:
        log.warning("the audit is written; its MLflow run was not recorded: %s", err)
