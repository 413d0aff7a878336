"""The MLflow runs of a ``trainyard tune`` study: one parent run for the study (created once,
reopened by every later worker), a child run per trial (created by the trial's training,
tagged here with its Optuna state and ended with the reason when it did not finish), and the
parent's running best and final result. Optuna itself stays in trainyard.experiments.study:
states arrive here by name (COMPLETE, PRUNED, FAIL).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from mlflow.exceptions import MlflowException

from trainyard import __version__
from trainyard.core.config import Params
from trainyard.core.errors import TrackingError
from trainyard.track.continued_runs import END_REASON_TAG, carry_end_reason, log_new_params
from trainyard.track.lineage import git_state
from trainyard.track.store import TrackingClient, tracking_client

log = logging.getLogger(__name__)

# Tags of the parent (STUDY_TAG) and child runs (all three).
STATE_TAG, STUDY_TAG, TRIAL_TAG = "optuna.state", "optuna.study", "optuna.trial"


def _experiment_id(client: TrackingClient, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is None:
        raise TrackingError(f"MLflow experiment {name!r} is missing from the tracking store")
    return str(found.experiment_id)


@dataclass
class StudyRuns:
    """Where the study's runs go: the store, the experiment, the parent run."""

    uri: str
    experiment: str
    parent_id: str = ""

    @property
    def client(self) -> TrackingClient:
        return tracking_client(self.uri)

    def trial_runs(self, number: int) -> list[Any]:
        """The child runs of trial ``number`` (one; more only if a store was reused)."""
        if not self.parent_id:
            return []
        client = self.client
        return client.search_runs(
            [_experiment_id(client, self.experiment)],
            filter_string=(
                f"tags.`mlflow.parentRunId` = '{self.parent_id}' "
                f"and tags.`{TRIAL_TAG}` = '{number}'"
            ),
        )

    def end_trial(
        self,
        number: int,
        state: str,
        reason: str | None = None,
        killed: bool = False,
        overwrite: bool = True,
    ) -> None:
        """Tag trial ``number``'s child run with its Optuna ``state`` (its name); a run not
        FINISHED by its training ends with ``reason`` (tag trainyard.end_reason; not over one
        already there unless ``overwrite``): KILLED when pruned or its worker ``killed``,
        else FAILED. Never raises: the study goes on."""
        try:
            for run in self.trial_runs(number):
                if not overwrite and END_REASON_TAG in run.data.tags:
                    reason = None
                self._end(run, state, reason, killed)
        except Exception as err:
            log.warning("could not tag the MLflow run of trial %d: %s", number, err)

    def _end(self, run: Any, state: str, reason: str | None, killed: bool) -> None:
        client, run_id = self.client, run.info.run_id
        client.set_tag(run_id, STATE_TAG, state)
        # A failed trial's run is FAILED even if its fit had finished (the trial failed
        # after it); a pruned one already ended by its fit (FAILED, Lightning's word for an
        # exception) is KILLED: stopped on purpose.
        if state == "COMPLETE" or (state == "PRUNED" and run.info.status == "FINISHED"):
            return
        status = "FAILED" if state == "FAIL" and not killed else "KILLED"
        if reason:
            client.set_tag(run_id, END_REASON_TAG, reason[:5000])
        client.set_terminated(run_id, status)

    def reopen_parent(self, run_id: str, base: Params, space: dict[str, Any]) -> bool:
        """Make ``run_id`` the parent again, RUNNING, with this worker's base params; False
        when it is not in this store (deleted, or never was)."""
        client = self.client
        try:
            run = client.get_run(run_id)
        except MlflowException:
            return False
        if run.info.lifecycle_stage == "deleted":
            return False
        carry_end_reason(client, run_id, run.data.tags)
        client.update_run(run_id, status="RUNNING")
        _log_base_params(client, run_id, base, space)
        self.parent_id = run_id
        return True

    def create_parent(
        self,
        study: str,
        optuna_tags: dict[str, str],
        base: Params,
        space: dict[str, Any],
        root: str | os.PathLike[str],
    ) -> str:
        """A new parent run named ``study``, with lineage tags (commit, host, version) and
        ``optuna_tags``, the base params and the search space."""
        git = git_state(root)
        tags = {
            STUDY_TAG: study,
            **optuna_tags,
            "mlflow.source.git.commit": git["git_commit"],
            "git.commit": git["git_commit"],
            "git.dirty": git["git_dirty"],
            "host": socket.gethostname(),
            "trainyard": __version__,
        }
        client = self.client
        exp_id = _experiment_id(client, self.experiment)
        self.parent_id = client.create_run(exp_id, run_name=study, tags=tags).info.run_id
        _log_base_params(client, self.parent_id, base, space)
        return self.parent_id

    def trial_tags(self, study: str, number: int) -> dict[str, str]:
        """The tags that make trial ``number``'s training run a child of the parent."""
        return {"mlflow.parentRunId": self.parent_id, STUDY_TAG: study, TRIAL_TAG: str(number)}

    def mark_parent_running(self) -> None:
        """The parent RUNNING while this worker runs a trial (another worker's end may have
        set it FINISHED)."""
        self.client.update_run(self.parent_id, status="RUNNING")

    def log_trial_score(self, number: int, value: float | None, best: tuple[float, int]) -> None:
        """On the parent's charts: trial ``number``'s val/acc (``value``; None for a trial
        that did not complete) and the study's best so far (score, trial)."""
        client = self.client
        if value is not None:
            client.log_metric(self.parent_id, "trial_val_acc", value, step=number)
        client.log_metric(self.parent_id, "best_val_acc", best[0], step=number)

    def finish_parent(
        self,
        best: tuple[int, float, dict[str, str]] | None,
        trials: int,
        running: bool,
        interrupted: str | None = None,
    ) -> None:
        """The study's end for this worker: the best trial (number, val/acc, its values as
        params text) as tags and metric; the parent then FINISHED (KILLED with the reason
        if ``interrupted``), unless another worker still runs a trial (``running``)."""
        client, parent = self.client, self.parent_id
        if best is not None:
            number, value, values = best
            client.set_tag(parent, "best_trial", str(number))
            client.log_metric(parent, "best_val_acc", value, step=trials)
            for key, text in values.items():
                client.set_tag(parent, f"best.{key}", text[:5000])
        if running:
            return
        if interrupted:
            client.set_tag(parent, END_REASON_TAG, interrupted)
            client.set_terminated(parent, "KILLED")
        else:
            client.set_terminated(parent, "FINISHED")


def _log_base_params(
    client: TrackingClient, run_id: str, base: Params, space: dict[str, Any]
) -> None:
    """The base params as the parent's params (MLflow params never change: a rerun on other
    base params logs the new keys only, and names the changed ones in a tag) and the search
    space as ``tune/space.json``."""
    changed = log_new_params(client, run_id, base.flat())
    if changed:
        client.set_tag(run_id, "trainyard.params_changed_on_rerun", ", ".join(changed)[:5000])
    client.log_dict(run_id, space, "tune/space.json")
    client.set_tag(run_id, "optuna.trials_target", str(base.tune.trials))
