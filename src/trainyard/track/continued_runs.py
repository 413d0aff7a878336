"""A run carried on after its start: the params it lacks, why it ended early (and that reason
kept as the previous one once it goes on), and the train run reopened by a later stage
(export, evaluate)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Param
from mlflow.exceptions import MlflowException

from trainyard.core.errors import Terminated, TrackingError
from trainyard.core.handoffs import TRAIN_RECORD
from trainyard.track.interrupts import release_interrupted_store
from trainyard.track.store import TrackingClient, check_tracking_uri, resolve_tracking_uri

log = logging.getLogger(__name__)

# Why a run ended other than FINISHED (Ctrl-C, SIGTERM, an error), set by every stage that
# ends a run early; kept as PREVIOUS_END_TAG once the run is finished again.
END_REASON_TAG = "trainyard.end_reason"
PREVIOUS_END_TAG = "trainyard.previous_end"


def carry_end_reason(client: Any, run_id: str, tags: dict[str, str]) -> None:
    """A run going on again after an early end: its reason becomes the previous one, so a
    run that later ends FINISHED carries no stale reason but keeps the history."""
    if END_REASON_TAG in tags:
        client.set_tag(run_id, PREVIOUS_END_TAG, tags[END_REASON_TAG])
        client.delete_tag(run_id, END_REASON_TAG)


def open_run(run_id: str, root: str | os.PathLike[str] = ".") -> str:
    """Point MLflow at the current store, check the train run ``run_id`` is there, return it."""

    uri = resolve_tracking_uri(root)
    check_tracking_uri(uri)
    mlflow.set_tracking_uri(uri)
    try:
        mlflow.get_run(run_id)
    except MlflowException as err:
        raise TrackingError(
            f"MLflow run {run_id} (from {TRAIN_RECORD.name}) is not in the tracking store "
            f"{uri}: {err.message}. Rerun train with the same MLFLOW_TRACKING_URI."
        ) from None
    return run_id


@contextlib.contextmanager
def logging_into(run_id: str, stage: str) -> Iterator[None]:
    """Reopen the train run ``run_id`` as the active run for a later stage (export, evaluate).

    MLflow sets the run RUNNING while it is open; it ends FINISHED, or FAILED on an error.
    A Ctrl-C ends it KILLED with a ``trainyard.end_reason`` tag naming the stage, as a Ctrl-C
    in train does: MLflow's own context manager would call it FAILED, as if the training
    had failed. The next successful run of the stage ends it FINISHED again and keeps the
    old reason as ``trainyard.previous_end`` (carry_end_reason).
    """

    try:
        # Inside the try: a Ctrl-C that lands within start_run, after it has set the run
        # RUNNING, must not leave it RUNNING.
        mlflow.start_run(run_id=run_id)
        carry_end_reason(mlflow.MlflowClient(), run_id, mlflow.get_run(run_id).data.tags)
        yield
    except KeyboardInterrupt as err:
        release_interrupted_store(err)
        what = "SIGTERM" if isinstance(err, Terminated) else "Ctrl-C (SIGINT)"
        _end_run(run_id, "KILLED", f"{what} in {stage}")
        raise
    except BaseException:
        _end_run(run_id, "FAILED")
        raise
    mlflow.end_run("FINISHED")


def log_to_open_run(
    metrics: dict[str, float] | None = None,
    tags: dict[str, str] | None = None,
    artifacts: dict[Path, str] | None = None,
) -> None:
    """Into the run ``logging_into`` holds open: ``metrics``, ``tags``, and each file of
    ``artifacts`` into its artifact folder (path -> folder)."""
    if metrics:
        mlflow.log_metrics(metrics)
    if tags:
        mlflow.set_tags(tags)
    for path, folder in (artifacts or {}).items():
        mlflow.log_artifact(str(path), folder)


def log_new_params(client: TrackingClient, run_id: str, flat: dict[str, Any]) -> list[str]:
    """Log the params ``run_id`` does not have yet (values cut to MLflow's 250 characters);
    MLflow params never change, so return the keys it has with another value."""
    have = client.get_run(run_id).data.params
    values = {k: str(v)[:250] for k, v in flat.items()}
    new = [Param(k, v) for k, v in values.items() if k not in have]
    for i in range(0, len(new), 100):
        client.log_batch(run_id, params=new[i : i + 100])
    return sorted(k for k, v in values.items() if k in have and have[k] != v)


def _end_run(run_id: str, status: str, reason: str | None = None) -> None:
    """End ``run_id`` ``status`` on the way out of an error; never raises, so the stage
    reports the error it is handling, not a tracking hiccup on top of it."""

    try:
        client = mlflow.MlflowClient()
        if reason is not None:
            client.set_tag(run_id, END_REASON_TAG, reason)
        active = mlflow.active_run()
        if active is not None and active.info.run_id == run_id:
            mlflow.end_run(status)
        else:  # interrupted inside start_run, before it made the run the active one
            client.set_terminated(run_id, status)
    except Exception as err:
        log.warning("could not mark MLflow run %s %s: %s", run_id, status, err)
