"""The MLflow run of ``trainyard audit``: one finished run in the workspace's experiment
with the audit's counts as metrics, its settings as params, and its files (suspects.csv,
report.html, summary.json) as artifacts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainyard import __version__
from trainyard.core.config import Params
from trainyard.track.lineage import git_state
from trainyard.track.outage import recording
from trainyard.track.store import ensure_experiment, resolve_tracking_uri, tracking_client

log = logging.getLogger(__name__)

KIND_TAG, KIND = "trainyard.kind", "audit"


def record_audit_run(params: Params, summary: dict[str, Any], out: Path) -> str:
    """Log the audit's ``summary`` and the files in ``out`` as a new finished run; its id."""
    uri = resolve_tracking_uri()
    client = tracking_client(uri)
    with recording(uri, "the audit run"):
        experiment = ensure_experiment(uri, params.experiment_name())
        run = client.create_run(
            experiment,
            run_name="audit",
            tags={KIND_TAG: KIND, "trainyard.version": __version__, **git_state()},
        )
        run_id = run.info.run_id
        client.log_param(run_id, "audit.folder", summary["folder"])
        client.log_param(run_id, "audit.model", summary["model"])
        for key, value in summary.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                client.log_metric(run_id, f"audit/{key}", float(value))
        for name in ("suspects.csv", "report.html", "summary.json"):
            if (out / name).is_file():
                client.log_artifact(run_id, str(out / name), "audit")
        client.set_terminated(run_id, "FINISHED")
    log.info("MLflow run %s (audit) in %s", run_id, uri)
    return run_id
