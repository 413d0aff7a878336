"""The training run in MLflow: what it learns from and what it leaves (datasets, params
file, card, recipe; checkpoint, fit time), and its life across interruptions (reopened
RUNNING with the params it lacks, or ended FAILED/KILLED with the reason).

The run itself is created by Lightning's ``MLFlowLogger`` (train/fit.py); ``client`` is that
logger's MLflow client, or ``runs.tracking_client(uri)``.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import mlflow.data
from mlflow.entities import DatasetInput, InputTag

from trainyard.core.card import CARD_FILE, Card
from trainyard.track.runs import END_REASON_TAG, carry_end_reason, log_new_params
from trainyard.track.store import TrackingClient

log = logging.getLogger(__name__)


def log_dataset_inputs(
    client: TrackingClient,
    run_id: str,
    splits: dict[str, tuple[Any, Any]],
    digest: str,
    source: str,
    name: str = "dataset",
) -> None:
    """Record the splits as MLflow dataset inputs (name, digest, source, schema)."""

    inputs = []
    for split, (images, labels) in splits.items():
        with warnings.catch_warnings():
            # "source can be interpreted in multiple ways": both candidates are the same class.
            warnings.simplefilter("ignore", UserWarning)
            dataset = mlflow.data.from_numpy(
                images,
                targets=labels,
                source=source,
                name=f"{name}-{split}",
                digest=f"{digest[:16]}-{split}",
            )
        context = {"train": "training", "val": "validation"}.get(split, split)
        inputs.append(
            DatasetInput(
                dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]
            )
        )
    client.log_inputs(run_id, datasets=inputs)


def log_fit_inputs(
    client: TrackingClient,
    run_id: str,
    splits: dict[str, tuple[Any, Any]],
    card: Card,
    data_dir: str | os.PathLike[str],
    params_file: str | os.PathLike[str] | None,
    recipe_tags: dict[str, str],
    recipe: dict[str, Any],
) -> None:
    """What the run learns from: the splits as datasets, the params file (``config/``), the
    dataset card (``data/``) and its skipped-file count, and the recipe's choices (tags
    ``recipe.<key>`` and ``config/recipe.json``)."""
    log_dataset_inputs(
        client,
        run_id,
        splits,
        card.data_sha256,
        source=str(Path(data_dir).resolve()),
        name=card.source,
    )
    if params_file is not None:
        client.log_artifact(run_id, str(params_file), "config")
    # The card (classes, normalisation, counts, every skipped file and why) beside the run.
    client.log_artifact(run_id, str(Path(data_dir) / CARD_FILE), "data")
    client.log_metric(run_id, "data/skipped_files", len(card.skipped))
    for key, value in recipe_tags.items():
        client.set_tag(run_id, key, value)
    client.log_dict(run_id, recipe, "config/recipe.json")


def log_fit_outputs(
    client: TrackingClient, run_id: str, checkpoint: Path, fit_s: float, stopped_by: str
) -> None:
    """The best checkpoint (``checkpoints/``), the fit's seconds and why it stopped."""
    client.log_artifact(run_id, str(checkpoint), "checkpoints")
    client.log_metric(run_id, "train/fit_time_s", fit_s)
    client.set_tag(run_id, "train.stopped_by", stopped_by)


def reopen_run(client: TrackingClient, run_id: str, flat_params: dict[str, Any]) -> None:
    """Set an interrupted run back to RUNNING; log only params it does not have yet (MLflow
    params are immutable: a changed one that is not part of the key is noted in a tag)."""

    changed = log_new_params(client, run_id, flat_params)
    tags = client.get_run(run_id).data.tags
    resumes = int(tags.get("trainyard.resumes", "0")) + 1
    client.set_tag(run_id, "trainyard.resumes", str(resumes))
    if changed:
        client.set_tag(run_id, "trainyard.params_changed_on_resume", ", ".join(changed)[:5000])
    carry_end_reason(client, run_id, tags)
    client.update_run(run_id, status="RUNNING")


def run_status(client: TrackingClient, run_id: str) -> str | None:
    """The run's status (RUNNING, KILLED, ...); None when it is not in the store or deleted."""
    try:
        run = client.get_run(run_id)
    except Exception:
        return None
    return None if run.info.lifecycle_stage == "deleted" else run.info.status


def end_interrupted_run(client: TrackingClient, run_id: str, status: str, reason: str) -> None:
    """Mark an interrupted run ``status`` (FAILED/KILLED) with why (``trainyard.end_reason``);
    a finished or deleted run is left alone. Never raises."""
    try:
        run = client.get_run(run_id)
        if run.info.lifecycle_stage == "deleted" or run.info.status == "FINISHED":
            return
        client.set_tag(run_id, END_REASON_TAG, reason)
        client.set_terminated(run_id, status)
        log.info("MLflow run %s marked %s: %s", run_id, status, reason)
    except Exception as err:  # a run missing from this store, a store hiccup
        log.warning("could not mark MLflow run %s %s: %s", run_id, status, err)
