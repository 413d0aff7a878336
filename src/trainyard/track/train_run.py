"""The training run in MLflow: what it learns from and what it leaves (datasets, params
file, card, recipe; checkpoint, fit time), and its life across interruptions (reopened
RUNNING with the params it lacks, or ended FAILED/KILLED with the reason).

The run itself is created by Lightning's ``MLFlowLogger`` (training/tracked_run.py); rank 0
then holds it as a ``TrainRun``: every metric and tag of the fit goes through its
``ServerGap`` (track.outage), so a tracking server that goes away costs no metric, and what
the server did not take is kept beside the resumable checkpoint for the next start.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow.data
from mlflow.entities import DatasetInput, InputTag

from trainyard.core.card import CARD_FILE, Card
from trainyard.track.continued_runs import END_REASON_TAG, carry_end_reason, log_new_params
from trainyard.track.outage import PENDING_FILE, ServerGap
from trainyard.track.store import TrackingClient
from trainyard.track.system_metrics import SystemMetrics

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
    try:
        client.log_inputs(run_id, datasets=inputs)
    except Exception as err:  # MlflowException, or SQLAlchemy's IntegrityError itself
        # Two processes logging the same dataset into one experiment at once (two tune
        # workers): MLflow's store looks for the dataset's row, then inserts it, and the
        # later insert breaks the UNIQUE constraint. The row exists now: again links it.
        if not any(s in str(err) for s in ("UNIQUE constraint", "duplicate key")):
            raise
        client.log_inputs(run_id, datasets=inputs)


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


class TrainRun:
    """The training run rank 0 holds once Lightning's logger has made (or found) it: its
    store, id and client, and the ``ServerGap`` every metric and tag of the fit goes
    through (kept while the server is away, sent when it answers)."""

    def __init__(self, uri: str, run_id: str, client: TrackingClient) -> None:
        self.uri, self.run_id, self.client = uri, run_id, client
        self.gap = ServerGap(uri, run_id, client)  # reads the wait now: a bad one stops here

    def reopen(self, flat_params: dict[str, Any]) -> None:
        """Set the interrupted run back to RUNNING; log only params it does not have yet
        (MLflow params are immutable: a changed one that is not part of the key is noted in
        a tag)."""
        client, run_id = self.client, self.run_id
        changed = log_new_params(client, run_id, flat_params)
        tags = client.get_run(run_id).data.tags
        resumes = int(tags.get("trainyard.resumes", "0")) + 1
        client.set_tag(run_id, "trainyard.resumes", str(resumes))
        if changed:
            client.set_tag(run_id, "trainyard.params_changed_on_resume", ", ".join(changed)[:5000])
        carry_end_reason(client, run_id, tags)
        client.update_run(run_id, status="RUNNING")

    def log_params(self, flat_params: dict[str, Any]) -> None:
        """A new run's params (dotted keys, values cut to MLflow's 250 characters)."""
        log_new_params(self.client, self.run_id, flat_params)

    def log_inputs(
        self,
        splits: dict[str, tuple[Any, Any]],
        card: Card,
        data_dir: str | os.PathLike[str],
        params_file: str | os.PathLike[str] | None,
        recipe_tags: dict[str, str],
        recipe: dict[str, Any],
    ) -> None:
        """What the run learns from: the splits as datasets, the params file (``config/``),
        the dataset card (``data/``) and its skipped-file count, and the recipe's choices
        (tags ``recipe.<key>`` and ``config/recipe.json``)."""
        client, run_id = self.client, self.run_id
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

    def send_kept(self, folder: Path) -> None:
        """What an earlier start of this training kept in ``folder`` while the server was
        away (``keep_unsent``, ``complete``): sent now into the same run."""
        self.gap.take_saved(folder / PENDING_FILE)
        if self.gap.pending:
            self.gap.flush()

    def system_metrics(self, interval_s: float, enabled: bool, resume: bool) -> SystemMetrics:
        """The fit's system metrics, every ``interval_s`` through the gap; ``resume``: after
        the resumed run's last sample, not over it."""
        return SystemMetrics(self.run_id, self.uri, interval_s, enabled, resume, self.gap)

    def keep_unsent(self, folder: Path) -> None:
        """A fit stopped (a signal, an error) while the server was away: what it did not
        take is saved in ``folder``, beside the checkpoint, for the next start to send."""
        if not self.gap.pending:
            return
        path = folder / PENDING_FILE
        n = self.gap.save(path)
        log.warning(
            "%d metric values MLflow server %s has not taken are saved in %s; the next start "
            "of this training sends them",
            n,
            self.uri,
            path,
        )

    def end_interrupted(self, status: str, reason: str) -> None:
        """Mark the run ``status`` (KILLED, FAILED) with ``reason``; with the server away no
        one can: the run stays RUNNING, and the next start resumes it."""
        if not self.gap.away:
            end_interrupted_run(self.client, self.run_id, status, reason)

    def complete(
        self, folder: Path, checkpoint: Path, fit_s: float, tags: Mapping[str, str]
    ) -> int | None:
        """Send what is kept, log the outputs (the best ``checkpoint`` under
        ``checkpoints/``, the fit's seconds, its ``tags``) and end the run FINISHED,
        waiting for an away server (``ServerGap.settle``); None once done. If it does not
        answer in time, what it has not taken is saved in ``folder`` for the next start
        (``send_kept``): how many metric values. A signal or an error while waiting saves
        them too, and is raised."""
        client, run_id = self.client, self.run_id

        def last_calls() -> None:
            client.log_artifact(run_id, str(checkpoint), "checkpoints")
            client.log_metric(run_id, "train/fit_time_s", fit_s)
            for key, value in tags.items():
                client.set_tag(run_id, key, value)
            client.set_terminated(run_id, "FINISHED")

        try:
            if self.gap.settle(last_calls):
                return None
        except BaseException:
            if self.gap.pending:
                self.gap.save(folder / PENDING_FILE)
            raise
        return self.gap.save(folder / PENDING_FILE)
